"""Finding the residual stream: the points ``p_0 .. p_L`` of METRICS.md §1.4, from evidence.

Class names do not say where the stream is (PITFALLS.md, "Finding the residual stream"): a
Gemma 2/3/4 ``post_attention_layernorm`` reads a branch, a GPT-NeoX ``post_attention_layernorm``
reads the block input, BLOOM adds the residual inside its attention module. So
:func:`find_residual_points` runs the model once, with temporary hooks, and decides from the
tensors themselves:

1. The **block stack** is an ``nn.ModuleList`` / ``nn.Sequential`` of same-class modules that ran
   once each, in order, each reading the previous one's output (the longest such stack; one
   containing norm layers first). Block ``k``'s output is block ``k+1``'s input: one point.
2. Inside a block, a norm's input is a **stream point** iff it is a point already (the same
   tensor, or a view of it: GPT-NeoX's parallel norms both read the block input, counted
   once), or equals the latest point plus the output of one module of the block (recomputed in
   the model's dtype, ``x + f`` is bit-identical), or, failing both, has a point's values.
   Identity is tried before values so that a zero branch (``x + 0``) still makes a new point.
   The module's path names the sublayer: ``attn`` or ``mlp`` (the keywords below), else the
   modules run in between, else ``block``. Any other norm input is a **branch** (sandwich
   post-norms, QK-norms over ``head_dim``), listed in ``ResidualLayout.branch_norms``.
3. The block output is a point too, labelled the same way (``block`` when the block adds
   several branches at once, as parallel attention + MLP does); a learned scalar applied after
   the add (Gemma 4's ``layer_scalar``) is recognised and noted.
4. The final point is the input of the **final norm**: the first norm after the stack that
   reads the last block's output.

Styles (``ResidualLayout.style``): ``"pre-norm"`` (norms read the stream), ``"sandwich"``
(pre-norm, plus norms on branch outputs before the add: Gemma 2/3/4), ``"parallel"`` (one step
per block: GPT-NeoX/GPT-J/Phi), ``"post-norm"`` (BERT: the stream is the norms' *outputs*; the
points are the block outputs), ``"other"`` (no norm reads the stream; points are the block
boundaries) and ``"mixed"`` (blocks disagree).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from normscope._common import NormscopeError
from normscope.taps.norms import NormLayer, find_norm_layers

__all__ = [
    "ResidualDiscovery",
    "ResidualDiscoveryError",
    "ResidualLayout",
    "ResidualPoint",
    "find_residual_points",
    "tap_input",
    "tap_output",
]

_ATTN_WORDS = ("attn", "attention")
# Path words (lower case, "_" removed) that name a sublayer; leaves are whole segments.
_MLP_WORDS = ("mlp", "ffn", "feedforward", "intermediate", "densereludense", "densegatedact")
_MLP_WORDS += ("experts", "moe")
_ATTN_LEAVES = {"qproj", "kproj", "vproj", "oproj", "outproj", "qkv", "query", "key", "value"}
_MLP_LEAVES = {"fc1", "fc2", "fcin", "fcout", "cfc", "w1", "w2", "w3", "wi", "wo", "upproj"}
_MLP_LEAVES |= {"downproj", "gateproj", "densehto4h", "dense4htoh"}
_POST_NORM_NOTE = (
    "post-norm blocks: the residual stream is the norms' outputs, so the profile is taken over "
    "block outputs (where='output'); the sigma_min theory of METRICS.md §1.4 assumes pre-norm "
    "identity skips and does not apply as stated"
)


class ResidualDiscoveryError(NormscopeError, ValueError):
    """No block stack, or a forward pass that does not run one in sequence."""


@dataclass(frozen=True)
class ResidualPoint:
    """One point of the residual stream.

    Args:
        name: stable label for metric keys: the path of the module whose input it is, or
            ``"<block path>.output"``.
        module_name: path of the module to hook.
        where: ``"input"`` (forward pre-hook, :func:`tap_input`) or ``"output"`` (forward hook,
            :func:`tap_output`).
        sublayer: what lies between the previous point and this one: ``"attn"``, ``"mlp"`` or
            ``"block"``; ``None`` for ``p_0``.
        depth: ``0 .. L``.
        readers: every norm whose input is this tensor (two for a GPT-NeoX parallel block).
    """

    name: str
    module_name: str
    where: str
    sublayer: str | None
    depth: int
    readers: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResidualLayout:
    """The residual points of a model and how they were found.

    Args:
        points: ``p_0 .. p_L`` in forward order.
        style: see the module docstring (``"pre-norm"``, ``"sandwich"``, ``"parallel"``,
            ``"post-norm"``, ``"other"``, ``"mixed"``).
        blocks: block module paths, in order.
        final_norm: path of the norm after the stack, if one reads the last block's output.
        notes: plain statements a report should show (post-norm caveat, branch norms...).
        branch_norms: norms inside blocks that read a branch, not the stream.
        fallback: why the points are the block boundaries although norms read the stream (a
            sublayer could not be told apart, e.g. ``x + x @ A + attn(ln(x))``: the matmul is no
            module); ``None`` when each sublayer was found. Also the first of ``notes``.
    """

    points: tuple[ResidualPoint, ...]
    style: str
    blocks: tuple[str, ...]
    final_norm: str | None
    notes: tuple[str, ...]
    branch_norms: tuple[str, ...] = ()
    fallback: str | None = None


def tap_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor a forward pre-hook taps: the first positional argument, else the first of the
    keywords ``hidden_states``, ``input`` (``nn.LayerNorm(input=x)``), ``x`` that holds a tensor."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    for name in _INPUT_KEYWORDS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            return value
    return None


_INPUT_KEYWORDS = ("hidden_states", "input", "x")


def tap_output(output: object) -> torch.Tensor | None:
    """The tensor a forward hook taps: the output, or its first element if it is a tuple."""
    if hasattr(output, "to_tuple"):  # a transformers ModelOutput
        output = output.to_tuple()
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


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


def _describe_scale(c: float | torch.Tensor) -> str:
    if isinstance(c, torch.Tensor):
        return f"c per channel in [{float(c.min()):.4g}, {float(c.max()):.4g}]"
    return f"c = {c:.4g}"


@dataclass
class _Point:
    ref: torch.Tensor | None  # the tensor itself, kept alive so that data_ptr identity holds
    version: int
    rows: torch.Tensor | None  # a frozen copy, (N, d): later in-place edits cannot change it
    producer: tuple[str, int]  # ("input", 0), ("output", k) or ("norm", k)
    sublayer: str | None = None
    readers: list[str] = field(default_factory=list)
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


class _StackTrace:
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
        """(sublayer, matched, via_norm, scale, branch_scale) of the step from the latest
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
            return "block", False, False, None, None
        path, is_norm = min(hits, key=lambda h: (_label(h[0]) is None, h[0].count("."), h[0]))
        branch_scale = fits.get(path)
        label = _label(path)
        if label is None:  # e.g. ViT's "output.dense": look at what ran since the last point
            prefix = self.blocks[self.current][0] + "."
            readers = {r[len(prefix) :] for r in self.visible[-1].readers if r.startswith(prefix)}
            seen = {_label(c) for c in self.completed if c not in readers}
            seen.discard(None)
            label = seen.pop() if len(seen) == 1 else "block"
        return label, True, is_norm, scale, branch_scale

    def _forget_all_but_last(self) -> None:
        """Drop the tensors of points no later comparison needs: memory stays one block's worth."""
        for p in self.visible[:-1]:
            p.ref = p.rows = None
        self.visible = self.visible[-1:]

    def _add(self, t: torch.Tensor, rows: torch.Tensor, producer: tuple[str, int], step) -> _Point:
        label, _, via_norm, _, branch_scale = step
        p = _Point(
            t, t._version, rows, producer, label, via_norm=via_norm, branch_scale=branch_scale
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
            self._add(x, rows, ("input", 0), (None, False, False, None, None))
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


def _candidate_stacks(model: nn.Module, norm_ids: set[int]) -> list[_StackTrace]:
    """Every ModuleList/Sequential of same-class modules; those holding norms, if any do."""
    found = []
    for path, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) == 0:
            continue
        children = list(mod.named_children())
        cls = type(children[0][1])
        if issubclass(cls, (nn.ModuleList, nn.ModuleDict)) or any(
            type(c) is not cls for _, c in children
        ):
            continue
        blocks = [(f"{path}.{n}" if path else n, c) for n, c in children]
        norms_inside = sum(id(m) in norm_ids for _, c in blocks for m in c.modules())
        found.append(_StackTrace(path, blocks, norms_inside))
    if any(t.has_norms for t in found):
        found = [t for t in found if t.has_norms]
    return found


