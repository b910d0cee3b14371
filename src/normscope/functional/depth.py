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

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from normscope.functional.covariance import host_array, on_device
from normscope.functional.eigh import symmetric_eigh
from normscope.functional.gamma import GammaRead, resolve_gamma, row_count, square_matrix
from normscope.functional.kernel import DECLARED_KINDS
from normscope.functional.premise import check_placement, input_read_reason
from normscope.functional.schur import SchurRead

__all__ = [
    "DepthRead",
    "InputRead",
    "direction_depth",
    "input_reads",
    "rank_one_floor",
    "secular_bottom",
    "spectral_depth",
]

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
            # not "depth": a residual point's index has that key, and a pre-norm model's
            # point and norm share their module path
            "depth_gamma": self.depth,
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
    return input_reads(
        input_covariance,
        gamma,
        n_rows,
        declared_kind=declared_kind,
        placement=placement,
        live_tol=live_tol,
        control_seed=control_seed,
        where="direction_depth",
    ).depth


@dataclass(frozen=True)
class InputRead:
    """The reads of a norm's input covariance from its one ``eigh``: ``depth`` (a
    :class:`DepthRead`), ``schur`` (a :class:`~normscope.functional.schur.SchurRead`, no
    baseline) and ``spectrum``, the ``(eigenvalues, eigenvectors)`` they came from (None when
    no decomposition was taken: a reason came first), for a caller that reads more from it
    (:func:`rank_one_floor`)."""

    depth: DepthRead
    schur: SchurRead
    spectrum: tuple[torch.Tensor, torch.Tensor] | None


def input_reads(
    input_covariance: torch.Tensor,
    gamma: torch.Tensor | GammaRead,
    n_rows: int,
    *,
    declared_kind: str | None = None,
    placement: str = "pre",
    live_tol: float = LIVE_TOL,
    control_seed: int = 0,
    ridge: float = 1e-12,
    where: str = "input_reads",
) -> InputRead:
    """:func:`direction_depth` and the Schur quotient from **one** ``eigh`` of ``C_h``.

    The Schur quotient's forms are sums over the same eigenpairs (``w_i = <u_i, v*>^2``, ridge
    ``r = ridge * tr(C_h) / d`` as :func:`~normscope.functional.schur.schur_quotient` adds):
    ``v*^T (C_h + r I)^-1 v* = sum_i w_i / (lambda_i + r)`` and ``v*^T (C_h + r I) v* =
    sum_i w_i (lambda_i + r)``, so ``R_q`` and ``s`` need no Cholesky factor of their own
    (equal to ``schur_quotient``'s within rounding, tested). The monitor reads a LayerNorm's
    input this way: one factorisation per matrix.

    Example::

        >>> import torch
        >>> c = torch.diag(torch.tensor([1e-3, 1.0, 1.0, 10.0], dtype=torch.float64))
        >>> read = input_reads(c, torch.ones(4), 8)   # v* = (1, 1, 1, 1) / 2: every w_i 1/4
        >>> round(read.depth.depth, 12), round(read.schur.schur_quotient, 6)
        (0.0, 0.00133)
    """
    c = square_matrix(input_covariance, where, "input_covariance")
    d = c.shape[0]
    g = resolve_gamma(gamma, d, where)
    n = row_count(n_rows, where)
    check_placement(placement, where)
    if declared_kind is not None and declared_kind not in DECLARED_KINDS:
        raise ValueError(
            f"{where}: declared_kind must be None or one of {DECLARED_KINDS}, got {declared_kind!r}"
        )
    if not (isinstance(live_tol, (int, float)) and math.isfinite(live_tol) and live_tol >= 0):
        raise ValueError(f"{where}: live_tol must be a finite number >= 0, got {live_tol!r}")

    def empty(reason: str, live: int = 0, schur: SchurRead | None = None, spectrum=None):
        depth = DepthRead(_NAN, _NAN, _NAN, _NAN, _NAN, _NAN, live, _NAN, n, reason, d)
        if schur is None:
            schur = SchurRead(_NAN, _NAN, reason, n, delta_reason=reason)
        return InputRead(depth, schur, spectrum)

    reason = input_read_reason(placement, declared_kind, g.reason, n, c)
    if reason is not None:
        return empty(reason)
    try:
        evals, evecs = symmetric_eigh(c)
    except RuntimeError:
        return empty("eigh_failed")
    spectrum = (evals, evecs)
    # Everything after the decomposition is O(d) on the host: the eigenvalues and the squared
    # projections of v* and of the control's direction, moved in one copy (a handful of device
    # ops per read, whatever d)
    r = _control_direction(int(control_seed), d)
    dirs = torch.stack([on_device(g.v_star, c), on_device(r, c)], dim=1)
    host = host_array(torch.cat([evals[:, None], (evecs.mT @ dirs) ** 2], dim=1))
    lam_all, w_v, w_r = host[:, 0], host[:, 1], host[:, 2]
    top = float(lam_all[-1])
    if not top > 0:
        return empty("zero_covariance", spectrum=spectrum)
    schur = _schur_from_spectrum(lam_all, w_v, n, ridge)
    live = lam_all > live_tol * top
    m = int(live.sum())
    lam = lam_all[live]
    share = float(w_v[live].sum())
    if not share > OUTSIDE_SHARE:  # what is left is rounding: no direction to read
        return empty("outside_live_space", m, schur, spectrum)
    logs = np.log10(lam)
    depth, control = (float(logs.mean() - logs @ (w[live] / w[live].sum())) for w in (w_v, w_r))
    sd = math.sqrt(2.0 / (m + 2)) * float(logs.std())
    z = depth / sd if sd > 0 else 0.0
    read = DepthRead(
        depth, 1.0 - 10.0**-depth, control, 1.0 - 10.0**-control, sd, z, m, min(share, 1.0),
        n, None, d,
    )  # fmt: skip
    return InputRead(read, schur, spectrum)


