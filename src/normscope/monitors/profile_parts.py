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
    [(1.0, None, 0), (2.0, None, 0)]
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
    SigmaMinProfile,
    profile_from_sigmas,
    sigma_min_profile,
)

__all__ = ["point_sigma", "profile_from_parts"]

_NAN = math.nan


def point_sigma(second_moment: torch.Tensor, n_rows: int) -> tuple[float, str | None, int]:
    """One point's ``(sigma_min, reason, dense_fallbacks)``, as :func:`sigma_min_profile` reads
    it (its own reason: ``insufficient_rows``, ``non_finite_second_moment``, ``eigh_failed`` or
    None; ``dense_fallbacks``: 1 when the fast solver could not verify it)."""
    profile = sigma_min_profile(["p"], [second_moment], [n_rows], [None])
    point = profile.points[0]
    reason = None if point.reason == "first_point_unavailable" else point.reason
    return point.sigma_min, reason, profile.dense_fallbacks


def profile_from_parts(
    points: Sequence[Any],
    sigmas: Sequence[tuple],
    n_rows: Sequence[int],
    dims: Sequence[int],
    margins: Sequence[float] | None = None,
) -> SigmaMinProfile:
    """The profile of ``points`` (residual points: ``name``, ``sublayer``) from each point's
    :func:`point_sigma`, row count and width (:func:`profile_from_sigmas`, the dense fallbacks
    summed); ``margins``: ``p_1 ... p_L``'s no-cancellation margins (None: not measured)."""
    profile = profile_from_sigmas(
        [p.name for p in points],
        [p.sublayer for p in points],
        [(s[0], s[1]) for s in sigmas],
        n_rows,
        dims,
        dense_fallbacks=sum(s[2] if len(s) > 2 else 0 for s in sigmas),
    )
    if margins is None:
        return profile
    return dataclasses.replace(profile, no_cancellation_margin=(_NAN, *margins))
