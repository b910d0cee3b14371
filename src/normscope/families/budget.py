"""The tracker's memory budget: what each accumulator costs and which taps fit in max_memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from normscope._common import fmt_bytes
from normscope.taps.norms import NormLayer
from normscope.taps.residual import ResidualLayout, ResidualPoint

__all__ = ["BudgetFit", "fit_budget"]

_fmt_bytes = fmt_bytes


@dataclass(frozen=True)
class BudgetFit:
    """What :func:`fit_budget` keeps of a tracker's taps."""

    #: the residual stream's width (0 without residual points)
    width: int
    #: True: the per-source reads were planned for and do not fit (they are off)
    sources_dropped: bool
    norms: list[NormLayer]
    layout: ResidualLayout | None
    skipped_norms: list[str]
    skipped_points: list[str]
    #: the warning naming what is left out; None when everything fits (nothing changes)
    warning: str | None


def fit_budget(
    norms: list[NormLayer],
    layout: ResidualLayout | None,
    budget: int,
    *,
    sources: int,
) -> BudgetFit:
    """Fit a tracker's taps (its ``norms``, the points of ``layout``, ``sources`` per-source
    accumulators per point) in ``budget`` bytes (:func:`plan_budget`), with the warning naming
    what is left out."""
    points = layout.points if layout is not None else ()
    width = stream_width(norms, layout) if points else 0
    n_src = sources if points else 0
    full = tap_cost(norms, points, width, n_src)
    total_norms = len(norms)
    kept_norms, kept, src_kept = plan_budget(norms, points, width, budget, n_src)
    dropped = bool(n_src and not src_kept)
    if len(kept_norms) == len(norms) and len(kept) == len(points) and src_kept == n_src:
        return BudgetFit(width, dropped, norms, layout, [], [], None)
    skipped_norms = [n.name for n in norms if n not in kept_norms]
    kept_names = {p.name for p in kept}
    skipped_points = [p.name for p in points if p.name not in kept_names]
    if layout is not None:
        note = (
            f"max_memory: the residual profile reads {len(kept)} of {len(points)} points"
            if skipped_points
            else None
        )
        notes = layout.notes + ((note,) if note else ())
        layout = dataclasses.replace(layout, points=tuple(kept), notes=notes)

    def names(items: list[str]) -> str:
        return ", ".join(items[:8]) + (" ..." if len(items) > 8 else "") if items else "none"

    warning = (
        f"normscope: the accumulators of all {total_norms} norm "
        f"layers and {len(points)} residual points need {_fmt_bytes(full)}, over "
        f"max_memory={_fmt_bytes(budget)}; reading {len(kept_norms)} of {total_norms} norm "
        f"layers and {len(kept)} of {len(points)} residual points, at a stride over depth "
        f"({_fmt_bytes(tap_cost(kept_norms, kept, width, src_kept))}); left out: "
        f"norm layers {names(skipped_norms)}; residual points "
        f"{names(skipped_points)}"
        + (
            f"; the per-source reads (max_sources={n_src}: not read)"
            if n_src and not src_kept
            else ""
        )
    )
    return BudgetFit(width, dropped, kept_norms, layout, skipped_norms, skipped_points, warning)


def stream_width(norms: Sequence[NormLayer], layout: ResidualLayout) -> int:
    by_name = {n.name: n.dim for n in norms}
    for point in layout.points:
        if point.module_name in by_name:
            return by_name[point.module_name]
    if layout.final_norm in by_name:
        return by_name[layout.final_norm]
    return max(by_name.values())


def tap_cost(
    norms: Sequence[NormLayer],
    points: Sequence[ResidualPoint],
    width: int,
    sources: int = 0,
) -> int:
    """Bytes of the co-moments of every distinct tap (``8 d^2`` each; a point that is a norm's
    input shares that norm's input tap), and ``sources`` accumulators per point."""
    keys: dict[tuple[str, str], int] = {}
    for n in norms:
        keys[(n.name, "input")] = keys[(n.name, "output")] = n.dim
    for p in points:
        keys.setdefault((p.module_name, p.where), width)
    per_source = 8 * width * width * len(points) * sources
    return sum(8 * d * d for d in keys.values()) + per_source


def _thin_points(points: Sequence[ResidualPoint], kept: Sequence[int]) -> list[ResidualPoint]:
    """The points at indices ``kept``; a point whose predecessor was left out is relabelled
    with what now lies before it (one sublayer kind, else ``"block"``)."""
    out: list[ResidualPoint] = []
    prev = None
    for i in kept:
        p = points[i]
        if prev is not None and i - prev > 1:
            kinds = {q.sublayer for q in points[prev + 1 : i + 1]}
            p = dataclasses.replace(p, sublayer=kinds.pop() if len(kinds) == 1 else "block")
        out.append(p)
        prev = i
    return out


def plan_budget(
    norms: list[NormLayer],
    points: Sequence[ResidualPoint],
    width: int,
    budget: int,
    sources: int = 0,
) -> tuple[list[NormLayer], list[ResidualPoint], int]:
    """What fits in ``budget`` bytes: the residual profile first (the collapse alarm; at a
    stride over depth, first and last point kept, when it alone is over), then norm layers at
    the smallest stride over depth that fits in what is left (the final norm kept when it
    fits). Returns the norms, the points and the sources planned for (the ``sources``
    per-source accumulators at every kept point come after the profile and before the norm
    layers, all or none).
    """
    if tap_cost(norms, points, width, sources) <= budget:
        return norms, list(points), sources
    kept_points: list[ResidualPoint] = list(points)
    if tap_cost([], points, width) > budget:
        kept_points = []
        for stride in range(2, len(points)):
            idx = list(range(0, len(points), stride))
            if idx[-1] != len(points) - 1:
                idx.append(len(points) - 1)
            if tap_cost([], [points[i] for i in idx], width) <= budget:
                kept_points = _thin_points(points, idx)
                break
        if not kept_points and len(points) >= 2:
            ends = _thin_points(points, [0, len(points) - 1])
            kept_points = ends if tap_cost([], ends, width) <= budget else []
    if sources and tap_cost([], kept_points, width, sources) > budget:
        sources = 0
    chosen: list[NormLayer] = []
    for stride in range(1, len(norms) + 1):
        candidate = norms[::stride]
        if norms[-1] not in candidate:
            candidate = [*candidate[:-1], norms[-1]] if len(candidate) > 1 else [norms[-1]]
        if tap_cost(candidate, kept_points, width, sources) <= budget:
            chosen = candidate
            break
    return chosen, kept_points, sources
