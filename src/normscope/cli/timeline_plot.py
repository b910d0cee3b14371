"""The timeline figure of ``normscope report``: the reads that left their bands, each in its
band's units, over training steps, with the first alert and the loss move as vertical lines."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from normscope.cli.figures import new_figure, run_series, save, step_span, titled
from normscope.cli.timeline import Timeline

__all__ = ["plot_timeline"]

_SHOWN = (1e-2, 1e4)  # band units drawn: a read far inside or far outside is clipped


def plot_timeline(
    timeline: Timeline, reads: Mapping[float, Mapping[str, float]], path: str | Path, *, title: str
) -> Path:
    """Each mover's read over steps in units of its band (:meth:`Band.units`: 1 at the worse
    edge, above 1 outside it; log axis, clipped to 1e-2..1e4), the band's edge at 1, the
    baseline reads shaded, and the first alert (red) and the loss move (black, dashed) as
    vertical lines. The title's second line names the first mover and its leads."""
    fig = new_figure(9.0, 4.8)
    ax = fig.add_subplot()
    ax.set_yscale("log")
    steps = sorted(reads)
    if steps and timeline.baseline:
        b = timeline.baseline  # shaded to halfway to the next read, so one read shows too
        end = (steps[b - 1] + steps[b]) / 2 if b < len(steps) else steps[b - 1] + 0.5
        ax.axvspan(steps[0], end, color="tab:green", alpha=0.1,
                   label=f"the band's reads ({b})")  # fmt: skip
    ax.axhline(1.0, color="tab:green", lw=1.0, ls="--", label="band edge (worse side)")
    for m in timeline.movers:
        at, values = run_series(reads, m.key)
        units = np.array([m.band.units(float(v)) for v in values])
        ok = ~np.isnan(units)
        shown = np.clip(units[ok], *_SHOWN)
        ax.plot(at[ok], shown, marker="o", ms=3, lw=1.3,
                label=f"{m.key[len('dd/'):]} (out at step {m.step:g})")  # fmt: skip
    if timeline.alert_step is not None:
        ax.axvline(timeline.alert_step, color="tab:red", lw=1.2, label="first alert")
    if timeline.loss_step is not None:
        ax.axvline(timeline.loss_step, color="black", lw=1.2, ls="--",
                   label=f"loss moved ({timeline.loss_key})")  # fmt: skip
    step_span(ax, reads)
    first = timeline.movers[0] if timeline.movers else None
    leads = [
        f"{lead} read(s) before the {what}"
        for lead, what in ((timeline.lead(timeline.alert_read), "alert"),
                           (timeline.lead(timeline.loss_read), "loss moved"))
        if lead is not None
    ]  # fmt: skip
    verdict = (
        f"first out: {first.key[len('dd/') :]} at step {first.step:g}"
        + (f"; {', '.join(leads)}" if leads else "")
        if first
        else "no read left its band"
    )
    ax.set_xlabel("training step")
    ax.set_ylabel("read / its band's edge (worse side up; clipped)")
    ax.set_title(titled(title, verdict), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    return save(fig, path)