@functools.lru_cache(maxsize=16)
def _control_direction(seed: int, d: int) -> torch.Tensor:
    """The control's random direction of width ``d`` from ``seed`` (a CPU generator, float64),
    drawn once per ``(seed, d)``: every norm of a model reads the same one (never written)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=gen, dtype=torch.float64)


def _schur_from_spectrum(lam: np.ndarray, w: np.ndarray, n: int, ridge: float) -> SchurRead:
    """``R_q`` and ``s`` of :func:`~normscope.functional.schur.schur_quotient` from the
    eigenvalues ``lam`` of ``C_h`` and ``w_i = <u_i, v*>^2`` (its ridge, its reasons)."""
    d = lam.shape[0]
    trace = float(lam.sum())
    if not trace > 0:
        return SchurRead(_NAN, _NAN, "zero_covariance", n, delta_reason="zero_covariance")
    shift = ridge * trace / d
    # eigenvalues of a PSD matrix read a few ulps below 0 by rounding: floored as the
    # dense fallback of schur_quotient floors them
    floor = max(shift, d * float(np.finfo(np.float64).eps) * float(lam[-1]))
    inv_form = float((w / np.maximum(lam + shift, floor)).sum())
    form = float((w * (lam + shift)).sum())
    r = 1.0 / (inv_form * form) if inv_form > 0 and form > 0 else _NAN
    if not (math.isfinite(r) and r > 0):
        return SchurRead(_NAN, _NAN, "solve_failed", n, delta_reason="solve_failed")
    return SchurRead(min(r, 1.0), (1.0 / inv_form) / (trace / d), None, n)


def rank_one_floor(evals: torch.Tensor, evecs: torch.Tensor, vector: torch.Tensor) -> float:
    """``lambda_min(C + m m^T)`` from ``C``'s eigendecomposition, with no second one: the
    smallest root of the secular equation ``1 + sum_i z_i^2 / (lambda_i - x) = 0``,
    ``z = U^T m``, which lies in ``(lambda_1, lambda_2)`` where the function rises from
    ``-inf`` to ``+inf`` (``lambda_1`` itself when ``z_1 = 0`` or ``lambda_1 = lambda_2``);
    bisection to the last bit on the host. The second moment of a residual point is
    ``S = C + mu mu^T``, so its ``sigma_min`` comes from the covariance's ``eigh`` that the
    norm reading the point already took.

    Example::

        >>> import torch
        >>> lam, u = torch.linalg.eigh(torch.diag(torch.tensor([1.0, 2.0, 3.0]).double()))
        >>> rank_one_floor(lam, u, torch.tensor([0.0, 0.0, 1.0]).double())  # [1, 2, 4]
        1.0
        >>> m = torch.tensor([1.0, 1.0, 0.0]).double()
        >>> c = torch.diag(torch.tensor([1.0, 2.0, 3.0]).double())
        >>> abs(rank_one_floor(lam, u, m) - torch.linalg.eigvalsh(c + torch.outer(m, m))[0].item()) < 1e-14
        True
    """
    both = host_array(torch.stack([evals, evecs.mT @ on_device(vector, evecs)]))
    return secular_bottom(both[0], both[1] ** 2)


def secular_bottom(lam: np.ndarray, z2: np.ndarray) -> float:
    """:func:`rank_one_floor` on the host: ``lambda_min(diag(lam) + z z^T)`` from the ascending
    eigenvalues ``lam`` and the squared projections ``z2``.

    Example::

        >>> import numpy as np
        >>> secular_bottom(np.array([1.0, 2.0]), np.array([0.0, 4.0]))
        1.0
    """
    lo = float(lam[0])
    if lam.shape[0] < 2:
        return lo + float(z2[0])
    hi = float(lam[1])
    if z2[0] == 0.0 or not hi > lo:
        return lo
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:
                break
            if 1.0 + float(np.sum(z2 / (lam - mid))) < 0.0:
                lo = mid
            else:
                hi = mid
    return 0.5 * (lo + hi)
