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

from normscope.alerts import SigmaMinRatioRule

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
    "titled",
]

DPI = 110
SUBLAYER_STYLE = {  # marker and colour of a residual point by what lies before it
    None: ("o", "black", "p_0 (stream entry)"),
    "attn": ("o", "tab:blue", "after attention"),
    "mlp": ("s", "tab:orange", "after MLP"),
    "block": ("^", "tab:green", "after a block"),
}
KIND_COLOUR = {"layernorm": "tab:blue", "rmsnorm": "tab:orange"}
KERNEL_ALERT = 1e-4  # the default LayerNormKernelRule max_kernel_residual
ALERT_RATIO = SigmaMinRatioRule().threshold  # the default rule's floor (1.0 - 0.4)
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
    -> ``0.output``; ``...attention.output.LayerNorm`` -> ``...attention.output``) and, when a
    label is still long, with the prefix most of them share cut to its last part, so that tick
    labels stay readable; the labels stay distinct.

    Example::

        >>> short_names(["model.h.0.ln_1", "model.h.1.ln_2", "model.ln_f"])
        ['h.0.ln_1', 'h.1.ln_2', 'ln_f']
        >>> short_names(["embeddings.LayerNorm", "encoder.layer.0.output.LayerNorm"])
        ['embeddings', 'encoder.layer.0.output']
        >>> short_names(["embeddings.LayerNorm", "encoder.layer.0.attention.output.LayerNorm",
        ...              "encoder.layer.0.output.LayerNorm"])
        ['embeddings', 'layer.0.attention.output', 'layer.0.output']
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
    cut = cut if len(set(cut)) == len(cut) else [".".join(p) for p in parts]
    return _majority_prefix_cut(cut)


def _majority_prefix_cut(labels: list[str], longest: int = 24) -> list[str]:
    """When a label is over ``longest`` characters, the dotted prefix most labels share is cut
    to its last part (``encoder.layer.0.output`` -> ``layer.0.output`` next to ``embeddings``),
    as long as the labels stay distinct."""
    if max(map(len, labels), default=0) <= longest:
        return labels
    parts = [label.split(".") for label in labels]
    shares = {
        tuple(p[:size]): sum(q[:size] == p[:size] for q in parts)
        for p in parts
        for size in range(2, len(p))
    }  # the most shared prefix wins, the shorter on a tie
    shared = [(-n, len(head), head) for head, n in shares.items() if n > len(parts) / 2]
    if not shared:
        return labels
    best = min(shared)[2]
    cut = [
        ".".join(p[len(best) - 1 :]) if tuple(p[: len(best)]) == best else ".".join(p)
        for p in parts
    ]
    return cut if len(set(cut)) == len(cut) else labels


def titled(title: str, verdict: str, width: int = 90) -> str:
    """``title`` over the ``verdict`` (its ``"; "``-separated parts packed into lines of at
    most ``width`` characters), so that a long conclusion wraps instead of leaving the figure.

    Example::

        >>> titled("GPT", "3 layers; no alert; dead channels: 2 in ln_f", width=20)
        'GPT\\n3 layers; no alert;\\ndead channels: 2 in ln_f'
    """
    lines: list[str] = []
    for part in verdict.split("; "):
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += "; " + part
        else:
            if lines:
                lines[-1] += ";"
            lines.append(part)
    return "\n".join([title, *lines])


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
    resid = _finite(norms[i].get("kernel_residual") for i in ln)
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
        parts.append(f"{rms} RMSNorm{'s' if rms > 1 else ''}: no kernel by design")
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
    distance = 1.0 - _finite(n.get("gamma_alignment") for n in norms)
    resid = _finite(n.get("kernel_residual") for n in norms)
    panels = (
        (top, distance, "1 - gamma_alignment", [(1 - 0.9999, "0.9999 alignment")],
         "gamma off the kernel direction"),
        (bottom, resid, "kernel_residual", [(KERNEL_ALERT, "1e-4 kernel-loss alert")],
         "kernel lost (a LayerNorm alerts)"),
    )  # fmt: skip
    dims = [n.get("dim") for n in norms if n.get("dim")]
    for ax, values, ylabel, lines, above in panels:
        ax.set_yscale("log")
        shown, low, floor = log_floor(values)
        ok = np.isfinite(shown)
        base = min(floor, lines[0][0] / 100) / 3  # the threshold line always in view
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
        ax.axhspan(lines[0][0], top_y, color="tab:red", alpha=0.06, lw=0)
        ax.text(0.005, lines[0][0] * 2, above, transform=ax.get_yaxis_transform(), fontsize=7,
                color="tab:red", va="bottom", zorder=5,
                bbox={"facecolor": "white", "alpha": 0.8, "lw": 0, "pad": 1})  # fmt: skip
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    for kind, colour in KIND_COLOUR.items():
        if any(n.get("kind") == kind for n in norms):
            top.scatter([], [], color=colour, s=22, label=kind)
    for ax in (top, bottom):
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.align_ylabels([top, bottom])
    top.set_title(titled(title, alignment_verdict(norms)), fontsize=9)
    _ticks(bottom, labels)
    for tick, is_dead in zip(bottom.get_xticklabels(), dead):
        if is_dead:
            tick.set_color("tab:red")
    return save(fig, path)


