"""One sign–magnitude read as its logged keys: per layer ``sm/<module path>/<metric>``, the run
level ``sm/<metric>`` (docs/monitors.md lists them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from normscope.families.checks import key_path
from normscope.functional.sign_magnitude import OutlierRead, ProbeRead, WeightRead

__all__ = ["FAMILY", "SignMagnitudeReport"]

FAMILY = "sm"


@dataclass(frozen=True)
class SignMagnitudeReport:
    """One read: per Linear its weight read and outlier read; per probe layer its probe read."""

    step: int
    weights: dict[str, WeightRead]
    outliers: dict[str, OutlierRead]
    probes: dict[str, ProbeRead]
    failed: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for group in (self.weights, self.outliers, self.probes):
            for name, read in group.items():
                for metric, value in read.as_dict().items():
                    out[f"{FAMILY}/{key_path(name)}/{metric}"] = float(value)
        summaries = {
            "sign_alignment_mean": [w.sign_alignment for w in self.weights.values()],
            "ternary_alignment_mean": [w.ternary_alignment for w in self.weights.values()],
            "sign_churn_mean": [w.sign_churn for w in self.weights.values()],
            "asymmetry_ratio_mean": [p.asymmetry_ratio for p in self.probes.values()],
            "quant_transverse_rel_mean": [p.quant_transverse_rel for p in self.probes.values()],
        }
        for key, values in summaries.items():
            finite = [v for v in values if math.isfinite(v)]
            out[f"{FAMILY}/{key}"] = sum(finite) / len(finite) if finite else math.nan
        leverages = [
            o.max_leverage for o in self.outliers.values() if math.isfinite(o.max_leverage)
        ]
        out[f"{FAMILY}/max_leverage_max"] = max(leverages) if leverages else math.nan
        # reads no longer taken after a failure (a layer's outlier tap, weight read or probe)
        out[f"{FAMILY}/reads_disabled"] = float(len(self.failed))
        return out

    def read_line(self, fired_messages: list[str]) -> str:
        """The one line a verbose monitor prints for this read (with the alerts it fired)."""
        metrics = self.as_dict()

        def f(key: str) -> str:
            v = metrics.get(f"{FAMILY}/{key}", math.nan)
            return "nan" if not math.isfinite(v) else f"{v:.4g}"

        line = (
            f"normscope sm step {self.step} | sign_alignment {f('sign_alignment_mean')} | "
            f"ternary_alignment {f('ternary_alignment_mean')} | sign_churn "
            f"{f('sign_churn_mean')} | max_leverage {f('max_leverage_max')} | asymmetry_ratio "
            f"{f('asymmetry_ratio_mean')} | quant_transverse_rel {f('quant_transverse_rel_mean')}"
        )
        if fired_messages:
            line += f" | ALERTS {len(fired_messages)}: " + "; ".join(fired_messages)
        return line
