"""The retention pencil of one sublayer (docs/metrics.md §1.4): how much of the stream a
sublayer keeps along the directions it cancels most, from the two residual points' second
moments on the same rows (no cross-moment).

Between consecutive residual points ``x_k = x_{k-1} + f_k`` the pencil ``(S_k, S_{k-1})`` has
eigenvalues ``rho_1 <= rho_2 <= ...``: the smallest shares of their energy that directions keep
through the sublayer. :func:`sublayer_retention` reads them; no key or rule of the monitor does
(it separates a planted cancellation within one width, but no single floor separates across
widths: ``benchmarks/RESULTS.md``, "A localising cancellation read"). It stays a functional read
for analyses and per-sublayer plots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from normscope.functional.dead_direction import row_count, square_matrix
from normscope.functional.eigh import symmetric_eigh, symmetric_eigvalsh
from normscope.functional.premise import POST_NORM, check_placement

__all__ = ["RetentionRead", "sublayer_retention"]

_NAN = math.nan

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
