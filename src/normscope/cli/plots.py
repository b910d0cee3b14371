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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from normscope.cli.figures import (
    ALERT_RATIO,
    ENTRY_ZERO,
    KERNEL_ALERT,
    KERNEL_ALERT_LABEL,
    LEGEND_KEY,
    POST_NORM,
    finite,
    log_floor,
    new_figure,
    save,
    say_empty,
    short_names,
    sparse_ticks,
    ticks,
    titled,
)

__all__ = [
    "KIND_COLOUR",
    "SUBLAYER_STYLE",
    "alignment_verdict",
    "plot_alignment",
    "plot_gamma",
    "plot_profile",
    "profile_verdict",
]

SUBLAYER_STYLE = {  # marker and colour of a residual point by what lies before it
    None: ("o", "black", "p_0 (stream entry)"),
    "attn": ("o", "tab:blue", "after attention"),
    "mlp": ("s", "tab:orange", "after MLP"),
    "block": ("^", "tab:green", "after a block"),
}
KIND_COLOUR = {"layernorm": "tab:blue", "rmsnorm": "tab:orange"}


def profile_verdict(profile: Sequence[Mapping[str, Any]], post_norm: bool = False) -> str:
    """The line under ``sigma_min_profile.png``'s title: the lowest ratio and where, or why no
    cumulative ratio is defined (``sigma_min(p_0) = 0``), and the post-norm caveat.

    Example::

        >>> profile_verdict([{"name": "e", "sigma_min": 0.0, "sigma_min_ratio": None,
        ...                   "sigma_min_step": None},
        ...                  {"name": "h.0", "sigma_min": 0.1, "sigma_min_ratio": None,
        ...                   "sigma_min_step": None}])
        'cumulative ratios undefined; sigma_min(p_0) = 0: the stream entry has rank < d (fewer distinct tokens than d?)'
    """
    ratio = finite(p.get("sigma_min_ratio") for p in profile[1:])
    parts = []
    if np.isfinite(ratio).any():
        i = int(np.nanargmin(ratio))
        names = short_names([p["name"] for p in profile])
        parts.append(f"lowest ratio {ratio[i]:.3g} at {names[i + 1]}")
        if profile[0].get("sigma_min_ratio") is None:  # anchored past p_0 (rows do not span)
            k = next(k for k, p in enumerate(profile) if p.get("sigma_min_ratio") is not None)
            parts.append(f"ratios read against {names[k]} (the points before it do not span)")
    elif profile:
        step = finite(p.get("sigma_min_step") for p in profile)
        entry = profile[0].get("sigma_min")
        parts.append(ENTRY_ZERO if entry == 0 else "no cumulative ratio could be read")
        if np.isfinite(step).any():
            parts.append("step ratios drawn")
    if post_norm:
        parts.append(POST_NORM)
    return "; ".join(parts)


