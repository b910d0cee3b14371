"""The dead-direction reads of one norm layer: gamma, kernel, Schur reads (METRICS.md §1.1–1.3).

A LayerNorm outputs ``y = gamma * z + beta`` with ``sum_i z_i = 0``, so the centred output
covariance ``C`` has ``C v* = 0`` exactly, ``v* = gamma^-1 / ||gamma^-1||``, whatever the data.
The reads here compare that prediction with a measured covariance:

* :func:`gamma_read` -- parameters only: dead channels, ``v*``, the spread of ``gamma``;
* :func:`kernel_read` -- the norm's *output* covariance against the predicted kernel;
* :func:`schur_quotient` -- the norm's *input* covariance along ``v*``: the quotient ``R``,
  the Schur complement ``s`` and, against a baseline read, ``Delta_gamma`` and ``deepening``.

Every read returns a frozen dataclass with ``as_dict()`` (floats keyed by the METRICS names,
``NaN`` where a number cannot be computed) and a ``reason`` attribute, never in ``as_dict``:

* ``None`` -- every number is read as METRICS defines it;
* ``"non_finite_gamma"`` -- ``gamma`` holds NaN/Inf: no prediction, every ``v*`` number is NaN;
* ``"dead_channels"`` -- some ``|gamma_i| <= dead_tol * max|gamma|``, so ``v*`` is undefined:
  kernel reads are taken against ``span{e_i : i dead}`` instead (finite numbers), the Schur
  quotient is NaN;
* ``"insufficient_rows"`` -- ``n_rows < 2 d``: the bottom of the spectrum would be empty for
  lack of rows, not for a reason in the model; every row-based number is NaN;
* ``"non_finite_covariance"`` -- the covariance holds NaN/Inf;
* ``"zero_covariance"`` -- ``lambda_d <= 0`` (Schur: ``trace <= 0``): every row is the same;
* ``"eigh_failed"`` -- the eigensolver failed, even on the CPU;
* ``"solve_failed"`` -- the Schur quotient's solve gave no finite positive number;
* ``"no_gamma_kernel"`` -- the layer is declared an RMSNorm: it does not centre, ``v*`` is no
  kernel of its output, and the Schur reads along ``v*`` mean nothing (all NaN).

``Delta_gamma`` and ``deepening`` have a reason of their own, :attr:`SchurRead.delta_reason`:
the read's ``reason`` when ``s`` is NaN, ``"no_baseline"`` without a baseline,
``"rows_not_comparable"`` when the read and its baseline rest on row counts too far apart
(:func:`rows_comparable`), ``"baseline_unavailable"`` when the baseline's ``s`` is not finite.

When several apply, the first is reported, in this order. :func:`schur_quotient`:
``no_gamma_kernel``, ``non_finite_gamma``, ``dead_channels``, ``insufficient_rows``, ``non_finite_covariance``,
``zero_covariance``, ``solve_failed``. :func:`kernel_read`: ``insufficient_rows``,
``non_finite_covariance``, ``zero_covariance``, ``eigh_failed``, then ``non_finite_gamma``
(``null_dim`` and ``bottom_eigenvalues`` need no ``gamma`` and are still read) and
``dead_channels`` (numbers finite, the reason says what they are read against). Bad
*arguments* (a non-square matrix, a ``gamma`` of the wrong length, an unknown
``declared_kind``) raise ``ValueError`` naming what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from normscope.functional.covariance import symmetric_eigh, symmetric_eigvalsh

__all__ = [
    "GammaRead",
    "KernelRead",
    "SchurRead",
    "deepening",
    "gamma_read",
    "kernel_read",
    "predicted_kernel",
    "rmsnorm_alignment_max",
    "rows_comparable",
    "schur_quotient",
]

NORM_CLASSES = ("layernorm-like", "rmsnorm-like", "indeterminate")
DECLARED_KINDS = ("layernorm", "rmsnorm")
# METRICS §1.2 thresholds of norm_class: kernel_residual decides (a LayerNorm's is ~1e-15 in a
# float32 forward, ~1e-6 in bfloat16; an RMSNorm's 2.6e-3 .. 1.8e-2 measured at d = 32 .. 1024
# with uneven gammas), the alignment is a second witness with a width-aware cut.
LAYERNORM_RESIDUAL_MAX = 1e-8
LAYERNORM_ALIGNMENT_MIN = 0.999
RMSNORM_RESIDUAL_MIN = 1e-4
# A random unit vector's overlap with a fixed one is about sqrt(2 / (pi d)) = 0.8 / sqrt(d);
# with uneven gammas an RMSNorm's bottom eigenvector leans towards v* (measured up to
# 4.7 / sqrt(d), d = 32 .. 1024): the cut is 8 / sqrt(d), never above 0.9.
RMSNORM_ALIGNMENT_SCALE = 8.0
RMSNORM_ALIGNMENT_CAP = 0.9
# Delta_gamma compares Schur complements read on comparable row counts: the estimate from N rows
# is biased low by about d / N (Wishart), so |d / N - d / N_baseline| must stay within this.
ROWS_COMPARABLE_TOL = 0.02

_NAN = math.nan


# ------------------------------------------------------------------- argument checks
def _real_tensor(x: object, where: str, what: str, ok: bool, expected: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not ok or x.is_complex():
        got = f"shape {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x)
        raise ValueError(f"{where}: {what} must be a real {expected}, got {got}")
    return x.detach().to(torch.float64)


def square_matrix(matrix: torch.Tensor, where: str, what: str) -> torch.Tensor:
    """``matrix`` as float64, or a ValueError saying a square ``(d, d)`` tensor is expected."""
    ok = isinstance(matrix, torch.Tensor) and matrix.ndim == 2
    ok = ok and matrix.shape[0] == matrix.shape[1] > 0
    return _real_tensor(matrix, where, what, ok, "square (d, d) tensor with d >= 1")


def gamma_vector(gamma: torch.Tensor, where: str) -> torch.Tensor:
    """``gamma`` as float64, or a ValueError saying a non-empty ``(d,)`` tensor is expected."""
    ok = isinstance(gamma, torch.Tensor) and gamma.ndim == 1 and gamma.numel() > 0
    return _real_tensor(gamma, where, "gamma", ok, "non-empty 1-D tensor (d,)")


def row_count(n_rows: int, where: str) -> int:
    """``n_rows`` as an int >= 0 (Python, numpy or 0-d integer tensor), else a ValueError."""
    if isinstance(n_rows, torch.Tensor) and n_rows.ndim == 0 and not n_rows.is_floating_point():
        n_rows = int(n_rows)
    if isinstance(n_rows, bool) or not hasattr(n_rows, "__index__") or int(n_rows) < 0:
        raise ValueError(f"{where}: n_rows must be an int >= 0, got {n_rows!r}")
    return int(n_rows)


# --------------------------------------------------------------------------- §1.1 gamma
@dataclass(frozen=True)
class GammaRead:
    """The gamma read of one norm layer (METRICS §1.1); parameters only.

    ``gamma_min``/``gamma_max`` are the signed extremes of ``gamma``; ``gamma_spread`` is
    ``std(gamma) / mean(|gamma|)`` with the population std (``ddof = 0``). With a non-finite
    ``gamma`` those three are NaN and ``dead_channels`` counts only the finite entries at or
    below the tolerance. ``dead_index``, ``v_star``, ``dim`` and ``reason`` are not in
    :meth:`as_dict`.
    """

    dead_channels: int
    gamma_min: float
    gamma_max: float
    gamma_spread: float
    dead_index: tuple[int, ...]
    v_star: torch.Tensor | None
    reason: str | None
    dim: int

    def as_dict(self) -> dict[str, float]:
        return {
            "dead_channels": float(self.dead_channels),
            "gamma_min": self.gamma_min,
            "gamma_max": self.gamma_max,
            "gamma_spread": self.gamma_spread,
        }


def gamma_read(gamma: torch.Tensor, *, dead_tol: float = 1e-6) -> GammaRead:
    """Dead channels, the predicted direction ``v*`` and the spread of ``gamma``.

    Args:
        gamma: the norm's effective scale, shape ``(d,)`` (any float dtype; read in float64).
        dead_tol: channel ``i`` is dead when ``|gamma_i| <= dead_tol * max|gamma|``.

    Returns:
        A :class:`GammaRead`; ``v_star`` (float64 ``(d,)``, on ``gamma``'s device) is
        ``gamma^-1 / ||gamma^-1||`` when no channel is dead and ``gamma`` is finite, else None.

    Example::

        >>> import torch
        >>> g = gamma_read(torch.tensor([1.0, 2.0, 0.0, 4.0]))
        >>> g.dead_channels, g.dead_index, g.v_star is None, g.reason
        (1, (2,), True, 'dead_channels')
        >>> gamma_read(torch.tensor([1.0, 1.0])).v_star
        tensor([0.7071, 0.7071], dtype=torch.float64)
    """
    if not (isinstance(dead_tol, (int, float)) and math.isfinite(dead_tol) and dead_tol >= 0):
        raise ValueError(f"gamma_read: dead_tol must be a finite number >= 0, got {dead_tol!r}")
    g = gamma_vector(gamma, "gamma_read")
    d = g.numel()
    mag = g.abs()
    finite = torch.isfinite(g)
    if not bool(finite.all()):
        top = mag[finite].max() if bool(finite.any()) else torch.zeros((), dtype=g.dtype)
        dead = torch.nonzero(finite & (mag <= dead_tol * top)).flatten().tolist()
        return GammaRead(len(dead), _NAN, _NAN, _NAN, tuple(dead), None, "non_finite_gamma", d)
    top = mag.max()
    dead = tuple(torch.nonzero(mag <= dead_tol * top).flatten().tolist())
    mean_abs = mag.mean()
    gmin, gmax, std, mabs = torch.stack([g.min(), g.max(), g.std(correction=0), mean_abs]).tolist()
    spread = std / mabs if mabs > 0 else _NAN
    if dead:
        return GammaRead(len(dead), gmin, gmax, spread, dead, None, "dead_channels", d)
    # top / gamma lies in [1, 1/dead_tol] in magnitude: no overflow however small gamma is.
    inv = top / g
    return GammaRead(0, gmin, gmax, spread, (), inv / torch.linalg.vector_norm(inv), None, d)


def predicted_kernel(
    gamma_or_read: torch.Tensor | GammaRead, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """The predicted kernel of a LayerNorm's output covariance as an orthonormal basis.

    Args:
        gamma_or_read: ``gamma`` ``(d,)`` or its :class:`GammaRead`.
        device: where the basis goes (default: ``v*``'s device, else the CPU).

    Returns:
        Float64 ``(d, k)``: ``v*`` as one column (``k = 1``) when no channel is dead; the unit
        vectors ``e_i`` of the dead channels (``k = dead_channels``) otherwise; ``(d, 0)`` when
        ``gamma`` is not finite (no prediction).

    Example::

        >>> predicted_kernel(torch.tensor([2.0, 0.0, 1.0])).T
        tensor([[0., 1., 0.]], dtype=torch.float64)
    """
    read = gamma_or_read if isinstance(gamma_or_read, GammaRead) else gamma_read(gamma_or_read)
    if read.v_star is not None:
        out = read.v_star.reshape(-1, 1)
        return out.to(device) if device is not None else out
    eye = torch.eye(read.dim, dtype=torch.float64, device=device)
    if read.reason == "non_finite_gamma":
        return eye[:, :0]
    return eye[:, list(read.dead_index)]


def _resolve_gamma(gamma: torch.Tensor | GammaRead, d: int, where: str) -> GammaRead:
    read = gamma if isinstance(gamma, GammaRead) else gamma_read(gamma)
    if read.dim != d:
        raise ValueError(
            f"{where}: gamma has {read.dim} entries, the covariance is {d} x {d}; they must match"
        )
    return read


# ------------------------------------------------------------------------- §1.2 kernel
@dataclass(frozen=True)
class KernelRead:
    """The kernel reads of one norm layer's output covariance ``C`` (METRICS §1.2).

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
    * ``norm_class``, decided by ``kernel_residual`` with the alignment as a second witness:
      ``"layernorm-like"`` when ``kernel_residual <= 1e-8`` and ``gamma_alignment >= 0.999``;
      ``"rmsnorm-like"`` when ``kernel_residual >= 1e-4`` and ``gamma_alignment <=``
      :func:`rmsnorm_alignment_max` ``(d) = min(0.9, 8 / sqrt(d))`` (a cut that scales with a
      random direction's overlap, ``~0.8 / sqrt(d)``); else ``"indeterminate"`` -- also
      whenever ``reason`` is set: with dead channels both kinds have the ``e_i`` in their
      kernel, so the kernel cannot tell them apart;
    * ``kind_mismatch``: ``declared_kind`` was given and ``norm_class`` is the *other* kind's
      class (``"indeterminate"`` is no mismatch).

    :meth:`as_dict` holds the five numbers and ``kind_mismatch`` (0.0/1.0); ``norm_class``
    (a string), ``n_rows``, ``bottom_eigenvalues`` (the smallest ``bottom_k`` eigenvalues over
    ``lambda_d``, for spectrum plots; empty when not computable) and ``reason`` are attributes.
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
    g = _resolve_gamma(gamma, d, "kernel_read")
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

    def empty(reason: str, null_dim: int | float = _NAN, bottom=()) -> KernelRead:
        return KernelRead(
            _NAN, _NAN, null_dim, _NAN, _NAN, "indeterminate", n, reason, bottom,
            False, declared_kind,
        )  # fmt: skip

    if n < 2 * d:
        return empty("insufficient_rows")
    if not bool(torch.isfinite(c).all()):
        return empty("non_finite_covariance")
    try:
        evals, evecs = symmetric_eigh(c)
    except RuntimeError:
        return empty("eigh_failed")
    lam_d = float(evals[-1])
    if not lam_d > 0:
        return empty("zero_covariance")
    null = evals <= null_tol * lam_d
    null_dim = int(null.sum())
    bottom = tuple((evals[:bottom_k] / lam_d).tolist())
    if g.reason == "non_finite_gamma":
        return empty("non_finite_gamma", null_dim, bottom)

    p = predicted_kernel(g, device=c.device)
    k = p.shape[1]
    # A declared RMSNorm has no centring, so v* is not a kernel there; dead e_i still are.
    removed = p if (declared_kind != "rmsnorm" or g.v_star is None) else p[:, :0]
    alignment = torch.linalg.vector_norm(p.T @ evecs[:, 0])
    try:
        residual = symmetric_eigvalsh(p.T @ c @ p)[-1] / lam_d
        floor = _restricted_floor(c, removed)
    except RuntimeError:
        return empty("eigh_failed", null_dim, bottom)
    overlap = evecs[:, null].T @ p  # (null_dim, k)
    subspace = torch.sqrt((overlap**2).sum() / k)
    alignment_f, residual_f, subspace_f = torch.stack([alignment, residual, subspace]).tolist()
    # Norms of projections of unit vectors: <= 1 but for an ulp of rounding.
    alignment_f, subspace_f = min(alignment_f, 1.0), min(subspace_f, 1.0)

    if g.reason is not None:
        norm_class = "indeterminate"
    elif residual_f <= LAYERNORM_RESIDUAL_MAX and alignment_f >= LAYERNORM_ALIGNMENT_MIN:
        norm_class = "layernorm-like"
    elif residual_f >= RMSNORM_RESIDUAL_MIN and alignment_f <= rmsnorm_alignment_max(d):
        norm_class = "rmsnorm-like"
    else:
        norm_class = "indeterminate"
    mismatch = (declared_kind == "layernorm" and norm_class == "rmsnorm-like") or (
        declared_kind == "rmsnorm" and norm_class == "layernorm-like"
    )
    return KernelRead(
        alignment_f, residual_f, null_dim, subspace_f, floor, norm_class, n, g.reason, bottom,
        mismatch, declared_kind,
    )  # fmt: skip


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


# -------------------------------------------------------------------------- §1.3 Schur
@dataclass(frozen=True)
class SchurRead:
    """The Schur reads of a norm's input covariance ``C_h`` along ``v*`` (METRICS §1.3).

    * ``schur_quotient`` ``R_q = 1 / ((v*^T C_h^-1 v*) (v*^T C_h v*))`` in ``(0, 1]``: 1 when
      ``v*`` is an eigenvector of ``C_h``. Version 1 logged ``1 - R_q`` as ``Delta_gamma``; it
      is kept under this key because it says how far ``v*`` is from an eigenvector, but it is
      *not* near 0 at random init (``gamma = 1`` makes ``v*`` a generic direction, and ``R_q``
      is then about the harmonic over the arithmetic mean of ``C_h``'s eigenvalues: measured
      0.04-0.32 at init on the demo GPT).
    * ``schur_complement`` ``s = [1 / (v*^T C_h^-1 v*)] / [tr(C_h) / d]``: the variance of
      ``h`` along ``v*`` that the other directions cannot explain, in units of the mean
      variance. Small when a near-dead direction of ``h`` overlaps ``v*``.
    * ``delta_gamma = 1 - s / s_baseline`` and ``deepening = s_baseline / s``, against a
      baseline read (the run's first read; for ``normscope scan`` the random-init twin): 0 and
      1 at the baseline, ``delta_gamma -> 1`` as training digs the dead direction deeper.
      NaN, with ``delta_reason``, when there is no baseline or the row counts are not
      comparable (:func:`rows_comparable`).

    ``reason`` explains a NaN ``schur_quotient``/``schur_complement``; ``n_rows``, ``reason``
    and ``delta_reason`` are not in :meth:`as_dict` (``deepening`` is logged by the norm's
    report, next to it).
    """

    schur_quotient: float
    schur_complement: float
    reason: str | None
    n_rows: int = 0
    delta_gamma: float = _NAN
    deepening: float = _NAN
    delta_reason: str | None = "no_baseline"

    def as_dict(self) -> dict[str, float]:
        return {
            "schur_quotient": self.schur_quotient,
            "schur_complement": self.schur_complement,
            "delta_gamma": self.delta_gamma,
        }


def rows_comparable(n_rows: int, baseline_rows: int, d: int) -> bool:
    """Whether a Schur complement read on ``n_rows`` rows may be compared with one read on
    ``baseline_rows``: ``|d / n_rows - d / baseline_rows| <= 0.02``.

    The estimate of ``1 / (v*^T C^-1 v*)`` from ``N`` rows is biased low by about ``d / N``
    (for independent Gaussian rows it is a Wishart Schur complement with ``N - d + 1`` degrees of
    freedom); token rows are correlated, so the measured shift is larger (the demo's ``s`` moves
    9-30% between 2k and 32k rows). Two reads whose ``d / N`` differ by at most 0.02 carry
    nearly the same bias, so their ratio is training, not sampling.

    Example::

        >>> rows_comparable(2048, 2048, 128), rows_comparable(1024, 2048, 128)
        (True, False)
    """
    if n_rows <= 0 or baseline_rows <= 0:
        return False
    return abs(d / n_rows - d / baseline_rows) <= ROWS_COMPARABLE_TOL


def schur_quotient(
    input_covariance: torch.Tensor,
    gamma: torch.Tensor | GammaRead,
    n_rows: int,
    *,
    ridge: float = 1e-12,
    declared_kind: str | None = None,
    baseline: SchurRead | None = None,
) -> SchurRead:
    """The Schur reads of ``C_h`` along ``v*``: ``R_q``, ``s`` and, with a baseline, ``Delta_gamma``.

    ``R_q = 1 / ((v*^T C_h^-1 v*) (v*^T C_h v*))``, ``s = [1 / (v*^T C_h^-1 v*)] / [tr(C_h)/d]``,
    ``Delta_gamma = 1 - s / s_baseline``, ``deepening = s_baseline / s`` (:class:`SchurRead`).
    The paper's body was not available to us: these formulas are the project's reading of its
    words ("Schur quotient", ``Delta_gamma ~ 0`` at random init and ``~ 1`` trained, dead
    directions ``~10^3`` deeper), and the README says so. ``1 / (v*^T C_h^-1 v*)`` is the Schur
    complement of ``C_h`` along ``v*`` (the variance of ``h`` along ``v*`` that the other
    directions cannot explain). On the demo GPT (4 x 128, LayerNorm) the deep layers' ``s``
    falls by three orders of magnitude in the first 50 steps (README, "Dead directions").

    Both quadratic forms are taken on the ridged matrix ``C_h + ridge * trace(C_h) / d * I``
    (so that Cauchy-Schwarz keeps ``R_q <= 1`` exactly and an exact eigenvector gives 1); the
    inverse form is ``||L^-1 v*||^2`` from a float64 Cholesky factor ``L``. If the
    factorisation fails (``ridge = 0`` on a singular matrix, say) it falls back to an
    eigendecomposition with eigenvalues floored at ``max(ridge * trace / d, d eps lambda_d)``.

    Args:
        input_covariance: ``C_h`` ``(d, d)``, the covariance of what enters the norm.
        gamma: the norm's effective scale ``(d,)`` or its :class:`GammaRead`.
        n_rows: rows behind ``C_h``; below ``2 d`` the read is NaN.
        ridge: relative ridge (default 1e-12, METRICS §1.3).
        declared_kind: ``"rmsnorm"`` makes every number NaN (reason ``"no_gamma_kernel"``):
            an RMSNorm does not centre, so ``v*`` is no kernel of it.
        baseline: the read ``Delta_gamma`` and ``deepening`` are measured against (None: they
            are NaN, ``delta_reason = "no_baseline"``).

    Returns:
        A :class:`SchurRead`.

    Example::

        >>> import torch
        >>> c = torch.diag(torch.tensor([1.0, 2.0, 3.0]))
        >>> read = schur_quotient(c, torch.ones(3), 6)
        >>> round(read.schur_quotient, 6), round(read.schur_complement, 6)  # 9/11, (18/11)/2
        (0.818182, 0.818182)
        >>> deeper = schur_quotient(c * torch.tensor([1.0, 1.0, 1e-3]), torch.ones(3), 6,
        ...                         baseline=read)
        >>> round(deeper.delta_gamma, 3), round(deeper.deepening, 1), deeper.delta_reason
        (0.989, 91.4, None)
    """
    c = square_matrix(input_covariance, "schur_quotient", "input_covariance")
    d = c.shape[0]
    g = _resolve_gamma(gamma, d, "schur_quotient")
    n = row_count(n_rows, "schur_quotient")
    if not (isinstance(ridge, (int, float)) and math.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"schur_quotient: ridge must be a finite number >= 0, got {ridge!r}")
    if declared_kind is not None and declared_kind not in DECLARED_KINDS:
        raise ValueError(
            f"schur_quotient: declared_kind must be None or one of {DECLARED_KINDS}, "
            f"got {declared_kind!r}"
        )
    if baseline is not None and not isinstance(baseline, SchurRead):
        raise ValueError(
            f"schur_quotient: baseline must be a SchurRead or None, got {type(baseline).__name__}"
        )

    def empty(reason: str) -> SchurRead:
        return SchurRead(_NAN, _NAN, reason, n, delta_reason=reason)

    if declared_kind == "rmsnorm":
        return empty("no_gamma_kernel")
    if g.reason is not None:  # non_finite_gamma or dead_channels: no v*
        return empty(g.reason)
    if n < 2 * d:
        return empty("insufficient_rows")
    if not bool(torch.isfinite(c).all()):
        return empty("non_finite_covariance")
    trace = float(torch.trace(c))
    if not trace > 0:
        return empty("zero_covariance")
    v = g.v_star.to(c.device)
    shift = ridge * trace / d
    c = (c + c.T) * 0.5 + shift * torch.eye(d, dtype=torch.float64, device=c.device)
    chol, info = torch.linalg.cholesky_ex(c)
    if int(info) == 0:
        y = torch.linalg.solve_triangular(chol, v.reshape(-1, 1), upper=False)
        inv_form = float((y**2).sum())
    else:
        try:
            evals, evecs = symmetric_eigh(c)
        except RuntimeError:
            return empty("solve_failed")
        floor = max(shift, d * torch.finfo(torch.float64).eps * float(evals[-1]))
        inv_form = float(((evecs.T @ v) ** 2 / evals.clamp_min(floor)).sum())
    form = float(v @ c @ v)
    r = 1.0 / (inv_form * form) if inv_form > 0 and form > 0 else _NAN
    if not (math.isfinite(r) and r > 0):
        return empty("solve_failed")
    r = min(r, 1.0)  # Cauchy-Schwarz gives <= 1; rounding can add an ulp
    s = (1.0 / inv_form) / (trace / d)
    if baseline is None:
        return SchurRead(r, s, None, n)
    s_base = baseline.schur_complement
    if not (math.isfinite(s_base) and s_base > 0):
        return SchurRead(r, s, None, n, delta_reason="baseline_unavailable")
    if not rows_comparable(n, baseline.n_rows, d):
        return SchurRead(r, s, None, n, delta_reason="rows_not_comparable")
    return SchurRead(r, s, None, n, 1.0 - s / s_base, s_base / s, None)


def deepening(s_baseline: float, s_now: float) -> float:
    """``s_baseline / s_now``: how much deeper the dead direction is than at the baseline.

    Args:
        s_baseline: the baseline read's Schur complement (:attr:`SchurRead.schur_complement`).
        s_now: the current one.

    Returns:
        The ratio; NaN when either is not finite or ``s_now <= 0``.

    Example::

        >>> deepening(0.5, 0.005)
        100.0
    """
    if not (math.isfinite(s_baseline) and math.isfinite(s_now) and s_now > 0):
        return _NAN
    return s_baseline / s_now
