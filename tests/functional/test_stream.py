"""The stream reads (docs/metrics.md §1.6): offset share, RMS, RankMe, gain drift, the share of
non-finite rows, each from a real accumulator's parts against numpy on the rows themselves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from normscope.functional import StreamingCovariance
from normscope.functional.gamma import gamma_read, gamma_reads
from normscope.functional.stream import (
    effective_rank,
    gain_drift,
    gain_drifts,
    nonfinite_share,
    offset_share,
    stream_rms,
    stream_scales,
)


def _rows(n: int, d: int, offset: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(d, generator=g)
    scales = torch.linspace(0.1, 2.0, d)
    return offset * shared + torch.randn(n, d, generator=g) * scales


def _fold(rows: torch.Tensor) -> StreamingCovariance:
    acc = StreamingCovariance(rows.shape[1], max_rows=None)
    for chunk in rows.split(37):  # several folds: the streaming merge, not one batch
        acc.update(chunk)
    return acc


@pytest.mark.parametrize("offset", [0.0, 0.5, 3.0, 30.0])
def test_offset_share_and_rms_equal_numpy_on_the_rows(offset):
    rows = _rows(300, 24, offset)
    acc = _fold(rows)
    x = rows.double().numpy()
    want_share = np.sum(x.mean(0) ** 2) / np.mean(np.sum(x**2, axis=1))
    want_rms = math.sqrt(np.mean(x**2))
    var = acc.comoment.diagonal() / acc.count
    # float64 folds of float32 rows: the moments agree with numpy's to rounding (1e-12 relative)
    assert offset_share(acc.mean, var, acc.count) == pytest.approx(want_share, rel=1e-12, abs=1e-15)
    assert offset_share(acc.mean, acc.covariance(), acc.count) == pytest.approx(
        want_share, rel=1e-12, abs=1e-15
    )
    assert stream_rms(acc.mean, var, acc.count) == pytest.approx(want_rms, rel=1e-12)


def test_offset_share_extremes_and_nan():
    same = torch.ones(10, 4) * torch.tensor([1.0, -2.0, 0.5, 3.0])
    acc = _fold(same)
    assert offset_share(acc.mean, acc.covariance(), acc.count) == pytest.approx(1.0, abs=1e-15)
    empty = StreamingCovariance(4)
    assert math.isnan(offset_share(empty.mean, torch.zeros(4), empty.count))
    assert math.isnan(stream_rms(empty.mean, torch.zeros(4), empty.count))
    bad = torch.tensor([float("nan"), 0.0])
    assert math.isnan(offset_share(bad, torch.ones(2), 5))
    with pytest.raises(ValueError, match="differ"):
        offset_share(torch.zeros(3), torch.ones(2), 5)


@pytest.mark.parametrize("offset", [0.0, 3.0])
def test_rankme_equals_numpy_svd_of_the_rows(offset):
    rows = _rows(400, 32, offset, seed=1)
    acc = _fold(rows)
    x = rows.double().numpy()

    def rankme(m):
        s = np.linalg.svd(m, compute_uv=False)
        p = s / s.sum()
        p = p[p > 0]
        return math.exp(-np.sum(p * np.log(p)))

    # eigenvalues of the d x d moment against the singular values of the N x d rows: the same
    # spectrum by two routes, to 1e-9 relative (the smallest eigenvalues are squared rounding)
    assert effective_rank(acc.second_moment(), acc.count) == pytest.approx(rankme(x), rel=1e-9)
    centred = x - x.mean(0)
    assert effective_rank(acc.covariance(), acc.count) == pytest.approx(rankme(centred), rel=1e-9)


def test_rankme_of_a_shared_offset_falls_and_its_centred_twin_does_not():
    spread = _rows(400, 32, 0.0, seed=2)
    piled = _rows(400, 32, 30.0, seed=2)
    a, b = _fold(spread), _fold(piled)
    assert effective_rank(a.second_moment(), a.count) > 20
    assert effective_rank(b.second_moment(), b.count) < 3  # one direction holds the rows
    assert effective_rank(b.covariance(), b.count) == pytest.approx(
        effective_rank(a.covariance(), a.count), rel=1e-6
    )  # the spread about the mean is the same rows
    assert math.isnan(effective_rank(torch.eye(3), 1))
    assert math.isnan(effective_rank(torch.full((3, 3), float("inf")), 10))


def test_gain_drift_equals_numpy():
    g = torch.Generator().manual_seed(3)
    g0 = 1 + 0.1 * torch.randn(65, generator=g)
    g1 = 0.05 * g0 + 0.08 * torch.randn(65, generator=g)
    scale, crossed = gain_drift(g1, g0)
    a, a0 = g1.double().numpy(), g0.double().numpy()
    # torch.median is the lower median; with 65 entries there is one middle: numpy's median
    assert scale == pytest.approx(np.median(np.abs(a)) / np.median(np.abs(a0)), rel=1e-12)
    assert crossed == pytest.approx(np.mean(np.sign(a) != np.sign(a0)), abs=0)
    assert 0 < crossed < 1
    assert gain_drift(g0, g0) == (1.0, 0.0)


def test_nonfinite_share():
    assert nonfinite_share(0, 512) == 0.0
    assert nonfinite_share(512, 0) == 1.0
    assert nonfinite_share(0, 0) == 0.0
    with pytest.raises(ValueError):
        nonfinite_share(-1, 4)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-15, abs=0.0)


def test_the_batched_reads_equal_one_call_each():
    """stream_scales, gain_drifts and gamma_reads (issue 35: one stacked computation and one
    copy to the host per group of equal shapes) give each layer's single read: widths mixed,
    a stream without rows, gains with a zero, a NaN, a dead channel."""
    accs = [
        _fold(_rows(300, d, off, seed)) for d, off, seed in ((8, 0.0, 1), (8, 3.0, 2), (5, 1.0, 3))
    ]
    accs.append(StreamingCovariance(8))  # no rows: NaN
    means = [a.mean for a in accs]
    variances = [a.comoment.diagonal() / max(a.count, 1) for a in accs]
    counts = [a.count for a in accs]
    shares, rms = stream_scales(means, variances, counts)
    for mu, var, n, share, scale in zip(means, variances, counts, shares, rms):
        assert _same(share, offset_share(mu, var, n)) and _same(scale, stream_rms(mu, var, n))
    assert stream_scales([accs[0].mean], [accs[0].covariance()], [counts[0]])[0] == [shares[0]]

    g = torch.Generator().manual_seed(0)
    gammas = [torch.randn(8, generator=g, dtype=torch.float64) for _ in range(3)]
    gammas[1][2] = 0.0
    gammas[2][0] = math.nan
    gammas.append(torch.randn(5, generator=g))  # float32, another width
    bases = [torch.randn(g_.shape[0], generator=g, dtype=torch.float64) for g_ in gammas]
    for got, gamma, base in zip(gain_drifts(gammas, bases), gammas, bases):
        want = gain_drift(gamma, base)
        assert _same(got[0], want[0]) and _same(got[1], want[1])
    assert gain_drifts([], []) == []

    gains = [torch.linspace(0.5, 2.0, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)]
    gains += [torch.tensor([1.0, 0.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)]
    gains += [torch.full((8,), math.inf, dtype=torch.float64), torch.rand(5, generator=g) + 0.5]
    for got, gamma in zip(gamma_reads(gains), gains):
        want = gamma_read(gamma)
        assert (got.dead_channels, got.dead_index, got.reason, got.dim) == (
            want.dead_channels, want.dead_index, want.reason, want.dim,
        )  # fmt: skip
        for key in ("gamma_min", "gamma_max", "gamma_spread"):
            assert _same(getattr(got, key), getattr(want, key)), key
        # v* itself, to the last bit: the kernel residual is a rounding-level quadratic form
        assert (got.v_star is None) == (want.v_star is None)
        assert got.v_star is None or torch.equal(got.v_star, want.v_star)
