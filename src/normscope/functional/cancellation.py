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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from einops import rearrange

from normscope.functional._rows import check_dim
from normscope.functional.covariance import symmetric_eigh, symmetric_eigvalsh
from normscope.functional.dead_direction import row_count, square_matrix
from normscope.functional.premise import POST_NORM, check_placement

__all__ = ["RetentionRead", "StreamingCrossMoment", "no_cancellation_margin", "sublayer_retention"]

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


# ----------------------------------------------------------------- the retention pencil
RETENTION_K = 4  # the bottom pencil eigenvalues whose geometric mean is ``retention``
# rho_1 >= 1 - LOEWNER_TOL reads as S_k >= S_{k-1}: the pencil's rounding is about
# eps * kappa(S_{k-1}), 2e-10 at kappa = 1e6
LOEWNER_TOL = 1e-9
RETENTION_CUT = 0.01  # cancelled_dims: pencil eigenvalues under 1% (a direction cut to 1%)


@dataclass(frozen=True)
class RetentionRead:
    """How much of the stream a sublayer keeps along the directions it cancels most.

    For consecutive residual points on the same rows, the pencil ``(S_k, S_{k-1})`` has
    eigenvalues ``rho_1 <= rho_2 <= ...``, ``rho_1 = min_v (v^T S_k v) / (v^T S_{k-1} v)``:
    the smallest share of its energy any direction keeps through the sublayer (the
    eigenvalues of ``S_{k-1}^-1/2 S_k S_{k-1}^-1/2``).

    * ``retention``: the geometric mean of ``rho_1 .. rho_k`` (``k`` = ``len(bottom)``,
      default 4). A sublayer that cancels a subspace of dimension ``>= k`` reads about
      ``(1 - s)^2`` for a cancelling strength ``s``; healthy sublayers cancel single
      directions but not ``k`` of them at once (docs/metrics.md §1.4, measured floors there);
    * ``retention_min``: ``rho_1`` alone;
    * ``loewner``: ``rho_1 >= 1 - 1e-9`` (rounding), i.e. ``S_k >= S_{k-1}``: the exact premise of "``sigma_min``
      cannot fall" (weaker than ``M_k >= 0``), which healthy sublayers rarely meet;
    * ``cancelled_dims``: how many ``rho_i`` are under ``cut`` (default 0.01): the number of
      directions the sublayer cuts to under 1% of their energy (NaN when not read);
    * ``bottom``: ``rho_1 .. rho_k``; ``live_dim``: the dimension of ``S_{k-1}``'s live
      subspace the pencil is read on (``< d`` when the stream does not span).

    ``reason``: ``"post_norm"``, ``"insufficient_rows"``, ``"non_finite_moment"``,
    ``"previous_point_unavailable"`` (``S_{k-1}`` is zero) or ``"eigh_failed"``.
    """

    retention: float
    retention_min: float
    loewner: bool
    bottom: tuple[float, ...]
    live_dim: int
    n_rows: int
    reason: str | None
    cancelled_dims: int | float = _NAN

    def as_dict(self) -> dict[str, float]:
        return {
            "retention": self.retention,
            "retention_min": self.retention_min,
            "cancelled_dims": float(self.cancelled_dims),
        }


def sublayer_retention(
    previous_second_moment: torch.Tensor,
    second_moment: torch.Tensor,
    n_rows: int,
    *,
    k: int = RETENTION_K,
    live_tol: float = 1e-10,
    cut: float = RETENTION_CUT,
    placement: str = "pre",
) -> RetentionRead:
    """The retention pencil of one sublayer: ``rho_i`` of ``(S_k, S_{k-1})``, their bottom
    ``k``'s geometric mean ``retention`` and ``rho_1`` (:class:`RetentionRead`).

    Needs only the two points' uncentred second moments on the same rows (the profile's
    accumulators), no cross-moment. Read on the live subspace of ``S_{k-1}`` (eigenvalues
    ``> live_tol * lambda_max``): ``W = L^-1/2 U^T S_k U L^-1/2`` from one ``eigh`` of
    ``S_{k-1}`` and one ``eigvalsh`` of ``W`` (float64, ``O(d^3)``).

    Args:
        previous_second_moment: ``S_{k-1}`` ``(d, d)``, the point before the sublayer.
        second_moment: ``S_k`` ``(d, d)``, the point after it.
        n_rows: rows behind both (the same rows); below ``2 d`` every number is NaN.
        k: how many bottom pencil eigenvalues ``retention`` averages (geometrically).
        live_tol: ``S_{k-1}``'s eigenvalues ``<= live_tol * lambda_max`` are dead directions,
            left out of the pencil.
        cut: ``cancelled_dims`` counts the pencil eigenvalues under it.
        placement: ``"post"`` reads NaN with reason ``"post_norm"`` (no identity skip).

    Returns:
        A :class:`RetentionRead`.

    Example::

        >>> import torch
        >>> s_prev = torch.diag(torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64))
        >>> keep = torch.tensor([0.01, 1.5, 1.0, 1.0], dtype=torch.float64)  # e_1 cut to 10%
        >>> read = sublayer_retention(s_prev, s_prev * keep, 8, k=2)
        >>> round(read.retention_min, 6), round(read.retention, 6), read.loewner  # sqrt(0.01 * 1)
        (0.01, 0.1, False)
        >>> sublayer_retention(s_prev, s_prev * keep, 8, cut=0.02).cancelled_dims
        1
    """
    a = square_matrix(previous_second_moment, "sublayer_retention", "previous_second_moment")
    b = square_matrix(second_moment, "sublayer_retention", "second_moment")
    if a.shape != b.shape:
        raise ValueError(
            f"sublayer_retention: previous_second_moment is {tuple(a.shape)}, second_moment is "
            f"{tuple(b.shape)}; they must match"
        )
    n = row_count(n_rows, "sublayer_retention")
    check_placement(placement, "sublayer_retention")
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise ValueError(f"sublayer_retention: k must be an int >= 1, got {k!r}")
    d = a.shape[0]

    def empty(reason: str) -> RetentionRead:
        return RetentionRead(_NAN, _NAN, False, (), 0, n, reason)

    if placement == "post":
        return empty(POST_NORM)
    if n < 2 * d:
        return empty("insufficient_rows")
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return empty("non_finite_moment")
    try:
        lam, u = symmetric_eigh(a)
    except RuntimeError:
        return empty("eigh_failed")
    top = float(lam[-1])
    if not top > 0:
        return empty("previous_point_unavailable")
    live = lam > live_tol * top
    u, scale = u[:, live], lam[live].rsqrt()
    b = (b + b.T) * 0.5
    w = scale[:, None] * (u.T @ b @ u) * scale[None, :]
    try:
        rho = symmetric_eigvalsh(w)
    except RuntimeError:
        return empty("eigh_failed")
    bottom = rho[: min(k, rho.numel())].clamp_min(0.0)  # PSD pencil: below 0 is rounding
    low = float(bottom[0])
    gm = float(torch.exp(torch.log(bottom).mean())) if low > 0 else 0.0
    holds = low >= 1.0 - LOEWNER_TOL
    cancelled = int((rho < cut).sum())
    return RetentionRead(
        gm, low, holds, tuple(bottom.tolist()), int(live.sum()), n, None, cancelled
    )
