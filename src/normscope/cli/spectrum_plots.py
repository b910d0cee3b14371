"""The scan's ``spectrum.png``: the bottom of each norm's eigen-spectrum, with its verdict."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from normscope.cli.figures import (
    LOG_FLOOR,
    finite,
    new_figure,
    save,
    say_empty,
    short_names,
    titled,
)

__all__ = ["NULL_TOL", "plot_spectrum", "spectrum_highlights", "spectrum_verdict"]

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
    has = [i for i, n in enumerate(norms) if finite(n.get("bottom_eigenvalues") or []).size]
    if not has:
        return {}
    roles = {has[0]: "first", has[-1]: "final"}

    def badness(i: int) -> tuple[int, float]:
        values = finite(norms[i]["bottom_eigenvalues"])
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
        values = finite(n.get("bottom_eigenvalues") or [])
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
    every = [finite(n.get("bottom_eigenvalues") or []) for n in norms]
    positive = np.concatenate([v[np.isfinite(v) & (v > 0)] for v in every] + [np.array([])])
    # one floor for every layer, under the null region: a layer's zeros (a rank-deficient
    # input's many null eigenvalues) are drawn at the bottom, never above another's live ones
    floor = max(
        LOG_FLOOR, min(float(positive.min()) / 10 if positive.size else 1.0, NULL_TOL / 100)
    )
    for i, (n, label, raw) in enumerate(zip(norms, labels, every)):
        if not raw.size or not np.isfinite(raw).any():
            continue
        low = np.isfinite(raw) & (raw <= floor)
        values = np.where(low, floor, raw)
        lowest, highest = min(lowest, floor), max(highest, float(np.nanmax(values)))
        longest = max(longest, len(values))
        drawn.append((i, values, low, label, _null_count(n, raw)))
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
    if not drawn:
        say_empty(ax, "no eigen-spectrum: no norm layer had enough rows (2 d) to read one")
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
