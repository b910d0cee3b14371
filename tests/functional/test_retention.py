"""``sublayer_retention``: the pencil ``(S_k, S_{k-1})`` of one sublayer (docs/metrics.md §1.4)
against scipy's generalized symmetric-definite eigensolver.

Tolerances: relative 1e-8 against ``scipy.linalg.eigh(S_k, S_{k-1})`` for ``kappa(S_{k-1}) <=
1e6`` (both float64; the pencil's eigenvalues carry about ``eps kappa`` of relative error,
2e-10, and the two routes, Cholesky against eigendecomposition, differ by that much); 1e-12
where the answer is exact (commuting, diagonal moments).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch

from normscope.functional.retention import RetentionRead, sublayer_retention

torch.set_num_threads(1)


def spd(d: int, rng: np.random.Generator, decades: float = 3.0) -> np.ndarray:
    q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    s = q @ np.diag(10.0 ** rng.uniform(-decades, 0, d)) @ q.T
    return (s + s.T) / 2


@pytest.mark.parametrize("seed", range(3))
def test_pencil_matches_scipy(seed):
    d = 48
    rng = np.random.default_rng(seed)
    a, b = spd(d, rng), spd(d, rng)
    read = sublayer_retention(torch.from_numpy(a), torch.from_numpy(b), 4 * d, k=5)
    ref = scipy.linalg.eigh(b, a, eigvals_only=True)
    assert read.reason is None and read.live_dim == d
    assert read.cancelled_dims == int((ref < 0.01).sum())
    assert read.bottom == pytest.approx(ref[:5], rel=1e-8)
    assert read.retention_min == pytest.approx(ref[0], rel=1e-8)
    assert read.retention == pytest.approx(math.exp(np.log(ref[:5]).mean()), rel=1e-8)
    assert read.loewner == (ref[0] >= 1)


def test_planted_cancellation_reads_one_minus_s_squared():
    """x_k = x_{k-1} (I - s P), P a coordinate projector of rank 6 on a diagonal moment: the
    bottom 6 pencil eigenvalues are exactly (1 - s)^2, the others 1."""
    d, s = 32, 0.9
    rng = np.random.default_rng(1)
    a = np.diag(10.0 ** rng.uniform(-2, 0, d))
    keep = np.ones(d)
    keep[rng.choice(d, 6, replace=False)] = 1 - s
    b = np.diag(keep) @ a @ np.diag(keep)
    read = sublayer_retention(torch.from_numpy(a), torch.from_numpy(b), 4 * d)
    assert read.retention == pytest.approx((1 - s) ** 2, rel=1e-12)
    assert read.retention_min == pytest.approx((1 - s) ** 2, rel=1e-12)
    assert not read.loewner and read.cancelled_dims == 6
    assert (
        sublayer_retention(
            torch.from_numpy(a), torch.from_numpy(b), 4 * d, cut=0.005
        ).cancelled_dims
        == 0
    )


def test_a_branch_that_only_adds_keeps_everything():
    """S_k = S_{k-1} + S_f (an update uncorrelated with the stream): every rho >= 1, the
    Loewner premise holds and retention >= 1."""
    d = 40
    rng = np.random.default_rng(2)
    a = spd(d, rng)
    f = rng.standard_normal((d, 5))
    read = sublayer_retention(torch.from_numpy(a), torch.from_numpy(a + f @ f.T), 4 * d)
    assert read.loewner and read.retention_min >= 1 - 1e-9 and read.retention >= 1 - 1e-9


def test_random_rotation_cancelling_from_rows():
    """From rows: a stream, and the same stream with a rank-8 random subspace cut to 5%. With
    P not commuting with S the pencil's bottom 8 are the squared singular values of
    S^1/2 (I - s P) S^-1/2, not (1 - s)^2 each, but all 8 are far under 1 and the rest is
    at least 1 - rounding (I - s P differs from I on 8 dimensions only: at least d - 16 of
    the pencil's eigenvalues are exactly 1)."""
    d, n, s = 64, 4096, 0.95
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.diag(
        torch.linspace(0.2, 2.0, d, dtype=torch.float64)
    )
    q = torch.linalg.qr(torch.randn(d, 8, generator=g, dtype=torch.float64)).Q
    y = x - s * (x @ q) @ q.T
    read = sublayer_retention(x.T @ x / n, y.T @ y / n, n, k=8)
    assert read.reason is None and max(read.bottom) < 0.05 and read.retention < 0.01
    everything = sublayer_retention(x.T @ x / n, y.T @ y / n, n, k=d)
    assert sum(abs(r - 1) < 1e-9 for r in everything.bottom) >= d - 16


def test_rank_deficient_previous_point_reads_on_its_live_subspace():
    d, m = 32, 20
    rng = np.random.default_rng(4)
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0][:, :m]
    a = basis @ np.diag(10.0 ** rng.uniform(-1, 0, m)) @ basis.T
    read = sublayer_retention(torch.from_numpy(a), torch.from_numpy(2.0 * a), 4 * d)
    assert read.live_dim == m and read.retention == pytest.approx(2.0, rel=1e-9)


@pytest.mark.parametrize(
    ("a", "n", "placement", "reason"),
    [
        (torch.eye(4), 8, "post", "post_norm"),
        (torch.eye(4), 7, "pre", "insufficient_rows"),
        (torch.full((4, 4), math.nan), 8, "pre", "non_finite_moment"),
        (torch.zeros(4, 4), 8, "pre", "previous_point_unavailable"),
    ],
)
def test_nan_reads_carry_a_reason(a, n, placement, reason):
    read = sublayer_retention(a.double(), torch.eye(4, dtype=torch.float64), n, placement=placement)
    assert isinstance(read, RetentionRead) and read.reason == reason
    assert math.isnan(read.retention) and math.isnan(read.retention_min)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="must match"):
        sublayer_retention(torch.eye(3), torch.eye(4), 8)
    with pytest.raises(ValueError, match="k must be"):
        sublayer_retention(torch.eye(4), torch.eye(4), 8, k=0)
