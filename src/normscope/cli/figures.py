"""The plots' shared drawing kit: an Agg figure, PNG saving, tick labels, titles, log floors."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from normscope.alerts import KernelLossRule, SigmaMinRatioRule

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "ALERT_RATIO",
    "DPI",
    "ENTRY_ZERO",
    "KERNEL_ALERT",
    "KERNEL_ALERT_LABEL",
    "LEGEND_KEY",
    "LEGEND_MAX",
    "LOG_FLOOR",
    "POST_NORM",
    "any_finite",
    "depth_colours",
    "depth_scale",
    "finite",
    "log_floor",
    "mark_alerts",
    "name_worst",
    "new_figure",
    "run_series",
    "save",
    "say_empty",
    "short_names",
    "sparse_ticks",
    "step_span",
    "ticks",
    "titled",
    "wide",
]

DPI = 110
KERNEL_ALERT = KernelLossRule().max_kernel_residual  # the default rule's max_kernel_residual
KERNEL_ALERT_LABEL = f"{KERNEL_ALERT:.0e}".replace("e-0", "e-")  # "1e-4"
ALERT_RATIO = SigmaMinRatioRule().threshold  # the default rule's floor (1.0 - 0.4)
LOG_FLOOR = 1e-18
# What a figure says when the theory's reads do not apply, in scan and report alike
ENTRY_ZERO = (
    "cumulative ratios undefined; sigma_min(p_0) = 0: the stream entry has rank < d (fewer "
    "distinct tokens than d?)"
)
POST_NORM = "post-norm: no sigma_min alert (the bound assumes pre-norm identity skips)"


def new_figure(width: float = 9.0, height: float = 4.8) -> Figure:
    """A figure on an Agg canvas (PNG output without pyplot or a display). matplotlib, of the
    ``cli`` extra, is imported here, when a figure is drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

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


def finite(values: Iterable[Any]) -> np.ndarray:
    """Numbers as a float array, anything else (None, a string) as NaN."""
    return np.array([v if isinstance(v, (int, float)) else math.nan for v in values], dtype=float)


def log_floor(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """``(values with <= 0 raised to a floor, mask of the raised ones, the floor)``."""
    positive = values[np.isfinite(values) & (values > 0)]
    floor = float(positive.min()) / 10 if positive.size else 1e-3
    floor = max(floor, LOG_FLOOR)
    low = np.isfinite(values) & (values <= floor)
    return np.where(low, floor, values), low, floor


def ticks(ax: Any, labels: Sequence[str]) -> None:
    """One x tick per label, rotated, smaller past 30 labels."""
    ax.set_xticks(range(len(labels)))
    size = 8 if len(labels) <= 30 else 6
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=size)


LEGEND_MAX = 12  # more lines than this: a depth colour scale and the worst few named instead
LEGEND_KEY = "legend-key"  # the gid of an empty artist that only shows a style in a legend


def depth_colours(n: int) -> list[Any]:
    """``n`` colours by depth (viridis: dark is shallow, yellow is deep)."""
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.9 * i / max(1, n - 1)) for i in range(n)]


def depth_scale(fig: Any, ax: Any, names: Sequence[str], label: str = "depth") -> Any:
    """A colour bar beside ``ax`` for lines coloured by :func:`depth_colours`, its ticks naming
    the first, middle and last of ``names``: with too many lines for a legend, it says which
    colour is which layer."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, Normalize

    n = len(names)
    mappable = ScalarMappable(Normalize(-0.5, n - 0.5), ListedColormap(depth_colours(n)))
    bar = fig.colorbar(mappable, ax=ax, pad=0.01, fraction=0.04, aspect=30)
    at = sorted({0, n // 2, n - 1})
    bar.set_ticks(at)
    bar.set_ticklabels([names[i] for i in at], fontsize=7)
    bar.set_label(f"{label} ({n} lines, by depth)", fontsize=8)
    return bar


def name_worst(ax: Any, points: Sequence[tuple[float, float, str]]) -> None:
    """Write each ``(x, y, name)`` next to its point with a leader line: the few worst lines of
    a figure with too many for a legend. A name goes below a point in the upper half of the
    axes and above one in the lower half, so that it stays inside the axes (clear of the
    title and of the next panel)."""
    ax.autoscale_view()
    to_axes = ax.transData + ax.transAxes.inverted()
    for i, (x, y, name) in enumerate(points):
        up = to_axes.transform((x, y))[1] < 0.5
        ax.annotate(name, (x, y), xytext=(-40, (1 if up else -1) * (12 + 12 * i)),
                    textcoords="offset points", fontsize=7, zorder=6, va="center", ha="right",
                    bbox={"facecolor": "white", "alpha": 0.85, "lw": 0, "pad": 1},
                    arrowprops={"arrowstyle": "-", "color": "0.3", "lw": 0.6})  # fmt: skip


def say_empty(ax: Any, why: str) -> None:
    """An axes with nothing to draw says why, in its middle (never a blank frame)."""
    ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", fontsize=9,
            color="0.25", wrap=True,
            bbox={"facecolor": "0.95", "edgecolor": "0.6", "boxstyle": "round"})  # fmt: skip
    ax.set_yticks([])


def sparse_ticks(ax: Any, labels: Sequence[str], most: int = 40) -> None:
    """:func:`ticks`, keeping every k-th label (and the last) when there are more than
    ``most``: a 32-block model's 66 points stay readable."""
    step = max(1, math.ceil(len(labels) / most))
    keep = [i for i in range(len(labels)) if i % step == 0 or i == len(labels) - 1]
    ax.set_xticks(keep)
    ax.set_xticklabels([labels[i] for i in keep], rotation=60, ha="right",
                       fontsize=8 if len(keep) <= 30 else 6)  # fmt: skip


# ---------------------------------------------------------------- a run's reads over steps
def run_series(
    reads: Mapping[float, Mapping[str, float]], key: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of one logged key over a run's reads ``{step: {key: value}}``."""
    steps = [s for s in sorted(reads) if key in reads[s]]
    return np.array(steps, dtype=float), np.array([reads[s][key] for s in steps], dtype=float)


def any_finite(reads: Mapping[float, Mapping[str, float]], key: str) -> bool:
    """Some read holds a finite value of ``key``."""
    return bool(np.isfinite(run_series(reads, key)[1]).any())


def mark_alerts(ax: Any, alerts: Sequence[Mapping[str, Any]], label: bool = True) -> None:
    """Each alert's step as a red vertical line (one legend entry)."""
    seen = set()
    for a in alerts:
        step = a.get("step")
        if step is None or step != step or step in seen:  # NaN: no step known
            continue
        seen.add(step)
        ax.axvline(step, color="tab:red", lw=1.0, ls="-", alpha=0.7,
                   label="alert" if label and len(seen) == 1 else None)  # fmt: skip


def step_span(ax: Any, reads: Mapping[float, Mapping[str, float]]) -> None:
    """The x axis over the run's reads, also when a panel draws nothing."""
    steps = sorted(reads)
    if steps:
        pad = max(1.0, 0.03 * (steps[-1] - steps[0]))
        ax.set_xlim(steps[0] - pad, steps[-1] + pad)


def wide(values: np.ndarray) -> bool:
    """Values that need a log axis: some <= 0 or spanning more than 30x."""
    v = values[np.isfinite(values)]
    return v.size > 0 and (v.min() <= 0 or v.max() / max(v.min(), 1e-300) > 30)
