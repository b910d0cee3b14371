"""Rank-deficient entry points (issue 33): the cumulative ``sigma_min`` ratios anchor at the
first residual point whose rows span, against numpy's ``eigvalsh`` of the same moments.

Tolerances: relative 1e-10 on ratios against numpy (both dense float64 symmetric solvers on
the same matrices, condition numbers under 1e4 at the anchor and later points).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from normscope.functional.profile import RANK_DEFICIENT, profile_from_sigmas, sigma_min_profile

torch.set_num_threads(1)


def vit_like(d: int = 48, m: int = 30, n: int = 1024, seed: int = 0, dtype=torch.float64):
    """p_0: patch + position embeddings of rank m < d; p_1, p_2, p_3: a full-rank update
    added at each sublayer, so the stream spans from p_1 on."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, m, generator=g, dtype=torch.float64)).Q
    x = (torch.randn(n, m, generator=g, dtype=torch.float64) @ basis.T).to(dtype).double()
    points = [x]
    for _ in range(3):
        x = x + 0.5 * torch.randn(n, d, generator=g, dtype=torch.float64)
        points.append(x)
    return [p.T @ p / n for p in points]


def np_sigma(s: torch.Tensor) -> float:
    return math.sqrt(max(np.linalg.eigvalsh(s.numpy())[0], 0.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ratios_anchor_at_the_first_point_that_spans(dtype):
    moments = vit_like(dtype=dtype)
    names, subs = ["embed", "h.0.attn", "h.0.mlp", "h.1.attn"], [None, "attn", "mlp", "attn"]
    prof = sigma_min_profile(names, moments, [1024] * 4, subs, solver="dense", anchor=True)
    assert prof.rank_deficient_entry and prof.anchor == "h.0.attn" and prof.anchor_depth == 1
    p0, p1 = prof.points[0], prof.points[1]
    assert p0.reason == RANK_DEFICIENT and math.isnan(p0.sigma_min_ratio)
    assert p0.sigma_min < 1e-6  # exactly 0 in float64 rows, rounding (~1e-8) from float32
    assert p1.sigma_min_ratio == 1.0 and math.isnan(p1.sigma_min_step)
    assert p1.reason == "previous_point_unavailable"
    anchor = np_sigma(moments[1])
    for k in (2, 3):
        assert prof.points[k].reason is None
        assert prof.points[k].sigma_min_ratio == pytest.approx(
            np_sigma(moments[k]) / anchor, rel=1e-10
        )
        assert math.isfinite(prof.points[k].ratio_lo)
    assert prof.reason is None and math.isfinite(prof.sigma_min_ratio_min)
    assert prof.worst_point in names[2:]


def test_a_full_rank_entry_keeps_p0_as_anchor():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=g, dtype=torch.float64)
    moments = [x.T @ x / 512, 4 * x.T @ x / 512]
    prof = sigma_min_profile(["a", "b"], moments, [512, 512], [None, "block"], anchor=True)
    assert prof.anchor == "a" and prof.anchor_depth == 0 and not prof.rank_deficient_entry
    assert prof.points[1].sigma_min_ratio == pytest.approx(2.0, rel=1e-12)


def test_a_later_point_that_stops_spanning_keeps_its_ratio_and_the_flag():
    """A collapse to exact zero after the anchor is what the profile is for: not skipped."""
    d, n = 16, 256
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = x.clone()
    y[:, 0] = 0.0
    moments = [x.T @ x / n, y.T @ y / n]
    prof = sigma_min_profile(["a", "b"], moments, [n, n], [None, "mlp"], anchor=True)
    assert prof.anchor == "a"
    assert prof.points[1].reason == RANK_DEFICIENT and prof.points[1].sigma_min_ratio < 1e-6
    assert prof.worst_point == "b"


def test_no_point_spans():
    m = torch.diag(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64))
    prof = sigma_min_profile(["a", "b"], [m, m], [8, 8], [None, "mlp"], anchor=True)
    assert prof.reason == "first_point_unavailable" and prof.anchor is None
    assert all(p.reason == RANK_DEFICIENT for p in prof.points)


def test_split_read_gets_the_same_anchor():
    moments = vit_like()
    names, subs = ["e", "a0", "m0", "a1"], [None, "attn", "mlp", "attn"]
    whole = sigma_min_profile(names, moments, [1024] * 4, subs, solver="dense", anchor=True)
    parts = [(p.sigma_min, RANK_DEFICIENT if k == 0 else None) for k, p in enumerate(whole.points)]
    split = profile_from_sigmas(names, subs, parts, [1024] * 4, [48] * 4)
    assert split.anchor == whole.anchor
    assert [p.sigma_min_ratio for p in split.points[1:]] == [
        p.sigma_min_ratio for p in whole.points[1:]
    ]
