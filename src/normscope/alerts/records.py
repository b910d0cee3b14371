"""The alert record and the rule protocol every alert rule follows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Alert", "AlertRule"]


@dataclass(frozen=True)
class Alert:
    """One alert: which rule, which metric key, where (point and sublayer), when, how bad."""

    rule: str
    key: str
    step: int
    value: float
    threshold: float
    message: str
    point: str | None = None
    sublayer: str | None = None
    #: the monitor that raised it: ``"DeadDirectionMonitor"``, or with its name
    #: ``"DeadDirectionMonitor[fast]"`` (then ``key`` is the key that monitor logs, ``dd[fast]/...``)
    monitor: str | None = None

    @property
    def title(self) -> str:
        """A short title (W&B caps alert titles near 64 characters); a named monitor's alert
        says its name: ``normscope[fast]: sigma_min_collapse at mlp``."""
        where = f" at {self.sublayer}" if self.sublayer else ""
        named = (
            self.monitor[self.monitor.find("[") :] if self.monitor and "[" in self.monitor else ""
        )
        return f"normscope{named}: {self.rule}{where}"[:63]

    def as_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "key": self.key,
            "step": self.step,
            "value": self.value,
            "threshold": self.threshold,
            "point": self.point,
            "sublayer": self.sublayer,
            "message": self.message,
            "monitor": self.monitor,
        }


class AlertRule(Protocol):
    name: str

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
