"""The cost guard: warn once when reads cost more than ``overhead_warn`` of training time."""

from __future__ import annotations

import math
import time
from typing import Any

__all__ = ["CostGuard"]


class CostGuard:
    """Timing the plain steps and judging a read's cost against them (a mixin
    :class:`~normscope.callbacks._base.MonitorCallback` inherits)."""

    #: plain (not sampled) steps timed before a read's cost is judged against them
    min_timed_steps: int = 20

    # Supplied by MonitorCallback.
    label: str
    every_n_steps: int
    overhead_warn: float | None
    _clock_last: float | None
    _plain_seconds: float
    _plain_steps: int
    _read_seconds: float | None
    _warn_once: Any

    def _clock(self, *, plain: bool) -> None:
        """At the end of every optimiser step: time the plain ones (a wall clock, no device
        sync: over many steps it follows the device's pace)."""
        now = time.perf_counter()
        if plain and self._clock_last is not None:
            self._plain_seconds += now - self._clock_last
            self._plain_steps += 1
        self._clock_last = now

    def _judge_cost(self, read_seconds: float) -> None:
        """Warn once when reads cost more than ``overhead_warn`` of training time at this
        cadence, with the ``every_n_steps`` that would not (rank zero)."""
        self._read_seconds = read_seconds
        if self.overhead_warn is None or self._plain_steps < self.min_timed_steps:
            return
        step = self._plain_seconds / self._plain_steps
        share = read_seconds / (self.every_n_steps * step) if step > 0 else math.inf
        if share <= self.overhead_warn:
            return
        suggest = math.ceil(read_seconds / (self.overhead_warn * step)) if step > 0 else None
        self._warn_once(
            "cost",
            f"normscope: a {self.label} read takes {read_seconds:.3g} s against a mean "
            f"training step of {step:.3g} s: about {share:.0%} of training time at "
            f"every_n_steps={self.every_n_steps}. every_n_steps={suggest} keeps it under "
            f"{self.overhead_warn:.0%} (or read fewer layers: layers=[...], max_memory=...); "
            "overhead_warn=None turns this warning off",
        )
