"""The story of a run, for ``normscope report``: which run-level reads left their own healthy
band first, in what order, and how many reads before the first alert and before the loss moved.

A read's **band** comes from the run itself: its values over the baseline reads (the first
``baseline`` reads, and never the read of the first alert or of the loss move, but at least
one read), widened outward by a factor -- ``[min / factor, max * factor]`` -- and, for a read
whose healthy level is known, never narrower than ``floor`` on its worse side; a read defined
relative to the run's start (a gain's scale) has its band from that definition instead
(``anchor``) and is judged from the first read on. A read *leaves*
its band when it passes the edge on its **worse** side (``up`` or ``down``: a falling
``sigma_min`` ratio, a rising logit); a move the other way is no news. ``+inf`` on an ``up``
read leaves; NaN (not read) decides nothing. The **loss moved** where its trailing mean over
``loss_window`` logged values rose more than ``loss_rise`` over its lowest so far, or went
non-finite. The watched reads and their factors: :data:`WATCHED`; docs/cli.md says why.

Example::

    >>> reads = {float(s): {"dd/gamma_scale_min": g} for s, g in
    ...          zip(range(10, 90, 10), [1.0, 0.99, 1.0, 0.98, 0.3, 0.2, 0.1, 0.05])}
    >>> t = first_movers(reads, alert_steps=[70.0])
    >>> [(m.key, m.read) for m in t.movers], t.alert_read, t.lead(t.alert_read)
    ([('dd/gamma_scale_min', 5)], 7, 2)
    >>> first_movers({1.0: {"dd/gamma_scale_min": 1.0}}).lines()[0][:30]
    'timeline: healthy: no read lef'
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from normscope.alerts import AttentionLogitRule, RepresentationCollapseRule

__all__ = [
    "LOSS_KEYS",
    "WATCHED",
    "Band",
    "Mover",
    "Timeline",
    "Watch",
    "find_loss",
    "first_movers",
    "loss_moved",
]

Reads = Mapping[float, Mapping[str, float]]


@dataclass(frozen=True)
class Watch:
    """A run-level read the timeline watches: which way is ``worse`` (``"up"`` or ``"down"``),
    how far outside its baseline range it must go (``factor``), and for ``up`` reads the
    least top of its band (``floor``: a level that is healthy whatever the run began at).
    ``anchor``: a read defined relative to the run's start (a gain's scale, 1 at the monitor's
    first batch) has the band ``[anchor / factor, anchor * factor]`` from that definition, not
    from its reads, and is judged from the first read on."""

    key: str
    worse: str
    factor: float = 1.5
    floor: float = 0.0
    anchor: float | None = None


#: The run-level keys the default rules read, each with the side that is worse. Set from the
#: pathology zoo's healthy twins (seeds 0 and 1, docs/cli.md): the gains' scales are read
#: against their definition (1 at the first batch), 3x either way (a twin at learning rate
#: 0.03 drifts to 0.39 in 150 steps); a few gains crossing zero (under 5% of a layer's) are no
#: news (a twin's reach 1.6%); the floors of the logit and the offset share are their rules'
#: (:class:`AttentionLogitRule`'s ``base``, :class:`RepresentationCollapseRule`'s
#: ``alert_above``: a self-supervised twin's share wanders between 0.004 and 0.09). The centred
#: RankMe is not watched: it has no worse side (a healthy language model's falls 15x from
#: initialisation; the collapse rule asks it to stay high).
WATCHED: tuple[Watch, ...] = (
    Watch("dd/nonfinite_share", "up"),
    Watch("dd/rows_rejected", "up"),
    Watch("dd/sigma_min_ratio_min", "down"),
    Watch("dd/sigma_min_step_min", "down"),
    Watch("dd/gamma_alignment_min", "down"),
    Watch("dd/gamma_scale_min", "down", factor=3.0, anchor=1.0),
    Watch("dd/gamma_scale_max", "up", factor=3.0, anchor=1.0),
    Watch("dd/gamma_crossed_max", "up", floor=0.05),
    Watch("dd/rms_growth_max", "up"),
    Watch("dd/attn_logit_max", "up", floor=AttentionLogitRule().base),
    Watch("dd/final_out_offset_share", "up", floor=RepresentationCollapseRule().alert_above),
)

#: The loss keys looked for, in this order (Lightning's ``self.log`` names, the Hugging Face
#: Trainer's ``train/loss``).
LOSS_KEYS = ("train/loss", "train_loss", "loss", "train/loss_step", "train_loss_step")


@dataclass(frozen=True)
class Band:
    """A read's band ``[lo, hi]`` from ``n`` baseline values (0: from the read's definition,
    :attr:`Watch.anchor`); only its ``worse`` edge counts."""

    lo: float
    hi: float
    worse: str
    n: int

    def outside(self, value: float) -> bool:
        if self.worse == "up":
            return value > self.hi  # +inf included; NaN compares False
        return value < self.lo

    def units(self, value: float) -> float:
        """``value`` in band units: 1 at the worse edge, above 1 outside it."""
        if self.worse == "up":
            return value / self.hi if self.hi > 0 else (math.inf if value > 0 else 0.0)
        return self.lo / value if value > 0 else math.inf


@dataclass(frozen=True)
class Mover:
    """A read that left its band: where first (``read``, 1-based, and ``step``) and at what."""

    key: str
    read: int
    step: float
    value: float
    band: Band


@dataclass
class Timeline:
    """What :func:`first_movers` found. ``movers`` in the order they left their bands (ties in
    :data:`WATCHED` order); ``alert_read`` / ``loss_read``: the first read at or after the first
    alert / the loss move (None: none)."""

    movers: list[Mover]
    bands: dict[str, Band]
    n_reads: int
    baseline: int
    alert_step: float | None = None
    alert_read: int | None = None
    loss_key: str | None = None
    loss_step: float | None = None
    loss_read: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.movers and self.alert_step is None and self.loss_step is None

    def lead(self, event_read: int | None) -> int | None:
        """Reads from the first mover to ``event_read`` (0: the same read; negative: after)."""
        if event_read is None or not self.movers:
            return None
        return event_read - self.movers[0].read

    def lines(self) -> list[str]:
        """The timeline in words, one line per mover and event."""
        band_words = f"bands from the first {self.baseline} read(s)"
        loss = f"the loss ({self.loss_key}) did not move" if self.loss_key else "no loss logged"
        if self.healthy:
            return [f"timeline: healthy: no read left its band, no alert, {loss} ({band_words})"]
        out = [f"timeline ({band_words}, widened outward; {self.n_reads} reads):"]
        events = [(self.alert_read, self.alert_step, "first alert")]
        events.append((self.loss_read, self.loss_step, f"the loss ({self.loss_key}) moved"))
        for m in self.movers:
            edge = m.band.hi if m.band.worse == "up" else m.band.lo
            since = "; a scale: its band about its start" if m.band.n == 0 else ""
            out.append(
                f"  read {m.read} (step {m.step:g}): {m.key} {m.value:.4g} left its band "
                f"({'above' if m.band.worse == 'up' else 'below'} {edge:.4g}{since})"
            )
        for read, step, what in events:
            if read is None:
                continue
            lead = self.lead(read)
            led = (
                "no read had left its band"
                if lead is None
                else f"the first mover led it by {lead} read(s)"
                if lead >= 0
                else f"the first mover came {-lead} read(s) after it"
            )
            out.append(f"  {what} at step {step:g} (read {read}): {led}")
        if self.alert_step is None:
            out.append("  no alert")
        if self.loss_step is None:
            out.append(f"  {loss}")
        return out + [f"  note: {n}" for n in self.notes]

    def as_dict(self) -> dict[str, Any]:
        """For ``report.json``."""
        return {
            "healthy": self.healthy,
            "baseline_reads": self.baseline,
            "movers": [
                {
                    "key": m.key,
                    "read": m.read,
                    "step": m.step,
                    "value": m.value,
                    "band": [m.band.lo, m.band.hi],
                    "worse": m.band.worse,
                }
                for m in self.movers
            ],  # fmt: skip
            "first_alert": {"step": self.alert_step, "read": self.alert_read},
            "loss": {"key": self.loss_key, "moved_at": self.loss_step, "read": self.loss_read},
            "lead_over_alert": self.lead(self.alert_read),
            "lead_over_loss": self.lead(self.loss_read),
            "lines": self.lines(),
        }


def find_loss(history: Sequence[Mapping[str, float]]) -> tuple[str, list[tuple[float, float]]]:
    """The run's training loss ``(key, [(step, value), ...])`` by :data:`LOSS_KEYS`, or
    ``("", [])`` when none was logged."""
    for key in LOSS_KEYS:
        points = [(float(r["step"]), float(r[key])) for r in history if key in r and "step" in r]
        if points:
            return key, sorted(points)
    return "", []


def loss_moved(
    loss: Sequence[tuple[float, float]], window: int = 5, rise: float = 1.0
) -> float | None:
    """The first step where the trailing mean of the last ``window`` logged losses is more than
    ``rise`` over its lowest so far, or a loss is non-finite; None when it never is.

    Example::

        >>> loss_moved([(s, 3.0 - 0.1 * s) for s in range(10)] + [(10, 9.0), (11, 9.0)])
        10
    """
    best = math.inf
    for i, (step, value) in enumerate(loss):
        if not math.isfinite(value):
            return step
        recent = [v for _, v in loss[max(0, i - window + 1) : i + 1]]
        mean = sum(recent) / len(recent)
        if mean > best + rise:
            return step
        best = min(best, mean)
    return None


def _read_of(steps: Sequence[float], event: float | None) -> int | None:
    """The 1-based index of the first read at or after ``event``'s step."""
    if event is None:
        return None
    return 1 + sum(1 for s in steps if s < event)


