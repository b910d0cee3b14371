"""One event, one page: which alerts reach the sinks, which are only counted.

A divergence fires one rule, then others, then one rule again on layer after layer. The
:class:`Pager` groups a run's alerts into *events* (an event opens at an alert and ends after
``quiet_reads`` reads with none) and pages, per event, the first alert and at most
``max_pages_per_event - 1`` follow-ups, each from a rule not yet heard from in that event. A
rule's further alerts in the event (other layers, other points), a ``consequences`` rule firing
after another rule, and everything past the cap are *counted*: they stay in
``monitor.alerts_fired``, ``StepResult.alerts`` and the end-of-fit summary (:func:`format_alerts`),
and reach no sink. The count line is logged when the event ends (or at the end of the fit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Pager", "format_alerts"]


class Pager:
    """The paging policy of one monitor (the monitor's ``paging=``; its state is checkpointed).

    Args:
        max_pages_per_event: pages per event: the first alert and follow-ups from other rules
            (None: every rule's first alert in the event pages).
        quiet_reads: reads without an alert that end an event (>= 1).
        consequences: rules that are news only as an event's first alert: after another rule
            they are counted (a LayerNorm's lost kernel while its gains cross zero).

    Example::

        >>> from normscope.alerts import Alert
        >>> pager = Pager(max_pages_per_event=2, quiet_reads=2)
        >>> fire = lambda rule, step, n=1: [Alert(rule, f"dd/l{i}/x", step, 1.0, 0.5, rule)
        ...                                 for i in range(n)]
        >>> [a.paged for a in pager.sort(fire("attention_logit_growth", 10))]
        [True]
        >>> [a.paged for a in pager.sort(fire("layernorm_kernel_lost", 20, n=3))]
        [False, False, False]
        >>> [a.paged for a in pager.sort(fire("stream_scale_growth", 30) + fire("x", 30))]
        [True, False]
        >>> pager.sort([]), pager.sort([]), pager.closed
        ([], [], 'normscope: 4 more alerts in this event (see the summary)')
    """

    def __init__(
        self,
        max_pages_per_event: int | None = 2,
        quiet_reads: int = 10,
        consequences: Iterable[str] = ("layernorm_kernel_lost",),
    ) -> None:
        if max_pages_per_event is not None and (
            isinstance(max_pages_per_event, bool)
            or not isinstance(max_pages_per_event, int)
            or max_pages_per_event < 1
        ):
            raise ValueError(
                f"Pager: max_pages_per_event must be an int >= 1 or None, got "
                f"{max_pages_per_event!r}"
            )
        if isinstance(quiet_reads, bool) or not isinstance(quiet_reads, int) or quiet_reads < 1:
            raise ValueError(f"Pager: quiet_reads must be an int >= 1, got {quiet_reads!r}")
        self.max_pages_per_event = max_pages_per_event
        self.quiet_reads = quiet_reads
        self.consequences = frozenset(consequences)
        self.event = 0  # events so far; the open one's number while ``open``
        self.open = False
        self.quiet = 0  # reads without an alert since the event's last
        self.pages = 0  # pages in the open event
        self.counted = 0  # alerts counted, not paged, in the open event
        self.rules: set[str] = set()  # rules heard from in the open event
        #: the count line of the event the last :meth:`sort` or :meth:`close` ended (None: none
        #: ended, or it had nothing counted)
        self.closed: str | None = None

    def sort(self, fired: Sequence[Any]) -> list[Any]:
        """One read's alerts (call it at every read, with none too: quiet reads end an
        event), returned with ``event`` and ``paged`` set; :attr:`closed` says whether this
        read ended an event with alerts counted."""
        self.closed = None
        if not fired:
            if self.open:
                self.quiet += 1
                if self.quiet >= self.quiet_reads:
                    self.close()
            return []
        if not self.open:
            self.event += 1
            self.open, self.pages, self.counted, self.rules = True, 0, 0, set()
        self.quiet = 0
        return [self._one(alert) for alert in fired]

    def _one(self, alert: Any) -> Any:
        rule = str(getattr(alert, "rule", type(alert).__name__))
        page = (
            rule not in self.rules
            and not (self.rules and rule in self.consequences)
            and (self.max_pages_per_event is None or self.pages < self.max_pages_per_event)
        )
        self.rules.add(rule)
        self.pages += page
        self.counted += not page
        if dataclasses.is_dataclass(alert) and hasattr(alert, "paged"):
            return dataclasses.replace(alert, event=self.event, paged=page)
        return alert

    def close(self) -> str | None:
        """End the open event (the end of the fit): its count line, also in :attr:`closed`."""
        self.closed = None
        if self.open and self.counted:
            n = self.counted
            self.closed = (
                f"normscope: {n} more alert{'s' * (n != 1)} in this event (see the summary)"
            )
        self.open, self.quiet = False, 0
        return self.closed

    def state_dict(self) -> dict[str, Any]:
        return {
            "event": self.event,
            "open": self.open,
            "quiet": self.quiet,
            "pages": self.pages,
            "counted": self.counted,
            "rules": sorted(self.rules),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.event = int(state.get("event", 0))
        self.open = bool(state.get("open", False))
        self.quiet = int(state.get("quiet", 0))
        self.pages = int(state.get("pages", 0))
        self.counted = int(state.get("counted", 0))
        self.rules = set(state.get("rules", []))


def format_alerts(alerts: Sequence[Any]) -> str:
    """The end-of-fit list of a run's alerts: each with its step, rule, place and whether it
    was paged or counted, grouped by event, then what to try for each rule ("" without alerts).

    Example::

        >>> from normscope.alerts import Alert
        >>> a = Alert("norm_gain_drift", "dd/gamma_scale_min", 40, 0.2, 0.25, "m", point="h.1",
        ...           remedy="exclude the gains from weight decay", event=1, paged=True)
        >>> print(format_alerts([a]))
        normscope alerts: 1 (1 paged, 0 counted)
          event 1
            step 40: norm_gain_drift at h.1 (dd/gamma_scale_min 0.2, line 0.25) paged
          what to try:
            norm_gain_drift: exclude the gains from weight decay
    """
    if not alerts:
        return ""
    paged = sum(1 for a in alerts if getattr(a, "paged", None) is True)
    counted = sum(1 for a in alerts if getattr(a, "paged", None) is False)
    lines = [f"normscope alerts: {len(alerts)} ({paged} paged, {counted} counted)"]
    event: object = object()
    remedies: dict[str, str | None] = {}
    for a in alerts:
        if getattr(a, "event", None) != event:
            event = getattr(a, "event", None)
            lines.append(f"  event {event}" if event is not None else "  alerts")
        point, sublayer = getattr(a, "point", None), getattr(a, "sublayer", None)
        where = f" at {point}" if point else ""
        where += f" ({sublayer})" if sublayer else ""
        status = {True: " paged", False: " counted"}.get(getattr(a, "paged", None), "")
        lines.append(
            f"    step {a.step}: {a.rule}{where} ({a.key} {a.value:.3g}, line "
            f"{a.threshold:.3g}){status}"
        )
        remedies.setdefault(a.rule, getattr(a, "remedy", None))
    if any(remedies.values()):
        lines.append("  what to try:")
        lines += [f"    {rule}: {text}" for rule, text in remedies.items() if text]
    return "\n".join(lines)