def plot_profile(
    profile: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    title: str,
    baseline_label: str = "random-init twin",
    post_norm: bool = False,
) -> Path:
    """``sigma_min_ratio`` against depth (markers by sublayer), the step ratio, the twin's
    ratio when present, the floor at 1 and the default rule's alert threshold (``ALERT_RATIO``).
    With no finite ratio (``sigma_min(p_0) = 0``) the markers go on the step ratios and the
    title says why; a post-norm profile gets no floor or threshold (no bound, no alert there);
    with nothing finite at all the axes say so (:func:`profile_verdict`)."""
    fig = new_figure()
    ax = fig.add_subplot()
    depth = np.arange(len(profile))
    ratio = finite(p.get("sigma_min_ratio") for p in profile)
    step = finite(p.get("sigma_min_step") for p in profile)
    twin = finite(p.get("baseline_ratio") for p in profile)
    cumulative = bool(np.isfinite(ratio[1:]).any())
    every = np.concatenate([ratio, step, twin])
    every = every[np.isfinite(every)]
    use_log = every.size > 0 and (every.min() <= 0 or every.max() / max(every.min(), 1e-300) > 30)
    if use_log:
        ax.set_yscale("log")
        ratio, low, _ = log_floor(ratio)
        step, low_step, _ = log_floor(step)
        twin, _, _ = log_floor(twin)
    else:
        low = low_step = np.zeros(len(ratio), dtype=bool)
    if cumulative:
        ax.plot(depth, ratio, "-", color="0.3", lw=1.2, zorder=1,
                label="ratio sigma_min(p_k)/sigma_min(p_0)")  # fmt: skip
    if np.isfinite(step).any():
        ax.plot(depth, step, ":", color="tab:purple", lw=1.2,
                label="step ratio sigma_min(p_k)/sigma_min(p_k-1)")  # fmt: skip
    if np.isfinite(twin).any():
        ax.plot(depth, twin, "--", color="0.6", lw=1.2, label=f"ratio, {baseline_label}")
    marked, marked_low = (ratio, low) if cumulative else (step, low_step)
    for sub, (marker, colour, label) in SUBLAYER_STYLE.items():
        idx = [
            i
            for i, p in enumerate(profile)
            if p.get("sublayer") == sub and not marked_low[i] and np.isfinite(marked[i])
        ]
        if idx:
            ax.scatter(depth[idx], marked[idx], marker=marker, color=colour, s=36, zorder=3,
                       label=label)  # fmt: skip
    if marked_low.any():
        ax.scatter(depth[marked_low], marked[marked_low], marker="v", color="tab:red", s=40,
                   zorder=3, label="<= axis floor (0 or rounding)")  # fmt: skip
    if every.size == 0:
        say_empty(ax, "no finite sigma_min ratio at any residual point")
    if post_norm:
        ax.axhline(1.0, color="black", lw=0.9, label="1 (p_0's level)")
    else:
        ax.axhline(1.0, color="black", lw=0.9, label="1 (the pre-norm floor)")
        ax.axhline(ALERT_RATIO, color="tab:red", lw=0.8, ls="--",
                   label=f"alert threshold {ALERT_RATIO}")  # fmt: skip
    sparse_ticks(ax, short_names([p["name"] for p in profile]))
    ax.set_xlabel("residual point (depth)")
    ax.set_ylabel("sigma_min(p_k) / sigma_min(p_0)" if cumulative else "sigma_min ratio")
    verdict = profile_verdict(profile, post_norm)
    ax.set_title(titled(title, verdict) if verdict else title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return save(fig, path)


def _worst(names: Sequence[str], values: np.ndarray) -> str:
    i = int(np.nanargmax(values))
    return f"{names[i]} {values[i]:.1e}"


def alignment_verdict(norms: Sequence[Mapping[str, Any]]) -> str:
    """The one line a reader of ``alignment.png`` should take away, from the scan's norms.

    LayerNorms without dead channels keep the exact kernel while ``kernel_residual <= 1e-4``
    (the ``layernorm_kernel_lost`` rule); RMSNorms have none by design; dead channels are named.

    Example::

        >>> alignment_verdict([
        ...     {"name": "h.0.ln_1", "kind": "layernorm", "kernel_residual": 1e-15,
        ...      "dead_channels": 0},
        ...     {"name": "h.0.ln_2", "kind": "layernorm", "kernel_residual": 3e-3,
        ...      "dead_channels": 0},
        ...     {"name": "ln_f", "kind": "layernorm", "kernel_residual": 1e-16,
        ...      "dead_channels": 2}])
        'kernel LOST at h.0.ln_2; 1/2 LayerNorms without dead channels keep it; dead channels: 2 in ln_f'
    """
    names = short_names([n["name"] for n in norms]) if norms else []
    ln = [
        i
        for i, n in enumerate(norms)
        if n.get("kind") == "layernorm" and not n.get("dead_channels")
    ]
    resid = finite(norms[i].get("kernel_residual") for i in ln)
    parts = []
    lost = [names[i] for i, r in zip(ln, resid) if r > KERNEL_ALERT]
    kept = int(np.sum(resid <= KERNEL_ALERT))
    which = "LayerNorms" if len(ln) == len(norms) else "LayerNorms without dead channels"
    if lost:
        more = f" (+{len(lost) - 3})" if len(lost) > 3 else ""
        parts.append(
            f"kernel LOST at {', '.join(lost[:3])}{more}; {kept}/{len(ln)} {which} keep it"
        )
    elif kept:
        worst = float(np.nanmax(resid))
        parts.append(
            f"{kept}/{len(ln)} {which} keep the exact kernel (kernel_residual <= {worst:.0e})"
        )
    rms = sum(n.get("kind") == "rmsnorm" for n in norms)
    if rms:
        parts.append(f"{rms} RMSNorm{'s' if rms > 1 else ''}: no kernel by design, no kernel alert")
    dead = [
        f"{n['dead_channels']} in {names[i]}" for i, n in enumerate(norms) if n.get("dead_channels")
    ]
    if dead:
        more = f" (+{len(dead) - 3} layers)" if len(dead) > 3 else ""
        parts.append("dead channels: " + ", ".join(dead[:3]) + more)
    return "; ".join(parts) or "no norm layer was read"


def plot_alignment(norms: Sequence[Mapping[str, Any]], path: str | Path, *, title: str) -> Path:
    """Per norm layer, both on log axes (what varies is the distance from exact): ``1 -
    gamma_alignment`` with the 0.9999 line and the random level ``1 - 1/sqrt(d)``, and
    ``kernel_residual`` with the 1e-4 kernel-loss alert; above the lines is shaded. Dead
    channels: a red cross and a red tick label. The title says what to conclude
    (:func:`alignment_verdict`)."""
    fig = new_figure(9.0, 5.6)
    top, bottom = fig.subplots(2, 1, sharex=True)
    x = np.arange(len(norms))
    labels = short_names([n["name"] for n in norms])
    colours = np.array([KIND_COLOUR.get(n.get("kind"), "tab:gray") for n in norms], dtype=object)
    dead = np.array([bool(n.get("dead_channels")) for n in norms], dtype=bool)
    distance = 1.0 - finite(n.get("gamma_alignment") for n in norms)
    resid = finite(n.get("kernel_residual") for n in norms)
    has_ln = any(n.get("kind") == "layernorm" for n in norms)
    panels = (
        (top, distance, "1 - gamma_alignment", [(1 - 0.9999, "LayerNorm: 0.9999 alignment")],
         "gamma off the kernel direction"),
        (bottom, resid, "kernel_residual",
         [(KERNEL_ALERT, f"LayerNorm: {KERNEL_ALERT_LABEL} kernel-loss alert")],
         "kernel lost (a LayerNorm alerts)"),
    )  # fmt: skip
    dims = [n.get("dim") for n in norms if n.get("dim")]
    for ax, values, ylabel, lines, above in panels:
        ax.set_yscale("log")
        shown, low, floor = log_floor(values)
        ok = np.isfinite(shown)
        lines = lines if has_ln else []  # an RMSNorm is held to no kernel: no LayerNorm lines
        base = min([floor] + [y / 100 for y, _ in lines]) / 3  # the threshold always in view
        top_y = max(1.0, float(np.nanmax(shown)) if ok.any() else 1.0) * 3
        ax.set_ylim(base, top_y)  # before any artist: an axis of lines alone has no span
        ax.vlines(x[ok], base, shown[ok], colors=colours[ok], lw=2.5, zorder=2)
        ax.scatter(x[ok & ~low], shown[ok & ~low], color=colours[ok & ~low], s=22, zorder=3)
        if low.any():
            ax.scatter(x[low], shown[low], marker="v", color="tab:red", s=30, zorder=3,
                       label="<= axis floor (0 or rounding)")  # fmt: skip
        if (ok & dead).any():
            ax.scatter(x[ok & dead], shown[ok & dead], marker="x", color="tab:red", s=70,
                       lw=2, zorder=4, label="dead channels")  # fmt: skip
        for y, lab in lines:
            ax.axhline(y, color="tab:red", lw=0.9, ls="--", label=lab)
        if ax is top and dims:
            rand = 1 - 1 / math.sqrt(max(dims))
            ax.axhline(rand, color="0.4", lw=0.8, ls=":", label="1 - 1/sqrt(d): a random v*")
        if lines:
            ax.axhspan(lines[0][0], top_y, color="tab:red", alpha=0.06, lw=0)
            ax.text(0.005, lines[0][0] * 2, above, transform=ax.get_yaxis_transform(), fontsize=7,
                    color="tab:red", va="bottom", zorder=5,
                    bbox={"facecolor": "white", "alpha": 0.8, "lw": 0, "pad": 1})  # fmt: skip
        if not ok.any():
            say_empty(ax, f"no finite {ylabel} at any norm layer (too few rows?)")
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    for kind, colour in KIND_COLOUR.items():
        if any(n.get("kind") == kind for n in norms):
            top.scatter([], [], color=colour, s=22, label=kind, gid=LEGEND_KEY)
    for ax in (top, bottom):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.align_ylabels([top, bottom])
    top.set_title(titled(title, alignment_verdict(norms)), fontsize=9)
    sparse_ticks(bottom, labels)
    for tick, at in zip(bottom.get_xticklabels(), bottom.get_xticks()):
        if dead[int(at)]:
            tick.set_color("tab:red")
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
    ticks(ax, short_names(names))
    ax.set_ylabel("gamma (effective scale)")
    ax.set_title(title, fontsize=10)
    if any(dead.get(n) for n in names):
        ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3, axis="y")
    return save(fig, path)