def _guarded(traces: list[_StackTrace], fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` as a hook that never raises into the forward (it may be a training forward): a
    failure becomes every trace's problem, and discovery reports it at ``finish()``."""

    def hook(*args: object, **kwargs: object) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - told at finish(), never to the forward
            for trace in traces:
                trace.problem = trace.problem or f"a discovery hook failed ({exc!r})"

    return hook


def _install(traces: list[_StackTrace], norms: Sequence[NormLayer]) -> list:
    """Register the temporary hooks; return their handles."""
    norm_path = {id(n.module): n.name for n in norms}
    modules: dict[int, nn.Module] = {id(n.module): n.module for n in norms}
    inside: dict[int, list[tuple[_StackTrace, int, str]]] = {}
    for trace in traces:
        for i, (_, block) in enumerate(trace.blocks):
            for rel, m in block.named_modules():
                if rel:
                    inside.setdefault(id(m), []).append((trace, i, rel))
                    modules[id(m)] = m

    def norm_pre(m: nn.Module, args: tuple, kwargs: dict) -> None:
        t, path = tap_input(args, kwargs), norm_path[id(m)]
        homes = inside.get(id(m), [])
        for trace in traces:
            if trace.problem:
                continue
            here = [i for tr, i, _ in homes if tr is trace]
            if trace.current is not None and trace.current in here:
                trace.norm_input(path, t)
            elif not here and trace.finished and trace.final_norm is None:
                trace.after_stack_norm(path, t)

    def sub_post(m: nn.Module, args: tuple, output: object) -> None:
        for trace, i, rel in inside.get(id(m), []):
            if not trace.problem and trace.current == i:
                trace.sub_output(rel, output, id(m) in norm_path, norm_path.get(id(m), ""))

    order = iter(range(1 << 62))
    handles = []
    norm_hook, sub_hook = _guarded(traces, norm_pre), _guarded(traces, sub_post)
    for key, m in modules.items():
        if key in norm_path:
            handles.append(m.register_forward_pre_hook(norm_hook, with_kwargs=True))
        if key in inside:
            handles.append(m.register_forward_hook(sub_hook))
    for trace in traces:
        for i, (_, block) in enumerate(trace.blocks):

            def pre(m, args, kwargs, trace=trace, i=i):
                trace.block_start(i, tap_input(args, kwargs))

            def post(m, args, output, trace=trace, i=i):
                trace.block_end(i, output, next(order))

            handles.append(block.register_forward_pre_hook(_guarded(traces, pre), with_kwargs=True))
            handles.append(block.register_forward_hook(_guarded(traces, post)))
    return handles


def find_residual_points(
    model: nn.Module,
    forward: Callable[[], object],
    norms: Sequence[NormLayer] | None = None,
) -> ResidualLayout:
    """Find the residual points ``p_0 .. p_L`` of ``model`` from one forward pass.

    ``forward`` is called once, under ``torch.no_grad()`` and with the model in eval mode
    (dropout would break the exact ``x + f`` evidence); the training flags and the hooks are
    restored / removed afterwards, whatever happens.

    Args:
        model: the model.
        forward: zero-argument callable running one forward pass on a small batch, e.g.
            ``lambda: model(input_ids)``.
        norms: the norm layers to consider (default :func:`find_norm_layers`). Pass all of
            them: a norm left out cannot show where the stream is.

    Returns:
        The :class:`ResidualLayout`.

    Raises:
        ResidualDiscoveryError: no block stack, the forward failed, or the stack did not run
            once, in order, each block reading the previous one's output.
        NormDiscoveryError: ``norms=None`` and the model has no norm layer.

    Example::

        >>> import torch, transformers
        >>> cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64,
        ...                               bos_token_id=0, eos_token_id=0)
        >>> model = transformers.GPT2LMHeadModel(cfg)
        >>> ids = torch.randint(0, 64, (2, 8))
        >>> layout = find_residual_points(model, lambda: model(input_ids=ids))
        >>> layout.style, layout.final_norm
        ('pre-norm', 'transformer.ln_f')
        >>> [(p.name, p.sublayer) for p in layout.points]  # doctest: +NORMALIZE_WHITESPACE
        [('transformer.h.0.ln_1', None), ('transformer.h.0.ln_2', 'attn'),
         ('transformer.h.1.ln_1', 'mlp'), ('transformer.h.1.ln_2', 'attn'),
         ('transformer.ln_f', 'mlp')]
    """
    discovery = ResidualDiscovery(model, norms)
    training = {m: m.training for m in model.modules()}
    discovery.install()
    try:
        model.eval()
        with torch.no_grad():
            try:
                forward()
            except Exception as exc:
                raise ResidualDiscoveryError(
                    f"find_residual_points: the forward callable failed: {exc!r}"
                ) from exc
    finally:
        discovery.remove()
        for m, flag in training.items():
            m.training = flag
    return discovery.finish()


class ResidualDiscovery:
    """Residual discovery around a forward that someone else runs (the training step's own).

    :func:`find_residual_points` is ``install()``, one eval-mode no-grad forward, ``finish()``.
    A Lightning callback instead installs the hooks before the first training batch, lets
    ``training_step`` run its forward (whatever it calls: ``self(...)``, ``self.model(...)``,
    blocks held as attributes), and decides the layout after it. The hooks only observe: they
    copy (detached) what the stack's blocks and norms see, never change a tensor, and never
    raise into the forward (a failure is reported by :meth:`finish`). Blocks that run again
    once the stack has finished (an activation-checkpoint recompute in the backward) are
    ignored. In training mode the ``x + f`` evidence holds wherever dropout is a module inside
    the branch (its output is the branch); a functional dropout between a module and the add
    leaves the sublayer unexplained, and the layout falls back to the block boundaries
    (``ResidualLayout.fallback``).

    Args:
        model: the model whose modules hold the stack (the LightningModule itself is fine).
        norms: the norm layers to consider (default :func:`find_norm_layers`).

    Raises:
        ResidualDiscoveryError: (at construction) the model has no block stack.

    Example::

        discovery = ResidualDiscovery(model).install()
        try:
            loss = model(batch).loss   # any forward: discovery watches it
        finally:
            discovery.remove()
        layout = discovery.finish()
    """

    def __init__(self, model: nn.Module, norms: Sequence[NormLayer] | None = None) -> None:
        self.model = model
        self.norms = find_norm_layers(model) if norms is None else list(norms)
        self.traces = _candidate_stacks(model, {id(n.module) for n in self.norms})
        if not self.traces:
            raise ResidualDiscoveryError(
                f"no block stack in {type(model).__name__}: looked for an nn.ModuleList or "
                "nn.Sequential of same-class modules (the transformer's layers)"
            )
        self._handles: list = []
        self._finished = False

    @property
    def installed(self) -> bool:
        """Whether the temporary hooks are registered."""
        return bool(self._handles)

    def install(self) -> ResidualDiscovery:
        """Register the temporary hooks (once); the next forward is the evidence."""
        if self._finished:
            raise ResidualDiscoveryError("ResidualDiscovery: finish() was called already")
        if not self._handles:
            self._handles = _install(self.traces, self.norms)
        return self

    def remove(self) -> None:
        """Remove the temporary hooks (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def finish(self) -> ResidualLayout:
        """Remove the hooks and decide the layout from what the forward showed.

        Raises:
            ResidualDiscoveryError: the stack did not run once, in order, each block reading
                the previous one's output (or no forward ran at all).
        """
        self.remove()
        self._finished = True
        traces = self.traces
        for trace in traces:
            if trace.problem is None and trace.calls != list(range(len(trace.blocks))):
                trace.problem = f"ran blocks {trace.calls} of {len(trace.blocks)}"
        valid = [t for t in traces if t.problem is None]
        if not valid:
            tried = "; ".join(f"{t.path or '<root>'}: {t.problem}" for t in traces)
            raise ResidualDiscoveryError(
                f"no block stack of {type(self.model).__name__} ran in sequence (each block "
                f"once, in order, reading the previous block's output): {tried}"
            )
        best = max(valid, key=lambda t: (t.has_norms, len(t.blocks), t.finish_order))
        return _layout(best, [t for t in valid if t is not best])


def _names(paths: list[str], limit: int = 4) -> str:
    more = f", ... ({len(paths)} in all)" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


def _points(trace: _StackTrace, blocks: list[str], style: str) -> list[ResidualPoint]:
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
        points.append(ResidualPoint(name, module, where, sublayer, k, tuple(p.readers)))
    return points


def _notes(
    trace: _StackTrace,
    styles: list[str],
    points: list[ResidualPoint],
    others: list[_StackTrace],
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


def _layout(trace: _StackTrace, others: list[_StackTrace]) -> ResidualLayout:
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
