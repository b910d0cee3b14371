"""The kernel reads of one norm layer's output covariance and the norm-type classifier
(docs/metrics.md §1.2, §1.2.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from normscope.functional.covariance import host_array, on_device
from normscope.functional.eigh import symmetric_eigh, symmetric_eigvalsh
from normscope.functional.gamma import (
    GammaRead,
    as_float64,
    predicted_kernel,
    resolve_gamma,
    row_count,
    square_matrix,
)
from normscope.functional.solvers import (
    ShiftedCholesky,
    bottom_eigh,
    check_solver,
    lambda_max,
    use_fast,
)

__all__ = [
    "KernelRead",
    "centring_residual",
    "classify",
    "kernel_read",
    "kernel_residual",
    "rmsnorm_alignment_max",
    "secular_floor",
]

NORM_CLASSES = ("layernorm-like", "rmsnorm-like", "indeterminate")
DECLARED_KINDS = ("layernorm", "rmsnorm")
# docs/metrics.md §1.2 thresholds of norm_class: kernel_residual decides (a LayerNorm's is ~1e-15 in a
# float32 forward, ~1e-6 in bfloat16; an RMSNorm's 2.6e-3 .. 1.8e-2 measured at d = 32 .. 1024
# with uneven gammas), the alignment is a second witness with a width-aware cut.
LAYERNORM_RESIDUAL_MAX = 1e-8
RMSNORM_RESIDUAL_MIN = 1e-4
# A random unit vector's overlap with a fixed one is about sqrt(2 / (pi d)) = 0.8 / sqrt(d);
# with uneven gammas an RMSNorm's bottom eigenvector leans towards v* (measured up to
# 4.7 / sqrt(d), d = 32 .. 1024): the cut is 8 / sqrt(d), never above 0.9.
RMSNORM_ALIGNMENT_SCALE = 8.0
RMSNORM_ALIGNMENT_CAP = 0.9

_NAN = math.nan


# ------------------------------------------------------------------------- §1.2 kernel
@dataclass(frozen=True)
class KernelRead:
    """The kernel reads of one norm layer's output covariance ``C`` (docs/metrics.md §1.2).

    With ``P`` the predicted kernel (:func:`predicted_kernel`, ``k`` columns), ``u_1`` the
    bottom eigenvector of ``C`` and ``U_0`` the eigenvectors counted by ``null_dim``:

    * ``gamma_alignment = ||P^T u_1||`` -- ``|<u_1, v*>|`` when no channel is dead; with dead
      channels, the share of ``u_1`` inside ``span{e_i : i dead}``;
    * ``kernel_residual = lambda_max(P^T C P) / lambda_d`` -- ``v*^T C v* / lambda_d`` when
      ``k = 1``; the worst direction of the predicted kernel otherwise;
    * ``null_dim`` = number of eigenvalues ``<= null_tol * lambda_d`` (an int; NaN when not
      computable);
    * ``subspace_alignment = sqrt(||U_0^T P||_F^2 / k)`` -- ``||U_0^T v*||`` when ``k = 1``;
      with dead channels the root-mean-square share of each ``e_i`` inside the null space
      (1 when the null space contains the whole predicted kernel; 0 when ``null_dim = 0``);
    * ``live_floor`` = smallest over mean eigenvalue of ``C`` restricted to the orthogonal
      complement of the predicted kernel. For a declared ``"rmsnorm"`` layer ``v*`` is no
      kernel, so only dead channels are removed (the whole space when there are none);
    * ``centring_residual``: ``(1^T C_z 1) / tr(C_z)``, ``C_z = D^-1 C D^-1``,
      ``D = diag(gamma)`` (:func:`centring_residual`): ``v*``'s variance normalised by the
      gain-free scale; NaN without ``v*``;
    * ``norm_class``, decided by ``centring_residual`` (:func:`classify`):
      ``"layernorm-like"`` when it is ``<= 1e-8``, ``"rmsnorm-like"`` when it is ``>= 1e-4``,
      else ``"indeterminate"`` with ``class_reason`` (``"between_lines"``; without a residual
      the gamma's or the read's reason). Gains under the dead tolerance but not zero are read
      along ``gamma^-1`` still; a gain exactly zero cannot tell the kinds apart
      (``"dead_channels"``). (Until issue 33 the class was decided by ``kernel_residual``,
      whose ``lambda_d`` uneven gains inflate; until issue 41 an alignment witness and any
      dead channel also left reads undecided: ``benchmarks/RESULTS.md``.)
    * ``kind_mismatch``: ``declared_kind`` was given and ``norm_class`` is the *other* kind's
      class (``"indeterminate"`` is no mismatch).

    :meth:`as_dict` holds the five numbers and ``kind_mismatch`` (0.0/1.0); ``norm_class``
    (a string), ``n_rows``, ``bottom_eigenvalues`` (the smallest ``bottom_k`` eigenvalues over
    ``lambda_d``, for spectrum plots; empty when not computable) and ``reason`` are attributes.

    ``solver`` says which route read it: ``"fast"`` (:mod:`normscope.functional.solvers`:
    Lanczos for ``lambda_d``, shift-invert block Lanczos on one Cholesky factor for the bottom
    pairs and the live floor) or ``"dense"`` (full eigendecompositions); ``dense_fallbacks``
    is 1 when the fast route was asked for and did not verify, so the dense one answered.
    """

    gamma_alignment: float
    kernel_residual: float
    null_dim: int | float
    subspace_alignment: float
    live_floor: float
    norm_class: str
    n_rows: int
    reason: str | None
    bottom_eigenvalues: tuple[float, ...]
    kind_mismatch: bool = False
    declared_kind: str | None = None
    solver: str = "dense"
    dense_fallbacks: int = 0
    centring_residual: float = _NAN
    class_reason: str | None = None

    @property
    def kernel_alignment(self) -> float:
        """The headline alignment: ``subspace_alignment`` when the null space has more than one
        dimension (the norm's input does not span -- a ViT's small patches, a vocabulary under
        ``d`` -- so ``u_1`` is any vector of a degenerate null space and ``gamma_alignment``
        reads what a random one would: measured 0.0003-0.055 while ``subspace_alignment`` read
        0.9999999999996), else ``gamma_alignment``."""
        if isinstance(self.null_dim, int) and self.null_dim > 1:
            return self.subspace_alignment
        return self.gamma_alignment

    def as_dict(self) -> dict[str, float]:
        return {
            "gamma_alignment": self.gamma_alignment,
            "kernel_residual": self.kernel_residual,
            "null_dim": float(self.null_dim),
            "subspace_alignment": self.subspace_alignment,
            "live_floor": self.live_floor,
            "kind_mismatch": float(self.kind_mismatch),
        }


def kernel_read(
    covariance: torch.Tensor,
    gamma: torch.Tensor | GammaRead,
    n_rows: int,
    *,
    null_tol: float = 1e-10,
    declared_kind: str | None = None,
    bottom_k: int = 8,
    solver: str = "fast",
) -> KernelRead:
    """Compare a norm's centred output covariance with the kernel ``gamma`` predicts.

    Args:
        covariance: ``C``, the centred (population) covariance of the norm's output rows,
            ``(d, d)``; read in float64 on its own device.
        gamma: the norm's effective scale ``(d,)`` or its :class:`GammaRead`.
        n_rows: rows behind ``covariance``; below ``2 d`` every number is NaN.
        null_tol: ``tau`` of ``null_dim`` (raise it for bfloat16 forwards, about 1e-4).
        declared_kind: ``"layernorm"``, ``"rmsnorm"`` or None (what the module says it is).
        bottom_k: how many bottom eigenvalues to keep in ``bottom_eigenvalues``.
        solver: ``"fast"`` (default: :mod:`normscope.functional.solvers`, every number equal
            to the dense route's within 1e-10; it takes the dense route below ``d = 1024`` or
            when ``bottom_k >= d / 4``, and whenever it cannot verify its answer, counted in
            ``dense_fallbacks``) or ``"dense"`` (a full float64 ``eigh`` of ``C`` and one of
            ``C`` restricted to the live space).

    Returns:
        A :class:`KernelRead` (see there for every definition).

    Example::

        >>> import torch
        >>> from normscope.functional import StreamingCovariance
        >>> gamma = torch.linspace(0.5, 2.0, 16)
        >>> acc = StreamingCovariance(16)
        >>> acc.update(torch.nn.functional.layer_norm(torch.randn(256, 16), (16,), gamma))
        >>> read = kernel_read(acc.covariance(), gamma, acc.count, declared_kind="layernorm")
        >>> read.norm_class, read.null_dim, read.gamma_alignment > 0.9999
        ('layernorm-like', 1, True)
    """
    c = square_matrix(covariance, "kernel_read", "covariance")
    d = c.shape[0]
    g = resolve_gamma(gamma, d, "kernel_read")
    n = row_count(n_rows, "kernel_read")
    if declared_kind is not None and declared_kind not in DECLARED_KINDS:
        raise ValueError(
            f"kernel_read: declared_kind must be None or one of {DECLARED_KINDS}, "
            f"got {declared_kind!r}"
        )
    if not (isinstance(null_tol, (int, float)) and null_tol >= 0):
        raise ValueError(f"kernel_read: null_tol must be a number >= 0, got {null_tol!r}")
    if not (isinstance(bottom_k, int) and bottom_k >= 0):
        raise ValueError(f"kernel_read: bottom_k must be an int >= 0, got {bottom_k!r}")
    check_solver(solver, "kernel_read")
    route, fallbacks = "dense", 0

    def empty(reason: str, null_dim: int | float = _NAN, bottom=()) -> KernelRead:
        return KernelRead(
            _NAN, _NAN, null_dim, _NAN, _NAN, "indeterminate", n, reason, bottom,
            False, declared_kind, route, fallbacks, _NAN, reason,
        )  # fmt: skip

    if n < 2 * d:
        return empty("insufficient_rows")
    if not bool(torch.isfinite(c).all()):
        return empty("non_finite_covariance")
    factor = None
    removed_z = None  # the dense route's U^T v* (device), for the live floor's secular equation
    lam = None  # the dense route's eigenvalues on the host
    if use_fast(solver, d, max(bottom_k, 1)):
        try:
            fast = _fast_spectrum(c, max(bottom_k, 1), null_tol)
        except RuntimeError:  # a device solver that failed: the dense route answers
            fast = None
        if fast is None:
            fallbacks = 1
        elif not fast[0] > 0:
            route = "fast"
            return empty("zero_covariance")
        else:
            route = "fast"
            lam_d, values, vectors, null_dim, factor = fast
            u_1, u_0, low = vectors[:, 0], vectors[:, :null_dim], float(values[0])
            bottom_vectors = vectors
            bottom = tuple((values[:bottom_k] / lam_d).tolist())
    if route == "dense":
        try:
            evals, evecs = symmetric_eigh(c)
        except RuntimeError:
            return empty("eigh_failed")
        # the eigenvalues on the host in one copy: lambda_d, null_dim, the bottom ratios and
        # the live floor read from it (the same float64 numbers as on the device)
        lam = host_array(evals)
        lam_d = float(lam[-1])
        if not lam_d > 0:
            return empty("zero_covariance")
        null = evals <= null_tol * lam_d
        null_dim = int((lam <= null_tol * lam_d).sum())
        u_1, u_0 = evecs[:, 0], evecs[:, null]
        bottom = tuple((lam[:bottom_k] / lam_d).tolist())
    if g.reason == "non_finite_gamma":
        return empty("non_finite_gamma", null_dim, bottom)

    p = predicted_kernel(g, device=c.device)
    k = p.shape[1]
    # A declared RMSNorm has no centring, so v* is not a kernel there; dead e_i still are.
    removed = p if (declared_kind != "rmsnorm" or g.v_star is None) else p[:, :0]
    p_t = p.T
    alignment = torch.linalg.vector_norm(p_t @ u_1)
    try:
        pcp = p_t @ c @ p
        # one predicted direction (no dead channel): P^T C P is the number v*^T C v* itself
        top = pcp.reshape(()) if k == 1 else symmetric_eigvalsh(pcp)[-1]
        floor = None
        if factor is not None:
            try:
                floor = _fast_floor(c, removed, pcp, low, factor, bottom_vectors)
            except RuntimeError:
                floor = None
            if floor is None:
                fallbacks, route = 1, "dense"
        if floor is None and lam is not None and removed.shape[1] <= 1:
            # the eigendecomposition of C already taken: no second one (secular equation);
            # U^T v* joins the one copy to the host below
            if removed.shape[1]:
                v = on_device(g.v_star, c) if g.v_star is not None else removed[:, 0]
                removed_z = evecs.mT @ v
            else:
                floor = _secular_floor_host(lam, None)
        elif floor is None:
            floor = _restricted_floor(c, removed)
    except RuntimeError:
        return empty("eigh_failed", null_dim, bottom)
    overlap = (u_0.T @ p).reshape(-1)  # (null_dim, k), flat: its squares summed on the host
    # every number left on the device reaches the host in one copy:
    # [alignment, v*^T C v*, (centring's two forms), (U^T v*), overlap]
    scalars = [alignment, top]
    if g.v_star is not None:
        scalars += list(_centring_parts(c, g, g))
    parts = [torch.stack(scalars)]
    if removed_z is not None:
        parts.append(removed_z)
    host = host_array(torch.cat([*parts, overlap]))
    alignment_f, top_f = float(host[0]), float(host[1])
    residual_f = top_f / lam_d
    subspace_f = math.sqrt(float((host[host.shape[0] - overlap.shape[0] :] ** 2).sum()) / k)
    # Norms of projections of unit vectors: <= 1 but for an ulp of rounding.
    alignment_f, subspace_f = min(alignment_f, 1.0), min(subspace_f, 1.0)
    if removed_z is not None:
        z = host[len(scalars) : len(scalars) + removed_z.shape[0]]
        floor = _secular_floor_host(lam, z**2)

    if g.v_star is not None:
        centring = _centring_host(float(host[2]), float(host[3]))
    elif g.dead_centring is not None:  # gains under the dead tolerance, none zero
        centring = _centring_host(*torch.stack(_centring_parts_along(c, g.dead_centring)).tolist())
    else:
        centring = _NAN
    norm_class, class_reason = classify(centring, g.reason)
    mismatch = (declared_kind == "layernorm" and norm_class == "rmsnorm-like") or (
        declared_kind == "rmsnorm" and norm_class == "layernorm-like"
    )
    return KernelRead(
        alignment_f, residual_f, null_dim, subspace_f, floor, norm_class, n, g.reason, bottom,
        mismatch, declared_kind, route, fallbacks, centring, class_reason,
    )  # fmt: skip


def kernel_residual(
    covariance: torch.Tensor, gamma: torch.Tensor | GammaRead, n_rows: int
) -> float:
    """:func:`kernel_read`'s ``kernel_residual`` alone, without a decomposition of ``C``:
    ``lambda_max(P^T C P) / lambda_d`` (``v*^T C v* / lambda_d`` without dead channels),
    ``lambda_d`` by Lanczos (:func:`~normscope.functional.solvers.lambda_max`, ``O(d^2)`` a
    step; the values-only dense solve when it does not verify). NaN where :func:`kernel_read`
    gives NaN (under ``2 d`` rows, a non-finite ``C`` or gamma, a zero ``C``). For a caller
    holding ``C`` that wants this number alone; the monitors' reads take it from
    :func:`kernel_read` on spectral windows (docs/costs.md, "Tiers").

    Example::

        >>> import torch
        >>> gamma = torch.linspace(0.5, 2.0, 16, dtype=torch.float64)
        >>> x = torch.randn(256, 16, dtype=torch.float64)
        >>> c = torch.cov(torch.nn.functional.layer_norm(x, (16,), gamma).T, correction=0)
        >>> abs(kernel_residual(c, gamma, 256) - kernel_read(c, gamma, 256).kernel_residual) < 1e-12
        True
    """
    c = square_matrix(covariance, "kernel_residual", "covariance")
    d = c.shape[0]
    g = resolve_gamma(gamma, d, "kernel_residual")
    n = row_count(n_rows, "kernel_residual")
    if n < 2 * d or g.reason == "non_finite_gamma" or not bool(torch.isfinite(c).all()):
        return _NAN
    lam_d, ok = lambda_max(c)
    if not ok:
        lam_d = float(symmetric_eigvalsh(c)[-1])
    if not lam_d > 0:
        return _NAN
    p = predicted_kernel(g, device=c.device)
    pcp = p.T @ c @ p
    top = pcp.reshape(()) if p.shape[1] == 1 else symmetric_eigvalsh(pcp)[-1]
    return float(top) / lam_d


def classify(centring: float, gamma_reason: str | None = None) -> tuple[str, str | None]:
    """``(norm_class, class_reason)`` from the centring residual (:func:`centring_residual`):
    ``"layernorm-like"`` at or under ``1e-8``, ``"rmsnorm-like"`` at or over ``1e-4``, else
    ``"indeterminate"`` with the reason the data cannot tell: ``"between_lines"`` (the residual
    between the two), ``gamma_reason`` when there is one (``"dead_channels"``: gains under the
    dead tolerance, read along ``gamma^-1`` when none is zero, decide only ``"layernorm-like"``:
    a channel whose signal fell under the forward's rounding, ``beta_i + gamma_i z_i == beta_i``,
    inflates a LayerNorm's residual too), or ``"no_centring"``.

    The residual bounds ``kernel_residual`` from above (``tr C_z <= lambda_d ||gamma^-1||^2``),
    so no read whose kernel is there by this line is left undecided.

    Example::

        >>> classify(3e-13), classify(0.9), classify(1e-6), classify(float("nan"), "dead_channels")
        (('layernorm-like', None), ('rmsnorm-like', None), ('indeterminate', 'between_lines'), ('indeterminate', 'dead_channels'))
    """
    if centring <= LAYERNORM_RESIDUAL_MAX:
        return "layernorm-like", None
    if gamma_reason is not None:
        # gains under the dead tolerance: a channel whose signal fell under the forward's
        # rounding inflates the residual of a LayerNorm too, so only a small one decides
        return "indeterminate", gamma_reason
    if centring >= RMSNORM_RESIDUAL_MIN:
        return "rmsnorm-like", None
    if math.isnan(centring):
        return "indeterminate", gamma_reason or "no_centring"
    return "indeterminate", "between_lines"


def centring_residual(covariance: torch.Tensor, gamma: torch.Tensor | GammaRead) -> float:
    """The norm's output variance along ``v*`` over what ``v*`` would carry if the output,
    divided by its gains, were isotropic: ``(1^T C_z 1) / tr(C_z)``, ``C_z = D^-1 C D^-1``,
    ``D = diag(gamma)`` (docs/metrics.md §1.2.1).

    ``C_z`` is the covariance of ``z = (y - beta) / gamma``: a LayerNorm's ``z`` sums to 0 for
    every row, so the residual is at the rounding floor of its forward (measured 2e-14 to
    1.6e-12 in float32, d = 32..1024, gain spreads up to log-normal sigma = 2); an RMSNorm's
    ``z = x / rms(x)`` does not depend on the gains at all, so neither does its residual
    (measured 0.17 to 1.7 on the same sweep). ``1^T C_z 1 = ||gamma^-1||^2 v*^T C v*``: the
    numerator of ``kernel_residual``, normalised by the gain-free scale instead of
    ``lambda_d``, which uneven gains inflate (RMSNorms with log-normal sigma = 1-2 gains read
    ``kernel_residual`` 4e-10 to 3e-4, inside the undecided band).

    Args:
        covariance: ``C`` ``(d, d)``, the centred covariance of the norm's output.
        gamma: the effective scale ``(d,)`` or its :class:`GammaRead` (no dead channel).

    Returns:
        The residual, NaN when ``v*`` is undefined or ``tr(C_z) <= 0``.

    Example::

        >>> import torch
        >>> g = torch.tensor([1.0, 2.0, 4.0])
        >>> z = torch.tensor([[1.0, -1.0, 0.0], [0.0, 1.0, -1.0]])   # rows summing to 0
        >>> acc = torch.cov((z * g).T, correction=0).double()
        >>> centring_residual(acc, g) < 1e-15
        True
    """
    c = square_matrix(covariance, "centring_residual", "covariance")
    read = resolve_gamma(gamma, c.shape[0], "centring_residual")
    if read.v_star is None:
        return _NAN
    scale, quad = torch.stack(_centring_parts(c, read, gamma)).tolist()  # one copy to the host
    return _centring_host(scale, quad)


def _centring_parts(
    c: torch.Tensor, read: GammaRead, gamma: torch.Tensor | GammaRead
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`centring_residual`'s ``tr(C_z)`` and ``1^T C_z 1`` as device scalars."""
    inv = on_device(read_gains(read, gamma), c).reciprocal()  # 1 / gamma
    return (torch.diagonal(c) * inv**2).sum(), inv @ c @ inv


def _centring_parts_along(
    c: torch.Tensor, direction: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tr(C_z)`` and ``1^T C_z 1`` up to one scale, from ``direction`` along ``gamma^-1``."""
    u = on_device(direction, c)
    return (torch.diagonal(c) * u**2).sum(), u @ c @ u


def _centring_host(scale: float, quad: float) -> float:
    return max(quad, 0.0) / scale if scale > 0 else _NAN


def read_gains(read: GammaRead, gamma: torch.Tensor | GammaRead) -> torch.Tensor:
    """``gamma`` itself (float64) when given as a tensor; from a :class:`GammaRead`, a gain
    vector with the same ``v*`` (``1 / v*``: the residual is invariant to scaling gamma)."""
    if isinstance(gamma, torch.Tensor):
        return as_float64(gamma)
    return read.v_star.reciprocal()


def rmsnorm_alignment_max(d: int) -> float:
    """The largest ``gamma_alignment`` an ``"rmsnorm-like"`` read may have at width ``d``:
    ``min(0.9, 8 / sqrt(d))``.

    A random direction's overlap with ``v*`` is about ``sqrt(2 / (pi d))``; a fixed cut (0.1)
    called a third of the demo's RMSNorm reads indeterminate at d = 128. Measured with uneven
    gammas (uniform in [0.1, 2], log-normal 0.3 and 0.5), d = 32 .. 1024: at most 4.7 / sqrt(d).

    Example::

        >>> rmsnorm_alignment_max(64), rmsnorm_alignment_max(1024)
        (0.9, 0.25)
    """
    return min(RMSNORM_ALIGNMENT_CAP, RMSNORM_ALIGNMENT_SCALE / math.sqrt(d))


def _fast_spectrum(c: torch.Tensor, want: int, null_tol: float):
    """``(lambda_d, values, vectors, null_dim, factor)`` by the fast solvers, None when one
    of them did not verify (``(0.0, ...)`` for a zero matrix)."""
    # No (C + C^T) / 2 here (symmetric_eigh's): the Cholesky reads one triangle and the
    # Rayleigh quotients are the same for both; they differ by rounding, ~1e-16 of lambda_d.
    lam_d, ok = lambda_max(c)
    if not ok:
        return None
    if not lam_d > 0:
        return lam_d, None, None, 0, None
    factor = ShiftedCholesky(c, lam_d)
    out = bottom_eigh(c, want, lam_d, factor=factor, null_tol=null_tol)
    if not out.converged:
        return None
    return lam_d, out.values, out.vectors, out.null_dim, factor


def _fast_floor(
    c: torch.Tensor,
    removed: torch.Tensor,
    pcp: torch.Tensor,
    low: float,
    factor: ShiftedCholesky,
    vectors: torch.Tensor,
) -> float | None:
    """:func:`_restricted_floor` without ``Q^T C Q``: the bottom of ``C`` on the complement of
    ``removed`` by shift-invert Lanczos on the bordered solve of ``factor`` (None when it did
    not verify); the mean is ``(tr C - tr(P^T C P)) / (d - k)``."""
    d, k = removed.shape
    if k >= d:
        return _NAN
    if k == 0:
        mean = float(torch.trace(c)) / d
        return low / mean if mean > 0 else _NAN
    # warm start: the bottom pair of C off the removed span (the restricted bottom vector
    # lies mostly in the span of C's bottom ones; for a LayerNorm it is C's first live one)
    near = vectors - removed @ (removed.T @ vectors)
    pick = torch.argmax((torch.linalg.vector_norm(near, dim=0) > 0.5).to(torch.int8)).reshape(1)
    out = bottom_eigh(
        factor.c, 1, factor.lam_max, factor=factor, constraint=removed, vectors=0,
        value_tol=1e-15, value_rtol=1e-11, block=1, start=near[:, pick],
    )  # fmt: skip
    if not out.converged:
        return None
    mean = (float(torch.trace(c)) - float(torch.trace(pcp))) / (d - k)
    return float(out.values[0]) / mean if mean > 0 else _NAN


def secular_floor(
    evals: torch.Tensor, evecs: torch.Tensor, removed: torch.Tensor | None = None
) -> float:
    """``live_floor`` from ``C``'s eigendecomposition: the smallest over the mean eigenvalue
    of ``C`` restricted to the complement of the unit vector ``removed`` (all of ``C`` when
    None), with no second decomposition.

    With ``z = U^T v`` the eigenvalues of ``C`` compressed to ``v``'s complement are the roots
    of the secular equation ``sum_i z_i^2 / (lambda_i - mu) = 0``; the smallest lies in
    ``[lambda_1, lambda_2]``, where the function increases from ``-inf`` to ``+inf`` (to
    ``lambda_2`` itself when ``z_2 = 0``, ``lambda_1`` when ``z_1 = 0``): bisection to the
    last bit, on the host (one ``d``-vector moved, a few hundred flops per step). The mean
    of the restricted eigenvalues is ``(tr C - v^T C v) / (d - 1)``.

    Args:
        evals: ``lambda``, ascending ``(d,)``; evecs: ``U`` ``(d, d)``, columns.
        removed: ``v`` ``(d,)``, unit; None: the floor of ``C`` itself.

    Example::

        >>> import torch
        >>> c = torch.diag(torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64))
        >>> lam, u = torch.linalg.eigh(c)
        >>> secular_floor(lam, u, torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))  # 1 / 2
        0.5
        >>> secular_floor(lam, u)   # lambda_1 / mean
        0.0
    """
    if removed is None:
        return _secular_floor_host(host_array(evals), None)
    if evals.shape[0] < 2:
        return _NAN
    both = host_array(torch.stack([evals, evecs.mT @ on_device(removed, evecs)]))
    return _secular_floor_host(both[0], both[1] ** 2)


def _secular_floor_host(lam: np.ndarray, z2: np.ndarray | None) -> float:
    """:func:`secular_floor` on the host from ``lambda`` and ``z^2`` (None: no ``v``)."""
    d = lam.shape[0]
    if z2 is None:
        mean = float(lam.mean())
        return float(lam[0]) / mean if mean > 0 else _NAN
    if d < 2:
        return _NAN
    mean = (float(lam.sum()) - float(z2 @ lam)) / (d - 1)
    lo, hi = float(lam[0]), float(lam[1])
    if z2[0] == 0.0 or not hi > lo:
        low = lo
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            for _ in range(200):
                mid = 0.5 * (lo + hi)
                if not lo < mid < hi:
                    break
                if float(np.sum(z2 / (lam - mid))) < 0.0:
                    lo = mid
                else:
                    hi = mid
        low = 0.5 * (lo + hi)
    return low / mean if mean > 0 else _NAN


def _restricted_floor(c: torch.Tensor, removed: torch.Tensor) -> float:
    """Smallest over mean eigenvalue of ``C`` on the orthogonal complement of ``removed``."""
    d, k = removed.shape
    if k >= d:
        return _NAN
    if k == 0:
        restricted = c
    else:
        # The complete QR of an orthonormal (d, k) basis: its last d - k columns span the
        # complement, so Q^T C Q is C restricted there (any orthonormal basis has its spectrum).
        q = torch.linalg.qr(removed, mode="complete").Q[:, k:]
        restricted = q.T @ c @ q
    ev = symmetric_eigvalsh(restricted)
    low, mean = float(ev[0]), float(ev.mean())
    return low / mean if mean > 0 else _NAN
