"""The alert record, the rule protocol, the once-per-episode base and a rule of your own.

:class:`Alert` is what every rule returns and every sink delivers; :class:`AlertRule` is what a
monitor asks of a rule; :class:`EpisodeRule` is the debounce the stream and attention rules
share (fire once, re-arm after a "no"); :class:`CallableRule` wraps a function of yours.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Alert", "AlertRule", "CallableRule", "EpisodeRule"]


@dataclass(frozen=True)
class Alert:
    """One alert: which rule, which metric key, where (point and sublayer), when, how bad, and
    what to try (``remedy``: the rule's entry of :data:`~normscope.alerts.remedies.REMEDIES`).
    A monitor's :class:`~normscope.alerts.paging.Pager` sets ``event`` (the event it belongs
    to, from 1) and ``paged`` (whether the sinks got it, or it was only counted)."""

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
    remedy: str | None = None
    event: int | None = None
    paged: bool | None = None

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
            "remedy": self.remedy,
            "event": self.event,
            "paged": self.paged,
        }


class AlertRule(Protocol):
    """What a monitor asks of a rule: a ``name``, ``evaluate(metrics, step)`` returning the
    alerts one read raises (``metrics`` is the flat dict a monitor logs, canonical keys), and
    its debounce state as ``state_dict`` / ``load_state_dict`` (saved in checkpoints)."""

    name: str

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class EpisodeRule(abc.ABC):
    """A rule that fires once per episode: when :meth:`check` has said True ``patience`` reads
    in a row; it re-arms after a read where it says False (a read that says None, cannot
    decide, changes nothing). A subclass sets ``name`` and writes :meth:`check`;
    ``self.step`` is the step of the read being judged. The stream and attention rules are
    episode rules.

    Example::

        >>> class Loud(EpisodeRule):
        ...     name = "loud"
        ...     def check(self, metrics):
        ...         v = metrics.get("x", float("nan"))
        ...         if v != v:
        ...             return None, None
        ...         return v > 1, Alert(self.name, "x", self.step, v, 1.0, "x is loud")
        >>> rule = Loud(patience=2)
        >>> rule.evaluate({"x": 5.0}, 1), [a.step for a in rule.evaluate({"x": 5.0}, 2)]
        ([], [2])
        >>> rule.evaluate({"x": 5.0}, 3), rule.evaluate({}, 4), rule.firing  # same episode
        ([], [], True)
    """

    name = "episode"

    def __init__(self, patience: int = 1) -> None:
        if patience < 1:
            raise ValueError(f"{type(self).__name__}: patience must be >= 1, got {patience}")
        self.patience = int(patience)
        self.count = 0
        self.firing = False
        self.step = 0

    @abc.abstractmethod
    def check(self, metrics: Mapping[str, float]) -> tuple[bool | None, Alert | None]:
        """``(hit, alert)`` for one read: hit True / False / None (cannot decide), and the
        alert to raise when the episode fires."""

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        self.step = step
        hit, alert = self.check(metrics)
        if hit is None:
            return []
        if not hit:
            self.firing, self.count = False, 0
            return []
        self.count += 1
        if self.firing or alert is None or self.count < self.patience:
            return []
        self.firing = True
        return [alert]

    def state_dict(self) -> dict[str, Any]:
        return {"firing": self.firing, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.firing = bool(state.get("firing", False))
        self.count = int(state.get("count", 0))


class CallableRule:
    """A rule of yours: ``fn(metrics, step)`` returns None, a message, an :class:`Alert`, or a
    list of them; it keeps no state. ``remedy``: what to try, on the alerts of its messages.

    Example::

        >>> rule = CallableRule("loss_spike", lambda m, step: "spike" if m["loss"] > 9 else None)
        >>> [(a.rule, a.step, a.message) for a in rule.evaluate({"loss": 12.0}, 7)]
        [('loss_spike', 7, 'spike')]
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[Mapping[str, float], int], Any],
        remedy: str | None = None,
    ) -> None:
        self.name = name
        self.fn = fn
        self.remedy = remedy

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        out = self.fn(metrics, step)
        if out is None:
            return []
        items = out if isinstance(out, (list, tuple)) else [out]
        return [
            a
            if isinstance(a, Alert)
            else Alert(self.name, self.name, step, math.nan, math.nan, str(a), remedy=self.remedy)
            for a in items
        ]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
