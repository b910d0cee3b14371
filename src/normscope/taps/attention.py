"""Reading the largest pre-softmax logit of each attention module on sampled forwards.

The logit is made inside an attention module's forward and kept nowhere, so it cannot be had
from a hooked tensor. On a sampled forward (the :class:`~normscope.taps.hooks.Gate` open), a
pre-hook on each attention module pushes a :class:`torch.overrides.TorchFunctionMode` for the
duration of that module's forward alone; the mode sees the module's calls of

* ``torch.nn.functional.scaled_dot_product_attention`` (nanoGPT, Hugging Face's ``sdpa``
  attention, Llama's with its grouped keys): the logits are re-formed from its query and key
  (after RoPE or qk-layernorm, as the attention sees them) with its mask
  (:func:`~normscope.functional.attention.sdpa_logit_max`), at the cost of one ``q k^T`` --
  of the queries at a sample of positions when the batch holds more token rows than the read's
  row budget (``max_rows``: every key, ``ceil(budget / batch)`` query positions);
* ``softmax`` (``torch.softmax``, ``Tensor.softmax``, ``F.softmax``: hand-written attention,
  Hugging Face's ``eager``): its input is the logits, mask included
  (:func:`~normscope.functional.attention.logit_max`), at the cost of one reduction,

leaving out the query rows the batch's padding mask drops (:meth:`Gate.sampling`'s ``mask``,
when the logits are laid out by the batch's tokens), and keeps each module's running maximum
over the window as a float64 0-d tensor on the device:
no host sync until the read. Between sampled steps the hook returns at its first line. A
forward traced by ``torch.compile`` is not read (the mode cannot see inside a compiled graph):
the module's key is NaN and ``dd/attn_modules_read`` says how many modules were read. A forward
re-run by activation checkpointing is skipped. ``nn.MultiheadAttention`` forms its logits inside
one fused call and is not read.
"""

from __future__ import annotations

import inspect
import math
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from normscope._common import warn_disabled
from normscope.functional.attention import (
    logit_max,
    mha_logit_max,
    query_rows,
    sample_positions,
    sdpa_logit_max,
)
from normscope.taps.hooks import Gate, in_backward_recompute

__all__ = ["ATTENTION_CLASS", "AttentionLogits", "find_attention_modules"]

#: class names taken for attention modules by ``attention="auto"`` (innermost match only)
ATTENTION_CLASS = re.compile(r"att(?:n|ention)", re.IGNORECASE)

_SOFTMAX = (torch.softmax, torch.Tensor.softmax, F.softmax, torch.special.softmax)
_SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_MHA = F.multi_head_attention_forward
_MHA_ARGS = tuple(inspect.signature(_MHA).parameters)
_READ = (_SDPA, _MHA, *_SOFTMAX)


def find_attention_modules(model: nn.Module, attention: str | Sequence[str] | None) -> list[str]:
    """The attention modules to read: ``"auto"`` takes every module whose class name contains
    ``attn`` or ``attention`` (any case) and holds no other such module (Hugging Face's
    ``BertAttention`` wraps ``BertSelfAttention``: the inner one is read); a list names them by
    path; ``None`` or ``()`` reads none.

    Raises:
        ValueError: ``attention`` is neither, or names a module the model does not have.

    Example::

        >>> from torch import nn
        >>> class SelfAttention(nn.Module): ...
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.attn, self.mlp = SelfAttention(), nn.Linear(4, 4)
        >>> find_attention_modules(nn.ModuleList([Block(), Block()]), "auto")
        ['0.attn', '1.attn']
    """
    if attention is None:
        return []
    if isinstance(attention, str):
        if attention != "auto":
            raise ValueError(
                f'attention must be "auto", a list of module paths or None, got {attention!r}'
            )
        found = [
            name
            for name, module in model.named_modules()
            if name and ATTENTION_CLASS.search(type(module).__name__)
        ]
        return [n for n in found if not any(o.startswith(n + ".") for o in found)]
    names = list(attention)
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"attention: module paths must be strings, got {name!r}")
        try:
            model.get_submodule(name)
        except AttributeError as err:
            raise ValueError(f"attention: the model has no module {name!r}") from err
    return names


