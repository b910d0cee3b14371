"""Following one candidate block stack through a forward pass: which tensors are stream points."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from normscope.taps.hooks import tap_output

_ATTN_WORDS = ("attn", "attention")
# Path words (lower case, "_" removed) that name a sublayer; leaves are whole segments.
_MLP_WORDS = ("mlp", "ffn", "feedforward", "intermediate", "densereludense", "densegatedact")
_MLP_WORDS += ("experts", "moe")
_ATTN_LEAVES = {"qproj", "kproj", "vproj", "oproj", "outproj", "qkv", "query", "key", "value"}
_MLP_LEAVES = {"fc1", "fc2", "fcin", "fcout", "cfc", "w1", "w2", "w3", "wi", "wo", "upproj"}
_MLP_LEAVES |= {"downproj", "gateproj", "densehto4h", "dense4htoh"}


def _label(path: str) -> str | None:
    for segment in path.lower().replace("_", "").split("."):
        if segment in _ATTN_LEAVES or any(w in segment for w in _ATTN_WORDS):
            return "attn"
        if segment in _MLP_LEAVES or any(w in segment for w in _MLP_WORDS):
            return "mlp"
    return None


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal entry by entry up to a few roundings of ``dtype``.

    A recomputed ``x + f`` is bit-identical in practice; the slack covers a sum the model forms
    in another precision, or a scale applied to it. Entry-wise (not relative to the largest
    entry) so that a branch ``f`` never passes for ``x + f`` in bfloat16 unless ``x`` is
    negligible in *every* entry.
    """
    if a.shape != b.shape:
        return False
    if a.dtype == b.dtype and torch.equal(a, b):
        return True
    a64, b64 = a.double(), b.double()
    eps = torch.finfo(dtype).eps
    slack = 4 * eps * (a64.abs() + b64.abs()) + 1e-3 * eps * a64.abs().max()
    return bool(((a64 - b64).abs() <= slack).all())


def _branch_scale(
    rows: torch.Tensor, base: torch.Tensor, s: torch.Tensor
) -> float | torch.Tensor | None:
    """The ``c`` of ``rows = base + c * s`` (a scalar, else one per channel), or None.

    ``c`` is solved by least squares (per channel: over the rows) and accepted only when the
    reconstruction holds entry by entry at rounding level. The slack also covers the rounding
    of the product ``c * s`` the model formed before the add (it does not shrink when ``base``
    and ``c * s`` cancel in an entry). A per-channel ``c`` needs 8 rows or more: on fewer, any
    branch would fit.
    """
    if rows.shape != s.shape or rows.shape != base.shape:
        return None
    r64, b64, s64 = rows.double(), base.double(), s.double()
    eps = torch.finfo(rows.dtype).eps
    diff = r64 - b64

    def holds(cs: torch.Tensor) -> bool:
        slack = 4 * eps * (r64.abs() + b64.abs() + cs.abs()) + 1e-3 * eps * r64.abs().max()
        return bool(((diff - cs).abs() <= slack).all())

    total = float((s64 * s64).sum())
    if total == 0.0 or not math.isfinite(total):
        return None
    c = float((diff * s64).sum()) / total
    if c != 0.0 and math.isfinite(c) and holds(c * s64):
        return c
    if rows.shape[0] < 8:
        return None
    den = (s64 * s64).sum(0)
    cv = torch.where(den > 0, (diff * s64).sum(0) / den.clamp_min(1e-300), torch.zeros_like(den))
    if not bool(torch.isfinite(cv).all()) or float(cv.abs().max()) == 0.0:
        return None
    return cv if holds(cv * s64) else None


@dataclass
class _Point:
    ref: torch.Tensor | None  # the tensor itself, kept alive so that data_ptr identity holds
    version: int
    rows: torch.Tensor | None  # a frozen copy, (N, d): later in-place edits cannot change it
    producer: tuple[str, int]  # ("input", 0), ("output", k) or ("norm", k)
    sublayer: str | None = None
    readers: list[str] = field(default_factory=list)
    module: str | None = None  # the module whose output the step added (the sublayer itself)
    via_norm: bool = False  # the step added a norm's output (sandwich)
    branch_scale: float | torch.Tensor | None = None  # the c of "previous + c * branch"


