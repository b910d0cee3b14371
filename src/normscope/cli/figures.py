"""The plots' shared drawing kit: an Agg figure, PNG saving, tick labels, titles, log floors."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from normscope.alerts import KernelLossRule, SigmaMinRatioRule

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "ALERT_RATIO",
    "DPI",
    "KERNEL_ALERT",
    "KERNEL_ALERT_LABEL",
    "LOG_FLOOR",
    "finite",
    "log_floor",
    "new_figure",
    "save",
    "short_names",
    "ticks",
    "titled",
]

DPI = 110
KERNEL_ALERT = KernelLossRule().max_kernel_residual  # the default rule's max_kernel_residual
KERNEL_ALERT_LABEL = f"{KERNEL_ALERT:.0e}".replace("e-0", "e-")  # "1e-4"
ALERT_RATIO = SigmaMinRatioRule().threshold  # the default rule's floor (1.0 - 0.4)
LOG_FLOOR = 1e-18


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
