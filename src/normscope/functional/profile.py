"""The residual stream's ``sigma_min`` depth profile (docs/metrics.md §1.4).

Residual points ``p_0, ..., p_L`` in forward order. ``sigma_min(p) = sqrt(lambda_1(S_p))``,
``S_p`` the *uncentred* second moment of the rows at ``p``. With identity skips
``x_k = x_{k-1} + f(x_{k-1})`` and no cancellation (``X^T F + F^T X`` positive semi-definite),
``sigma_min`` cannot fall: every ``sigma_min_ratio`` is ``>= 1``. A ratio below 1 is a real dead
direction opened by training, or a calibration artefact.

``reason`` vocabulary (an attribute, never in ``as_dict``): ``"insufficient_rows"``
(``n_rows < 2 d``), ``"non_finite_second_moment"``, ``"eigh_failed"`` for a point's own
``sigma_min``; ``"rank_deficient"`` (a flag on a finite ``sigma_min``: the rows do not span,
``lambda_1 <= 1e-10 ||S||_F``; leading such points are skipped by the cumulative ratios'
anchor, :class:`SigmaMinProfile`); ``"first_point_unavailable"`` (``p_0``'s ``sigma_min`` is NaN or 0, so no ratio
exists), ``"previous_point_unavailable"`` (only the step is NaN); for the whole profile also
``"no_points"``, ``"single_point"`` (nothing after ``p_0``) and ``"no_finite_ratio"``.

**Error bars from the rows** (docs/metrics.md §1.4.1). A ratio read from ``N`` rows in ``d``
dimensions is biased low and noisy when ``N / d`` is small: the smallest eigenvalue of a sample
second moment sits below the population's (``lambda_min`` is concave, so on average it can only
fall; Marchenko–Pastur puts an isotropic bottom at ``(1 - sqrt(d/N))^2``). Every ratio gets an
interval :func:`ratio_bounds`, ``[r / slack, r * slack]`` with
``slack = exp(z / sqrt(N)) / (1 - c sqrt(d / N))`` (``z = 3``, ``c = 0.5``, both measured: see
``benchmarks/alert_roc.py --errors``), NaN below ``N / d = 4``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from normscope.functional.dead_direction import row_count, square_matrix
from normscope.functional.eigh import symmetric_eigvalsh
from normscope.functional.premise import POST_NORM, check_placement
from normscope.functional.solvers import bottom_eigh, check_solver, use_fast

__all__ = [
    "BOUND_BIAS",
    "BOUND_Z",
    "MIN_ROWS_PER_DIM",
    "RANK_DEFICIENT",
    "RANK_TOL",
    "ProfilePoint",
    "SigmaMinProfile",
    "profile_from_sigmas",
    "sigma_min",
    "ratio_bounds",
    "sigma_min_profile",
]

_NAN = math.nan

MIN_ROWS_PER_DIM = 4.0  # below N/d = 4 a ratio gets no interval and decides nothing
BOUND_BIAS = 0.5  # c: the share of the Marchenko-Pastur bottom bias the interval allows
BOUND_Z = 3.0  # z: the noise allowance, in units of 1/sqrt(N)
# A point whose lambda_1 is <= RANK_TOL * ||S||_F does not span (a ViT's 4x4 patches: 48 patch
# dimensions + 65 positions under d = 192; a byte vocabulary under d): its sigma_min is 0 or
# rounding (measured ~1e-8), so cumulative ratios anchor at the first point that spans.
RANK_TOL = 1e-10
RANK_DEFICIENT = "rank_deficient"


def ratio_bounds(
    ratio: float,
    n_rows: float,
    rows_per_dim: float,
    *,
    c: float = BOUND_BIAS,
    z: float = BOUND_Z,
    min_rows_per_dim: float = MIN_ROWS_PER_DIM,
) -> tuple[float, float]:
    """The interval ``(lo, hi)`` of a ``sigma_min`` ratio read from ``n_rows`` rows.

    ``slack = exp(z / sqrt(N)) / (1 - c sqrt(d / N))``; ``lo = ratio / slack``,
    ``hi = ratio * slack``. The numerator's ``sigma_min`` may be read low by up to the share
    ``c`` of the isotropic Marchenko–Pastur bias ``1 - sqrt(d/N)`` (the denominator's too, for
    ``lo``), plus a noise term ``z / sqrt(N)``. ``c = 0.5`` and ``z = 3`` cover every error
    measured against a 48x larger reference read on the demo GPT (docs/metrics.md §1.4.1);
    ``c = 1`` (the isotropic worst case) is 4–20x wider than any error measured.

    Args:
        ratio: the read ratio (cumulative or step).
        n_rows: the rows behind it (the smaller count of the two points).
        rows_per_dim: ``N / d``.
        c, z: the bias share and the noise allowance.
        min_rows_per_dim: below this ``N / d`` the interval is ``(nan, nan)``.

    Example::

        >>> lo, hi = ratio_bounds(0.7, 6400, 50.0)
        >>> round(lo, 3), round(hi, 3)
        (0.627, 0.782)
        >>> ratio_bounds(0.7, 256, 2.0)
        (nan, nan)
    """
    if not (math.isfinite(ratio) and rows_per_dim >= min_rows_per_dim and n_rows > 0):
        return _NAN, _NAN
    slack = math.exp(z / math.sqrt(n_rows)) / (1.0 - c / math.sqrt(rows_per_dim))
    return ratio / slack, ratio * slack


def _sigma_min(
    second_moment: torch.Tensor, n_rows: int, where: str, solver: str = "fast", flag: bool = False
) -> tuple[float, str | None, int]:
    """``(sigma_min, reason, dense_fallbacks)`` of one point; ``flag``: a point whose rows do
    not span gets the reason ``"rank_deficient"``."""
    check_solver(solver, where)
    s = square_matrix(second_moment, where, "second_moment")
    n = row_count(n_rows, where)
    if n < 2 * s.shape[0]:
        return _NAN, "insufficient_rows", 0
    if not bool(torch.isfinite(s).all()):
        return _NAN, "non_finite_second_moment", 0
    low, fallbacks = None, 0
    if use_fast(solver, s.shape[0]):
        try:
            low = _fast_bottom(s)
        except RuntimeError:  # a device solver that failed: the dense route answers
            low = None
        fallbacks = int(low is None)
    try:
        if low is None:
            low = float(symmetric_eigvalsh(s)[0])
    except RuntimeError:
        return _NAN, "eigh_failed", fallbacks
    # S is PSD: a negative bottom eigenvalue is rounding (a few ulps of lambda_d), read as 0.
    # The rows do not span when lambda_1 <= RANK_TOL ||S||_F: a finite sigma_min, flagged.
    spans = not flag or low > RANK_TOL * float(torch.linalg.matrix_norm(s))
    return math.sqrt(max(low, 0.0)), None if spans else RANK_DEFICIENT, fallbacks


def _fast_bottom(s: torch.Tensor) -> float | None:
    """``lambda_1(S)`` by shift-invert Lanczos on one Cholesky factor (values only, error
    bound ``<= 1e-11 lambda_1 + 1e-15 ||S||_F``); None when it did not verify. The Frobenius
    norm (``>= lambda_max``) scales the shift: no Lanczos for ``lambda_max`` is needed."""
    scale = float(torch.linalg.matrix_norm(s))  # no (S + S^T) / 2: see kernel._fast_spectrum
    if not scale > 0:
        return 0.0
    out = bottom_eigh(s, 1, scale, vectors=0, value_tol=1e-15, value_rtol=1e-11, block=1)
    return float(out.values[0]) if out.converged else None


def sigma_min(second_moment: torch.Tensor, n_rows: int, *, solver: str = "fast") -> float:
    """``sqrt(lambda_1(S))`` of an uncentred second moment ``S`` (float64).

    Args:
        second_moment: ``S`` ``(d, d)`` (:meth:`StreamingCovariance.second_moment`).
        n_rows: rows behind ``S``.
        solver: ``"fast"`` (shift-invert Lanczos on one Cholesky factor,
            :mod:`normscope.functional.solvers`; dense below ``d = 1024`` and when it cannot
            verify its answer) or ``"dense"`` (a full ``eigvalsh``).

    Returns:
        The smallest singular value of the rows over ``sqrt(n_rows)``; NaN when
        ``n_rows < 2 d`` or ``S`` is not finite (rounding below 0 reads as 0).

    Example::

        >>> import torch
        >>> sigma_min(torch.diag(torch.tensor([4.0, 9.0])), 4)
        2.0
        >>> sigma_min(torch.eye(2), 3)
        nan
    """
    return _sigma_min(second_moment, n_rows, "sigma_min", solver)[0]


@dataclass(frozen=True)
class ProfilePoint:
    """One residual point of the profile.

    ``depth`` is the point's index ``k``; ``sublayer`` what lies between ``p_{k-1}`` and
    ``p_k`` (``"attn"``, ``"mlp"``, ``"block"``; None for ``p_0``). ``sigma_min_ratio =
    sigma_min(p_k) / sigma_min(p_0)``, ``sigma_min_step = sigma_min(p_k) / sigma_min(p_{k-1})``;
    both 1 at ``p_0``. ``reason`` says why a number is NaN (module docstring).
    ``rows_per_dim`` is ``N / d``; ``ratio_lo``/``ratio_hi`` and ``step_lo``/``step_hi`` the
    intervals of :func:`ratio_bounds` (NaN below ``N / d = 4``; ``p_0``'s are 1).
    """

    name: str
    depth: int
    sublayer: str | None
    sigma_min: float
    sigma_min_ratio: float
    sigma_min_step: float
    n_rows: int
    reason: str | None
    rows_per_dim: float = _NAN
    ratio_lo: float = _NAN
    ratio_hi: float = _NAN
    step_lo: float = _NAN
    step_hi: float = _NAN


@dataclass(frozen=True)
class SigmaMinProfile:
    """The depth profile: every point, the smallest ratio and where it is.

    ``sigma_min_ratio_min`` and ``worst_point`` are taken over the points after the anchor
    (the anchor's ratio is 1 by definition), NaN points ignored; so ``worst_point``'s ratio is
    ``sigma_min_ratio_min``. ``reason`` is None when that minimum exists.

    ``anchor`` is the point the cumulative ratios are read against: ``p_0``, or, when the
    first points' rows do not span (their reason ``"rank_deficient"``: ``lambda_1 <= 1e-10
    ||S||_F``, a ViT with small patches, a vocabulary under ``d``), the first point that
    does (``anchor_depth`` its index, :attr:`rank_deficient_entry` True). The points before
    it have NaN ratio and step; the anchor's step is NaN (``"previous_point_unavailable"``).
    A point after the anchor that does not span (a collapse to exact zero) keeps its ratio
    and the reason ``"rank_deficient"`` as a flag. ``anchor`` is None when no ratio exists.

    """

    points: tuple[ProfilePoint, ...]
    sigma_min_ratio_min: float
    worst_point: str | None
    reason: str | None
    dense_fallbacks: int = 0
    anchor: str | None = None
    anchor_depth: int = 0

    @property
    def rank_deficient_entry(self) -> bool:
        """Whether leading points did not span, so the ratios anchor at ``anchor``, not p_0."""
        return self.anchor_depth > 0

    def as_dict(self) -> dict[str, float]:
        """Flat: ``<point>/sigma_min``, ``<point>/sigma_min_ratio``, ``<point>/sigma_min_step``,
        ``<point>/depth`` (its index ``k``, so that a log alone gives the forward order) and
        the intervals ``<point>/sigma_min_ratio_lo``, ``_hi``, ``<point>/sigma_min_step_lo``,
        ``_hi`` for every point; ``sigma_min_ratio_min`` and ``rows_per_dim`` (``N / d`` at
        ``p_0``: the points fold the same rows)."""
        out: dict[str, float] = {}
        for p in self.points:
            out[f"{p.name}/sigma_min"] = p.sigma_min
            out[f"{p.name}/sigma_min_ratio"] = p.sigma_min_ratio
            out[f"{p.name}/sigma_min_step"] = p.sigma_min_step
            out[f"{p.name}/depth"] = float(p.depth)
            out[f"{p.name}/sigma_min_ratio_lo"] = p.ratio_lo
            out[f"{p.name}/sigma_min_ratio_hi"] = p.ratio_hi
            out[f"{p.name}/sigma_min_step_lo"] = p.step_lo
            out[f"{p.name}/sigma_min_step_hi"] = p.step_hi
        out["sigma_min_ratio_min"] = self.sigma_min_ratio_min
        # every point folds the same sampled rows: one N/d for the profile (p_0's)
        out["rows_per_dim"] = self.points[0].rows_per_dim if self.points else _NAN
        return out


def sigma_min_profile(
    names: Sequence[str],
    second_moments: Sequence[torch.Tensor],
    n_rows: Sequence[int],
    sublayers: Sequence[str | None],
    *,
    solver: str = "fast",
    placement: str = "pre",
    anchor: bool = False,
) -> SigmaMinProfile:
    """``sigma_min``, cumulative ratio and step at every residual point, in forward order.

    Args:
        names: the points' names (module paths), ``p_0`` first; must be distinct (they key
            :meth:`SigmaMinProfile.as_dict`).
        second_moments: each point's uncentred second moment ``S_p`` ``(d, d)``.
        n_rows: each point's row count.
        sublayers: what lies before each point (``"attn"``, ``"mlp"``, ``"block"``, None).
        solver: ``"fast"`` or ``"dense"``, as for :func:`sigma_min`.
        placement: ``"pre"`` (default) or ``"post"``: with post-norm blocks the points are no
            identity-skip stream, so every ratio and step is NaN with reason ``"post_norm"``
            (the ``sigma_min`` values are still given).
        anchor: flag points whose rows do not span (reason ``"rank_deficient"``) and read the
            cumulative ratios against the first point that does (:class:`SigmaMinProfile`).
            Off by default here; the monitors and :func:`normscope.scan_model` always anchor
            (``dd/profile_anchor_depth`` says where).

    Returns:
        A :class:`SigmaMinProfile`. When ``p_0``'s ``sigma_min`` is NaN (or 0) every ratio and
        the summaries are NaN and ``reason`` says so; the steps, which need only neighbouring
        points, are still read. No read raises on data.

    Example::

        >>> import torch
        >>> prof = sigma_min_profile(
        ...     ["embed", "h.0", "h.1"],
        ...     [torch.eye(2), 4 * torch.eye(2), torch.diag(torch.tensor([1.0, 9.0]))],
        ...     [8, 8, 8], [None, "attn", "mlp"])
        >>> [(p.sigma_min_ratio, p.sigma_min_step) for p in prof.points]
        [(1.0, 1.0), (2.0, 2.0), (1.0, 0.5)]
        >>> prof.sigma_min_ratio_min, prof.worst_point
        (1.0, 'h.1')
    """
    lengths = {len(names), len(second_moments), len(n_rows), len(sublayers)}
    if len(lengths) != 1:
        raise ValueError(
            "sigma_min_profile: names, second_moments, n_rows and sublayers must have one entry "
            f"per point, got lengths {len(names)}, {len(second_moments)}, {len(n_rows)}, "
            f"{len(sublayers)}"
        )
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if list(names).count(n) > 1})
        raise ValueError(f"sigma_min_profile: point names must be distinct, repeated: {dupes}")
    check_solver(solver, "sigma_min_profile")
    check_placement(placement, "sigma_min_profile")
    if not names:
        return SigmaMinProfile((), _NAN, None, "no_points")

    reads = [
        _sigma_min(s, n, "sigma_min_profile", solver, flag=anchor)
        for s, n in zip(second_moments, n_rows)
    ]
    return profile_from_sigmas(
        names,
        sublayers,
        [(value, reason) for value, reason, _ in reads],
        [row_count(n, "sigma_min_profile") for n in n_rows],
        [m.shape[-1] for m in second_moments],
        dense_fallbacks=sum(f for _, _, f in reads),
        placement=placement,
    )


def profile_from_sigmas(
    names: Sequence[str],
    sublayers: Sequence[str | None],
    sigmas: Sequence[tuple[float, str | None]],
    n_rows: Sequence[int],
    dims: Sequence[int],
    *,
    dense_fallbacks: int = 0,
    placement: str = "pre",
) -> SigmaMinProfile:
    """The profile from each point's solved ``(sigma_min, reason)``, row count and width:
    what :func:`sigma_min_profile` builds once its points are solved (a read split across
    ranks solves them apart and builds it here). Same ratios, steps, intervals and reasons.

    Example::

        >>> prof = profile_from_sigmas(["embed", "h.0"], [None, "attn"],
        ...                            [(1.0, None), (2.0, None)], [8, 8], [2, 2])
        >>> prof.sigma_min_ratio_min, prof.worst_point
        (2.0, 'h.0')
    """
    if not names:
        return SigmaMinProfile((), _NAN, None, "no_points", dense_fallbacks=dense_fallbacks)
    fb = dense_fallbacks
    if check_placement(placement, "profile_from_sigmas") == "post":
        pts = tuple(
            ProfilePoint(
                name, k, sub, value, _NAN, _NAN, int(n), POST_NORM, n / dim if dim else _NAN
            )
            for k, (name, sub, (value, _), n, dim) in enumerate(
                zip(names, sublayers, sigmas, n_rows, dims)
            )
        )
        return SigmaMinProfile(pts, _NAN, None, POST_NORM, dense_fallbacks=fb)
    # The anchor: p_0, or past leading points whose rows do not span (reason rank_deficient)
    a = 0
    while a < len(sigmas) - 1 and sigmas[a][1] == RANK_DEFICIENT:
        a += 1
    first = sigmas[a][0]
    first_ok = math.isfinite(first) and first > 0 and sigmas[a][1] != RANK_DEFICIENT
    points: list[ProfilePoint] = []
    for k, (name, (value, reason)) in enumerate(zip(names, sigmas)):
        if k < a:  # before the anchor: no ratio, no step (the rows do not span)
            ratio = step = _NAN
        elif k == a:
            ratio = 1.0 if first_ok else _NAN
            step = ratio if k == 0 else _NAN
            if reason is None and not first_ok:
                reason = "first_point_unavailable"
            elif reason is None and k > 0:
                reason = "previous_point_unavailable"  # the step's previous point: rank-deficient
        else:
            prev = sigmas[k - 1][0]
            ratio = value / first if first_ok else _NAN
            step = value / prev if math.isfinite(prev) and prev > 0 else _NAN
            if reason is None and not first_ok:
                reason = "first_point_unavailable"
            elif reason is None and math.isnan(step):
                reason = "previous_point_unavailable"
        count = int(n_rows[k])
        dim = dims[k]
        per_dim = count / dim if dim else _NAN
        if k < a:
            bounds = (_NAN,) * 4
        elif k == a:
            good = per_dim >= MIN_ROWS_PER_DIM
            bounds = (ratio, ratio, step, step) if good else (_NAN,) * 4
        else:
            n0 = min(count, int(n_rows[a]))
            n1 = min(count, int(n_rows[k - 1]))
            bounds = (
                *ratio_bounds(ratio, n0, n0 / dim),
                *ratio_bounds(step, n1, n1 / dim),
            )
        points.append(
            ProfilePoint(name, k, sublayers[k], value, ratio, step, count, reason, per_dim, *bounds)
        )

    pts = tuple(points)
    anchor = {"anchor": names[a] if first_ok else None, "anchor_depth": a}
    if not first_ok:
        return SigmaMinProfile(
            pts, _NAN, None, "first_point_unavailable", dense_fallbacks=fb, **anchor
        )
    if len(points) == a + 1:
        return SigmaMinProfile(pts, _NAN, None, "single_point", dense_fallbacks=fb, **anchor)
    later = [p for p in points[a + 1 :] if math.isfinite(p.sigma_min_ratio)]
    if not later:
        return SigmaMinProfile(pts, _NAN, None, "no_finite_ratio", dense_fallbacks=fb, **anchor)
    worst = min(later, key=lambda p: p.sigma_min_ratio)
    return SigmaMinProfile(
        pts, worst.sigma_min_ratio, worst.name, None, dense_fallbacks=fb, **anchor
    )
