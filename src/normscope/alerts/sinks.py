"""The sinks that deliver an alert: Python logging, W&B ``run.alert``, a callable of yours."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from normscope.alerts.base import Alert

__all__ = ["WANDB_TEXT_CHARS", "CallableSink", "LogSink", "WandbSink", "alert_text", "build_sinks"]

logger = logging.getLogger("normscope")


#: W&B alert text is cut to this many characters (W&B truncates long texts)
WANDB_TEXT_CHARS = 1000


def alert_text(alert: Alert) -> str:
    """The alert's message and, when it has one, its remedy: ``"<message> -- try: <remedy>"``.

    Example::

        >>> alert_text(Alert("r", "k", 3, 1.0, 0.5, "x is loud", remedy="turn it down"))
        'x is loud -- try: turn it down'
    """
    return f"{alert.message} -- try: {alert.remedy}" if alert.remedy else alert.message


class LogSink:
    """Python logging (logger ``normscope``) plus a warning, so that a console shows it: the
    message and the remedy (:func:`alert_text`)."""

    def __call__(self, alert: Alert, runs: Sequence[Any] = ()) -> None:
        import warnings

        text = alert_text(alert)
        logger.warning(text)
        warnings.warn(f"normscope alert: {text}", UserWarning, stacklevel=2)


class WandbSink:
    """``run.alert`` on every attached W&B run, rate-limited per (rule, key): the title
    (under 64 characters) and the message with its remedy (:func:`alert_text`, cut to
    :data:`WANDB_TEXT_CHARS`).

    In offline mode W&B writes the alert into the local run file. ``min_interval_s`` is also
    passed as ``wait_duration`` so that W&B's own limiter agrees.
    """

    def __init__(self, min_interval_s: float = 60.0) -> None:
        self.min_interval_s = min_interval_s
        self._last: dict[tuple[str, str], float] = {}

    def __call__(self, alert: Alert, runs: Sequence[Any] = ()) -> None:
        """Alert on ``runs``: the W&B runs the monitor logs to (none: nothing to do)."""
        if not runs:
            return
        now = time.monotonic()
        key = (alert.rule, alert.key)
        if now - self._last.get(key, -math.inf) < self.min_interval_s:
            return
        self._last[key] = now
        import wandb

        for run in runs:
            run.alert(
                title=alert.title,
                text=alert_text(alert)[:WANDB_TEXT_CHARS],
                level=wandb.AlertLevel.WARN,
                wait_duration=int(self.min_interval_s),
            )


class CallableSink:
    """Your function, called as ``fn(alert)``."""

    def __init__(self, fn: Callable[[Alert], Any]) -> None:
        self.fn = fn

    def __call__(self, alert: Alert, runs: Sequence[Any] = ()) -> None:
        self.fn(alert)


def build_sinks(spec: Iterable[str | Callable[..., Any]] | str | None) -> list[Callable[..., Any]]:
    """``("log", "wandb", fn)`` -> sink objects. Strings: ``"log"``, ``"wandb"``."""
    if spec is None:
        return []
    items: Sequence[Any] = (spec,) if isinstance(spec, str) or callable(spec) else tuple(spec)
    sinks: list[Callable[..., Any]] = []
    for item in items:
        if item == "log":
            sinks.append(LogSink())
        elif item == "wandb":
            sinks.append(WandbSink())
        elif isinstance(item, (LogSink, WandbSink, CallableSink)):
            sinks.append(item)
        elif callable(item):
            sinks.append(CallableSink(item))
        else:
            raise ValueError(
                f"alerts: unknown sink {item!r}; use 'log', 'wandb', a sink object or a callable"
            )
    return sinks
