"""Hooking tapped tensors into float64 accumulators: registered once, gated, masked, fail-open.

A :class:`TapSet` owns every hook normscope adds to a model. Each hook reads a plain Python
flag first (:attr:`Gate.open`) and returns at once while it is closed: no device work, no host
sync. On an eager model a family may also take the hooks off between its sampled windows
(:meth:`TapSet.unhook`, :meth:`TapSet.hook`), so that an unsampled forward pays nothing, not
even PyTorch's hooked-call path. torch.compile needs them fixed instead: registered before
compiling, never added or removed after. Under compile the gate check is traced (dynamo guards
on it: one graph with the gate open, one closed, both cached) and the fold itself is excluded
from the graph (``torch.compiler.disable``).

On a sampled forward a hook folds its tensor's rows into its accumulator (a
:class:`StreamingCovariance` unless the tap was added with another, such as the sign–magnitude
family's :class:`~normscope.functional.moments.DiagonalMoment`: see :class:`Accumulator`) on the
tensor's own device, with the batch's padding mask when the caller supplied one
(:meth:`Gate.sampling`). A forward re-run by activation checkpointing (inside backward) is
skipped, so no row is counted twice. If a hook raises, it disables that module's taps alone,
warns once naming it (or hands the failure to the set's ``on_fail``), and training goes on. The
residual points' taps fold through a :class:`~normscope.taps.hooks.PointChain`
(:meth:`TapSet.chain_points`): one row subset per forward for all of them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from einops import rearrange
from torch import nn

from normscope._common import warn_disabled
from normscope.functional.covariance import StreamingCovariance, pick_rows

__all__ = [
    "InertCopy",
    "batch_mask",
    "call_model",
    "Accumulator",
    "Gate",
    "PointChain",
    "Tap",
    "TapSet",
    "compiled",
    "eager_forwards",
    "in_backward_recompute",
    "tap_input",
    "tap_output",
]


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


def in_backward_recompute() -> bool:
    """True while autograd runs a backward pass (activation checkpointing recomputes forwards
    there). Wraps a private PyTorch API; if it disappears, nothing is treated as a recompute."""
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # pragma: no cover - depends on the torch build
        return False


class Gate:
    """The one flag every hook reads first. Flip it only between steps, never inside a forward."""

    def __init__(self) -> None:
        self.open = False
        self.mask: torch.Tensor | None = None
        # the batch's sources (normscope.taps.sources.SourceLabels), for the per-source reads
        self.sources: Any = None

    @contextlib.contextmanager
    def sampling(self, mask: torch.Tensor | None = None, sources: Any = None) -> Iterator[None]:
        """Open the gate for the forwards run inside the block, with an optional padding mask of
        shape ``(batch, tokens)`` (non-zero keeps a row) and the batch's
        :class:`~normscope.taps.sources.SourceLabels`."""
        previous = (self.open, self.mask, self.sources)
        self.open, self.mask, self.sources = True, mask, sources
        try:
            yield
        finally:
            self.open, self.mask, self.sources = previous


class Accumulator(Protocol):
    """What a tap folds its rows into: :class:`StreamingCovariance`, or
    :class:`~normscope.functional.moments.DiagonalMoment`, or anything with these members."""

    dim: int
    device: torch.device

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None: ...

    def reset(self) -> None: ...

    def to(self, device: torch.device | str) -> Any: ...

    def memory_bytes(self) -> int: ...


@dataclass
class Tap:
    """One tapped tensor: the input or output of one module, and its accumulator."""

    module_name: str
    where: str  # "input" | "output"
    dim: int
    accumulator: Any  # an Accumulator; StreamingCovariance unless TapSet.add(make=...)
    failed: str | None = None
    seen_shapes: set[tuple[int, ...]] = field(default_factory=set)

    @property
    def key(self) -> tuple[str, str]:
        return (self.module_name, self.where)


class TapSet:
    """Every hook normscope adds to one model, keyed by ``(module path, "input" | "output")``.

    Args:
        model: the model to tap.
        gate: the shared :class:`Gate`; hooks do nothing while it is closed.
        max_rows: rows kept per tap per forward (uniform, seeded); ``None`` keeps all.
        seed: seed of the row subsampling.
        on_fail: called as ``on_fail(tap, reason)`` when a tap fails (after its module's taps
            are disabled and reset) instead of the set's own warning; the caller warns.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from normscope.taps.hooks import Gate, TapSet
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
        >>> taps = TapSet(model, Gate())
        >>> tap = taps.add("1", "output", dim=8)
        >>> with taps.gate.sampling():
        ...     _ = model(torch.randn(32, 4))
        >>> tap.accumulator.count
        32
        >>> taps.remove()
    """

    def __init__(
        self,
        model: nn.Module,
        gate: Gate | None = None,
        *,
        max_rows: int | None = None,
        seed: int = 0,
        on_fail: Callable[[Tap, str], None] | None = None,
    ) -> None:
        self.model = model
        self.gate = gate if gate is not None else Gate()
        self.max_rows = max_rows
        self.seed = seed
        self.on_fail = on_fail
        self.taps: dict[tuple[str, str], Tap] = {}
        self._handles: dict[tuple[str, str], Any] = {}
        self.chain: PointChain | None = None  # the residual points: the same rows
        # the hooks hold this set weakly: once its owner (a monitor) is gone, the set is
        # collected and this removes every hook it left on the model
        weakref.finalize(self, _remove_handles, self._handles)

    def add(
        self,
        module_name: str,
        where: str,
        dim: int,
        *,
        make: Callable[[int, torch.device], Accumulator] | None = None,
    ) -> Tap:
        """Tap the input (``where="input"``) or output of ``module_name``; idempotent per key
        (after :meth:`remove`, adding a key again registers its hook again, same accumulator).

        ``make(dim, device)`` builds the tap's accumulator; default a :class:`StreamingCovariance`
        with this set's ``max_rows`` and a seed of its own."""
        if where not in ("input", "output"):
            raise ValueError(f"TapSet.add: where must be 'input' or 'output', got {where!r}")
        key = (module_name, where)
        module = self.model.get_submodule(module_name)
        tap = self.taps.get(key)
        if tap is None:
            # Accumulators are created now, on the module's parameter device, so that every rank
            # of a distributed run holds the same set of them (a collective over a set that
            # differs between ranks would hang). They follow the activations if those move.
            device = _module_device(module, self.model)
            if make is None:
                acc = StreamingCovariance(
                    dim, device=device, max_rows=self.max_rows, seed=self.seed + len(self.taps)
                )
            else:
                acc = make(dim, device)
            tap = self.taps[key] = Tap(module_name, where, dim, acc)
        if key not in self._handles:
            self._register(tap, module)
        return tap

    def _register(self, tap: Tap, module: nn.Module | None = None) -> None:
        if module is None:
            module = self.model.get_submodule(tap.module_name)
        hook = _TapHook(self, tap)
        if tap.where == "input":
            handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        else:
            handle = module.register_forward_hook(hook)
        self._handles[tap.key] = handle

    @property
    def hooked(self) -> bool:
        """Whether any of this set's hooks is registered on the model."""
        return bool(self._handles)

    def hook(self) -> None:
        """Register again the hook of every tap whose hook is not registered (after
        :meth:`unhook`; a failed tap stays off). Idempotent and cheap: one
        ``register_forward_(pre_)hook`` per missing tap, no device work. Hooks added again
        run after any the model got since they were first added."""
        for key, tap in self.taps.items():
            if key not in self._handles and tap.failed is None:
                self._register(tap)

    def unhook(self) -> None:
        """Take every hook off the model, keeping the taps, their accumulators and the open
        window's rows (:meth:`hook` puts them back). Never on a ``torch.compile``d model:
        dynamo guards on the hooks, so adding or removing them recompiles."""
        _remove_handles(self._handles)

    def chain_points(
        self,
        taps: list[Tap],
        *,
        max_rows: int | None | str = "same",
        seed: int | None = None,
    ) -> PointChain:
        """Make ``taps`` (residual points, in forward order) fold the same rows each forward
        (:class:`~normscope.taps.hooks.PointChain`; defaults: this set's ``max_rows``, ``seed``)."""
        self.chain = PointChain(
            taps,
            max_rows=self.max_rows if max_rows == "same" else max_rows,
            seed=self.seed if seed is None else seed,
        )
        return self.chain

    # Under torch.compile the hooks are traced: dynamo guards on the gate (two cached graphs,
    # open and closed; no recompile per step) and breaks the graph here, so that the fold runs
    # eagerly, in float64, exactly as without compile (tests/scaleout/test_compile.py).
    @torch.compiler.disable
    def _fold(self, tap: Tap, x: torch.Tensor | None) -> None:
        if in_backward_recompute():
            return
        try:
            if x is None or x.shape[-1] != tap.dim:
                shape = None if x is None else tuple(x.shape)
                raise ValueError(
                    f"expected a tensor of width {tap.dim} at the {tap.where} of "
                    f"{tap.module_name!r}, got {shape}"
                )
            mask = self.gate.mask
            if mask is not None and tuple(mask.shape) != tuple(x.shape[:-1]):
                mask = None  # a tensor not laid out (batch, tokens, d): no padding to skip
            if self.chain is not None and tap.key in self.chain:
                # one row subset for every residual point (and its sources' accumulators)
                self.chain.fold(tap, x, mask, self.gate.sources)
                return
            if x.device != tap.accumulator.device:
                tap.accumulator.to(x.device)
            tap.accumulator.update(x, mask=mask)
        except Exception as err:  # a monitor must never break the forward pass
            self._fail_module(tap, f"{type(err).__name__}: {err}")

    def _fail_module(self, tap: Tap, reason: str) -> None:
        """Disable every tap of ``tap``'s module (its input and output read one layer), forget
        their partial window, and warn once, naming the module and why."""
        siblings = [t for t in self.taps.values() if t.module_name == tap.module_name]
        for t in siblings:
            if t.failed is None:
                t.failed = reason
            try:
                t.accumulator.reset()  # a half-filled window would be read as if it were whole
            except Exception:  # noqa: BLE001 - still fail open
                pass
        if self.on_fail is not None:
            self.on_fail(tap, reason)
            return
        where = " and ".join(sorted({t.where for t in siblings}))
        warn_disabled(
            f"the tap on the {where} of {tap.module_name!r}",
            reason,
            goes_on="the other layers are still read",
            stacklevel=3,
        )

    def reset(self) -> None:
        """Start a new window: every accumulator forgets its rows."""
        for tap in self.taps.values():
            tap.accumulator.reset()
        if self.chain is not None:
            self.chain.reset()

    def remove(self) -> None:
        """Remove every hook this set registered (the accumulators stay readable; :meth:`add`
        registers a key's hook again)."""
        _remove_handles(self._handles)

    def __len__(self) -> int:
        return len(self.taps)

    def memory_bytes(self) -> int:
        """Bytes held by the accumulators (a covariance's co-moment: ``8 d^2``)."""
        return sum(t.accumulator.memory_bytes() for t in self.taps.values())