class AttentionLogits:
    """The largest pre-softmax logit of each attention module over a window of sampled forwards.

    Args:
        model: the model.
        names: the attention modules' paths (:func:`find_attention_modules`).
        gate: the shared :class:`~normscope.taps.hooks.Gate`; nothing is read while it is closed.
        max_rows: the read's row budget per forward, in token rows (the tracker sets it to what
            a stream tap keeps): a scaled-dot-product call over more rows reads the queries of
            ``ceil(max_rows / batch)`` positions drawn anew each call (seeded, the same in
            every sequence and head) against every key. None reads every query. A softmax's
            input (the logits exist already) is read whole.
        seed: the seed of those draws.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from normscope.taps.attention import AttentionLogits
        >>> from normscope.taps.hooks import Gate
        >>> class Attention(nn.Module):
        ...     def forward(self, q, k):
        ...         return (q @ k.mT).softmax(-1)
        >>> model = Attention()
        >>> logits = AttentionLogits(model, [""], Gate())
        >>> with logits.gate.sampling():
        ...     _ = model(torch.eye(3) * 2, torch.eye(3) * 3)
        >>> logits.take()[""].item()
        6.0
        >>> logits.remove()
    """

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[str],
        gate: Gate,
        *,
        max_rows: int | None = None,
        seed: int = 0,
    ) -> None:
        self.names = list(names)
        self.gate = gate
        self.max_rows = max_rows
        self._positions = torch.Generator().manual_seed(seed)  # on the CPU: no device sync
        self.maxima: dict[str, torch.Tensor | None] = dict.fromkeys(self.names)
        self.calls: dict[str, int] = dict.fromkeys(self.names, 0)  # calls read this window
        self.failed: dict[str, str] = {}
        self.devices: dict[str, torch.device] = {}
        self._modes: dict[str, list[TorchFunctionMode]] = {n: [] for n in self.names}
        self._handles: list[Any] = []
        self._modules: dict[str, nn.Module] = {}
        for name in self.names:
            module = self._modules[name] = model.get_submodule(name)
            self.devices[name] = next(
                (p.device for p in module.parameters()),
                next((p.device for p in model.parameters()), torch.device("cpu")),
            )
        self.hook()
        weakref.finalize(self, _remove, self._handles)

    # ------------------------------------------------------------------ registration
    @property
    def hooked(self) -> bool:
        """Whether the hooks are registered on the model."""
        return bool(self._handles)

    def hook(self) -> None:
        """Register each module's pre-hook and forward hook (``always_call``), unless they are
        registered already (done at construction; again after :meth:`unhook`)."""
        if self._handles:
            return
        for name, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(_Enter(self, name)))
            self._handles.append(module.register_forward_hook(_Exit(self, name), always_call=True))

    def unhook(self) -> bool:
        """Take the hooks off the model between sampled windows (the maxima stay; :meth:`hook`
        puts them back). Not while a module's forward is being read: its forward hook must
        still end the read. Returns whether the hooks are off."""
        if any(self._modes.values()):
            return False
        _remove(self._handles)
        return True

    # ------------------------------------------------------------------ hooks
    def enter(self, name: str) -> None:
        """``name``'s pre-hook: on a sampled, eager, non-recomputed forward, start reading."""
        # first: traced by torch.compile, the hook is nothing at all (no guard on the gate or
        # the state below, so it adds no recompile; the mode could not see a compiled graph)
        if torch.compiler.is_compiling():
            return
        if not self.gate.open or name in self.failed or in_backward_recompute():
            return
        mode = _LogitMode(self, name)
        mode.__enter__()
        self._modes[name].append(mode)

    def exit(self, name: str) -> None:
        """``name``'s forward hook (also when the forward raised): stop reading."""
        if torch.compiler.is_compiling():
            return
        stack = self._modes.get(name)
        if stack:
            stack.pop().__exit__(None, None, None)

    def observe(self, name: str, func: Callable, args: tuple, kwargs: dict) -> None:
        """Fold one call's largest logit into ``name``'s maximum; a failure disables that
        module's read (one warning) and never touches the call itself."""
        if name in self.failed:
            return
        try:
            if func is _SDPA:
                bound = _bind(_SDPA_ARGS, args, kwargs)
                q = bound["query"]
                sequences = q.shape[0] if q.ndim >= 3 else 1
                value = sdpa_logit_max(
                    q,
                    bound["key"],
                    bound.get("attn_mask"),
                    bool(bound.get("is_causal", False)),
                    bound.get("scale"),
                    bool(bound.get("enable_gqa", False)),
                    query_mask=query_rows(self.gate.mask, q.shape[0], q.shape[-2]),
                    positions=sample_positions(
                        q.shape[-2], sequences, self.max_rows, self._positions
                    ),
                )
            elif func is _MHA:
                bound = _bind(_MHA_ARGS, args, kwargs)
                q = bound["query"]  # (L, N, E) or unbatched (L, E)
                batch = q.shape[1] if q.dim() == 3 else 1
                value = mha_logit_max(
                    bound["query"],
                    bound["key"],
                    bound["num_heads"],
                    bound["in_proj_weight"],
                    bound["in_proj_bias"],
                    bias_k=bound.get("bias_k"),
                    add_zero_attn=bool(bound.get("add_zero_attn", False)),
                    key_padding_mask=bound.get("key_padding_mask"),
                    attn_mask=bound.get("attn_mask"),
                    use_separate_proj_weight=bool(bound.get("use_separate_proj_weight", False)),
                    q_proj_weight=bound.get("q_proj_weight"),
                    k_proj_weight=bound.get("k_proj_weight"),
                    static_k=bound.get("static_k"),
                    is_causal=bool(bound.get("is_causal", False)),
                    query_mask=query_rows(self.gate.mask, batch, q.shape[0]),
                )
            else:
                x = args[0] if args else kwargs["input"]
                rows = query_rows(self.gate.mask, x.shape[0], x.shape[-2]) if x.ndim >= 3 else None
                value = logit_max(x, rows)
            best = self.maxima[name]
            self.maxima[name] = value if best is None else torch.maximum(best, value.to(best))
            self.calls[name] += 1
        except Exception as err:  # noqa: BLE001 - a monitor must never break the forward
            self.failed[name] = f"{type(err).__name__}: {err}"
            self.maxima[name] = None
            warn_disabled(
                f"the attention-logit read of {name!r}",
                self.failed[name],
                goes_on="the other reads go on",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ windows
    def take(self) -> dict[str, torch.Tensor | None]:
        """The window's maxima (None: the module ran no readable attention), and a new window."""
        out = self.maxima
        self.maxima = dict.fromkeys(self.names)
        self.calls = dict.fromkeys(self.names, 0)
        return out

    def reduce_(self) -> None:
        """All-reduce each module's maximum across ranks (a collective: call it on every rank,
        in step). A module no rank read holds -inf (read as NaN)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        for name in self.names:
            best = self.maxima[name]
            t = (
                best.clone()
                if best is not None
                else torch.full((), -math.inf, dtype=torch.float64, device=self.devices[name])
            )
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            # -inf where no rank read the module: the read says NaN for it (no host sync here)
            self.maxima[name] = t

    def state_dict(self) -> dict[str, Any]:
        """The open window's maxima (on the CPU; None where nothing was read)."""
        return {n: (None if v is None else v.detach().cpu()) for n, v in self.maxima.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the maxima of the modules this set reads (others are ignored)."""
        for name, value in state.items():
            if name in self.maxima:
                self.maxima[name] = (
                    None
                    if value is None
                    else torch.as_tensor(value, dtype=torch.float64).to(self.devices[name])
                )

    def remove(self) -> None:
        """Remove the hooks (the maxima stay readable)."""
        _remove(self._handles)


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by parameter name (positional ones named from ``names``)."""
    return {**dict(zip(names, args)), **kwargs}


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class _LogitMode(TorchFunctionMode):
    """Active for one attention module's forward: passes every call through, reading softmax
    inputs and scaled-dot-product queries and keys on the way."""

    def __init__(self, owner: AttentionLogits, name: str) -> None:
        super().__init__()
        self.owner = weakref.ref(owner)
        self.name = name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READ:
            owner = self.owner()
            if owner is not None:
                owner.observe(self.name, func, args, kwargs)
        return func(*args, **kwargs)


def _inert_attention_hook() -> Callable[..., None]:
    """Unpickling an attention hook gives a hook that does nothing."""
    return _nothing


def _nothing(*_args: Any) -> None:
    return None


class _Enter:
    """An attention module's pre-hook; holds its :class:`AttentionLogits` weakly, pickles and
    deep-copies as a hook that does nothing (a copied model is not watched)."""

    __slots__ = ("_owner", "name")

    def __init__(self, owner: AttentionLogits, name: str) -> None:
        self._owner = weakref.ref(owner)
        self.name = name

    def __call__(self, module: nn.Module, *args: Any) -> None:
        owner = self._owner()
        if owner is not None:
            self.act(owner)
        return None

    def act(self, owner: AttentionLogits) -> None:
        owner.enter(self.name)

    def __reduce__(self) -> tuple[Any, tuple]:
        return (_inert_attention_hook, ())

    def __deepcopy__(self, memo: dict) -> Any:
        return _nothing


class _Exit(_Enter):
    """An attention module's forward hook (``always_call``: also when the forward raises)."""

    __slots__ = ()

    def act(self, owner: AttentionLogits) -> None:
        owner.exit(self.name)
