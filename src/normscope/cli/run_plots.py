"""The run report's PNG plots: normscope's logged metrics over training steps, alerts marked.

Each takes the run's reads (``{step: {key: value}}``, keys as the monitor logs them), the
layers or points to draw, and a path. Layers are coloured by depth (viridis: dark is shallow,
yellow is deep); every alert is a red vertical line at its step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from normscope.cli.plots import ALERT_RATIO, log_floor, new_figure, save, short_names

__all__ = ["plot_norm_metrics", "plot_run_profile", "plot_sigma_over_steps"]

Reads = Mapping[float, Mapping[str, float]]


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


def plot_sigma_over_steps(
    reads: Reads,
    points: Sequence[str],
    alerts: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    title: str,
) -> Path:
    """Every point's cumulative ``sigma_min_ratio`` over steps (thin, by depth), the run-level
    ``dd/sigma_min_ratio_min`` and ``dd/sigma_min_step_min`` (thick), the floor at 1, the
    default alert threshold and the alerts."""
    fig = new_figure()
    ax = fig.add_subplot()
    lines = [(f"dd/{p}/sigma_min_ratio", lab) for p, lab in zip(points, short_names(points))]
    every = np.concatenate([_series(reads, k)[1] for k, _ in lines] + [np.array([1.0])])
    log = _wide(every)
    if log:
        ax.set_yscale("log")
    for (key, lab), colour in zip(lines, _colours(len(lines))):
        steps, values = _series(reads, key)
        if log:
            values = log_floor(values)[0]
        ax.plot(steps, values, lw=0.8, color=colour, alpha=0.8,
                label=lab if len(lines) <= 12 else None)  # fmt: skip
    for key, style, lab in (
        ("dd/sigma_min_ratio_min", "-", "sigma_min_ratio_min"),
        ("dd/sigma_min_step_min", ":", "sigma_min_step_min"),
    ):
        steps, values = _series(reads, key)
        if steps.size:
            ax.plot(
                steps,
                log_floor(values)[0] if log else values,
                style,
                color="black",
                lw=2,
                label=lab,
            )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(
        ALERT_RATIO, color="tab:red", lw=0.8, ls="--", label=f"alert threshold {ALERT_RATIO}"
    )
    _mark_alerts(ax, alerts)
    ax.set_xlabel("training step")
    ax.set_ylabel("sigma_min ratio")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=6, ncol=2, loc="best")
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
    alert drawn in red), the floor at 1 and the alert threshold."""
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
    ax.set_xlabel("residual point (depth order inferred from module paths)")
    ax.set_ylabel("sigma_min(p_k) / sigma_min(p_0)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return save(fig, path)


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