@dataclass
class _Block:
    input_read: bool = False
    inner_points: int = 0
    output_matched: bool = False
    sandwich: bool = False
    output_norm: str | None = None
    scale: float | None = None
    unexplained: list[str] = field(default_factory=list)  # stream-width norm inputs, no step


class StackTrace:
    """The state machine that follows one candidate stack through the forward pass."""

    def __init__(self, path: str, blocks: list[tuple[str, nn.Module]], norms_inside: int) -> None:
        self.path, self.blocks = path, blocks
        self.calls: list[int] = []
        self.problem: str | None = None
        self.current: int | None = None
        self.finished = False
        self.points: list[_Point] = []
        self.visible: list[_Point] = []  # points of the running block
        self.window: list[tuple[str, torch.Tensor, bool]] = []  # (path, rows, is_norm)
        self.completed: list[str] = []
        self.records: list[_Block] = []
        self.branch: list[tuple[str, str]] = []
        self.final_norm: str | None = None
        self.last_norm_out: tuple[str, torch.Tensor] | None = None
        self.has_norms = norms_inside > 0
        self.width: int | None = None  # the stream width d, from the first block's input
        self.finish_order = -1

    def _rows(self, t: torch.Tensor | None) -> torch.Tensor | None:
        d = self.width
        if t is None or not t.is_floating_point() or t.shape[-1] != d:
            return None
        return t.detach().reshape(-1, d).clone()

    def _find(self, t: torch.Tensor, rows: torch.Tensor, by_value: bool) -> _Point | None:
        """The visible point that ``t`` is: the same tensor (or a view of it), else equal values.

        Identity comes first so that a zero branch (``x + 0``, a zero-initialised output
        projection) still makes a new point: its values equal the old one's, its tensor does not.
        """
        for p in reversed(self.visible):
            same_object = t is p.ref or (
                t.data_ptr() == p.ref.data_ptr()
                and t.numel() == p.ref.numel()
                and t._version == p.version
            )
            if same_object:
                return p
        if by_value:
            for p in reversed(self.visible):
                if _close(rows, p.rows, rows.dtype):
                    return p
        return None

    def _step(self, rows: torch.Tensor, scaled: bool) -> tuple:
        """(sublayer, matched, via_norm, scale, branch_scale, module) of the step from the latest
        point to ``rows``: ``rows = base + s`` for a module output ``s`` of the block (exact),
        else ``base + c * s`` (``c`` a scalar or one per channel: residual multipliers,
        ``1/sqrt(2L)``, LayerScale; ``branch_scale``), else (``scaled``: block outputs only)
        ``c * (base + s)`` (a learned scale after the add; ``scale``)."""
        base = self.visible[-1].rows
        hits = [(p, n) for p, s, n in self.window if _close(rows, base + s, rows.dtype)]
        scale = branch_scale = None
        fits: dict[str, float | torch.Tensor] = {}
        if not hits:
            for p, s, n in self.window:
                c = _branch_scale(rows, base, s)
                if c is not None:
                    hits.append((p, n))
                    fits[p] = c
        if not hits and scaled:
            for p, s, n in self.window:
                u = (base + s).double()
                c = float((rows.double() * u).sum() / (u * u).sum().clamp_min(1e-300))
                if c != 0.0 and _close(rows, c * u, rows.dtype):
                    hits, scale = [(p, n)], c
                    break
        if not hits:
            return "block", False, False, None, None, None
        path, is_norm = min(hits, key=lambda h: (_label(h[0]) is None, h[0].count("."), h[0]))
        branch_scale = fits.get(path)
        label = _label(path)
        if label is None:  # e.g. ViT's "output.dense": look at what ran since the last point
            prefix = self.blocks[self.current][0] + "."
            readers = {r[len(prefix) :] for r in self.visible[-1].readers if r.startswith(prefix)}
            seen = {_label(c) for c in self.completed if c not in readers}
            seen.discard(None)
            label = seen.pop() if len(seen) == 1 else "block"
        module = f"{self.blocks[self.current][0]}.{path}" if self.current is not None else path
        return label, True, is_norm, scale, branch_scale, module

    def _forget_all_but_last(self) -> None:
        """Drop the tensors of points no later comparison needs: memory stays one block's worth."""
        for p in self.visible[:-1]:
            p.ref = p.rows = None
        self.visible = self.visible[-1:]

    def _add(self, t: torch.Tensor, rows: torch.Tensor, producer: tuple[str, int], step) -> _Point:
        label, _, via_norm, _, branch_scale, module = step
        p = _Point(
            t,
            t._version,
            rows,
            producer,
            label,
            via_norm=via_norm,
            branch_scale=branch_scale,
            module=module,
        )
        self.points.append(p)
        self.visible.append(p)
        self.window, self.completed = [], []
        return p

    def block_start(self, i: int, x: torch.Tensor | None) -> None:
        if self.problem or self.finished:
            return  # finished: a later forward (activation-checkpoint recompute) adds nothing
        if self.current is not None:
            self.problem = f"block {i} started inside block {self.current}"
            return
        if i != len(self.calls):
            self.problem = f"blocks ran in the order {self.calls + [i]}, not 0, 1, 2, ..."
            return
        self.calls.append(i)
        if x is None or not x.is_floating_point():
            self.problem = f"block {i} received no floating-point hidden_states"
            return
        rows = x.detach().reshape(-1, x.shape[-1]).clone()
        self._forget_all_but_last()
        if i == 0:
            self.width = x.shape[-1]
            self._add(x, rows, ("input", 0), (None, False, False, None, None, None))
        elif self._find(x, rows, by_value=True) is None:
            self.problem = f"block {i} does not read block {i - 1}'s output"
            return
        self.records.append(_Block())
        self.current, self.last_norm_out = i, None

    def sub_output(self, path: str, out: object, is_norm: bool, norm_path: str) -> None:
        rows = self._rows(tap_output(out))
        if rows is not None:
            self.window.append((path, rows, is_norm))
            if is_norm:
                self.last_norm_out = (norm_path, rows)
        self.completed.append(path)

    def norm_input(self, path: str, t: torch.Tensor | None) -> None:
        rec, rows = self.records[-1], self._rows(t)
        if rows is None:
            self.branch.append((path, "width"))  # another width: QK-norms over head_dim, ...
            return
        point = self._find(t, rows, by_value=False)
        if point is None:
            step = self._step(rows, scaled=False)
            if step[1]:
                point = self._add(t, rows, ("norm", self.current), step)
                rec.inner_points += 1
                rec.sandwich |= step[2]
            else:
                point = self._find(t, rows, by_value=True)
        if point is None:
            if not any(_close(rows, s, rows.dtype) for _, s, _ in self.window):
                # no point, no step from one, not a module's output: a sum with something no
                # module computed (``x + x @ A + attn(ln(x))``, functional dropout in training)
                rec.unexplained.append(path)
            self.branch.append((path, "branch"))  # a branch before it is added (sandwich)
            return
        if point is self.visible[0]:
            rec.input_read = True
        point.readers.append(path)

    def block_end(self, i: int, out: object, order: int) -> None:
        if self.problem or self.current != i:
            return
        t, rec = tap_output(out), self.records[-1]
        rows = self._rows(t)
        if rows is None:
            self.problem = f"block {i} returned no tensor of the stream's width"
            return
        if self._find(t, rows, by_value=False) is None:
            step = self._step(rows, scaled=True)
            if step[1] or self._find(t, rows, by_value=True) is None:
                rec.output_matched, rec.scale = step[1], step[3]
                rec.sandwich |= step[2]
                self._add(t, rows, ("output", i), step)
        if self.last_norm_out is not None and _close(rows, self.last_norm_out[1], rows.dtype):
            rec.output_norm = self.last_norm_out[0]
        self.current = None
        if i == len(self.blocks) - 1:
            self.finished, self.finish_order = True, order
            self._forget_all_but_last()

    def after_stack_norm(self, path: str, t: torch.Tensor | None) -> None:
        rows = self._rows(t)
        if rows is not None and self._find(t, rows, by_value=True) is not None:
            self.final_norm = path
            self.points[-1].readers.append(path)

    def block_style(self, rec: _Block) -> str:
        if not rec.input_read:
            return "post-norm" if rec.output_norm is not None else "other"
        if rec.inner_points == 0 and not rec.output_matched:
            return "parallel"
        return "sandwich" if rec.sandwich else "pre-norm"
