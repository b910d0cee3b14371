"""How deep ``v*`` sits in a norm's input, beyond the typical direction, with its control
(docs/metrics.md §1.3): ``depth``, ``delta_gamma`` and the random-direction control.

For a unit direction ``v`` and the input covariance ``C = sum_i lambda_i u_i u_i^T``, the
weights ``w_i = <u_i, v>^2`` sum to 1, and

    ``depth(v) = mean_i log10 lambda_i - sum_i w_i log10 lambda_i``
    ``         = log10 [ GM(lambda) / exp(v^T log(C) v) ]``

is how many decades of variance ``v`` sits below the geometric-mean direction of ``C``. Over
uniformly random unit directions ``E[w_i] = 1/d`` exactly, so **a random direction reads 0 in
expectation, whatever the spectrum**, with standard deviation exactly
``sqrt(2 / (d + 2)) * std(log10 lambda)`` (the weights are Dirichlet(1/2, ..., 1/2)). A direction
that training digs into the stream reads its depth *beyond* the typical direction; a stream
whose whole bottom falls (the demo's smallest eigenvalue over its mean goes from 1e-2 to 1e-6)
moves the mean and ``v*``'s weighted mean together, and reads nothing for it.

``delta_gamma = 1 - 10^-depth`` puts it on the paper's scale (0 at random init, -> 1 as ``v*``
deepens): the share of the typical direction's (geometric) variance that ``v*`` lacks. No
baseline read is needed. The control is the same read of one seeded random unit direction,
logged beside it, so that a dashboard shows what "no specific depth" looks like on this very
spectrum.

Rank-deficient inputs (a ViT with 4x4 patches, a byte vocabulary under ``d``): eigenvalues
``<= live_tol * lambda_max`` carry no data; the read is taken on the live subspace (``v``
projected there and renormalised, the means over live eigenvalues only), and
``live_dim < d`` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from normscope.functional.covariance import symmetric_eigh
from normscope.functional.gamma import GammaRead, resolve_gamma, row_count, square_matrix
from normscope.functional.kernel import DECLARED_KINDS
from normscope.functional.premise import check_placement, input_read_reason

__all__ = ["DepthRead", "direction_depth", "spectral_depth"]

_NAN = math.nan
LIVE_TOL = 1e-10
# v* with less than this share of its squared length in the live subspace reads
# "outside_live_space": its renormalised projection would be rounding noise.
OUTSIDE_SHARE = 1e-8


@dataclass(frozen=True)
class DepthRead:
    """``v*``'s depth in a norm's input covariance beyond the typical direction, and its control.

    * ``depth``: decades of variance ``v*`` sits below the geometric-mean direction,
      ``mean_i log10 lambda_i - sum_i <u_i, v*>^2 log10 lambda_i`` (module docstring);
    * ``delta_gamma = 1 - 10^-depth`` (0 for a typical direction, -> 1 as ``v*`` deepens,
      negative when ``v*`` is shallower than typical);
    * ``control_depth``, ``control_delta_gamma``: the same reads of one seeded random unit
      direction (``control_seed``) on the same spectrum;
    * ``dim``: the width ``d``; :attr:`rank_deficient` is ``live_dim < dim``;
    * ``depth_sd``: the exact standard deviation of ``depth`` over uniformly random unit
      directions, ``sqrt(2 / (m + 2)) * std(log10 lambda)`` (``m = live_dim``);
      ``depth_z = depth / depth_sd`` (0 when the spectrum is flat: every direction is typical);
    * ``live_dim``: eigenvalues above ``live_tol * lambda_max`` (``< d``: the input does not
      span and the read is taken on the live subspace); ``live_share``: the share of ``v*``
      inside it (1 when the input spans).

    ``reason`` says why the numbers are NaN: ``"post_norm"``, ``"no_gamma_kernel"``,
    ``"non_finite_gamma"``, ``"dead_channels"``, ``"insufficient_rows"``,
    ``"non_finite_covariance"``, ``"zero_covariance"``, ``"eigh_failed"``,
    ``"outside_live_space"`` (under ``1e-8`` of ``v*``'s squared length lies in the live
    subspace), in that order.
    """

    depth: float
    delta_gamma: float
    control_depth: float
    control_delta_gamma: float
    depth_sd: float
    depth_z: float
    live_dim: int
    live_share: float
    n_rows: int
    reason: str | None

    dim: int = 0

    @property
    def rank_deficient(self) -> bool:
        """Whether the input covariance has fewer live eigenvalues than its width ``dim``."""
        return self.reason is None and self.live_dim < self.dim

    def as_dict(self) -> dict[str, float]:
        return {
            "delta_gamma": self.delta_gamma,
            "delta_gamma_control": self.control_delta_gamma,
            "depth": self.depth,
            "depth_control": self.control_depth,
            "depth_sd": self.depth_sd,
            "depth_z": self.depth_z,
            "live_dim": float(self.live_dim),
        }


def spectral_depth(
    eigenvalues: torch.Tensor, eigenvectors: torch.Tensor, directions: torch.Tensor
) -> torch.Tensor:
    """``mean log10 lambda - sum_i <u_i, v>^2 log10 lambda_i`` for each column ``v``.

    Args:
        eigenvalues: ``(m,)`` positive (the live spectrum).
        eigenvectors: ``(d, m)`` orthonormal columns, paired with ``eigenvalues``.
        directions: ``(d, k)``; each column's projection on the eigenvectors is renormalised to
            unit length (so a direction partly outside a live subspace is read inside it).

    Returns:
        ``(k,)`` float64 depths in decades.

    Example::

        >>> import torch
        >>> lam, u = torch.tensor([1e-4, 1.0, 1.0, 1.0], dtype=torch.float64), torch.eye(4).double()
        >>> spectral_depth(lam, u, torch.eye(4)[:, :2].double()).tolist()  # mean log10 = -1
        [3.0, -1.0]
    """
    logs = torch.log10(eigenvalues)
    w = (eigenvectors.T @ directions) ** 2
    w = w / w.sum(dim=0, keepdim=True)
    return logs.mean() - logs @ w


def direction_depth(
    input_covariance: torch.Tensor,
    gamma: torch.Tensor | GammaRead,
    n_rows: int,
    *,
    declared_kind: str | None = None,
    placement: str = "pre",
    live_tol: float = LIVE_TOL,
    control_seed: int = 0,
) -> DepthRead:
    """``v*``'s depth in ``C_h`` beyond the typical direction, ``delta_gamma``, and the control.

    ``depth = mean_i log10 lambda_i - sum_i <u_i, v*>^2 log10 lambda_i`` over the live
    eigenpairs of ``C_h``, ``delta_gamma = 1 - 10^-depth``; the control is the same read of a
    random unit direction drawn from ``control_seed`` (:class:`DepthRead`, docs/metrics.md
    §1.3). A random direction reads 0 in expectation on any spectrum (standard deviation
    ``depth_sd``); so does ``v*`` of random gains on data unrelated to them, and ``v*`` on data
    rotated at random.

    One dense float64 ``eigh`` of ``C_h`` (``O(d^3)``): measured on one shared CPU core
    0.015 s at d = 256 and 0.9 s at d = 1024, about 3x :func:`schur_quotient`'s Cholesky
    route. (Larger widths would want ``v*^T log(C) v`` by Lanczos quadrature from ``v*`` and
    ``log det C`` from a Cholesky factor; not written.)

    Args:
        input_covariance: ``C_h`` ``(d, d)``, the centred covariance of the norm's input.
        gamma: the norm's effective scale ``(d,)`` or its :class:`GammaRead`.
        n_rows: rows behind ``C_h``; below ``2 d`` every number is NaN.
        declared_kind: ``"rmsnorm"`` makes every number NaN (``"no_gamma_kernel"``).
        placement: ``"pre"`` (default) or ``"post"``: a post-norm layer's input is not the
            residual stream, so every number is NaN with reason ``"post_norm"``
            (:mod:`normscope.functional.premise`).
        live_tol: eigenvalues ``<= live_tol * lambda_max`` are dead (the input does not span).
        control_seed: seed of the control's random direction (CPU generator, float64).

    Returns:
        A :class:`DepthRead`.

    Example::

        >>> import torch
        >>> lam = torch.tensor([1e-3, 1.0, 1.0, 10.0], dtype=torch.float64)
        >>> q = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(1),
        ...                                 dtype=torch.float64)).Q
        >>> c = q @ torch.diag(lam) @ q.T                     # v* = q[:, 0] is the deep one
        >>> gamma = 1 / q[:, 0]                               # so gamma^-1 points along it
        >>> read = direction_depth(c, gamma, 8)
        >>> round(read.depth, 6), round(read.delta_gamma, 4)  # mean log10 = -0.5; -0.5 - (-3)
        (2.5, 0.9968)
        >>> direction_depth(c, gamma, 8, placement="post").reason
        'post_norm'
    """
    c = square_matrix(input_covariance, "direction_depth", "input_covariance")
    d = c.shape[0]
    g = resolve_gamma(gamma, d, "direction_depth")
    n = row_count(n_rows, "direction_depth")
    check_placement(placement, "direction_depth")
    if declared_kind is not None and declared_kind not in DECLARED_KINDS:
        raise ValueError(
            f"direction_depth: declared_kind must be None or one of {DECLARED_KINDS}, "
            f"got {declared_kind!r}"
        )
    if not (isinstance(live_tol, (int, float)) and math.isfinite(live_tol) and live_tol >= 0):
        raise ValueError(
            f"direction_depth: live_tol must be a finite number >= 0, got {live_tol!r}"
        )

    def empty(reason: str, live: int = 0) -> DepthRead:
        return DepthRead(_NAN, _NAN, _NAN, _NAN, _NAN, _NAN, live, _NAN, n, reason, d)

    reason = input_read_reason(placement, declared_kind, g.reason, n, c)
    if reason is not None:
        return empty(reason)
    try:
        evals, evecs = symmetric_eigh(c)
    except RuntimeError:
        return empty("eigh_failed")
    top = float(evals[-1])
    if not top > 0:
        return empty("zero_covariance")
    live = evals > live_tol * top
    m = int(live.sum())
    lam, u = evals[live], evecs[:, live]
    v = g.v_star.to(c.device)
    share = float(((u.T @ v) ** 2).sum())
    if not share > OUTSIDE_SHARE:  # what is left is rounding: no direction to read
        return empty("outside_live_space", m)
    gen = torch.Generator().manual_seed(int(control_seed))
    r = torch.randn(d, generator=gen, dtype=torch.float64).to(c.device)
    both = torch.stack([v, r / torch.linalg.vector_norm(r)], dim=1)
    depth, control = spectral_depth(lam, u, both).tolist()
    sd = math.sqrt(2.0 / (m + 2)) * float(torch.log10(lam).std(correction=0))
    z = depth / sd if sd > 0 else 0.0
    return DepthRead(
        depth, 1.0 - 10.0**-depth, control, 1.0 - 10.0**-control, sd, z, m, min(share, 1.0),
        n, None, d,
    )  # fmt: skip
