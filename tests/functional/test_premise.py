"""``placement="post"``: the reads whose premise is a pre-norm residual stream answer NaN with
the reason ``post_norm`` (functional.premise); the kernel reads take no placement."""

from __future__ import annotations

import math

import pytest
import torch

from normscope.functional import POST_NORM, direction_depth, schur_quotient
from normscope.functional.premise import check_placement
from normscope.functional.profile import sigma_min_profile
from normscope.functional.retention import sublayer_retention

torch.set_num_threads(1)

C = torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))


def test_schur_quotient_post_norm_is_nan_with_reason():
    pre = schur_quotient(C, torch.ones(4), 8)
    assert pre.reason is None and math.isfinite(pre.schur_complement)
    post = schur_quotient(C, torch.ones(4), 8, placement="post", baseline=pre)
    assert post.reason == post.delta_reason == POST_NORM == "post_norm"
    assert all(math.isnan(v) for v in post.as_dict().values())


def test_direction_depth_post_norm_is_nan_with_reason():
    read = direction_depth(C, torch.ones(4), 8, placement="post")
    assert read.reason == "post_norm" and math.isnan(read.delta_gamma)


@pytest.mark.parametrize("bad", ["Post", None, 1])
def test_unknown_placement_raises(bad):
    with pytest.raises(ValueError, match="placement must be one of"):
        check_placement(bad, "here")
    with pytest.raises(ValueError, match="placement"):
        schur_quotient(C, torch.ones(4), 8, placement=bad)


def test_profile_and_retention_post_norm_are_nan_with_reason():
    prof = sigma_min_profile(["a", "b"], [C, 2 * C], [8, 8], [None, "mlp"], placement="post")
    assert prof.reason == "post_norm" and prof.worst_point is None
    assert all(p.reason == "post_norm" and math.isnan(p.sigma_min_ratio) for p in prof.points)
    assert prof.points[1].sigma_min == pytest.approx(math.sqrt(2.0))  # the value is still read
    assert sublayer_retention(C, C, 8, placement="post").reason == "post_norm"
