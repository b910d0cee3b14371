"""``profile_from_parts`` (a profile put together from points solved apart, as a read split
across ranks does) equals ``sigma_min_profile(..., anchor=True)`` on the same moments, NaN cases and an anchor
past a zero entry included."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from normscope.families.dead_direction.solve import point_sigma, profile_from_parts
from normscope.functional.profile import sigma_min_profile


def _moment(d: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8 * d, d, dtype=torch.float64, generator=g) * scale
    return x.T @ x / x.shape[0]


CASES = {
    "healthy": ([1.0, 0.9, 1.2, 0.5], [64, 64, 64, 64]),
    "few rows at p2": ([1.0, 0.9, 1.2, 0.5], [64, 64, 5, 64]),
    "p0 unavailable": ([1.0, 0.9, 1.2], [5, 64, 64]),
    "single point": ([1.0], [64]),
    "a zero moment": ([1.0, 0.0, 1.0], [64, 64, 64]),
    "a zero entry (anchored past it)": ([0.0, 1.0, 1.2], [64, 64, 64]),
    "non-finite": ([1.0, math.nan, 1.0], [64, 64, 64]),
}


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return a == b


@pytest.mark.parametrize("case", list(CASES))
def test_parts_equal_the_whole_profile(case):
    scales, rows = CASES[case]
    d = 4
    moments = [_moment(d, s, k) if not math.isnan(s) else torch.full((d, d), math.nan,
               dtype=torch.float64) for k, s in enumerate(scales)]  # fmt: skip
    names = [f"p{k}" for k in range(len(scales))]
    subs = [None] + ["attn"] * (len(scales) - 1)
    whole = sigma_min_profile(names, moments, rows, subs, anchor=True)  # as the monitor reads
    points = [SimpleNamespace(name=n, sublayer=s) for n, s in zip(names, subs)]
    parts = profile_from_parts(points, [point_sigma(m, n) for m, n in zip(moments, rows)],
                               rows, [d] * len(rows))  # fmt: skip
    for field in dataclasses.fields(whole):
        a, b = getattr(whole, field.name), getattr(parts, field.name)
        if field.name == "points":
            for pa, pb in zip(a, b):
                for f in dataclasses.fields(pa):
                    assert _same(getattr(pa, f.name), getattr(pb, f.name)), (case, f.name)
            assert len(a) == len(b)
        else:
            assert _same(a, b), (case, field.name)


def test_dense_fallbacks_of_points_solved_apart_are_summed():
    """A split read's points report their dense fallbacks with their values; the profile put
    together from them counts them, as ``sigma_min_profile`` does (``dd/solver_fallbacks``)."""
    points = [
        SimpleNamespace(name="embed", sublayer=None),
        SimpleNamespace(name="h.0", sublayer="attn"),
    ]
    profile = profile_from_parts(points, [(1.0, None, 1), (2.0, None, 0)], [8, 8], [2, 2])
    assert profile.dense_fallbacks == 1
    assert profile.sigma_min_ratio_min == 2.0
    # the old two-field records (value, reason) still build a profile, with no fallbacks
    assert (
        profile_from_parts(points, [(1.0, None), (2.0, None)], [8, 8], [2, 2]).dense_fallbacks == 0
    )
