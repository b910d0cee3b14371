"""Finding the residual stream: the points ``p_0 .. p_L`` of docs/metrics.md §1.4, from evidence.

Class names do not say where the stream is (docs/monitors.md, "Finding the residual stream"): a
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

from collections.abc import Callable, Sequence

import torch
from torch import nn

from normscope.taps.hooks import tap_input, tap_output
from normscope.taps.layout_builder import build_layout
from normscope.taps.norms import NormLayer, find_norm_layers
from normscope.taps.residual_layout import ResidualDiscoveryError, ResidualLayout, ResidualPoint
from normscope.taps.stack_trace import StackTrace
from normscope.taps.stacks import same_class_stacks

__all__ = [
    "ResidualDiscovery",
    "ResidualDiscoveryError",
    "ResidualLayout",
    "ResidualPoint",
    "find_residual_points",
    "tap_input",
    "tap_output",
]


def _candidate_stacks(model: nn.Module, norm_ids: set[int]) -> list[StackTrace]:
    """Every ModuleList/Sequential of same-class modules; those holding norms, if any do."""
    found = []
    for path, mod in same_class_stacks(model):
        blocks = [(f"{path}.{n}" if path else n, c) for n, c in mod.named_children()]
        norms_inside = sum(id(m) in norm_ids for _, c in blocks for m in c.modules())
        found.append(StackTrace(path, blocks, norms_inside))
    if any(t.has_norms for t in found):
        found = [t for t in found if t.has_norms]
    return found


def _guarded(traces: list[StackTrace], fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` as a hook that never raises into the forward (it may be a training forward): a
    failure becomes every trace's problem, and discovery reports it at ``finish()``."""

    def hook(*args: object, **kwargs: object) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - told at finish(), never to the forward
            for trace in traces:
                trace.problem = trace.problem or f"a discovery hook failed ({exc!r})"

    return hook


def _install(traces: list[StackTrace], norms: Sequence[NormLayer]) -> list:
    """Register the temporary hooks; return their handles."""
    norm_path = {id(n.module): n.name for n in norms}
    modules: dict[int, nn.Module] = {id(n.module): n.module for n in norms}
    inside: dict[int, list[tuple[StackTrace, int, str]]] = {}
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
        return build_layout(best, [t for t in valid if t is not best])
