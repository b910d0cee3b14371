"""Streaming float64 diagonal second moment ``E[x_j^2]``: the sign–magnitude family's accumulator.

docs/metrics.md §2 (outlier leverage). Where the dead-direction reads need the whole covariance
(:class:`~normscope.functional.covariance.StreamingCovariance`, ``8 d^2`` bytes), the outlier
amplitudes of a Linear's input need only each channel's uncentred second moment: ``d + 1``
float64 numbers. Uncentred on purpose: the amplitude ``alpha_j^2 = E[x_j^2] / E||x||^2`` is a
ratio of raw second moments, and raw sums merge exactly by addition (one ``all_reduce``).

Like the covariance it keeps everything on the device: masked-out rows and rows holding NaN/Inf
get weight 0 (never boolean-indexed away), the row count is a float64 device scalar, and
nothing in :meth:`DiagonalMoment.update` reads a value back to the host.
"""

from __future__ import annotations

import torch

from normscope.functional._rows import check_dim, check_rows

__all__ = ["DiagonalMoment"]


class DiagonalMoment:
    """Float64 running sum of ``x_j^2`` per channel and the row count: ``E[x_j^2]``.

    Args:
        dim: the row width ``d`` (the last dimension of every tensor passed to :meth:`update`).
        device: where the float64 state lives; default the CPU.

    Example::

        >>> import torch
        >>> from normscope.functional.moments import DiagonalMoment
        >>> acc = DiagonalMoment(3)
        >>> acc.update(torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]))
        >>> acc.update(torch.tensor([[float("nan"), 1.0, 1.0]]))  # dropped, counted
        >>> acc.second_moment_diagonal().tolist(), acc.count, acc.rows_rejected
        ([5.0, 2.0, 0.0], 2, 1)
    """

    def __init__(self, dim: int, device: torch.device | str | None = None) -> None:
        self.dim = check_dim(dim, "DiagonalMoment")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.reset()

    def reset(self) -> None:
        """Forget every row."""
        self.sum_sq = torch.zeros(self.dim, dtype=torch.float64, device=self.device)
        self.n = torch.zeros((), dtype=torch.float64, device=self.device)
        self._rejected = torch.zeros((), dtype=torch.int64, device=self.device)

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Fold the rows of ``x`` (shape ``(..., d)``) in; rows where ``mask`` (shape
        ``x.shape[:-1]``, non-zero keeps) is zero are skipped, rows holding NaN/Inf dropped and
        counted in :attr:`rows_rejected`. No host sync."""
        check_rows(x, mask, self.dim, "DiagonalMoment.update")
        rows = x.detach().reshape(-1, self.dim).to(self.device, torch.float64)
        finite = torch.isfinite(rows.sum(dim=1))
        keep = finite
        if mask is not None:
            wanted = mask.detach().reshape(-1).to(self.device) != 0
            keep = finite & wanted
            self._rejected += (wanted & ~finite).sum()
        else:
            self._rejected += (~finite).sum()
        zero = torch.zeros((), dtype=rows.dtype, device=rows.device)
        self.sum_sq += torch.where(keep[:, None], rows, zero).square().sum(dim=0)
        self.n += keep.sum()

    def second_moment_diagonal(self) -> torch.Tensor:
        """``E[x_j^2]`` per channel, float64 ``(d,)`` (zeros before any row)."""
        return self.sum_sq / self.n.clamp_min(1)

    @property
    def count(self) -> int:
        """Rows folded in (a host sync)."""
        return int(self.n.item())

    @property
    def rows_rejected(self) -> int:
        """Rows dropped for holding NaN/Inf (a host sync)."""
        return int(self._rejected.item())

    def to(self, device: torch.device | str) -> DiagonalMoment:
        """Move the state to ``device`` (in place) and return ``self``."""
        self.device = torch.device(device)
        self.sum_sq, self.n = self.sum_sq.to(self.device), self.n.to(self.device)
        self._rejected = self._rejected.to(self.device)
        return self

    def memory_bytes(self) -> int:
        """Bytes of the state: ``8 (d + 1)`` (plus the 8-byte rejected count)."""
        return 8 * (self.dim + 2)

    def __repr__(self) -> str:
        return f"DiagonalMoment(dim={self.dim}, device={self.device})"
