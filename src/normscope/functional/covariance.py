"""Streaming float64 covariance: the accumulator every normscope read is taken from.

docs/metrics.md §0. A tapped tensor of shape ``(..., d)`` becomes rows ``(N, d)``. Each batch is
reduced to ``(n_b, mu_b, M_b)`` -- its row count, mean and *centred* co-moment
``M_b = sum (x - mu_b)(x - mu_b)^T`` -- and folded into the running state with Chan's pairwise
update::

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
* **Not a ``torchmetrics.Metric``.** torchmetrics' default ``sync`` gathers every rank's state
  before reducing: ``world_size x d^2 x 8`` bytes of transient memory per accumulator (d = 4096,
  8 ranks: about 1 GB). :meth:`StreamingCovariance.reduce_` instead sums re-centred co-moments
  in place with one ``all_reduce``: the memory of one state, whatever the number of ranks.
  Measured on 2 gloo processes (``benchmarks/torchmetrics_sync.py``): at d = 2048 (a 32 MiB
  state) a ``Metric``'s sync peaks 162 MiB above its resting memory, ``reduce_`` 2.5 MiB.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from einops import rearrange

from normscope.functional._rows import check_dim, check_rows
from normscope.functional.fold import add_gram_, centre_rows, fold_plan, mirror_upper_

__all__ = [
    "StreamingCovariance",
    "fetch_counts",
    "host_array",
    "on_device",
    "pick_rows",
    "symmetric_eigh",
    "symmetric_eigvalsh",
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


class StreamingCovariance:
    """Float64 running mean and centred co-moment of a stream of ``d``-dimensional rows.

    Args:
        dim: the row width ``d`` (the last dimension of every tensor passed to :meth:`update`).
        device: where the float64 state lives; default the CPU. Put it on the activation's
            device: the rank-k update then runs where the rows already are.
        max_rows: if set, each :meth:`update` keeps a uniform random subset of at most this many
            rows (before masking), drawn from a generator seeded with ``seed``.
        seed: seed of the subsampling generator.
        fold: how ``X^T X`` of a batch is formed (``functional/fold.py``): ``"auto"`` (default:
            the measured fastest for ``dim`` and the device), ``"gemm"`` (one full GEMM),
            ``"panels"`` (upper-triangle panel GEMMs, about half the flops) or ``"syrk"``
            (numpy's BLAS syrk; CPU only, opt-in: set ``OPENBLAS_NUM_THREADS``, its pool is not
            torch's). Every read sees the same symmetric matrix.

    Example::

        >>> import torch
        >>> from normscope.functional import StreamingCovariance
        >>> acc = StreamingCovariance(4)
        >>> acc.update(torch.randn(8, 16, 4))          # (batch, tokens, d): 128 rows
        >>> acc.update(torch.randn(3, 4), mask=torch.tensor([1, 0, 1]))  # 2 more rows
        >>> acc.count
        130
        >>> acc.covariance().shape
        torch.Size([4, 4])
    """

    def __init__(
        self,
        dim: int,
        device: torch.device | str | None = None,
        *,
        max_rows: int | None = None,
        seed: int = 0,
        fold: str = "auto",
    ) -> None:
        check_dim(dim, "StreamingCovariance")
        if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
            raise ValueError(
                f"StreamingCovariance: max_rows must be None or a positive int, got {max_rows!r}"
            )
        self.dim = dim
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "mps":
            raise ValueError(
                "StreamingCovariance: Apple MPS has no float64; keep the accumulator on the CPU "
                "(device='cpu') and rows are copied there"
            )
        self.max_rows = max_rows
        self.seed = seed
        self.fold = fold
        self._plan = fold_plan(dim, self.device, fold)
        self._generator: torch.Generator | None = None
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every row (the subsampling generator keeps its position)."""
        f64 = {"dtype": torch.float64, "device": self.device}
        self._n = torch.zeros((), **f64)
        self._mean = torch.zeros(self.dim, **f64)
        self._comoment = torch.zeros(self.dim, self.dim, **f64)
        self._rejected = torch.zeros((), dtype=torch.int64, device=self.device)
        self._stale_lower = False

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
        panel fold writes only its upper blocks until the next read).
        """
        return self._full()

    def covariance(self) -> torch.Tensor:
        """Population covariance ``C = M / n`` (float64 ``(d, d)``); all NaN when ``n == 0``
        (``M`` is exactly 0 then: every fold of no rows adds zeros, so ``0 / 0``), one op and
        no host sync."""
        return self._full() / self._n

    def second_moment(self) -> torch.Tensor:
        """Uncentred second moment ``S = C + mu mu^T`` (float64 ``(d, d)``)."""
        return self.covariance() + torch.outer(self._mean, self._mean)

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
        rows = rows.to(self.device)
        keep = keep.to(self.device) if keep is not None else None
        x, n_b, mean_b, rejected = centre_rows(rows, keep)
        self._rejected += rejected
        kind, panel = self._plan
        if add_gram_(self._comoment, x, kind, panel):
            self._stale_lower = True
        self._merge_moments(n_b, mean_b, None)

    def _full(self) -> torch.Tensor:
        # The panel fold leaves the blocks left of the diagonal stale: mirror them on a read (a
        # Python flag, no host sync). Every other update keeps the upper blocks right.
        if self._stale_lower:
            mirror_upper_(self._comoment, self._plan[1])
            self._stale_lower = False
        return self._comoment

    def _merge_moments(
        self, n_b: torch.Tensor, mean_b: torch.Tensor, comoment_b: torch.Tensor | None
    ) -> None:
        # Chan et al. (1979) pairwise update; safe when either side is empty (n_b / n -> 0 or 1).
        n_a = self._n
        n = n_a + n_b
        delta = mean_b - self._mean
        share = n_b / n.clamp_min(1)
        if comoment_b is not None:
            self._comoment += comoment_b
        # In-place rank-1 update, the scalar folded into one vector: no d x d temporary.
        self._comoment.addr_(delta, delta * (n_a * share))
        self._mean += delta * share
        self._n = n

    def merge(self, other: StreamingCovariance) -> StreamingCovariance:
        """Fold another accumulator's rows into this one (exact; order does not matter)."""
        if not isinstance(other, StreamingCovariance):
            raise TypeError(f"merge: expected a StreamingCovariance, got {type(other).__name__}")
        if other.dim != self.dim:
            raise ValueError(f"merge: dimensions differ ({self.dim} vs {other.dim})")
        self._merge_moments(
            other._n.to(self.device), other._mean.to(self.device), other._full().to(self.device)
        )
        self._rejected += other._rejected.to(self.device)
        return self

    # -------------------------------------------------------------- processes
    def reduce_(self, group: Any = None) -> StreamingCovariance:
        """Merge the state of every process in ``group`` exactly, in place, on every rank.

        docs/metrics.md §0: first the global count and mean (one small ``all_reduce`` of
        ``[n, n*mu, rejected]``), then each rank re-centres its co-moment on the global mean,
        ``M_r + n_r (mu_r - mu)(mu_r - mu)^T``, and the ``d x d`` co-moments are summed in one
        ``all_reduce``. Peak memory is one state, not one per rank. Every rank of the group must
        call it at the same point (it is a collective). A no-op when ``torch.distributed`` is not
        initialised or the world has one process.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return self
        if dist.get_world_size(group) == 1:
            return self
        head = torch.cat(
            [self._n.reshape(1), self._n * self._mean, self._rejected.to(torch.float64).reshape(1)]
        )
        dist.all_reduce(head, op=dist.ReduceOp.SUM, group=group)
        n = head[0]
        mean = head[1:-1] / n.clamp_min(1)
        delta = self._mean - mean
        self._full()
        # Re-centre in place (rank-1, no d x d temporary) and sum: one state of memory.
        self._comoment.addr_(delta, delta * self._n)
        dist.all_reduce(self._comoment, op=dist.ReduceOp.SUM, group=group)
        self._n = n
        self._mean = mean
        self._rejected = head[-1].round().to(torch.int64)
        return self

    # ------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """A dict of plain tensors and ints; :meth:`load_state_dict` restores it exactly."""
        state: dict[str, Any] = {
            "dim": self.dim,
            "max_rows": self.max_rows,
            "seed": self.seed,
            "n": self._n.clone(),
            "mean": self._mean.clone(),
            "comoment": self._full().clone(),
            "rows_rejected": self._rejected.clone(),
        }
        if self._generator is not None:
            state["generator"] = self._generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; tensors go to *this* accumulator's device."""
        if int(state["dim"]) != self.dim:
            raise ValueError(
                f"load_state_dict: state has d={state['dim']}, accumulator has d={self.dim}"
            )
        put = {"device": self.device}
        self._n = state["n"].to(dtype=torch.float64, **put).reshape(())
        self._mean = state["mean"].to(dtype=torch.float64, **put).clone()
        self._comoment = state["comoment"].to(dtype=torch.float64, **put).clone()
        self._stale_lower = False
        self._rejected = state["rows_rejected"].to(dtype=torch.int64, **put).reshape(())
        self.max_rows = state.get("max_rows", self.max_rows)
        self.seed = state.get("seed", self.seed)
        if "generator" in state:
            self._gen(self.device).set_state(state["generator"])

    def to(self, device: torch.device | str) -> StreamingCovariance:
        """Move the state to ``device`` (in place) and return ``self``."""
        plan = fold_plan(self.dim, torch.device(device), self.fold)  # raises before any change
        self._full()
        self.device, self._plan = torch.device(device), plan
        self._n, self._mean = self._n.to(self.device), self._mean.to(self.device)
        self._comoment, self._rejected = (
            self._comoment.to(self.device),
            self._rejected.to(self.device),
        )
        self._generator = None
        return self

    def memory_bytes(self) -> int:
        """Bytes of the co-moment, the state that counts: ``8 d^2`` (the mean adds ``8 d``)."""
        return 8 * self.dim * self.dim

    def _gen(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def __repr__(self) -> str:
        return (
            f"StreamingCovariance(dim={self.dim}, device={self.device}, max_rows={self.max_rows})"
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


def _symmetrised(matrix: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.device]:
    """``(A + A^T) / 2`` in float64 and the matrix's device; a clear error if not square."""
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"{where}: expected a square matrix, got shape {tuple(matrix.shape)}")
    a = matrix if matrix.dtype == torch.float64 else matrix.to(torch.float64)
    return (a + a.T) * 0.5, matrix.device


def symmetric_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 eigen-decomposition of a symmetric matrix, eigenvalues ascending.

    Symmetrises ``(A + A^T) / 2`` first (a co-moment is symmetric only up to rounding). Runs
    ``torch.linalg.eigh`` on the matrix's own device; if the device solver fails (it can on
    ill-conditioned input, and some backends have no float64 solver) it retries on the CPU and
    returns the result on the original device.

    Returns:
        ``(eigenvalues (d,), eigenvectors (d, d))``, columns the eigenvectors.
    """
    a, device = _symmetrised(matrix, "symmetric_eigh")
    try:
        evals, evecs = torch.linalg.eigh(a)
    except (RuntimeError, NotImplementedError, TypeError):
        if device.type == "cpu":
            raise
        evals, evecs = torch.linalg.eigh(a.cpu())
        evals, evecs = evals.to(device), evecs.to(device)
    return evals, evecs


def symmetric_eigvalsh(matrix: torch.Tensor) -> torch.Tensor:
    """Float64 eigenvalues (ascending) of a symmetric matrix, without eigenvectors.

    What :func:`symmetric_eigh` does, values only: about 0.25-0.45x of its time at d >= 512
    (``benchmarks/read_cost.py``). Same symmetrisation and CPU fallback.

    Example::

        >>> import torch
        >>> symmetric_eigvalsh(torch.tensor([[2.0, 1.0], [1.0, 2.0]])).tolist()
        [1.0, 3.0]
    """
    a, device = _symmetrised(matrix, "symmetric_eigvalsh")
    try:
        return torch.linalg.eigvalsh(a)
    except (RuntimeError, NotImplementedError, TypeError):
        if device.type == "cpu":
            raise
        return torch.linalg.eigvalsh(a.cpu()).to(device)
