"""Deciding a ResidualLayout from a finished stack trace: its points, style and notes."""

from __future__ import annotations

import torch

from normscope.taps.residual_layout import ResidualLayout, ResidualPoint
from normscope.taps.stack_trace import StackTrace

_POST_NORM_NOTE = (
    "post-norm blocks: the residual stream is the norms' outputs, so the profile is taken over "
    "block outputs (where='output'); the sigma_min theory of docs/metrics.md §1.4 assumes pre-norm "
    "identity skips and does not apply as stated"
)


def _describe_scale(c: float | torch.Tensor) -> str:
    if isinstance(c, torch.Tensor):
        return f"c per channel in [{float(c.min()):.4g}, {float(c.max()):.4g}]"
    return f"c = {c:.4g}"


def _names(paths: list[str], limit: int = 4) -> str:
    more = f", ... ({len(paths)} in all)" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


def _points(trace: StackTrace, blocks: list[str], style: str) -> list[ResidualPoint]:
    if style in ("post-norm", "boundaries"):  # the block boundaries
        first = ResidualPoint(blocks[0], blocks[0], "input", None, 0)
        return [first] + [
            ResidualPoint(f"{b}.output", b, "output", "block", k + 1) for k, b in enumerate(blocks)
        ]
    points = []
    for k, p in enumerate(trace.points):
        if p.readers:  # pre-norm: hook the first norm that reads it
            name = module = p.readers[0]
            where = "input"
        elif p.producer[0] == "input":
            name = module = blocks[0]
            where = "input"
        else:
            module = blocks[p.producer[1]]
            name, where = f"{module}.output", "output"
        sublayer = p.sublayer if k else None
        points.append(
            ResidualPoint(
                name, module, where, sublayer, k, tuple(p.readers), p.module if k else None
            )
        )
    return points


def _notes(
    trace: StackTrace,
    styles: list[str],
    points: list[ResidualPoint],
    others: list[StackTrace],
    fallback: str | None = None,
) -> list[str]:
    blocks = [b for b, _ in trace.blocks]
    narrow = [p for p, why in trace.branch if why == "width"]
    unexplained = {p for r in trace.records for p in r.unexplained} if fallback else set()
    branch = [p for p, why in trace.branch if why == "branch" and p not in unexplained]
    notes = [fallback] if fallback else []
    if "post-norm" in styles:
        notes.append(_POST_NORM_NOTE)
    if len(set(styles)) > 1:
        notes.append("blocks differ in style: " + ", ".join(map(": ".join, zip(blocks, styles))))
    if "parallel" in styles and not fallback:
        notes.append(
            "parallel residual: attention and MLP read the same stream tensor and are added "
            "together, so each block is one step, labelled 'block'"
        )
    if branch and "post-norm" not in styles:
        notes.append(
            f"{len(branch)} norm(s) read a branch before it is added to the stream (sandwich "
            f"post-norms) and are not stream points: {_names(branch)}"
        )
    if narrow:
        notes.append(
            f"{len(narrow)} norm(s) work over another width (QK-norms over head_dim, ...) and "
            f"are not stream points: {_names(narrow)}"
        )
    if "other" in styles:
        notes.append("no norm reads the block inputs: the points are the block boundaries")
    scaled = [f"{b}: {r.scale:.4g}" for b, r in zip(blocks, trace.records) if r.scale is not None]
    if scaled:
        notes.append(
            "block outputs are the residual sum times a scalar (a learned layer scale, e.g. "
            f"Gemma 4's layer_scalar), and the step includes it: {', '.join(scaled)}"
        )
    scaled_steps = [
        f"{point.name} ({point.sublayer}, {_describe_scale(p.branch_scale)})"
        for point, p in zip(points, trace.points)
        if p.branch_scale is not None
    ]
    if scaled_steps and not fallback and "post-norm" not in styles:
        notes.append(
            "scaled branches: the point is the previous point plus c times one module's output "
            "(a residual multiplier, 1/sqrt(2L), a learned scalar or LayerScale), labelled by "
            f"that module: {_names(scaled_steps)}"
        )
    unlabelled = [p.name for p in points[1:] if p.sublayer == "block"]
    if unlabelled and not fallback and not {"parallel", "post-norm"} & set(styles):
        notes.append(
            "steps labelled 'block' add several branches at once, or one whose path names "
            f"neither attention nor MLP: {_names(unlabelled)}"
        )
    if trace.final_norm is None:
        notes.append("no norm after the stack reads the last block's output: it is the last point")
    if others:
        stacks = [f"{t.path} ({len(t.blocks)} x {type(t.blocks[0][1]).__name__})" for t in others]
        notes.append(f"other block stacks ran and are not profiled: {', '.join(stacks)}")
    return notes


def build_layout(trace: StackTrace, others: list[StackTrace]) -> ResidualLayout:
    blocks = [b for b, _ in trace.blocks]
    styles = [trace.block_style(r) for r in trace.records]
    style = styles[0] if len(set(styles)) == 1 else "mixed"
    unexplained = [
        path
        for rec, st in zip(trace.records, styles)
        if st in ("pre-norm", "sandwich", "parallel")
        for path in rec.unexplained
    ]
    fallback = None
    if unexplained:
        fallback = (
            f"residual stream: {len(unexplained)} norm(s) read a sum that is no stream point "
            "plus (c times) one module's output, so a sublayer cannot be told apart (e.g. "
            "x + x @ A + attn(ln(x)): the matmul is no module; or a functional dropout in a "
            f"training forward): {_names(unexplained)}. The profile falls back to the block "
            "boundaries (block inputs/outputs, one step per block, labelled 'block')"
        )
    points = _points(trace, blocks, "boundaries" if fallback else style)
    skip = set(unexplained)
    branch = () if style == "post-norm" else tuple(p for p, _ in trace.branch if p not in skip)
    return ResidualLayout(
        points=tuple(points),
        style=style,
        blocks=tuple(blocks),
        final_norm=trace.final_norm,
        notes=tuple(_notes(trace, styles, points, others, fallback)),
        branch_norms=branch,
        fallback=fallback,
    )
