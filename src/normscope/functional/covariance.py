"""Streaming float64 covariance: the accumulator every normscope read is taken from.

docs/metrics.md §0. A tapped tensor of shape ``(..., d)`` becomes rows ``(N, d)``. Each batch is
reduced to ``(n_b, mu_b, M_b)`` -- its row count, mean and *centred* co-moment
``M_b = sum (x - mu_b)(x - mu_b)^T`` -- and folded into the running state with Chan's pairwise
update (:func:`~normscope.functional.comoment.merge_comoment_`)::

    delta = mu_b - mu_a
    n     = n_a + n_b
    mu    = mu_a + delta * n_b / n
    M     = M_a + M_b + delta delta^T * n_a n_b / n

Why not raw sums of ``x`` and ``x x^T``: the covariance from raw sums is a difference of two
numbers of size ``mu^2`` and loses ``eps * (mu / sigma)^2`` of relative accuracy. Residual
streams carry channels with means of 1e4 and spreads of 1: a raw float64 sum keeps about eight
digits there, the centred co-moment keeps them all (``tests/functional/test_covariance.py``
shows both side by side).

Design choices, written down because they matter inside a training step:

* **No host sync in ``update``.** Masked-out rows and rows holding NaN/Inf are given weight 0
  instead of being removed by boolean indexing (which would need their count on the host).
  The row count lives on the device as a float64 scalar (exact up to 2**53 rows).
* **Half the flops.** ``M_b`` is symmetric: the fold (``functional/fold.py``) forms only its
  upper blocks and mirrors the rest when the matrix is read; 1.2-1.9x the rows/s of one full
  GEMM (``benchmarks/RESULTS.md``).
* **A diagonal-only mode** (``full=False``, :meth:`StreamingCovariance.set_full`): a window
  whose read needs no matrix (the cheap tier, docs/costs.md "Tiers") folds ``(n, mu, diag M)``
  only, ``O(N d)`` per update instead of ``O(N d^2)``, by the same Chan merge on the diagonal;
  the full-matrix accessors then raise.
* **A ``torchmetrics.Metric`` with a sync of its own.** The default ``sync`` gathers every
  rank's state (``world x 8 d^2`` bytes); this one's ``dist_sync_fn`` merges the states with
  :func:`~normscope.functional.comoment.all_reduce_comoment_`, the co-moment summed in place
  (docs/design.md, "Dependencies", has the measured memory and per-update cost).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from einops import rearrange
from torchmetrics import Metric

from normscope.functional._rows import check_dim, check_rows
from normscope.functional.comoment import all_reduce_comoment_, merge_comoment_
from normscope.functional.fold import add_gram_, centre_rows, fold_plan, mirror_upper_

__all__ = [
    "StreamingCovariance",
    "fetch_counts",
    "host_array",
    "on_device",
    "pick_rows",
]


def pick_rows(
    n: int, k: int, keep: torch.Tensor | None, generator: torch.Generator
) -> torch.Tensor:
    """Indices of ``k`` of ``n`` rows, uniform at random (seeded by ``generator``), the rows
    ``keep`` marks first: a row masked out (padding) is picked only when fewer than ``k`` rows
    are kept, so a row budget goes to real rows. No host sync (random keys, masked-out rows'
    shifted by 1, the ``k`` smallest).

    Example::

        >>> g = torch.Generator().manual_seed(0)
        >>> keep = torch.tensor([False, True, False, True, True, False])
        >>> sorted(pick_rows(6, 3, keep, g).tolist())
        [1, 3, 4]
    """
    if keep is None:
        return torch.randperm(n, generator=generator, device=generator.device)[:k]
    key = torch.rand(n, generator=generator, device=generator.device, dtype=torch.float32)
    key = key + (~keep).to(key.dtype)
    return torch.topk(key, k, largest=False, sorted=False).indices


def _zeros(dim: int, device: torch.device, full: bool = True) -> dict[str, torch.Tensor]:
    """The empty state as broadcast views of one zero (what ``reset`` clones): 8 bytes held.
    ``full=False``: the co-moment's diagonal ``(d,)`` instead of the matrix."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return {
        "_n": zero,
        "_mean": zero.expand(dim),
        "_comoment": zero.expand(dim, dim) if full else zero.expand(dim),
        "_rejected": torch.zeros((), dtype=torch.int64, device=device),
    }


