"""The weight rules: a LayerNorm's lost kernel (dead-direction family), an outlier input
feature and a sign-churn spike (sign-magnitude family)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from normscope.alerts.base import Alert
from normscope.alerts.remedies import REMEDIES

__all__ = ["KernelLossRule", "OutlierRule", "SignChurnSpikeRule"]


class KernelLossRule:
    """A LayerNorm layer (no dead channels) whose exact kernel is gone: ``kernel_residual`` above
    ``max_kernel_residual``. Exact-kernel layers sit at the forward's floor (about 1e-14 for a
    float32 forward, 1e-5 for bfloat16), so the default 1e-4 holds for both.

    ``kinds`` maps norm paths to their declared kind (the monitor fills it); only ``layernorm``
    layers are checked, once per layer until it falls back under the line.

    Example::

        >>> rule = KernelLossRule()
        >>> rule.kinds = {"ln_f": "layernorm", "h.0.ln": "rmsnorm"}
        >>> [a.point for a in rule.evaluate({"dd/ln_f/kernel_residual": 0.02}, 30)]
        ['ln_f']
        >>> rule.evaluate({"dd/ln_f/kernel_residual": 0.03}, 40)  # still lost: no new alert
        []
    """

    name = "layernorm_kernel_lost"
    tier = "spectral"  # kernel_residual needs the full C: spectral windows only (docs/costs.md)
    remedy: str | None = REMEDIES["layernorm_kernel_lost"]

    def __init__(self, max_kernel_residual: float = 1e-4) -> None:
        self.max_kernel_residual = max_kernel_residual
        self.kinds: dict[str, str] = {}
        self.firing: set[str] = set()

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        alerts = []
        for path, kind in self.kinds.items():
            if kind != "layernorm" or metrics.get(f"dd/{path}/dead_channels", 0) > 0:
                continue
            value = metrics.get(f"dd/{path}/kernel_residual", math.nan)
            if not math.isfinite(value):
                continue
            if value <= self.max_kernel_residual:
                self.firing.discard(path)
                continue
            if path in self.firing:
                continue
            self.firing.add(path)
            alerts.append(
                Alert(
                    self.name,
                    f"dd/{path}/kernel_residual",
                    step,
                    float(value),
                    self.max_kernel_residual,
                    f"LayerNorm {path} lost its exact kernel at step {step}: kernel_residual "
                    f"{value:.3g} > {self.max_kernel_residual:.3g}",
                    point=path,
                    remedy=self.remedy,
                )
            )
        return alerts

    def state_dict(self) -> dict[str, Any]:
        return {"firing": sorted(self.firing)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.firing = set(state.get("firing", []))


class OutlierRule:
    """An outlier feature emerging: a Linear layer's input ``max_leverage = n max alpha_j^2``
    (docs/metrics.md §2.2) above ``max_leverage_above`` (delocalised inputs give 1; a flip in a
    channel of leverage L costs about L times a delocalised one's). Fires once per layer until
    it falls back.

    Example::

        >>> rule = OutlierRule()
        >>> [a.point for a in rule.evaluate({"sm/fc1/max_leverage": 240.0}, 50)]
        ['fc1']
    """

    name = "outlier_feature"
    tier = "cheap"  # the read tier its keys need (docs/costs.md, "Tiers")
    remedy: str | None = REMEDIES["outlier_feature"]

    def __init__(self, max_leverage_above: float = 100.0) -> None:
        if max_leverage_above <= 1:
            raise ValueError(
                f"OutlierRule: max_leverage_above must be > 1, got {max_leverage_above}"
            )
        self.max_leverage_above = max_leverage_above
        self.firing: set[str] = set()

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        alerts = []
        for key, value in metrics.items():
            if not (key.startswith("sm/") and key.endswith("/max_leverage")) or not math.isfinite(
                value
            ):
                continue
            layer = key[len("sm/") : -len("/max_leverage")]
            if value <= self.max_leverage_above:
                self.firing.discard(layer)
                continue
            if layer in self.firing:
                continue
            self.firing.add(layer)
            alerts.append(
                Alert(
                    self.name,
                    key,
                    step,
                    float(value),
                    self.max_leverage_above,
                    f"outlier feature at the input of {layer} at step {step}: max_leverage "
                    f"{value:.4g} > {self.max_leverage_above:.4g}",
                    point=layer,
                    remedy=self.remedy,
                )
            )
        return alerts

    def state_dict(self) -> dict[str, Any]:
        return {"firing": sorted(self.firing)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.firing = set(state.get("firing", []))


class SignChurnSpikeRule:
    """A sign-churn spike: ``sm/sign_churn_mean`` above ``factor`` times the median of the
    previous reads' values (the last 50) and above ``min_churn``. The first two reads only set
    the median.

    Example::

        >>> rule = SignChurnSpikeRule()
        >>> [rule.evaluate({"sm/sign_churn_mean": v}, s) for s, v in ((1, 0.004), (2, 0.005))]
        [[], []]
        >>> [a.rule for a in rule.evaluate({"sm/sign_churn_mean": 0.05}, 3)]
        ['sign_churn_spike']
    """

    name = "sign_churn_spike"
    tier = "cheap"  # the read tier its keys need (docs/costs.md, "Tiers")
    remedy: str | None = REMEDIES["sign_churn_spike"]

    def __init__(
        self, factor: float = 5.0, min_churn: float = 0.01, key: str = "sm/sign_churn_mean"
    ) -> None:
        if factor <= 1:
            raise ValueError(f"SignChurnSpikeRule: factor must be > 1, got {factor}")
        self.factor = factor
        self.min_churn = min_churn
        self.key = key
        self.history: list[float] = []

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        value = metrics.get(self.key, math.nan)
        if not math.isfinite(value):
            return []
        alerts = []
        if len(self.history) >= 2:
            ordered = sorted(self.history)
            median = ordered[len(ordered) // 2]
            limit = max(self.factor * median, self.min_churn)
            if value > limit:
                alerts.append(
                    Alert(
                        self.name,
                        self.key,
                        step,
                        float(value),
                        limit,
                        f"sign churn spiked to {value:.3g} at step {step} ({value / max(median, 1e-12):.3g}x "
                        f"the median {median:.3g} of earlier reads)",
                        remedy=self.remedy,
                    )
                )
        self.history = (self.history + [float(value)])[-50:]
        return alerts

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [float(v) for v in state.get("history", [])]
