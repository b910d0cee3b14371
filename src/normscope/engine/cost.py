"""The cost guard: time the plain optimiser steps with a wall clock (no device sync: over many
steps it follows the device's pace) and say, once, when reads cost more than a fraction of
training time at the monitor's cadence, with the ``every_n_steps`` that would not."""

from __future__ import annotations

import math
import time

__all__ = ["CostGuard"]


class CostGuard:
    """Judges a read's seconds against the mean plain step.

    Args:
        overhead_warn: the share of training time reads may take (``None``: never judged).

    Raises:
        ValueError: ``overhead_warn`` neither None nor a number > 0.

    Example::

        >>> guard = CostGuard(0.05)
        >>> guard.plain_seconds, guard.plain_steps = 2.0, 20   # 0.1 s a plain step
        >>> guard.judge(1.0, every_n_steps=50, label="DeadDirectionMonitor")[:45]
        'normscope: a DeadDirectionMonitor read takes '
        >>> guard.judge(0.1, every_n_steps=50, label="DeadDirectionMonitor") is None
        True
    """

    min_timed_steps: int = 20  # plain steps timed before a read's cost is judged

    def __init__(self, overhead_warn: float | None) -> None:
        if overhead_warn is not None and not (
            isinstance(overhead_warn, (int, float))
            and not isinstance(overhead_warn, bool)
            and overhead_warn > 0
        ):
            raise ValueError(f"overhead_warn must be None or a fraction > 0, got {overhead_warn!r}")
        self.overhead_warn = overhead_warn
        self.plain_seconds = 0.0
        self.plain_steps = 0
        self.read_seconds: float | None = None
        self._last: float | None = None

    def clock(self, *, plain: bool) -> None:
        """At the end of every optimiser step; ``plain``: a step without a read."""
        now = time.perf_counter()
        if plain and self._last is not None:
            self.plain_seconds += now - self._last
            self.plain_steps += 1
        self._last = now

    def judge(self, read_seconds: float, *, every_n_steps: int, label: str) -> str | None:
        """The warning to give when a read of ``read_seconds`` costs more than
        ``overhead_warn`` of training time at ``every_n_steps``; None when it does not (or too
        few plain steps were timed yet)."""
        self.read_seconds = read_seconds
        if self.overhead_warn is None or self.plain_steps < self.min_timed_steps:
            return None
        mean = self.plain_seconds / self.plain_steps
        share = read_seconds / (every_n_steps * mean) if mean > 0 else math.inf
        if share <= self.overhead_warn:
            return None
        suggest = math.ceil(read_seconds / (self.overhead_warn * mean)) if mean > 0 else None
        return (
            f"normscope: a {label} read takes {read_seconds:.3g} s against a mean "
            f"training step of {mean:.3g} s: about {share:.0%} of training time at "
            f"every_n_steps={every_n_steps}. every_n_steps={suggest} keeps it under "
            f"{self.overhead_warn:.0%} (or read fewer layers: layers=[...], max_memory=...); "
            "overhead_warn=None turns this warning off"
        )
