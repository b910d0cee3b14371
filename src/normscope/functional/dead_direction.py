"""The dead-direction reads of one norm layer, in one namespace (docs/metrics.md §1.1–1.3).

The code lives in :mod:`~normscope.functional.gamma` (§1.1 and the shared argument checks),
:mod:`~normscope.functional.kernel` (§1.2) and :mod:`~normscope.functional.schur` (§1.3); this
module re-exports them, so ``from normscope.functional.dead_direction import kernel_read`` keeps
working.

A LayerNorm outputs ``y = gamma * z + beta`` with ``sum_i z_i = 0``, so the centred output
covariance ``C`` has ``C v* = 0`` exactly, ``v* = gamma^-1 / ||gamma^-1||``, whatever the data.
The reads here compare that prediction with a measured covariance:

* :func:`gamma_read` -- parameters only: dead channels, ``v*``, the spread of ``gamma``;
* :func:`kernel_read` -- the norm's *output* covariance against the predicted kernel;
* :func:`schur_quotient` -- the norm's *input* covariance along ``v*``: the quotient ``R``,
  the Schur complement ``s`` and, against a baseline read, ``Delta_gamma`` and ``deepening``.

Every read returns a frozen dataclass with ``as_dict()`` (floats keyed by the names of docs/metrics.md,
``NaN`` where a number cannot be computed) and a ``reason`` attribute, never in ``as_dict``:

* ``None`` -- every number is read as docs/metrics.md defines it;
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

from normscope.functional.gamma import (
    GammaRead,
    gamma_read,
    gamma_vector,
    predicted_kernel,
    row_count,
    square_matrix,
)
from normscope.functional.kernel import (
    DECLARED_KINDS,
    LAYERNORM_RESIDUAL_MAX,
    NORM_CLASSES,
    RMSNORM_ALIGNMENT_CAP,
    RMSNORM_ALIGNMENT_SCALE,
    RMSNORM_RESIDUAL_MIN,
    KernelRead,
    kernel_read,
    rmsnorm_alignment_max,
)
from normscope.functional.schur import (
    ROWS_COMPARABLE_TOL,
    SchurRead,
    deepening,
    rows_comparable,
    schur_quotient,
)

__all__ = [
    "DECLARED_KINDS",
    "LAYERNORM_RESIDUAL_MAX",
    "NORM_CLASSES",
    "RMSNORM_ALIGNMENT_CAP",
    "RMSNORM_ALIGNMENT_SCALE",
    "RMSNORM_RESIDUAL_MIN",
    "ROWS_COMPARABLE_TOL",
    "GammaRead",
    "KernelRead",
    "SchurRead",
    "deepening",
    "gamma_read",
    "gamma_vector",
    "kernel_read",
    "predicted_kernel",
    "rmsnorm_alignment_max",
    "row_count",
    "rows_comparable",
    "schur_quotient",
    "square_matrix",
]
