"""The run report's PNG plots: normscope's logged metrics over training steps, alerts marked.

Each takes the run's reads (``{step: {key: value}}``, keys as the monitor logs them), the
layers or points to draw, and a path. Layers are coloured by depth (viridis: dark is shallow,
yellow is deep); every alert is a red vertical line at its step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from normscope.cli.figures import ALERT_RATIO, log_floor, new_figure, save, short_names, titled

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "depth_axis_label",
    "logged_depths",
    "plot_norm_metrics",
    "plot_run_profile",
    "plot_sigma_over_steps",
    "run_profile_figure",
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


def _series(reads: Reads, key: str) -> tuple[np.ndarray, np.ndarray]:
    steps = [s for s in sorted(reads) if key in reads[s]]
    return np.array(steps, dtype=float), np.array([reads[s][key] for s in steps], dtype=float)


def _colours(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.9 * i / max(1, n - 1)) for i in range(n)]


def _mark_alerts(ax: Any, alerts: Sequence[Mapping[str, Any]], label: bool = True) -> None:
    seen = set()
    for a in alerts:
        step = a.get("step")
        if step is None or step != step or step in seen:  # NaN: no step known
            continue
        seen.add(step)
        ax.axvline(step, color="tab:red", lw=1.0, ls="-", alpha=0.7,
                   label="alert" if label and len(seen) == 1 else None)  # fmt: skip


def _wide(values: np.ndarray) -> bool:
    v = values[np.isfinite(values)]
    return v.size > 0 and (v.min() <= 0 or v.max() / max(v.min(), 1e-300) > 30)


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
    at, values = _series(reads, "dd/sigma_min_step_min")
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
) -> Path:
    """Every point's cumulative ``sigma_min_ratio`` over steps (thin, by depth), the run-level
    ``dd/sigma_min_ratio_min`` and ``dd/sigma_min_step_min`` (thick, a marker at each read),
    the default alert threshold and the alerts. ``p_0`` (``points[0]``), the reference of every
    ratio, is 1 by definition: it is the labelled line at 1, and its logged ratio is drawn as
    dots on it so that a read where it is not 1 shows. The title's second line says whether
    and when it alerted (:func:`sigma_verdict`)."""
    fig = new_figure(9.0, 4.8)
    ax = fig.add_subplot()
    names = short_names(points)
    lines = [(f"dd/{p}/sigma_min_ratio", lab) for p, lab in zip(points, names)]
    every = np.concatenate([_series(reads, k)[1] for k, _ in lines] + [np.array([1.0])])
    log = _wide(every)
    if log:
        ax.set_yscale("log")
    if lines:
        ax.axhline(1.0, color="black", lw=1.0, zorder=1,
                   label=f"1 = p_0 {names[0]} (the reference)")  # fmt: skip
        steps, values = _series(reads, lines[0][0])
        if steps.size:
            ax.scatter(steps, log_floor(values)[0] if log else values, s=60, marker="o",
                       facecolors="none", edgecolors="tab:gray", linewidths=1.3, zorder=4,
                       label=f"p_0 {names[0]}, as logged")  # fmt: skip
    later = lines[1:]
    for (key, lab), colour in zip(later, _colours(len(later))):
        steps, values = _series(reads, key)
        if log:
            values = log_floor(values)[0]
        ax.plot(steps, values, lw=0.9, color=colour, alpha=0.85, zorder=2,
                label=lab if len(later) <= 12 else None)  # fmt: skip
    for key, style, lab in (
        ("dd/sigma_min_ratio_min", "-", "sigma_min_ratio_min"),
        ("dd/sigma_min_step_min", ":", "sigma_min_step_min"),
    ):
        steps, values = _series(reads, key)
        if steps.size:
            ax.plot(steps, log_floor(values)[0] if log else values, style, color="black", lw=2,
                    marker="o" if style == "-" else "s", ms=3.5, zorder=3, label=lab)  # fmt: skip
    ax.axhline(
        ALERT_RATIO, color="tab:red", lw=0.8, ls="--", label=f"alert threshold {ALERT_RATIO}"
    )
    _mark_alerts(ax, alerts)
    ax.set_xlabel("training step")
    ax.set_ylabel("sigma_min ratio")
    ax.set_title(titled(title, sigma_verdict(reads, alerts)), fontsize=9)
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
) -> Path:
    """The ``sigma_min`` ratio against depth at a few steps (colour by step; a read at an
    alert drawn in red), the floor at 1 and the alert threshold; the depth axis says whether
    the order was logged or inferred (:func:`depth_axis_label`)."""
    return save(run_profile_figure(reads, points, steps, alert_steps, title=title), path)


def run_profile_figure(
    reads: Reads,
    points: Sequence[str],
    steps: Sequence[float],
    alert_steps: Sequence[float],
    *,
    title: str,
) -> Figure:
    """The figure :func:`plot_run_profile` saves."""
    fig = new_figure()
    ax = fig.add_subplot()
    depth = np.arange(len(points))
    curves = {
        s: np.array([reads[s].get(f"dd/{p}/sigma_min_ratio", np.nan) for p in points])
        for s in steps
    }
    log = _wide(np.concatenate([*curves.values(), np.array([1.0])]))
    if log:
        ax.set_yscale("log")
    for (step, values), colour in zip(curves.items(), _colours(len(curves))):
        at_alert = step in alert_steps
        ax.plot(depth, log_floor(values)[0] if log else values, "-o", ms=3, lw=1.8 if at_alert else 1.0,
                color="tab:red" if at_alert else colour,
                label=f"step {step:g}" + (" (alert)" if at_alert else ""))  # fmt: skip
    ax.axhline(1.0, color="black", lw=0.9, label="1 (no-cancellation floor)")
    ax.axhline(
        ALERT_RATIO, color="tab:red", lw=0.8, ls="--", label=f"alert threshold {ALERT_RATIO}"
    )
    ax.set_xticks(depth)
    ax.set_xticklabels(short_names(points), rotation=60, ha="right", fontsize=8)
    ax.set_xlabel(depth_axis_label(points, reads))
    ax.set_ylabel("sigma_min(p_k) / sigma_min(p_0)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return fig


def plot_norm_metrics(
    reads: Reads,
    layers: Sequence[str],
    panels: Sequence[tuple[str, str, bool]],
    alerts: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    title: str,
    hlines: Mapping[str, Sequence[tuple[float, str]]] | None = None,
) -> Path:
    """One panel per ``(metric, y label, log axis)``: that metric of every layer over steps,
    alerts marked; ``hlines`` maps a metric to reference lines ``(y, label)``."""
    fig = new_figure(9.0, 2.8 * len(panels) + 0.6)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    colours = _colours(len(layers))
    labels = short_names(layers)
    for i, (ax, (metric, ylabel, log)) in enumerate(zip(axes, panels)):
        if log:
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", useOffset=False)  # 1.000000, not "+1" and 1e-6s
        for layer, lab, colour in zip(layers, labels, colours):
            steps, values = _series(reads, f"dd/{layer}/{metric}")
            if steps.size:
                ax.plot(steps, log_floor(values)[0] if log else values, "-", marker=".", ms=3, lw=1,
                        color=colour, label=lab if i == 0 and len(layers) <= 14 else None)  # fmt: skip
        for y, lab in (hlines or {}).get(metric, ()):
            ax.axhline(y, color="black", lw=0.8, ls="--", label=lab)
        _mark_alerts(ax, alerts, label=i == 0)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2, loc="best")
    axes[0].set_title(title, fontsize=10)
    axes[-1].set_xlabel("training step")
    return save(fig, path)
