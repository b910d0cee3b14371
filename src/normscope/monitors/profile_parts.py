"""The ``sigma_min`` profile from per-point parts solved apart (a read split across ranks).

:func:`normscope.functional.profile.sigma_min_profile` takes every point's second moment and
solves them all. A split read solves each point on one rank (:func:`point_sigma`) and puts the
profile together from the gathered values (:func:`profile_from_parts`), with the same ratios,
steps, intervals and reasons; ``tests/monitors/test_profile_parts.py`` checks the two agree.
Only the public API of :mod:`normscope.functional.profile` is used.

Example::

    >>> import torch
    >>> from types import SimpleNamespace as P
    >>> parts = [point_sigma(m, 8) for m in (torch.eye(2), 4 * torch.eye(2))]
    >>> parts
    [(1.0, None), (2.0, None)]
    >>> points = [P(name="embed", sublayer=None), P(name="h.0", sublayer="block")]
    >>> profile_from_parts(points, parts, [8, 8], [2, 2]).sigma_min_ratio_min
    2.0
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from normscope.functional.profile import (
    MIN_ROWS_PER_DIM,
    ProfilePoint,
    SigmaMinProfile,
    ratio_bounds,
    sigma_min_profile,
)

__all__ = ["point_sigma", "profile_from_parts"]

_NAN = math.nan


def point_sigma(second_moment: torch.Tensor, n_rows: int) -> tuple[float, str | None]:
    """One point's ``(sigma_min, reason)``, as :func:`sigma_min_profile` reads it (its own
    reason: ``insufficient_rows``, ``non_finite_second_moment``, ``eigh_failed`` or None)."""
    point = sigma_min_profile(["p"], [second_moment], [n_rows], [None]).points[0]
    reason = None if point.reason == "first_point_unavailable" else point.reason
    return point.sigma_min, reason


def profile_from_parts(
    points: Sequence[Any],
    sigmas: Sequence[tuple[float, str | None]],
    n_rows: Sequence[int],
    dims: Sequence[int],
    margins: Sequence[float] | None = None,
) -> SigmaMinProfile:
    """The profile of ``points`` (residual points: ``name``, ``sublayer``) from each point's
    :func:`point_sigma`, row count and width; ``margins``: ``p_1 ... p_L``'s no-cancellation
    margins (None: not measured)."""
    if not points:
        return SigmaMinProfile((), _NAN, None, "no_points")
    first = sigmas[0][0]
    first_ok = math.isfinite(first) and first > 0
    out: list[ProfilePoint] = []
    for k, (point, (value, reason)) in enumerate(zip(points, sigmas)):
        if k == 0:
            ratio = step = 1.0 if first_ok else _NAN
            reason = reason or (None if first_ok else "first_point_unavailable")
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
        if k == 0:
            bounds = (ratio, ratio, step, step) if per_dim >= MIN_ROWS_PER_DIM else (_NAN,) * 4
        else:
            n0 = min(count, int(n_rows[0]))
            n1 = min(count, int(n_rows[k - 1]))
            bounds = (*ratio_bounds(ratio, n0, n0 / dim), *ratio_bounds(step, n1, n1 / dim))
        out.append(
            ProfilePoint(
                point.name, k, point.sublayer, value, ratio, step, count, reason, per_dim, *bounds
            )
        )
    if not first_ok:
        profile = SigmaMinProfile(tuple(out), _NAN, None, "first_point_unavailable")
    elif len(out) == 1:
        profile = SigmaMinProfile(tuple(out), _NAN, None, "single_point")
    else:
        later = [p for p in out[1:] if math.isfinite(p.sigma_min_ratio)]
        if not later:
            profile = SigmaMinProfile(tuple(out), _NAN, None, "no_finite_ratio")
        else:
            worst = min(later, key=lambda p: p.sigma_min_ratio)
            profile = SigmaMinProfile(tuple(out), worst.sigma_min_ratio, worst.name, None)
    if margins is None:
        return profile
    return dataclasses.replace(profile, no_cancellation_margin=(_NAN, *margins))