def _remove_handles(handles: dict[tuple[str, str], Any]) -> None:
    for handle in handles.values():
        handle.remove()
    handles.clear()


def _inert(*_args: Any) -> None:
    """What a pickled or copied tap hook becomes: nothing (the copy of a model is not watched)."""
    return None


def _inert_hook() -> Any:
    """Unpickling a tap hook gives :func:`_inert`."""
    return _inert


class InertCopy:
    """Base of a normscope hook that pickles and deep-copies as a hook doing nothing, so a
    hooked model can be saved with ``torch.save(model)``, copied (an EMA teacher made by
    ``deepcopy``) or exported whole, and the copy is never watched."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple]:
        return (_inert_hook, ())

    def __deepcopy__(self, memo: dict) -> Any:
        return _inert


class _TapHook(InertCopy):
    """One tap's forward (pre-)hook. It holds its :class:`TapSet` weakly and pickles (and
    deep-copies) as :func:`_inert` (:class:`InertCopy`)."""

    __slots__ = ("_set", "tap", "_input")

    def __init__(self, taps: TapSet, tap: Tap) -> None:
        self._set = weakref.ref(taps)
        self.tap = tap
        self._input = tap.where == "input"

    def __call__(self, module: nn.Module, args: tuple, extra: Any) -> None:
        taps = self._set()
        if taps is None or not taps.gate.open or self.tap.failed is not None:
            return None
        # a pre-hook (with_kwargs) gets (module, args, kwargs), a post-hook (module, args, out)
        taps._fold(self.tap, tap_input(args, extra) if self._input else tap_output(extra))
        return None


def _module_device(module: nn.Module, model: nn.Module) -> torch.device:
    for source in (module, model):
        for p in source.parameters():
            return p.device
        for b in source.buffers():
            return b.device
    return torch.device("cpu")


def compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a submodule is ``torch.compile``d: Lightning's
    ``trainer.fit(torch.compile(model))``, ``self.model = torch.compile(...)`` (an
    ``OptimizedModule``) or ``module.compile()`` in place.

    Why it matters: dynamo caches the graph of the first compiled forward, and a forward traced
    with the gate open breaks its graph at every hooked module (the fold runs eagerly). Traced
    closed first, the model compiles whole and the open gate adds a second, cached graph for the
    sampled steps only; traced open first, the broken graph is what every step runs. So on a
    compiled model the baseline window is the second optimiser step, not the first."""
    if getattr(module, "_compiler_ctx", None) is not None:
        return True
    optimized = getattr(torch._dynamo, "OptimizedModule", ())
    return any(
        isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


@contextlib.contextmanager
def eager_forwards() -> Iterator[None]:
    """Run the forwards inside eagerly, even those of a ``torch.compile``d model: the monitor's
    own forwards (the residual discovery forward, whose temporary hooks compare tensor
    identities) must never be traced by dynamo, nor add graphs to the training cache."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    if set_stance is None:  # pragma: no cover - older torch
        with torch._dynamo.config.patch(disable=True):
            yield
        return
    with set_stance("force_eager"):
        yield


# ============================================================================
# The residual points as one chain: the same sampled rows at every point.
#
# The ``sigma_min`` step between two points compares their second moments, which is a statement
# about one stream only on the *same* rows, so the points' taps must not subsample independently.
# A :class:`PointChain` draws one row subset per forward, at ``p_0`` (seeded), and every later
# point of that forward keeps the same rows (masks are the gate's, the same for all points); each
# point's accumulator then sees at most ``max_rows`` rows and does not subsample again.
#
# :class:`~normscope.taps.hooks.TapSet` calls :meth:`PointChain.fold` from its hook, instead of
# the tap's own ``accumulator.update``, for the taps of the chain.
# ============================================================================


class PointChain:
    """Same-row folding of the residual point taps, in forward order.

    Args:
        taps: the points' :class:`~normscope.taps.hooks.Tap` objects, ``p_0`` first.
        max_rows: rows kept per forward (one seeded subset for every point); None keeps all.
        seed: seed of the subset.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from normscope.taps.hooks import TapSet
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Identity())
        >>> taps = TapSet(model)
        >>> chain = taps.chain_points([taps.add(n, "input", 4) for n in ("1", "2")], max_rows=8)
        >>> with taps.gate.sampling():
        ...     _ = model(torch.randn(32, 4))
        >>> [t.accumulator.count for t in chain.taps]
        [8, 8]
    """

    def __init__(
        self,
        taps: Sequence,
        *,
        max_rows: int | None = None,
        seed: int = 0,
    ) -> None:
        self.taps = list(taps)
        self.index = {t.key: k for k, t in enumerate(self.taps)}
        if len(self.index) != len(self.taps):
            raise ValueError("PointChain: every point needs a tap of its own")
        self.max_rows = max_rows
        self.seed = seed
        self.split = None  # normscope.taps.sources.SourceSplit: per-source accumulators
        self._generator: torch.Generator | None = None
        self._forward = 0
        self._pick: torch.Tensor | None = None
        self._pick_rows = -1
        self._broken = False  # this forward's points did not see the same rows

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self.index

    def fold(self, tap, x: torch.Tensor, mask: torch.Tensor | None, sources=None) -> None:
        """Fold ``x`` (``(..., d)``) into ``tap``'s accumulator on this forward's row subset.
        Raises on a bad tensor (the caller disables the tap)."""
        k = self.index[tap.key]
        rows = rearrange(x.detach(), "... d -> (...) d")
        keep = (
            rearrange(mask.detach(), "... -> (...)").to(rows.device) != 0
            if mask is not None
            else None
        )
        n = rows.shape[0]
        split = self.split if sources is not None else None
        split = split if split is not None and split.failed is None else None
        codes = (
            sources.row_codes(tuple(x.shape[:-1]), rows.device)
            if split is not None and sources.codes is not None
            else None
        )
        if k == 0:
            self._forward += 1
            self._broken = False
            self._draw(n, rows.device, keep)
        elif n != self._pick_rows:  # another row count than p_0's: not the same tokens
            self._broken = True
            self._draw(n, rows.device, keep)
        if self._pick is not None:
            # index_select, not rows[pick]: 5x faster on the CPU (d = 128, 1,024 of 2,048 rows)
            rows = rows.index_select(0, self._pick)
            keep = keep.index_select(0, self._pick) if keep is not None else None
            codes = codes.index_select(0, self._pick) if codes is not None else None
        if rows.device != tap.accumulator.device:
            tap.accumulator.to(rows.device)
        tap.accumulator.update(rows, mask=keep)
        if split is not None:
            try:
                split.fold(k, rows, keep, codes, sources)
            except Exception as err:  # noqa: BLE001 - the per-source reads only
                split.failed = f"{type(err).__name__}: {err}"
                warn_disabled(
                    "the per-source accumulation",
                    split.failed,
                    goes_on="the pooled reads go on",
                    stacklevel=4,
                )

    def _draw(self, n: int, device: torch.device, keep: torch.Tensor | None = None) -> None:
        self._pick_rows = n
        if self.max_rows is None or n <= self.max_rows:
            self._pick = None
            return
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        self._pick = pick_rows(n, self.max_rows, keep, self._generator)

    def reset(self) -> None:
        """Start a new window (the subset generator keeps its position)."""
        if self.split is not None:
            self.split.reset()


# ============================================================================
# What a forward of the model is given, as a user's loop gives it.
# ============================================================================

_NOT_INPUTS = ("labels", "label", "targets")


def call_model(model: nn.Module, batch: Any, drop: tuple[str, ...] = ()) -> Any:
    """Run ``model`` on a batch the way a user would: a dict as keyword arguments (labels and
    the ``drop`` fields left out: a ``sources=`` field name), a tuple/list by its first element
    (``(inputs, targets)``), a tensor as is."""
    if isinstance(batch, dict):
        skip = (*_NOT_INPUTS, *drop)
        return model(**{k: v for k, v in batch.items() if k not in skip})
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    return model(batch)


def batch_mask(batch: Any) -> torch.Tensor | None:
    """The padding mask a batch carries (``attention_mask`` of a dict batch), else None."""
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            return mask
    return None
