"""The run report's PNG plots: normscope's logged metrics over training steps, alerts marked.

Each takes the run's reads (``{step: {key: value}}``, keys as the monitor logs them), the
layers or points to draw, and a path. Layers are coloured by depth (viridis: dark is shallow,
yellow is deep), named in the legend up to ``LEGEND_MAX`` lines, past it by a colour scale
with the worst three named on the plot; every alert is a red vertical line at its step. No
panel is left blank: one with nothing to draw says why in its middle, and a figure with nothing
at all is not written (the function returns None and the report says why).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from normscope.cli.figures import (
    ALERT_RATIO,
    ENTRY_ZERO,
    LEGEND_MAX,
    POST_NORM,
    any_finite,
    depth_colours,
    depth_scale,
    log_floor,
    mark_alerts,
    name_worst,
    new_figure,
    run_series,
    save,
    say_empty,
    short_names,
    sparse_ticks,
    step_span,
    titled,
    wide,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "depth_axis_label",
    "logged_depths",
    "plot_run_profile",
    "plot_sigma_over_steps",
    "run_profile_figure",
    "sigma_verdict",
]

Reads = Mapping[float, Mapping[str, float]]


def logged_depths(points: Sequence[str], reads: Reads) -> dict[str, float] | None:
    """Each point's logged ``dd/<point>/depth`` (its index ``k``), when every point has one
    depth over the whole run and no two share one; else None (the order must be inferred).

    Example::

        >>> logged_depths(["e", "h.0"], {1.0: {"dd/e/depth": 0.0, "dd/h.0/depth": 1.0}})
        {'e': 0.0, 'h.0': 1.0}
        >>> logged_depths(["e", "h.0"], {1.0: {"dd/e/depth": 0.0}}) is None
        True
    """
    logged = {}
    for p in points:
        depths = {r[f"dd/{p}/depth"] for r in reads.values() if f"dd/{p}/depth" in r}
        if len(depths) == 1:
            logged[p] = depths.pop()
    if points and len(logged) == len(points) and len(set(logged.values())) == len(points):
        return logged
    return None


def depth_axis_label(points: Sequence[str], reads: Reads) -> str:
    """The depth axis's label: says where the order came from (the log, or module paths).

    Example::

        >>> depth_axis_label(["e"], {1.0: {"dd/e/depth": 0.0}})
        'residual point (forward order, from the logged dd/<point>/depth)'
        >>> depth_axis_label(["e"], {1.0: {}})
        'residual point (depth order inferred from module paths)'
    """
    if logged_depths(points, reads) is not None:
        return "residual point (forward order, from the logged dd/<point>/depth)"
    return "residual point (depth order inferred from module paths)"


def sigma_verdict(reads: Reads, alerts: Sequence[Mapping[str, Any]]) -> str:
    """The line under ``sigma_min_over_steps.png``'s title: the alerts' first step, else the
    lowest ``sigma_min_step_min`` and where it was.

    Example::

        >>> reads = {1.0: {"dd/sigma_min_step_min": 0.97}, 2.0: {"dd/sigma_min_step_min": 0.91}}
        >>> sigma_verdict(reads, [])
        'no alert; lowest sigma_min_step_min 0.91 (step 2), threshold 0.6'
        >>> sigma_verdict(reads, [{"step": 2.0}, {"step": 3.0}])
        '2 alerts, the first at step 2'
    """
    steps = sorted(
        {a["step"] for a in alerts if isinstance(a.get("step"), float) and a["step"] == a["step"]}
    )  # a NaN step: not known
    if alerts:
        first = f", the first at step {steps[0]:g}" if steps else ""
        return f"{len(alerts)} alert{'s' if len(alerts) > 1 else ''}{first}"
    at, values = run_series(reads, "dd/sigma_min_step_min")
    ok = np.isfinite(values)
    if not ok.any():
        return "no alert"
    i = int(np.argmin(np.where(ok, values, np.inf)))
    return (
        f"no alert; lowest sigma_min_step_min {values[i]:.3g} (step {at[i]:g}), "
        f"threshold {ALERT_RATIO}"
    )


def plot_sigma_over_steps(
    reads: Reads,
    points: Sequence[str],
    alerts: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    title: str,
    post_norm: bool = False,
) -> Path:
    """Every point's cumulative ``sigma_min_ratio`` over steps (thin, by depth), the run-level
    ``dd/sigma_min_ratio_min`` and ``dd/sigma_min_step_min`` (thick, a marker at each read),
    the default alert threshold and the alerts. ``p_0`` (``points[0]``), the reference of every
    ratio, is 1 by definition: it is the labelled line at 1, and its logged ratio is drawn as
    dots on it so that a read where it is not 1 shows. When no cumulative ratio is finite
    (``sigma_min(p_0) = 0``) the step ratios are drawn instead and the title says why; a
    post-norm run gets no threshold (no sigma_min alert there). The title's second line says
    whether and when it alerted (:func:`sigma_verdict`)."""
    fig = new_figure(9.0, 4.8)
    ax = fig.add_subplot()
    names = short_names(points)
    cumulative = any(any_finite(reads, f"dd/{p}/sigma_min_ratio") for p in points[1:])
    metric = "sigma_min_ratio" if cumulative else "sigma_min_step"
    lines = [(f"dd/{p}/{metric}", lab) for p, lab in zip(points, names)]
    every = np.concatenate([run_series(reads, k)[1] for k, _ in lines] + [np.array([1.0])])
    log = wide(every)
    if log:
        ax.set_yscale("log")

    def shown(values: np.ndarray) -> np.ndarray:
        return log_floor(values)[0] if log else values

    if lines:
        ax.axhline(1.0, color="black", lw=1.0, zorder=1,
                   label=f"1 = p_0 {names[0]} (the reference)")  # fmt: skip
        steps, values = run_series(reads, lines[0][0])
        if cumulative and np.isfinite(values).any():
            ax.scatter(steps, shown(values), s=60, marker="o", facecolors="none",
                       edgecolors="tab:gray", linewidths=1.3, zorder=4,
                       label=f"p_0 {names[0]}, as logged")  # fmt: skip
    later = [(k, lab) for k, lab in lines[1:] if any_finite(reads, k)]
    many = len(later) > LEGEND_MAX
    lows = []
    for (key, lab), colour in zip(later, depth_colours(len(later))):
        steps, values = run_series(reads, key)
        ax.plot(steps, shown(values), lw=0.9, color=colour, alpha=0.85, zorder=3.5,
                label=None if many else lab)  # fmt: skip
        i = int(np.nanargmin(values))
        lows.append((float(values[i]), float(steps[i]), lab))
    if many:
        depth_scale(fig, ax, [lab for _, lab in later], "residual point")
    run_keys = [("dd/sigma_min_step_min", ":", "sigma_min_step_min")]
    if cumulative:
        run_keys.insert(0, ("dd/sigma_min_ratio_min", "-", "sigma_min_ratio_min"))
    for key, style, lab in run_keys:
        steps, values = run_series(reads, key)
        if np.isfinite(values).any():
            ax.plot(steps, shown(values), style, color="black", lw=2,
                    marker="o" if style == "-" else "s", ms=3.5, zorder=3, label=lab)  # fmt: skip
    if not post_norm:
        ax.axhline(ALERT_RATIO, color="tab:red", lw=0.8, ls="--",
                   label=f"alert threshold {ALERT_RATIO}")  # fmt: skip
    mark_alerts(ax, alerts)
    step_span(ax, reads)
    if many:  # after every line that moves the limits
        worst = sorted(lows)[:3]
        name_worst(ax, [(x, float(shown(np.array([v]))[0]), lab) for v, x, lab in worst])
    verdict = sigma_verdict(reads, alerts)
    if post_norm:
        verdict = f"{verdict.replace(f', threshold {ALERT_RATIO}', '')}; {POST_NORM}"
    if not later and not any_finite(reads, "dd/sigma_min_step_min"):
        why = "no finite sigma_min ratio in any read"
        say_empty(ax, why + (f" ({ENTRY_ZERO})" if not cumulative else ""))
        verdict = f"{why}; {verdict}"
    elif not cumulative:
        verdict = f"{ENTRY_ZERO}; step ratios drawn; {verdict}"
    ax.set_xlabel("training step")
    ax.set_ylabel("sigma_min ratio" if cumulative else "step ratio sigma_min(p_k)/sigma_min(p_k-1)")
    ax.set_title(titled(title, verdict), fontsize=9)
    if many:  # the colour bar is beside the axes: the legend goes inside
        ax.legend(fontsize=6, loc="lower left", framealpha=0.85)
    else:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    return save(fig, path)


def plot_run_profile(
    reads: Reads,
    points: Sequence[str],
    steps: Sequence[float],
    alert_steps: Sequence[float],
    path: str | Path,
    *,
    title: str,
    post_norm: bool = False,
) -> Path:
    """The ``sigma_min`` ratio against depth at a few steps (colour by step; a read at an
    alert drawn in red), the floor at 1 and the alert threshold; the depth axis says whether
    the order was logged or inferred (:func:`depth_axis_label`)."""
    figure = run_profile_figure(reads, points, steps, alert_steps, title=title, post_norm=post_norm)
    return save(figure, path)


def run_profile_figure(
    reads: Reads,
    points: Sequence[str],
    steps: Sequence[float],
    alert_steps: Sequence[float],
    *,
    title: str,
    post_norm: bool = False,
) -> Figure:
    """The figure :func:`plot_run_profile` saves. Only the steps with a finite ratio are drawn
    and named in the legend; with none (``sigma_min(p_0) = 0``) the step ratios are drawn and
    the title says why; with nothing finite at all, the axes say so."""
    fig = new_figure()
    ax = fig.add_subplot()
    depth = np.arange(len(points))
    verdict = []
    metric = "sigma_min_ratio"
    curves = {}
    for metric in ("sigma_min_ratio", "sigma_min_step"):
        curves = {
            s: np.array([reads[s].get(f"dd/{p}/{metric}", np.nan) for p in points]) for s in steps
        }
        curves = {s: c for s, c in curves.items() if np.isfinite(c[1:]).any()}
        if curves:
            break
    if metric == "sigma_min_step" and curves:
        verdict.append(f"{ENTRY_ZERO}; step ratios sigma_min(p_k)/sigma_min(p_k-1) drawn")
    log = wide(np.concatenate([*curves.values(), np.array([1.0])]))
    if log:
        ax.set_yscale("log")
    for (step, values), colour in zip(curves.items(), depth_colours(len(curves))):
        at_alert = step in alert_steps
        ax.plot(depth, log_floor(values)[0] if log else values, "-o", ms=3, lw=1.8 if at_alert else 1.0,
                color="tab:red" if at_alert else colour,
                label=f"step {step:g}" + (" (alert)" if at_alert else ""))  # fmt: skip
    skipped = [s for s in steps if s not in curves]
    if curves and skipped:
        verdict.append(f"steps {', '.join(f'{s:g}' for s in skipped)}: no finite ratio")
    if not curves:
        p0 = run_series(reads, f"dd/{points[0]}/sigma_min")[1] if points else np.array([])
        entry_zero = bool(p0.size) and bool(np.all(p0[np.isfinite(p0)] <= 0))
        why = "no finite sigma_min ratio at any read" + (f" ({ENTRY_ZERO})" if entry_zero else "")
        say_empty(ax, why)
        verdict.append(why)
    if post_norm:
        ax.axhline(1.0, color="black", lw=0.9, label="1 (p_0's level)")
        verdict.append(POST_NORM)
    else:
        ax.axhline(1.0, color="black", lw=0.9, label="1 (the pre-norm floor)")
        ax.axhline(ALERT_RATIO, color="tab:red", lw=0.8, ls="--",
                   label=f"alert threshold {ALERT_RATIO}")  # fmt: skip
    sparse_ticks(ax, short_names(points))
    ax.set_xlabel(depth_axis_label(points, reads))
    ax.set_ylabel("sigma_min(p_k) / sigma_min(p_0)" if metric == "sigma_min_ratio"
                  else "sigma_min(p_k) / sigma_min(p_k-1)")  # fmt: skip
    ax.set_title(titled(title, "; ".join(verdict)) if verdict else title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return fig
