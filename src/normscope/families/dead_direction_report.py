"""The records of a dead-direction read (NormReport, DeadDirectionReport) and their metric keys."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from normscope.alerts.sources import classify_collapses, collapse_keys, source_reads
from normscope.functional.dead_direction import GammaRead, KernelRead, SchurRead
from normscope.functional.profile import SigmaMinProfile
from normscope.taps.residual import ResidualLayout

__all__ = ["DeadDirectionReport", "NormReport", "key_path"]

FAMILY = "dd"
NORM_CLASS_CODE = {"layernorm-like": 1.0, "rmsnorm-like": -1.0, "indeterminate": 0.0}
_COMPILE_WRAPPER = "_orig_mod"  # torch.compile's OptimizedModule holds the model under this name


def key_path(path: str) -> str:
    """A module path as metric keys spell it: without the ``_orig_mod`` segments that
    ``torch.compile(submodule)`` inserts, so a compiled run, an eager run and a scan log the
    same keys.

    Example::

        >>> key_path("model._orig_mod.h.0.ln_1")
        'model.h.0.ln_1'
        >>> key_path("_orig_mod.ln_f/sigma_min")
        'ln_f/sigma_min'
    """
    parts = path.split(".")
    if _COMPILE_WRAPPER not in parts:
        return path
    return ".".join(p for p in parts if p != _COMPILE_WRAPPER)


@dataclass(frozen=True)
class NormReport:
    """Every read of one norm layer (docs/metrics.md §1.1–1.3)."""

    name: str
    kind: str
    gamma: GammaRead
    kernel: KernelRead
    schur: SchurRead
    deepening: float
    n_rows: int

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        out.update(self.gamma.as_dict())
        out.update(self.kernel.as_dict())
        out.update(self.schur.as_dict())
        # norm_class as a number (loggers take numbers): +1 layernorm-like, -1 rmsnorm-like,
        # 0 indeterminate, NaN when not read.
        out["norm_class"] = NORM_CLASS_CODE.get(self.kernel.norm_class, math.nan)
        out["deepening"] = self.deepening
        out["n_rows"] = float(self.n_rows)
        return out


@dataclass(frozen=True)
class DeadDirectionReport:
    """One read of a whole model: ``norms`` by module path, the ``profile``, row counts.

    ``as_dict()`` is flat and keyed as the monitor logs (docs/metrics.md §3): ``dd/<module path>/<metric>``
    for each norm and residual point, ``dd/<metric>`` for the run-level summaries.
    """

    step: int
    norms: dict[str, NormReport]
    profile: SigmaMinProfile | None
    layout: ResidualLayout | None
    rows_rejected: int
    failed_taps: dict[str, str] = field(default_factory=dict)
    #: per-source depth profiles (``sources=``), by source name; empty without sources
    sources: dict[str, SigmaMinProfile] = field(default_factory=dict)
    #: the rule whose threshold classifies a collapse (``SigmaMinRatioRule()`` if None)
    source_rule: Any = None

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, norm in self.norms.items():
            for metric, value in norm.as_dict().items():
                out[f"{FAMILY}/{key_path(name)}/{metric}"] = float(value)
        if self.profile is not None:
            for key, value in self.profile.as_dict().items():
                out[f"{FAMILY}/{key_path(key)}"] = float(value)
            steps = [p.sigma_min_step for p in self.profile.points[1:]]
            steps = [s for s in steps if math.isfinite(s)]
            out[f"{FAMILY}/sigma_min_step_min"] = min(steps) if steps else math.nan
            # dd/<point>/no_cancellation_margin and dd/no_cancellation_margin_min come with
            # the profile's keys when the margin was measured
        out[f"{FAMILY}/rows_rejected"] = float(self.rows_rejected)
        # the residual points this read covers: 0 says "no sigma_min profile" out loud
        out[f"{FAMILY}/profile_points"] = (
            float(len(self.profile.points)) if self.profile is not None else 0.0
        )
        # reads the fast solvers could not verify, answered by the dense eigh instead
        out[f"{FAMILY}/solver_fallbacks"] = float(self.solver_fallbacks)
        # layers (norms, residual points, the profile) no longer read after a failure
        out[f"{FAMILY}/reads_disabled"] = float(
            len({key.rsplit(":", 1)[0] for key in self.failed_taps})
        )
        if self.norms:
            aligned = [
                n.kernel.gamma_alignment for n in self.norms.values() if n.kind == "layernorm"
            ]
            aligned = [a for a in aligned if not math.isnan(a)]
            if aligned:
                out[f"{FAMILY}/gamma_alignment_min"] = min(aligned)
        if self.sources:
            out.update(source_reads(self.sources, key_path))
            out.update(collapse_keys(out, self.source_rule))
        return out

    @property
    def collapses(self) -> list:
        """The classified collapses (:func:`normscope.alerts.sources.classify_collapses`);
        empty without sources."""
        if not self.sources:
            return []
        return classify_collapses(self.as_dict(), self.source_rule)

    @property
    def solver_fallbacks(self) -> int:
        """Dense fallbacks in this read (:mod:`normscope.functional.solvers`): the norms'
        kernel reads plus the points of the profile and of every source's profile."""
        profiles = ([self.profile] if self.profile is not None else []) + list(
            self.sources.values()
        )
        return sum(getattr(n.kernel, "dense_fallbacks", 0) for n in self.norms.values()) + sum(
            getattr(p, "dense_fallbacks", 0) for p in profiles
        )

    @property
    def sigma_min_ratio_min(self) -> float:
        return self.profile.sigma_min_ratio_min if self.profile is not None else math.nan