def first_movers(
    reads: Reads,
    alert_steps: Sequence[float] = (),
    loss: Sequence[tuple[float, float]] = (),
    *,
    loss_key: str = "",
    watched: Sequence[Watch] = WATCHED,
    baseline: int = 3,
    loss_window: int = 5,
    loss_rise: float = 1.0,
) -> Timeline:
    """The run's timeline from its reads ``{step: {key: value}}`` (the report's merged reads),
    the steps of its alerts, and its loss ``[(step, value)]`` (:func:`find_loss`); see the
    module docstring for the bands and the loss move."""
    steps = sorted(reads)
    alert = min((s for s in alert_steps if math.isfinite(s)), default=None)
    moved = loss_moved(loss, loss_window, loss_rise) if loss else None
    alert_read, loss_read = _read_of(steps, alert), _read_of(steps, moved)
    first_event = min((r for r in (alert_read, loss_read) if r is not None), default=None)
    base_n = max(1, min(baseline, (first_event or len(steps) + 1) - 1, len(steps)))
    notes = []
    if steps and base_n < baseline:
        why = f"the run has {len(steps)} read(s)"
        if first_event is not None and first_event <= len(steps):
            why = f"the run's first event came at read {first_event}"
            if first_event == 1:
                why += " and the band holds it: a mover after it tells how the run went on"
        notes.append(f"the band takes {base_n} read(s), not {baseline}: {why}")
    bands: dict[str, Band] = {}
    movers: list[Mover] = []
    for w in watched:
        if w.anchor is not None:  # the band from the read's definition: judged from read 1
            if not any(w.key in reads[s] for s in steps):
                continue
            band, first = Band(w.anchor / w.factor, w.anchor * w.factor, w.worse, 0), 0
        else:
            base = [reads[s].get(w.key, math.nan) for s in steps[:base_n]]
            base = [v for v in base if math.isfinite(v)]
            if not base:
                continue
            hi = max(max(base) * w.factor if max(base) > 0 else max(base), w.floor)
            lo = min(base) / w.factor if min(base) > 0 else min(base)
            band, first = Band(lo, hi, w.worse, len(base)), base_n
        bands[w.key] = band
        for i, s in enumerate(steps[first:], first + 1):
            value = reads[s].get(w.key, math.nan)
            if band.outside(value):
                movers.append(Mover(w.key, i, s, value, band))
                break
    movers.sort(key=lambda m: m.read)  # stable: ties keep WATCHED order
    return Timeline(
        movers, bands, len(steps), base_n, alert, alert_read, loss_key or None, moved, loss_read,
        notes,
    )  # fmt: skip
