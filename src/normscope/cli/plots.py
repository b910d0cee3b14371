"""The scan's PNG plots (matplotlib, Agg canvas, no pyplot state): the ``sigma_min`` ratio
against depth, ``gamma_alignment`` and ``kernel_residual`` per layer, the bottom of each norm's
eigen-spectrum, and the gamma distributions.

Each function takes the scan's plain result (the dicts of ``report.json``) and a path, writes
one PNG and returns the path. Numbers at or below zero on a log axis (an eigenvalue rounded to
0, a ``sigma_min`` at the rounding floor) are drawn at the axis floor with a down-pointing
marker, never dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = [
    "SUBLAYER_STYLE",
    "log_floor",
    "new_figure",
    "plot_alignment",
    "plot_gamma",
    "plot_profile",
    "plot_spectrum",
    "save",
    "short_names",
]

DPI = 110
SUBLAYER_STYLE = {  # marker and colour of a residual point by what lies before it
    None: ("o", "black", "p_0 (stream entry)"),
    "attn": ("o", "tab:blue", "after attention"),
    "mlp": ("s", "tab:orange", "after MLP"),
    "block": ("^", "tab:green", "after a block"),
}
KIND_COLOUR = {"layernorm": "tab:blue", "rmsnorm": "tab:orange"}
ALERT_RATIO = 0.8  # the default SigmaMinRatioRule threshold: alert_below 1.0 - tolerance 0.2
LOG_FLOOR = 1e-18


def new_figure(width: float = 9.0, height: float = 4.8) -> Figure:
    """A figure on an Agg canvas (PNG output without pyplot or a display)."""
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, format="png", dpi=DPI)
    return path


def short_names(names: Sequence[str]) -> list[str]:
    """Module paths without their common dotted prefix and suffix (``encoder.layer.0.output``
    -> ``0.output``; ``...attention.output.LayerNorm`` -> ``...attention.output``), so that tick
    labels stay readable; the labels stay distinct.

    Example::

        >>> short_names(["model.h.0.ln_1", "model.h.1.ln_2", "model.ln_f"])
        ['h.0.ln_1', 'h.1.ln_2', 'ln_f']
        >>> short_names(["embeddings.LayerNorm", "encoder.layer.0.output.LayerNorm"])
        ['embeddings', 'encoder.layer.0.output']
    """
    parts = [n.split(".") for n in names]
    if len(parts) < 2:
        return list(names)
    head = 0
    while all(len(p) > head + 1 for p in parts) and len({p[head] for p in parts}) == 1:
        head += 1
    parts = [p[head:] for p in parts]
    tail = 0
    while all(len(p) > tail + 1 for p in parts) and len({p[-1 - tail] for p in parts}) == 1:
        tail += 1
    cut = [".".join(p[: len(p) - tail]) for p in parts]
    return cut if len(set(cut)) == len(cut) else [".".join(p) for p in parts]


def _finite(values: Iterable[Any]) -> np.ndarray:
    return np.array([v if isinstance(v, (int, float)) else math.nan for v in values], dtype=float)


def log_floor(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """``(values with <= 0 raised to a floor, mask of the raised ones, the floor)``."""
    positive = values[np.isfinite(values) & (values > 0)]
    floor = float(positive.min()) / 10 if positive.size else 1e-3
    floor = max(floor, LOG_FLOOR)
    low = np.isfinite(values) & (values <= floor)
    return np.where(low, floor, values), low, floor


def _ticks(ax: Any, labels: Sequence[str]) -> None:
    ax.set_xticks(range(len(labels)))
    size = 8 if len(labels) <= 30 else 6
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=size)


def plot_profile(
    profile: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    title: str,
    baseline_label: str = "random-init twin",
) -> Path:
    """``sigma_min_ratio`` against depth (markers by sublayer), the step ratio, the twin's
    ratio when present, the floor at 1 and the default alert threshold (0.8)."""
    fig = new_figure()
    ax = fig.add_subplot()
    depth = np.arange(len(profile))
    ratio = _finite(p.get("sigma_min_ratio") for p in profile)
    step = _finite(p.get("sigma_min_step") for p in profile)
    twin = _finite(p.get("baseline_ratio") for p in profile)
    every = np.concatenate([ratio, step, twin])
    every = every[np.isfinite(every)]
    use_log = every.size > 0 and (every.min() <= 0 or every.max() / max(every.min(), 1e-300) > 30)
    if use_log:
        ax.set_yscale("log")
        ratio, low, _ = log_floor(ratio)
        step, _, _ = log_floor(step)
        twin, _, _ = log_floor(twin)
    else:
        low = np.zeros(len(ratio), dtype=bool)
    ax.plot(depth, ratio, "-", color="0.3", lw=1.2, zorder=1)
    ax.plot(
        depth,
        step,
        ":",
        color="tab:purple",
        lw=1.2,
        label="step ratio sigma_min(p_k)/sigma_min(p_k-1)",
    )
    if np.isfinite(twin).any():
        ax.plot(depth, twin, "--", color="0.6", lw=1.2, label=f"ratio, {baseline_label}")
    for sub, (marker, colour, label) in SUBLAYER_STYLE.items():
        idx = [i for i, p in enumerate(profile) if p.get("sublayer") == sub and not low[i]]
        if idx:
            ax.scatter(
                depth[idx], ratio[idx], marker=marker, color=colour, s=36, zorder=3, label=label
            )
    if low.any():
        ax.scatter(
            depth[low],
            ratio[low],
            marker="v",
            color="tab:red",
            s=40,
            zorder=3,
            label="<= axis floor (0 or rounding)",
        )
    ax.axhline(1.0, color="black", lw=0.9, label="1 (no-cancellation floor)")
    ax.axhline(
        ALERT_RATIO, color="tab:red", lw=0.8, ls="--", label=f"alert threshold {ALERT_RATIO}"
    )
    _ticks(ax, short_names([p["name"] for p in profile]))
    ax.set_xlabel("residual point (depth)")
    ax.set_ylabel("sigma_min(p_k) / sigma_min(p_0)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return save(fig, path)


def plot_alignment(norms: Sequence[Mapping[str, Any]], path: str | Path, *, title: str) -> Path:
    """Per norm layer: ``gamma_alignment`` (bars by kind, hatched with dead channels; lines at
    0.9999 and at the random level ``1/sqrt(d)``) and ``kernel_residual`` on a log axis."""
    fig = new_figure(9.0, 6.4)
    top, bottom = fig.subplots(2, 1, sharex=True)
    x = np.arange(len(norms))
    align = _finite(n.get("gamma_alignment") for n in norms)
    colours = [KIND_COLOUR.get(n.get("kind"), "tab:gray") for n in norms]
    bars = top.bar(x, np.nan_to_num(align, nan=0.0), color=colours)
    for bar, n in zip(bars, norms):
        if n.get("dead_channels"):
            bar.set_hatch("//")
            bar.set_edgecolor("tab:red")
    top.axhline(0.9999, color="black", lw=0.8, label="0.9999 (LayerNorm exact kernel)")
    dims = [n.get("dim") for n in norms if n.get("dim")]
    if dims:
        top.axhline(
            1 / math.sqrt(max(dims)),
            color="tab:orange",
            lw=0.8,
            ls="--",
            label="1/sqrt(d) (random direction)",
        )
    for kind, colour in KIND_COLOUR.items():
        if any(n.get("kind") == kind for n in norms):
            top.bar([0], [0], color=colour, label=kind)
    if any(n.get("dead_channels") for n in norms):
        top.bar(
            [0],
            [0],
            color="white",
            hatch="//",
            edgecolor="tab:red",
            label="dead channels (kernel = their e_i)",
        )
    top.set_ylim(0, 1.05)
    top.set_ylabel("gamma_alignment |<u_1, v*>|")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    top.grid(alpha=0.3, axis="y")
    resid, low, floor = log_floor(_finite(n.get("kernel_residual") for n in norms))
    bottom.set_yscale("log")
    shown = np.isfinite(resid)
    bottom.vlines(
        x[shown], floor / 10, resid[shown], colors=np.array(colours, dtype=object)[shown], lw=3
    )
    bottom.scatter(x[shown & ~low], resid[shown & ~low], color="black", s=10, zorder=3)
    if low.any():
        bottom.scatter(
            x[low], resid[low], marker="v", color="tab:red", s=30, zorder=3, label="<= axis floor"
        )
    bottom.axhline(1e-4, color="tab:red", lw=0.8, ls="--", label="1e-4 (kernel-loss alert)")
    bottom.set_ylabel("kernel_residual v*^T C v* / lambda_d")
    bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    bottom.grid(alpha=0.3, axis="y")
    _ticks(bottom, short_names([n["name"] for n in norms]))
    return save(fig, path)


def plot_spectrum(norms: Sequence[Mapping[str, Any]], path: str | Path, *, title: str) -> Path:
    """The smallest eigenvalues of each norm's output covariance over its largest, against
    their rank ``k`` (log axis), coloured by depth; the ``null_tol`` line at 1e-10."""
    from matplotlib import colormaps

    fig = new_figure()
    ax = fig.add_subplot()
    ax.set_yscale("log")
    cmap = colormaps["viridis"]
    labels = short_names([n["name"] for n in norms])
    shown = 0
    for i, (n, label) in enumerate(zip(norms, labels)):
        values = _finite(n.get("bottom_eigenvalues") or [])
        if not values.size or not np.isfinite(values).any():
            continue
        values, low, _ = log_floor(values)
        k = np.arange(1, len(values) + 1)
        colour = cmap(i / max(1, len(norms) - 1))
        ax.plot(
            k, values, "-o", ms=3, lw=1, color=colour, label=label if len(norms) <= 16 else None
        )
        if low.any():
            ax.scatter(k[low], values[low], marker="v", color="tab:red", s=30, zorder=3)
        shown += 1
    ax.axhline(1e-10, color="tab:red", lw=0.8, ls="--", label="null_tol 1e-10")
    ax.set_xlabel("k (k-th smallest eigenvalue of the output covariance C)")
    ax.set_ylabel("lambda_k / lambda_d")
    ax.set_title(title + ("" if shown else " (no spectrum: too few rows)"), fontsize=10)
    ax.legend(fontsize=6, ncol=2 if len(norms) > 8 else 1, loc="best")
    ax.grid(alpha=0.3)
    return save(fig, path)


def plot_gamma(
    gammas: Mapping[str, np.ndarray],
    dead: Mapping[str, Sequence[int]],
    path: str | Path,
    *,
    title: str,
) -> Path:
    """Box plots of each norm's effective gamma (whiskers at the 1st and 99th percentiles,
    min and max as dots); dead channels as red crosses."""
    fig = new_figure()
    ax = fig.add_subplot()
    names = list(gammas)
    if not names:  # e.g. a --max-memory that left room for the residual profile only
        ax.text(0.5, 0.5, "no norm layer was read", ha="center", va="center")
        ax.set_title(title, fontsize=10)
        return save(fig, path)
    data = [np.asarray(gammas[n], dtype=float) for n in names]
    ax.boxplot(data, positions=range(len(names)), whis=(1, 99), showfliers=False, widths=0.6)
    for i, g in enumerate(data):
        ax.scatter([i, i], [g.min(), g.max()], s=8, color="0.4", zorder=3)
        idx = list(dead.get(names[i], ()))
        if idx:
            ax.scatter(
                [i] * len(idx),
                g[idx],
                marker="x",
                color="tab:red",
                s=40,
                zorder=4,
                label="dead channel"
                if i == next(j for j, n in enumerate(names) if dead.get(n))
                else None,
            )
    ax.axhline(1.0, color="black", lw=0.6, ls=":")
    ax.axhline(0.0, color="black", lw=0.6)
    _ticks(ax, short_names(names))
    ax.set_ylabel("gamma (effective scale)")
    ax.set_title(title, fontsize=10)
    if any(dead.get(n) for n in names):
        ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3, axis="y")
    return save(fig, path)
