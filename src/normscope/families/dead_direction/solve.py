"""The float64 solves of one read's jobs, on plain accumulators: a norm layer's reads
(:func:`read_norm`), a residual point's ``sigma_min`` (:func:`point_sigma`, or from the norm's
own ``eigh``: :func:`point_from_spectrum`), the profile put together
(:func:`profile_from_parts`) and the per-source profiles (:func:`read_sources_of`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from normscope.families.dead_direction.report import NormReport
from normscope.functional.covariance import host_array, on_device
from normscope.functional.dead_direction import GammaRead, KernelRead, gamma_read, kernel_read
from normscope.functional.depth import input_reads, secular_bottom
from normscope.functional.profile import (
    RANK_DEFICIENT,
    RANK_TOL,
    SigmaMinProfile,
    profile_from_sigmas,
    sigma_min_profile,
)
from normscope.taps.hooks import Tap
from normscope.taps.norms import NormLayer
from normscope.taps.residual import ResidualLayout

__all__ = [
    "anchors",
    "point_from_spectrum",
    "point_sigma",
    "profile_from_parts",
    "read_norm",
    "read_norm_cheap",
    "read_sources_of",
]


def point_from_spectrum(
    accumulator: Any, spectrum: tuple[torch.Tensor, torch.Tensor] | None, *, anchor: bool = True
) -> tuple[float, str | None, int]:
    """A residual point's :func:`point_sigma` from the ``eigh`` of its covariance ``C`` that the
    norm reading it took: ``S = C + mu mu^T``, so ``lambda_1(S)`` is the smallest root of the
    rank-one update's secular equation (:func:`~normscope.functional.depth.rank_one_floor`,
    :func:`~normscope.functional.depth.secular_bottom`)
    and ``||S||_F^2 = sum lambda_i^2 + 2 sum lambda_i z_i^2 + (sum z_i^2)^2`` (``z = U^T mu``)
    for the ``rank_deficient`` flag. Without a spectrum (the norm's input reads had a reason
    first: an RMSNorm, too few rows...) the point's own decomposition answers
    (:func:`point_sigma`)."""
    if spectrum is None:
        return point_sigma(accumulator.second_moment(), accumulator.count, anchor=anchor)
    evals, evecs = spectrum
    host = host_array(torch.stack([evals, evecs.mT @ on_device(accumulator.mean, evecs)]))
    lam, z2 = host[0], host[1] ** 2
    low = secular_bottom(lam, z2)
    reason = None
    if anchor:
        fro2 = float((lam**2).sum() + 2 * (lam * z2).sum() + z2.sum() ** 2)
        if not low > RANK_TOL * math.sqrt(max(fro2, 0.0)):
            reason = RANK_DEFICIENT
    return math.sqrt(max(low, 0.0)), reason, 0


def read_norm(
    norm: NormLayer,
    tap_in: Tap,
    tap_out: Tap,
    gamma: torch.Tensor | GammaRead,
    null_tol: float,
    placement: str = "pre",
) -> NormReport:
    """Every read of ``norm`` from its input and output taps, with the window's ``gamma``: the
    kernel reads of the output covariance, and of the input covariance the Schur quotient and
    ``v*``'s depth with its control (one ``eigh`` for both: :func:`input_reads`;
    docs/metrics.md §1.3). ``placement="post"``
    (a post-norm block: the input is not the residual stream): the input reads are NaN with
    the reason ``post_norm``. ``gamma`` may be its
    :class:`~normscope.functional.gamma.GammaRead` already taken (:func:`solve_window` takes
    every norm's in one batch, :func:`~normscope.functional.gamma.gamma_reads`)."""
    g = gamma if isinstance(gamma, GammaRead) else gamma_read(gamma)
    n_out = tap_out.accumulator.count
    n_in = tap_in.accumulator.count
    kernel = kernel_read(
        tap_out.accumulator.covariance(), g, n_out, null_tol=null_tol, declared_kind=norm.kind
    )
    cov_in = tap_in.accumulator.covariance()
    read = input_reads(cov_in, g, n_in, declared_kind=norm.kind, placement=placement)
    return NormReport(norm.name, norm.kind, g, kernel, read.schur, read.depth, n_out, read.spectrum)


def read_norm_cheap(norm: NormLayer, tap_out: Tap, gamma: torch.Tensor | GammaRead) -> NormReport:
    """The cheap tier's read of ``norm`` (docs/costs.md, "Tiers"): the gamma read and the
    output's row count, nothing of its co-moment (a cheap window folds the diagonal only);
    the report's other reads are absent (``spectral=False``)."""
    g = gamma if isinstance(gamma, GammaRead) else gamma_read(gamma)
    n = tap_out.accumulator.count
    nan = math.nan
    kernel = KernelRead(nan, nan, nan, nan, nan, "indeterminate", n, g.reason, ())
    return NormReport(norm.name, norm.kind, g, kernel, None, None, n, spectral=False)


def anchors(layout: ResidualLayout | None) -> bool:
    """Whether a profile over ``layout`` anchors past leading points that do not span: yes,
    except on post-norm blocks, whose points are LayerNorm outputs (with ``beta = 0`` they never
    span: the kernel itself), so no point would anchor."""
    return layout is None or layout.style != "post-norm"


def point_sigma(
    second_moment: torch.Tensor, n_rows: int, *, anchor: bool = True
) -> tuple[float, str | None, int]:
    """One point's ``(sigma_min, reason, dense_fallbacks)``, as
    :func:`~normscope.functional.profile.sigma_min_profile` reads it (its own reason:
    ``insufficient_rows``, ``non_finite_second_moment``, ``eigh_failed``, ``rank_deficient``
    (``anchor``: the rows do not span) or None; ``dense_fallbacks``: 1 when the fast solver
    could not verify it).

    Example::

        >>> point_sigma(4 * torch.eye(2), 8)
        (2.0, None, 0)
    """
    profile = sigma_min_profile(["p"], [second_moment], [n_rows], [None], anchor=anchor)
    point = profile.points[0]
    reason = None if point.reason == "first_point_unavailable" else point.reason
    return point.sigma_min, reason, profile.dense_fallbacks


def profile_from_parts(
    points: Sequence[Any],
    sigmas: Sequence[tuple],
    n_rows: Sequence[int],
    dims: Sequence[int],
    placement: str = "pre",
) -> SigmaMinProfile:
    """The profile of ``points`` (residual points: ``name``, ``sublayer``) from each point's
    :func:`point_sigma`, row count and width (the dense fallbacks summed). The one profile
    builder of the monitor's reads. ``placement="post"`` (post-norm blocks): every point is a
    LayerNorm output, whose smallest direction is that norm's own kernel by construction, so
    every ratio and step, and ``sigma_min_ratio_min``, is NaN with reason ``post_norm`` (the
    ``sigma_min`` values stand).

    Example::

        >>> from types import SimpleNamespace as P
        >>> parts = [point_sigma(m, 8) for m in (torch.eye(2), 4 * torch.eye(2))]
        >>> points = [P(name="embed", sublayer=None), P(name="h.0", sublayer="block")]
        >>> profile_from_parts(points, parts, [8, 8], [2, 2]).sigma_min_ratio_min
        2.0
    """
    return profile_from_sigmas(
        [p.name for p in points],
        [p.sublayer for p in points],
        [(s[0], s[1]) for s in sigmas],
        n_rows,
        dims,
        dense_fallbacks=sum(s[2] if len(s) > 2 else 0 for s in sigmas),
        placement=placement,
    )


def read_sources_of(
    accs_by_source: dict[str, list], layout: ResidualLayout
) -> dict[str, SigmaMinProfile]:
    """One profile per source, on its own rows (NaN with ``insufficient_rows`` below ``2 d``
    rows at a point), from the per-source accumulators by source name."""
    points = layout.points
    out: dict[str, SigmaMinProfile] = {}
    for name in sorted(accs_by_source):
        accs = accs_by_source[name]
        out[name] = sigma_min_profile(
            [p.name for p in points],
            [a.second_moment() for a in accs],
            [a.count for a in accs],
            [p.sublayer for p in points],
            anchor=anchors(layout),
            placement="post" if layout.style == "post-norm" else "pre",
        )
    return out