# What update and a read write, every call: states and plain flags (StreamingCovariance.__setattr__)
_PLAIN = frozenset(
    {"_n", "_mean", "_comoment", "_rejected", "_stale_lower", "_computed", "_update_count"}
)


def _merged(stacked: torch.Tensor) -> torch.Tensor:
    # Every state's dist_reduce_fx: the sync function has merged the states already and
    # Metric.sync stacked its one-element answer. A gathered stack cannot be merged state by
    # state (the co-moments need the means): refuse it.
    if stacked.shape[0] != 1:
        raise ValueError(
            "StreamingCovariance: states merge by Chan's update through the accumulator's own "
            "dist_sync_fn, not by a gather; call sync() without dist_sync_fn"
        )
    return stacked[0]


class StreamingCovariance(Metric):
    """Float64 running mean and centred co-moment of a stream of ``d``-dimensional rows: a
    ``torchmetrics.Metric`` (``compute`` is the covariance; persistent states; ``.to()``).

    Args:
        dim: the row width ``d`` (the last dimension of every tensor passed to :meth:`update`).
        device: where the float64 state lives; default the CPU. Put it on the activation's
            device: the rank-k update then runs where the rows already are.
        max_rows: if set, each :meth:`update` keeps a uniform random subset of at most this many
            rows (before masking), drawn from a generator seeded with ``seed``.
        seed: seed of the subsampling generator.
        full: fold the whole co-moment (default); ``False``: its diagonal only (:meth:`set_full`).
        fold: how ``X^T X`` of a batch is formed (``functional/fold.py``): ``"auto"`` (default:
            the measured fastest for ``dim`` and the device), ``"gemm"`` (one full GEMM),
            ``"panels"`` (upper-triangle panel GEMMs, about half the flops) or ``"syrk"``
            (numpy's BLAS syrk; CPU only, opt-in: set ``OPENBLAS_NUM_THREADS``, its pool is not
            torch's).

    Example::

        >>> import torch
        >>> from normscope.functional import StreamingCovariance
        >>> acc = StreamingCovariance(4)
        >>> acc.update(torch.randn(8, 16, 4))          # (batch, tokens, d): 128 rows
        >>> acc.update(torch.randn(3, 4), mask=torch.tensor([1, 0, 1]))  # 2 more rows
        >>> acc.count
        130
        >>> acc.compute().shape                         # == acc.covariance() on one process
        torch.Size([4, 4])
        >>> acc.comoment_diagonal().shape               # in either mode
        torch.Size([4])
    """

    full_state_update = False  # merge_state and forward fold a state in by _reduce_states
    is_differentiable = False
    higher_is_better = None

    def __init__(
        self,
        dim: int,
        device: torch.device | str | None = None,
        *,
        max_rows: int | None = None,
        seed: int = 0,
        full: bool = True,
        fold: str = "auto",
    ) -> None:
        check_dim(dim, "StreamingCovariance")
        if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
            raise ValueError(
                f"StreamingCovariance: max_rows must be None or a positive int, got {max_rows!r}"
            )
        super().__init__(dist_sync_fn=self._sync_state)
        self.dim, self.max_rows, self.seed, self.fold = dim, max_rows, seed, fold
        self.full = bool(full)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self._plan = self._plan_on(device)
        self._device, self._dtype = device, torch.float64
        self._generator: torch.Generator | None = None
        for name in ("_n", "_mean", "_comoment", "_rejected"):
            # add_state keeps a dense copy of its default (8 d^2 bytes more for the co-moment):
            # a placeholder here, the empty state as broadcast zeros below, cloned by reset()
            placeholder = torch.zeros(0, device=device)  # reset() keeps a state's device
            self.add_state(name, placeholder, dist_reduce_fx=_merged, persistent=True)
        self._defaults = _zeros(dim, device, self.full)
        self.reset()

    def _plan_on(self, device: torch.device) -> tuple[str, int]:
        if device.type == "mps":
            raise ValueError(
                "StreamingCovariance: Apple MPS has no float64; keep the accumulator on the CPU "
                "(device='cpu') and rows are copied there"
            )
        return fold_plan(self.dim, device, self.fold)

    def __setattr__(self, name: str, value: Any) -> None:
        # The attributes an update writes are plain (no parameter, buffer or module): past
        # nn.Module's checks, about a microsecond each on every update.
        if name in _PLAIN:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # torchmetrics makes `==` build a CompositionalMetric, which is always true: an accumulator
    # (a field of the Tap dataclass) compares by identity.
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every row (new zero tensors; the subsampling generator keeps its position)."""
        super().reset()
        self._stale_lower = False

    def set_full(self, full: bool) -> None:
        """Fold the whole co-moment (``True``) or only its diagonal (``False``: ``O(N d)`` per
        update; :meth:`comoment_diagonal`, :attr:`mean` and :attr:`count` answer, the matrix
        accessors raise). Call it when a window opens, before its first update: a change of
        mode discards the rows held (a reset); setting the mode it has is a no-op."""
        full = bool(full)
        if full != self.full:
            self.full = full
            self._defaults = _zeros(self.dim, self._device, full)
            self.reset()

    @property
    def count(self) -> int:
        """Rows accumulated so far (a host sync: call it at read time, not in a hook). Kept on
        the host until the state changes: a read asks for it many times, syncs once
        (:func:`fetch_counts` syncs once for many accumulators)."""
        return self._host_counts()[0]

    @property
    def rows_rejected(self) -> int:
        """Rows dropped because they held NaN or Inf (masked-out rows are not counted); a host
        sync kept as :attr:`count` is."""
        return self._host_counts()[1]

    def _counts_key(self) -> tuple:
        # the state tensors themselves and their in-place versions: any fold, merge, reduce,
        # reset or load changes one of them
        n, rejected = self._n, self._rejected
        return (n, n._version, rejected, rejected._version)

    def _host_counts(self) -> tuple[int, int]:
        key = self._counts_key()
        cached = getattr(self, "_counts_cache", None)
        if cached is None or not _same_state(cached[0], key):
            fetch_counts([self])
            cached = self._counts_cache
        return cached[1]

    @property
    def count_tensor(self) -> torch.Tensor:
        """The row count as a float64 device scalar (no host sync)."""
        return self._n

    @property
    def rejected_tensor(self) -> torch.Tensor:
        """:attr:`rows_rejected` as an int64 device scalar (no host sync)."""
        return self._rejected

    @property
    def mean(self) -> torch.Tensor:
        """The running mean ``mu``, float64, shape ``(d,)``."""
        return self._mean

    @property
    def comoment(self) -> torch.Tensor:
        """The centred co-moment ``M = sum (x - mu)(x - mu)^T``, float64, shape ``(d, d)``.

        The live state, complete at the time of reading: read it again after more updates (a
        panel fold writes only its upper blocks until the next read). Raises on a
        diagonal-only window (:meth:`set_full`).
        """
        return self._matrix("comoment")

    def comoment_diagonal(self) -> torch.Tensor:
        """``diag M = sum (x_j - mu_j)^2`` per column, float64 ``(d,)``, in either mode (the
        live state or a view of it; divide by :attr:`count` for the variances)."""
        return self._comoment.diagonal() if self.full else self._comoment

    def covariance(self) -> torch.Tensor:
        """Population covariance ``C = M / n`` (float64 ``(d, d)``); all NaN when ``n == 0``
        (``M`` is exactly 0 then: every fold of no rows adds zeros, so ``0 / 0``), one op and
        no host sync. Raises on a diagonal-only window."""
        return self._matrix("covariance") / self._n

    def second_moment(self) -> torch.Tensor:
        """Uncentred second moment ``S = C + mu mu^T`` (float64 ``(d, d)``)."""
        return self.covariance() + torch.outer(self._mean, self._mean)

    def compute(self) -> torch.Tensor:
        """:meth:`covariance` over the rows of every process (``Metric.compute``: a collective
        under ``torch.distributed``, this process's window kept for more updates)."""
        return self.covariance()

    # ----------------------------------------------------------------- update
    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Fold the rows of ``x`` (shape ``(..., d)``, any float dtype) into the state.

        Args:
            x: activations; every leading dimension is a row index (tokens, patches, ...).
            mask: optional, shape ``x.shape[:-1]``; rows where it is zero/False are skipped
                (padding). Bool, integer or float masks are accepted (non-zero keeps a row).

        Rows with a NaN or Inf entry are dropped and counted in :attr:`rows_rejected`.
        Nothing here reads a value back to the host.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"StreamingCovariance.update: expected a tensor, got {type(x).__name__}"
            )
        check_rows(x, mask, self.dim, "StreamingCovariance.update")
        if x.is_complex():
            raise TypeError(
                f"StreamingCovariance.update: complex rows are not supported ({x.dtype})"
            )
        rows = rearrange(x.detach(), "... d -> (...) d")
        keep = None
        if mask is not None:
            keep = rearrange(mask.detach(), "... -> (...)").to(rows.device) != 0
        if rows.shape[0] == 0:
            return
        if self.max_rows is not None and rows.shape[0] > self.max_rows:
            pick = pick_rows(rows.shape[0], self.max_rows, keep, self._gen(rows.device))
            # index_select, not rows[pick]: 5x faster on the CPU (d = 128, 1,024 of 2,048 rows)
            rows = rows.index_select(0, pick)
            keep = keep.index_select(0, pick) if keep is not None else None
        self._fold(rows, keep)

    def _fold(self, rows: torch.Tensor, keep: torch.Tensor | None) -> None:
        # functional/fold.py: a private float64 centred copy in a few cheap passes, then the
        # symmetric product at about half the GEMM's flops. Nothing read back to the host.
        # In-place adds where the value is the same: each attribute assignment on a Metric
        # (an nn.Module) costs about a microsecond.
        device = self._device
        rows = rows.to(device)
        keep = keep.to(device) if keep is not None else None
        x, n_b, mean_b, rejected = centre_rows(rows, keep)
        self._rejected.add_(rejected)
        kind, panel = self._plan
        if not self.full:  # diag(X^T X): x is this update's private buffer, squared in place
            self._comoment.add_(x.square_().sum(dim=0))
        elif add_gram_(self._comoment, x, kind, panel) and not self._stale_lower:
            self._stale_lower = True
        self._merge_moments(n_b, mean_b, None)

    def _full(self) -> torch.Tensor:
        # The co-moment state whole. The panel fold leaves the blocks left of the diagonal
        # stale: mirror them on a read (a Python flag, no host sync). Every other update keeps
        # the upper blocks right; a diagonal-only state is never stale.
        if self._stale_lower:
            mirror_upper_(self._comoment, self._plan[1])
            self._stale_lower = False
        return self._comoment

    def _matrix(self, what: str) -> torch.Tensor:
        if not self.full:
            raise RuntimeError(
                f"StreamingCovariance.{what}: this window folded the co-moment's diagonal only "
                "(full=False, a cheap-tier window); read comoment_diagonal(), mean and count, or "
                "call set_full(True) before the window's first update"
            )
        return self._full()

    def _merge_moments(
        self, n_b: torch.Tensor, mean_b: torch.Tensor, comoment_b: torch.Tensor | None
    ) -> None:
        self._n = merge_comoment_(self._n, self._mean, self._comoment, n_b, mean_b, comoment_b)

    # ------------------------------------------------------------- merging
    def merge_state(self, incoming_state: dict[str, Any] | Metric) -> None:
        """Fold another accumulator's rows into this one (exact; order does not matter): a
        :class:`StreamingCovariance` of the same ``dim``, or its ``metric_state`` dict."""
        updates = incoming_state.update_count if isinstance(incoming_state, Metric) else 1
        super().merge_state(incoming_state)
        self._update_count += updates  # compute() after a merge is not "before update"

    @property
    def metric_state(self) -> dict[str, torch.Tensor]:
        """The four state tensors by name (the co-moment whole), what :meth:`merge_state` takes."""
        self._full()
        return super().metric_state

    def _reduce_states(self, incoming_state: dict[str, Any]) -> None:
        # What Metric.merge_state and Metric.forward call to fold a whole state in: Chan's merge.
        # A whole co-moment merges into a diagonal-only state by its diagonal; never the reverse.
        comoment = incoming_state["_comoment"]
        if comoment.shape[-1] != self.dim:
            raise ValueError(
                f"merge_state: dimensions differ ({self.dim} vs {tuple(comoment.shape)[-1]})"
            )
        if comoment.ndim == 2 and not self.full:
            comoment = comoment.diagonal()
        elif comoment.ndim != self._comoment.ndim:
            raise ValueError(
                "merge_state: a diagonal-only state cannot merge into a full accumulator"
            )
        put = self._device
        self._merge_moments(
            incoming_state["_n"].to(put), incoming_state["_mean"].to(put), comoment.to(put)
        )
        self._rejected.add_(incoming_state["_rejected"].to(put))
        self._computed = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``Metric.forward``: fold the rows in and return the covariance of this batch alone."""
        self._full()  # Metric.forward sets the state aside raw and merges it back
        return super().forward(*args, **kwargs)

    # -------------------------------------------------------------- processes
    def reduce_(self, group: Any = None) -> StreamingCovariance:
        """Merge the state of every process in ``group`` exactly, in place, for good (a read's
        window; :meth:`compute` merges but keeps the local state): docs/metrics.md §0,
        :func:`~normscope.functional.comoment.all_reduce_comoment_`, no copy of the state. A
        collective: every rank of the group calls it at the same point. A no-op when
        ``torch.distributed`` is not initialised or the world has one process."""
        if not (dist.is_available() and dist.is_initialized()):
            return self
        if dist.get_world_size(group) == 1:
            return self
        self._n, self._mean, self._rejected = all_reduce_comoment_(
            self._n, self._mean, self._full(), self._rejected, group
        )
        self._computed = None
        return self

    def sync(
        self,
        dist_sync_fn: Any = None,
        process_group: Any = None,
        should_sync: bool = True,
        distributed_available: Any = None,
    ) -> None:
        """``Metric.sync`` with this accumulator's own ``dist_sync_fn`` by default (an in-place
        all-reduce, never a gather); ``unsync()`` gives the local state back."""
        self._full()  # the local copy Metric.sync keeps for unsync must hold the whole matrix
        fn = dist_sync_fn or self.dist_sync_fn or self._sync_state
        super().sync(fn, process_group, should_sync, distributed_available)

    def _sync_state(self, state: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        # The dist_sync_fn. Metric.sync calls it once per state and stacks what it returns: the
        # first call merges every state at once (reduce_: the co-moment all-reduced in place),
        # each call returns its own state, merged, as a one-element list.
        pending = self.__dict__.get("_pending_sync")
        if not pending:
            before = {id(getattr(self, name)): name for name in self._defaults}
            self.reduce_(group)
            pending = self._pending_sync = {k: getattr(self, v) for k, v in before.items()}
        return [pending.pop(id(state))]

    def __copy__(self) -> StreamingCovariance:
        """``copy.copy``: a view of the state to read (a read's frozen window; ``reset`` gives
        the original new tensors), without torchmetrics' wrappers of ``update`` and ``compute``:
        they hold the instance in a cycle, and a dropped view would keep ``8 d^2`` bytes."""
        view = type(self).__new__(type(self))
        skip = ("update", "compute", "dist_sync_fn")
        view.__dict__.update({k: v for k, v in self.__dict__.items() if k not in skip})
        view.__dict__["dist_sync_fn"] = None  # sync() runs the view's own _sync_state
        return view

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.copy (a read's frozen window), deepcopy, pickle: the copy syncs itself
        super().__setstate__(state)
        self.dist_sync_fn = self._sync_state

    # ------------------------------------------------------------ persistence
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The four states (the co-moment whole) and ``_extra_state`` (``dim``, ...)."""
        self._full()
        return super().state_dict(*args, **kwargs)

    def get_extra_state(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"dim": self.dim, "max_rows": self.max_rows, "seed": self.seed}
        extra["full"] = self.full
        extra["updates"] = self._update_count
        if self._generator is not None:
            extra["generator"] = self._generator.get_state()
        return extra

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.max_rows = state.get("max_rows", self.max_rows)
        self.seed = state.get("seed", self.seed)
        self._update_count = int(state.get("updates", 0))
        if "generator" in state:
            self._gen(self._device).set_state(state["generator"])

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # Checked before anything changes; the loaded tensors are the caller's: copied onto
        # this accumulator's device, float64 (the count of rejected rows int64).
        saved = state_dict.get(prefix + "_comoment")
        extra = state_dict.get(prefix + "_extra_state") or {}
        width = int(extra.get("dim", saved.shape[-1] if saved is not None else self.dim))
        full = saved.ndim == 2 if saved is not None else bool(extra.get("full", self.full))
        shape = (width, width) if full else (width,)
        if width != self.dim or (saved is not None and tuple(saved.shape) != shape):
            raise ValueError(f"load_state_dict: state has d={width}, accumulator has d={self.dim}")
        if full != self.full:  # the saved window's mode
            self.full, self._defaults = full, _zeros(self.dim, self._device, full)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        for name, zero in self._defaults.items():
            value = getattr(self, name).to(device=self._device, dtype=zero.dtype, copy=True)
            setattr(self, name, value.reshape(zero.shape))
        self._stale_lower = False
        self._computed = None

    def to(self, *args: Any, **kwargs: Any) -> StreamingCovariance:
        """Move the state to a device (``acc.to("cuda")``), in place, and return ``self``; the
        state stays float64 whatever dtype is asked for."""
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)):
            self._plan_on(torch.device(target))  # an impossible move raises before any change
        return super().to(*args, **kwargs)

    def _apply(self, fn: Any, exclude_state: Any = ()) -> StreamingCovariance:
        # Metric._apply would cast the states and their defaults with fn, dtype included; here
        # only the device changes and the defaults stay broadcast zeros.
        device = fn(torch.zeros((), dtype=torch.float64, device=self._device)).device
        plan = self._plan_on(device)
        self._full()
        super()._apply(fn, exclude_state=tuple(self._defaults))
        for name in self._defaults:
            setattr(self, name, getattr(self, name).to(device))
        self._defaults = _zeros(self.dim, device, self.full)
        self._device, self._dtype, self._plan = device, torch.float64, plan
        self._generator, self._computed = None, None
        return self

    def memory_bytes(self) -> int:
        """Bytes of the co-moment, the state that counts: ``8 d^2`` (the mean adds ``8 d``), what
        a full window holds (a diagonal-only one holds ``8 d``)."""
        return 8 * self.dim * self.dim

    def _gen(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def __repr__(self) -> str:
        return (
            f"StreamingCovariance(dim={self.dim}, device={self.device}, max_rows={self.max_rows}, "
            f"full={self.full})"
        )


def host_array(x: torch.Tensor) -> np.ndarray:
    """A float64 tensor's values as a numpy array on the host, by ``tolist``: the same
    numbers as ``x.cpu().numpy()`` in two dispatched ops instead of five (no ``to``/``detach``
    around the copy), the reads' one host transfer per group of numbers.

    Example::

        >>> host_array(torch.tensor([[1.0, 2.0]], dtype=torch.float64))
        array([[1., 2.]])
    """
    return np.array(x.tolist(), dtype=np.float64)


def on_device(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` on ``like``'s device and dtype: ``x`` itself (no op) when it already is.

    Example::

        >>> a = torch.ones(2, dtype=torch.float64)
        >>> on_device(a, torch.zeros(3, dtype=torch.float64)) is a
        True
    """
    if x.device == like.device and x.dtype == like.dtype:
        return x
    return x.to(like)


def _same_state(a: tuple, b: tuple) -> bool:
    return a[0] is b[0] and a[1] == b[1] and a[2] is b[2] and a[3] == b[3]


def fetch_counts(accumulators: Any) -> None:
    """Read the row counts and rejected counts of many :class:`StreamingCovariance`
    accumulators to the host in one transfer per device (one host sync instead of two per
    accumulator); :attr:`~StreamingCovariance.count` and
    :attr:`~StreamingCovariance.rows_rejected` then answer from the host until the state
    changes. Other objects in ``accumulators`` are skipped.

    Example::

        >>> accs = [StreamingCovariance(2), StreamingCovariance(2)]
        >>> accs[1].update(torch.ones(3, 2))
        >>> fetch_counts(accs)
        >>> [a.count for a in accs]
        [0, 3]
    """
    by_device: dict[torch.device, list[StreamingCovariance]] = {}
    for acc in accumulators:
        if isinstance(acc, StreamingCovariance):
            by_device.setdefault(acc._n.device, []).append(acc)
    for group in by_device.values():
        keys = [acc._counts_key() for acc in group]
        counts = torch.stack([k[0] for k in keys])
        rejected = torch.stack([k[2] for k in keys]).to(torch.float64)
        host = torch.cat([counts, rejected]).tolist()  # exact: integers below 2**53
        m = len(group)
        for i, (acc, key) in enumerate(zip(group, keys)):
            acc._counts_cache = (key, (int(host[i]), int(host[m + i])))
