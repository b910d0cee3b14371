"""The Schur reads of a norm's input covariance along ``v*``: ``schur_complement``,
``delta_gamma``, ``deepening`` and version 1's ``schur_quotient`` (docs/metrics.md §1.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from normscope.functional.eigh import symmetric_eigh
from normscope.functional.gamma import GammaRead, resolve_gamma, row_count, square_matrix
from normscope.functional.kernel import DECLARED_KINDS
from normscope.functional.premise import check_placement, input_read_reason

__all__ = ["SchurRead", "deepening", "rows_comparable", "schur_quotient"]

# Delta_gamma compares Schur complements read on comparable row counts: the estimate from N rows
# is biased low by about d / N (Wishart), so |d / N - d / N_baseline| must stay within this.
ROWS_COMPARABLE_TOL = 0.02

_NAN = math.nan


# -------------------------------------------------------------------------- §1.3 Schur
@dataclass(frozen=True)
class SchurRead:
    """The Schur reads of a norm's input covariance ``C_h`` along ``v*`` (docs/metrics.md §1.3).

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
    placement: str = "pre",
) -> SchurRead:
    """The Schur reads of ``C_h`` along ``v*``: ``R_q``, ``s`` and, with a baseline, ``Delta_gamma``.

    ``R_q = 1 / ((v*^T C_h^-1 v*) (v*^T C_h v*))``, ``s = [1 / (v*^T C_h^-1 v*)] / [tr(C_h)/d]``,
    ``Delta_gamma = 1 - s / s_baseline``, ``deepening = s_baseline / s`` (:class:`SchurRead`).
    The paper's body was not available to us: these formulas are the project's reading of its
    words ("Schur quotient", ``Delta_gamma ~ 0`` at random init and ``~ 1`` trained, dead
    directions ``~10^3`` deeper), and docs/metrics.md §1.3 says so. ``1 / (v*^T C_h^-1 v*)`` is the Schur
    complement of ``C_h`` along ``v*`` (the variance of ``h`` along ``v*`` that the other
    directions cannot explain). On the demo GPT (4 x 128, LayerNorm) the deep layers' ``s``
    falls by three orders of magnitude in the first 50 steps (docs/metrics.md §1.3).

    Both quadratic forms are taken on the ridged matrix ``C_h + ridge * trace(C_h) / d * I``
    (so that Cauchy-Schwarz keeps ``R_q <= 1`` exactly and an exact eigenvector gives 1); the
    inverse form is ``||L^-1 v*||^2`` from a float64 Cholesky factor ``L``. If the
    factorisation fails (``ridge = 0`` on a singular matrix, say) it falls back to an
    eigendecomposition with eigenvalues floored at ``max(ridge * trace / d, d eps lambda_d)``.

    Args:
        input_covariance: ``C_h`` ``(d, d)``, the covariance of what enters the norm.
        gamma: the norm's effective scale ``(d,)`` or its :class:`GammaRead`.
        n_rows: rows behind ``C_h``; below ``2 d`` the read is NaN.
        ridge: relative ridge (default 1e-12, docs/metrics.md §1.3).
        declared_kind: ``"rmsnorm"`` makes every number NaN (reason ``"no_gamma_kernel"``):
            an RMSNorm does not centre, so ``v*`` is no kernel of it.
        baseline: the read ``Delta_gamma`` and ``deepening`` are measured against (None: they
            are NaN, ``delta_reason = "no_baseline"``).
        placement: ``"pre"`` (default) or ``"post"``: a post-norm layer's input is not the
            residual stream, so every number is NaN with reason ``"post_norm"``
            (:mod:`normscope.functional.premise`).

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
    g = resolve_gamma(gamma, d, "schur_quotient")
    n = row_count(n_rows, "schur_quotient")
    if not (isinstance(ridge, (int, float)) and math.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"schur_quotient: ridge must be a finite number >= 0, got {ridge!r}")
    if declared_kind is not None and declared_kind not in DECLARED_KINDS:
        raise ValueError(
            f"schur_quotient: declared_kind must be None or one of {DECLARED_KINDS}, "
            f"got {declared_kind!r}"
        )
    check_placement(placement, "schur_quotient")
    if baseline is not None and not isinstance(baseline, SchurRead):
        raise ValueError(
            f"schur_quotient: baseline must be a SchurRead or None, got {type(baseline).__name__}"
        )

    def empty(reason: str) -> SchurRead:
        return SchurRead(_NAN, _NAN, reason, n, delta_reason=reason)

    reason = input_read_reason(placement, declared_kind, g.reason, n, c)
    if reason is not None:
        return empty(reason)
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