NULL_TOL = 1e-10  # the scan's null_tol: eigenvalues at or below it over lambda_d are null


def _null_count(n: Mapping[str, Any], values: np.ndarray) -> int:
    null_dim = n.get("null_dim")
    if isinstance(null_dim, (int, float)) and math.isfinite(null_dim):
        return int(null_dim)
    return int(np.sum(np.isfinite(values) & (values <= NULL_TOL)))


def spectrum_highlights(norms: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    """Which layers ``spectrum.png`` draws in colour, ``{index: role}``: the first, the final
    norm and the worst in between -- the most null eigenvalues, then the lowest live one
    (nearest to losing its gap) --; the rest are drawn grey.

    Example::

        >>> spectrum_highlights([
        ...     {"bottom_eigenvalues": [1e-16, 1e-3], "null_dim": 1},
        ...     {"bottom_eigenvalues": [1e-17, 1e-18, 1e-4], "null_dim": 2},
        ...     {"bottom_eigenvalues": [1e-16, 2e-3], "null_dim": 1},
        ...     {"bottom_eigenvalues": [1e-16, 5e-3], "null_dim": 1}])
        {0: 'first', 3: 'final', 1: 'worst'}
    """
    has = [i for i, n in enumerate(norms) if _finite(n.get("bottom_eigenvalues") or []).size]
    if not has:
        return {}
    roles = {has[0]: "first", has[-1]: "final"}

    def badness(i: int) -> tuple[int, float]:
        values = _finite(norms[i]["bottom_eigenvalues"])
        null = _null_count(norms[i], values)
        live = values[np.isfinite(values) & (values > NULL_TOL)]
        return null, -(float(live.min()) if live.size else math.inf)

    inner = [i for i in has if i not in roles]
    if inner:
        roles[max(inner, key=badness)] = "worst"
    return roles


def spectrum_verdict(norms: Sequence[Mapping[str, Any]]) -> str:
    """The line under ``spectrum.png``'s title: how many layers have how many null eigenvalues
    (the LayerNorm kernel is one; each dead channel adds one) and the lowest live eigenvalue,
    i.e. the gap a null direction stands out by.

    Example::

        >>> spectrum_verdict([
        ...     {"name": "h.0.ln", "bottom_eigenvalues": [1e-16, 1e-3], "null_dim": 1},
        ...     {"name": "h.1.ln", "bottom_eigenvalues": [1e-16, 2e-4], "null_dim": 1},
        ...     {"name": "ln_f", "bottom_eigenvalues": [0.0, 0.0, 1e-3], "null_dim": 2}])
        '2 layers: 1 null eigenvalue; ln_f: 2 null; lowest live eigenvalue 2e-04 (h.1.ln)'
    """
    names = short_names([n["name"] for n in norms]) if norms else []
    counts: dict[int, list[str]] = {}
    dead = {name: n.get("dead_channels") for n, name in zip(norms, names)}
    low, where = math.inf, None
    for n, name in zip(norms, names):
        values = _finite(n.get("bottom_eigenvalues") or [])
        if not values.size:
            continue
        counts.setdefault(_null_count(n, values), []).append(name)
        live = values[np.isfinite(values) & (values > NULL_TOL)]
        if live.size and live.min() < low:
            low, where = float(live.min()), name
    if not counts:
        return "no spectrum: too few rows"
    common = max(counts, key=lambda c: len(counts[c]))
    plural = "s" if common != 1 else ""
    parts = [f"{len(counts[common])} layer{'s' if len(counts[common]) > 1 else ''}: "
             f"{common} null eigenvalue{plural}"]  # fmt: skip
    for c, who in sorted(counts.items()):
        if c != common:
            parts.append(f"{', '.join(who[:3])}{' ...' if len(who) > 3 else ''}: {c} null")
            if len(who) == 1 and dead.get(who[0]):
                parts[-1] += f" ({dead[who[0]]} dead channels)"
    if where is not None:
        parts.append(f"lowest live eigenvalue {low:.0e} ({where})")
    return "; ".join(parts)


def plot_spectrum(norms: Sequence[Mapping[str, Any]], path: str | Path, *, title: str) -> Path:
    """The smallest eigenvalues of each norm's output covariance over its largest, against
    their rank ``k`` (log axis): the first layer, the final norm and the worst one
    (:func:`spectrum_highlights`) in colour, the others grey; the null region below
    ``null_tol`` (1e-10) shaded. The title says how many null eigenvalues the layers have
    and how far the live ones sit above them (:func:`spectrum_verdict`)."""
    fig = new_figure(9.0, 4.8)
    ax = fig.add_subplot()
    ax.set_yscale("log")
    labels = short_names([n["name"] for n in norms])
    roles = spectrum_highlights(norms)
    style = {"first": "tab:blue", "worst": "tab:orange", "final": "tab:purple"}
    greys = 0
    lowest, highest, longest = math.inf, 0.0, 1
    drawn = []
    for i, (n, label) in enumerate(zip(norms, labels)):
        values = _finite(n.get("bottom_eigenvalues") or [])
        if not values.size or not np.isfinite(values).any():
            continue
        values, low, floor = log_floor(values)
        lowest, highest = min(lowest, floor), max(highest, float(np.nanmax(values)))
        longest = max(longest, len(values))
        drawn.append((i, values, low, label, _null_count(n, _finite(n["bottom_eigenvalues"]))))
    for i, values, low, label, null in sorted(drawn, key=lambda d: d[0] in roles):
        k = np.arange(1, len(values) + 1)
        role = roles.get(i)
        if role is None:
            greys += 1
            ax.plot(k, values, "-", color="0.75", lw=1, zorder=1,
                    label=None if greys > 1 else "other layers")  # fmt: skip
        else:
            ax.plot(k, values, "-o", ms=4, lw=1.8, color=style[role], zorder=3,
                    label=f"{role}: {label} ({null} null)")  # fmt: skip
        if low.any():
            ax.scatter(k[low], values[low], marker="v", color="tab:red", s=30, zorder=4,
                       label=None)  # fmt: skip
    if drawn:
        bottom = min(lowest, NULL_TOL / 100) / 3  # the null region always shows, empty or not
        ax.set_ylim(bottom, highest * 10)
        ax.axhspan(bottom, NULL_TOL, color="tab:red", alpha=0.06, lw=0)
        ax.set_xticks(range(1, longest + 1))
    ax.axhline(NULL_TOL, color="tab:red", lw=0.8, ls="--",
               label=f"null_tol {NULL_TOL:g}: below, null (kernel, dead channels)")  # fmt: skip
    ax.set_xlabel("k (k-th smallest eigenvalue of the output covariance C)")
    ax.set_ylabel("lambda_k / lambda_d")
    ax.set_title(titled(title, spectrum_verdict(norms)), fontsize=9)
    handles, names = ax.get_legend_handles_labels()
    names = [f"other {greys} layers" if n == "other layers" else n for n in names]
    ax.legend(handles, names, fontsize=8, loc="lower right")
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
