"""The no-cancellation hypothesis itself, measured: ``M_k`` and its margin (docs/metrics.md §1.4).

Between consecutive residual points ``x_k = x_{k-1} + f_k`` (rows ``X_{k-1}``, ``X_k``,
``F_k = X_k - X_{k-1}`` on the *same* rows), the uncentred second moments obey exactly::

    S_k = S_{k-1} + M_k + F_k^T F_k / N,      M_k = (X_{k-1}^T F_k + F_k^T X_{k-1}) / N

and ``F_k^T F_k`` is positive semi-definite, so by Weyl ``lambda_min(S_k) >= lambda_min(S_{k-1})
+ lambda_min(M_k)``. The theory's hypothesis ("no cancellation") is ``M_k >= 0``: then
``sigma_min`` cannot fall at sublayer ``k``. The margin

    ``no_cancellation_margin_k = lambda_min(M_k) / lambda_min(S_{k-1})``

says how far from failing it is: ``>= 0``, the premise holds and ``sigma_min_step_k >= 1`` is a
theorem (a step below 1 is then a numerical fault, not the model); ``< 0``, sublayer ``k``
cancels part of the stream, and the step is bounded below by ``sqrt(1 + margin)`` only.

:class:`StreamingCrossMoment` accumulates ``sum_rows x_{k-1} f_k^T`` in float64 (one ``8 d^2``
state per pair of points) from the two points' rows of the same forward;
:func:`no_cancellation_margin` reads the margin from it and the previous point's ``S``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from einops import rearrange

from normscope.functional._rows import check_dim
from normscope.functional.covariance import symmetric_eigvalsh
from normscope.functional.dead_direction import row_count, square_matrix
from normscope.functional.premise import POST_NORM, check_placement

__all__ = ["StreamingCrossMoment", "no_cancellation_margin"]

_NAN = math.nan


class StreamingCrossMoment:
    """Float64 running ``sum x f^T`` of paired rows ``(x, x_next)``, ``f = x_next - x``.

    Args:
        dim: the row width ``d``.
        device: where the state lives (default the CPU).

    Both tensors of :meth:`update` must hold the same rows in the same order (the same tokens
    at two residual points of one forward). A row that is masked out, or non-finite in either
    tensor, adds nothing.

    Example::

        >>> import torch
        >>> acc = StreamingCrossMoment(2)
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
        >>> acc.update(x, x * torch.tensor([0.5, 3.0]))   # f = (-0.5 x_1, 2 x_2)
        >>> acc.count, acc.moment().diag().tolist()     # (X^T F + F^T X) / N
        (2, [-0.5, 8.0])
    """

    def __init__(self, dim: int, device: torch.device | str | None = None) -> None:
        self.dim = check_dim(dim, "StreamingCrossMoment")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.reset()

    def reset(self) -> None:
        """Forget every row."""
        f64 = {"dtype": torch.float64, "device": self.device}
        self._n = torch.zeros((), **f64)
        self._cross = torch.zeros(self.dim, self.dim, **f64)

    @property
    def count(self) -> int:
        """Row pairs accumulated (a host sync: call it at read time)."""
        return int(self._n.item())

    @property
    def cross(self) -> torch.Tensor:
        """``sum_rows x f^T`` (float64 ``(d, d)``, not symmetric)."""
        return self._cross

    def moment(self) -> torch.Tensor:
        """``M = (X^T F + F^T X) / N`` (float64 ``(d, d)``); all NaN when ``N == 0``."""
        nan = torch.where(self._n > 0, 0.0, math.nan).to(self._cross)
        return (self._cross + self._cross.mT) / self._n.clamp_min(1) + nan

    def update(
        self, x: torch.Tensor, x_next: torch.Tensor, mask: torch.Tensor | None = None
    ) -> None:
        """Fold paired rows: ``x`` and ``x_next`` of shape ``(..., d)`` (the same shape), an
        optional ``mask`` of shape ``x.shape[:-1]`` (non-zero keeps a row). No host sync."""
        if not (isinstance(x, torch.Tensor) and isinstance(x_next, torch.Tensor)):
            raise TypeError("StreamingCrossMoment.update: x and x_next must be tensors")
        if x.shape != x_next.shape or x.ndim == 0 or x.shape[-1] != self.dim:
            raise ValueError(
                f"StreamingCrossMoment.update: x and x_next must both be (..., {self.dim}), got "
                f"{tuple(x.shape)} and {tuple(x_next.shape)}"
            )
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:-1]):
            raise ValueError(
                f"StreamingCrossMoment.update: mask must have shape {tuple(x.shape[:-1])}, got "
                f"{tuple(mask.shape)}"
            )
        a = rearrange(x.detach(), "... d -> (...) d").to(self.device, torch.float64, copy=True)
        b = rearrange(x_next.detach(), "... d -> (...) d").to(self.device, torch.float64)
        f = b - a
        keep = torch.isfinite(a.sum(dim=1)) & torch.isfinite(f.sum(dim=1))
        if mask is not None:
            keep &= rearrange(mask.detach(), "... -> (...)").to(self.device) != 0
        a.masked_fill_(~keep[:, None], 0.0)
        f.masked_fill_(~keep[:, None], 0.0)
        self._cross.addmm_(a.mT, f)
        self._n = self._n + keep.sum()

    def reduce_(self, group: Any = None) -> StreamingCrossMoment:
        """Sum the state of every process in ``group`` in place (a collective; a no-op
        without ``torch.distributed`` or with one process). Uncentred sums add exactly."""
        if not (dist.is_available() and dist.is_initialized()):
            return self
        if dist.get_world_size(group) == 1:
            return self
        n = self._n.reshape(1).clone()
        dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(self._cross, op=dist.ReduceOp.SUM, group=group)
        self._n = n.reshape(())
        return self

    def to(self, device: torch.device | str) -> StreamingCrossMoment:
        """Move the state to ``device`` (in place) and return ``self``."""
        self.device = torch.device(device)
        self._n, self._cross = self._n.to(self.device), self._cross.to(self.device)
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"dim": self.dim, "n": self._n.clone(), "cross": self._cross.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["dim"]) != self.dim:
            raise ValueError(
                f"load_state_dict: state has d={state['dim']}, accumulator has d={self.dim}"
            )
        self._n = state["n"].to(self.device, torch.float64).reshape(())
        self._cross = state["cross"].to(self.device, torch.float64).clone()

    def memory_bytes(self) -> int:
        return 8 * self.dim * self.dim


def no_cancellation_margin(
    cross_moment: torch.Tensor,
    previous_second_moment: torch.Tensor,
    n_rows: int,
    *,
    previous_lambda_min: float | None = None,
    placement: str = "pre",
) -> tuple[float, str | None]:
    """``lambda_min(M_k) / lambda_min(S_{k-1})`` and why it is NaN (None when it is not).

    Args:
        cross_moment: ``M_k = (X_{k-1}^T F_k + F_k^T X_{k-1}) / N`` ``(d, d)``
            (:meth:`StreamingCrossMoment.moment`).
        previous_second_moment: ``S_{k-1}``, the uncentred second moment at ``p_{k-1}``.
        n_rows: row pairs behind ``M_k``; below ``2 d`` the margin is NaN.
        previous_lambda_min: ``lambda_min(S_{k-1})`` when it is already known (a profile read
            it: ``sigma_min(p_{k-1})^2``); None solves for it here.
        placement: ``"pre"`` (default) or ``"post"``: with post-norm blocks the points are no
            identity-skip stream, so the margin is NaN with reason ``"post_norm"``.

    Returns:
        ``(margin, reason)``; ``reason`` is ``"post_norm"``, ``"insufficient_rows"``,
        ``"non_finite_moment"``, ``"previous_point_unavailable"`` (``lambda_min(S_{k-1})`` is
        0, negative by rounding, or NaN) or ``"eigh_failed"``.

    Example::

        >>> import torch
        >>> m = torch.diag(torch.tensor([-0.5, 8.0]))
        >>> no_cancellation_margin(m, torch.diag(torch.tensor([2.0, 4.0])), 8)
        (-0.25, None)
    """
    m = square_matrix(cross_moment, "no_cancellation_margin", "cross_moment")
    s = square_matrix(previous_second_moment, "no_cancellation_margin", "previous_second_moment")
    if m.shape != s.shape:
        raise ValueError(
            f"no_cancellation_margin: cross_moment is {tuple(m.shape)}, previous_second_moment "
            f"is {tuple(s.shape)}; they must match"
        )
    n = row_count(n_rows, "no_cancellation_margin")
    if check_placement(placement, "no_cancellation_margin") == "post":
        return _NAN, POST_NORM
    if n < 2 * m.shape[0]:
        return _NAN, "insufficient_rows"
    if not bool(torch.isfinite(m).all()):
        return _NAN, "non_finite_moment"
    if not bool(torch.isfinite(s).all()):
        return _NAN, "previous_point_unavailable"
    try:
        low_m = float(symmetric_eigvalsh(m)[0])
        known = previous_lambda_min is not None and math.isfinite(previous_lambda_min)
        low_s = float(previous_lambda_min) if known else float(symmetric_eigvalsh(s)[0])
    except RuntimeError:
        return _NAN, "eigh_failed"
    if not low_s > 0:
        return _NAN, "previous_point_unavailable"
    return low_m / low_s, None
