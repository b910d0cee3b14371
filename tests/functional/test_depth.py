"""``direction_depth``: v*'s depth beyond the typical direction, with its control
(docs/metrics.md §1.3), against numpy references on the same float64 covariance.

Tolerances: 1e-9 decades against numpy's ``eigh`` of the same matrix (both are LAPACK float64
solvers; an eigenvalue ``lambda`` is known to about ``d eps lambda_max``, so ``log10 lambda``
to about ``d eps kappa / ln 10``: 1e-9 at ``kappa = 1e6``, d = 64). Statistical checks
(random directions, random gains, rotated data) use the exact standard deviation
``sqrt(2 / (d + 2)) std(log10 lambda)`` of a random direction's depth: a mean over ``T`` draws
must lie within 4 standard errors of 0 (a false failure about once in 16,000 runs).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from normscope.functional import StreamingCovariance, gamma_read
from normscope.functional.depth import DepthRead, direction_depth, spectral_depth
from tests.support.norm_rows import make_gamma

torch.set_num_threads(1)


def steep_spectrum(d: int, rng: np.random.Generator, decades: float = 6.0) -> np.ndarray:
    """Log-uniform eigenvalues over ``decades`` decades (the trained demo's span)."""
    return 10.0 ** rng.uniform(-decades, 0.0, d)


def random_basis(d: int, rng: np.random.Generator, first: np.ndarray | None = None) -> np.ndarray:
    a = rng.standard_normal((d, d))
    if first is not None:
        a[:, 0] = first
    q, r = np.linalg.qr(a)
    return q * np.sign(np.diag(r))  # first column = +first / ||first||


def numpy_depth(c: np.ndarray, v: np.ndarray, live_tol: float = 1e-10) -> tuple[float, float, int]:
    """(depth, sd, live_dim) on the live subspace, the definition written out in numpy."""
    lam, u = np.linalg.eigh((c + c.T) / 2)
    live = lam > live_tol * lam[-1]
    lam, u = lam[live], u[:, live]
    w = (u.T @ v) ** 2
    w = w / w.sum()
    logs = np.log10(lam)
    return logs.mean() - w @ logs, math.sqrt(2 / (len(lam) + 2)) * logs.std(), int(live.sum())


@pytest.mark.parametrize("seed", range(4))
def test_depth_matches_numpy_reference(seed):
    d = 64
    rng = np.random.default_rng(seed)
    q = random_basis(d, rng)
    c = q @ np.diag(steep_spectrum(d, rng)) @ q.T
    c = (c + c.T) / 2
    gamma = make_gamma(d, seed).double()
    read = direction_depth(torch.from_numpy(c), gamma, 4 * d, control_seed=seed)
    depth, sd, live = numpy_depth(c, gamma_read(gamma).v_star.numpy())
    assert read.reason is None and read.live_dim == live == d and not read.rank_deficient
    assert read.depth == pytest.approx(depth, abs=1e-9)
    assert read.depth_sd == pytest.approx(sd, rel=1e-9)
    assert read.delta_gamma == pytest.approx(1 - 10**-depth, abs=1e-8)
    assert read.depth_z == pytest.approx(depth / sd, abs=1e-8)
    r = torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    control, _, _ = numpy_depth(c, (r / r.norm()).numpy())
    assert read.control_depth == pytest.approx(control, abs=1e-9)


def test_planted_deep_v_star_reads_its_exact_depth_and_rotation_removes_it():
    """C has v* as an eigenvector 5 decades under the others' geometric mean: depth is
    mean(log10 lambda) - log10 lambda_v*; the same spectrum in a random basis (v* no longer an
    eigenvector) reads ~0."""
    d = 96
    rng = np.random.default_rng(7)
    gamma = make_gamma(d, 7).double()
    v = gamma_read(gamma).v_star.numpy()
    lam = 10.0 ** rng.uniform(-1.0, 0.0, d)
    lam[0] = 1e-6
    q = random_basis(d, rng, first=v)
    c = q @ np.diag(lam) @ q.T
    read = direction_depth(torch.from_numpy(c), gamma, 4 * d)
    exact = np.log10(lam).mean() - np.log10(lam[0])
    assert read.depth == pytest.approx(exact, abs=1e-9)
    assert read.depth > 5.0 and read.delta_gamma > 0.99999 and read.depth_z > 20
    assert abs(read.control_depth) < 4 * read.depth_sd
    rotated = []
    for seed in range(40):
        o = random_basis(d, np.random.default_rng(100 + seed))
        cr = o @ c @ o.T
        rotated.append(direction_depth(torch.from_numpy((cr + cr.T) / 2), gamma, 4 * d))
    depths = np.array([r.depth for r in rotated])
    sd = rotated[0].depth_sd
    # one eigenvalue 5 decades out makes the distribution skewed (chi-square weight on it):
    # the mean is what is exact
    assert abs(depths.mean()) < 4 * sd / math.sqrt(len(depths))


def test_random_gains_on_unrelated_data_read_zero_on_average():
    """v* of random (log-normal, sigma = 1) gains on a steep spectrum whose basis is drawn
    apart from the gains: the mean depth over 60 draws is within 4 standard errors of 0, and so
    is the control's. (On one fixed basis the 60 v* would not be independent: every v* of
    positive gains leans on the ones direction, cos = exp(-sigma^2 / 2).)"""
    d = 64
    rng = np.random.default_rng(3)
    lam = steep_spectrum(d, rng)
    reads = []
    for seed in range(60):
        q = random_basis(d, rng)
        c = torch.from_numpy(q @ np.diag(lam) @ q.T)
        c = (c + c.T) / 2
        g = torch.from_numpy(np.exp(np.random.default_rng(seed).standard_normal(d)))
        reads.append(direction_depth(c, g, 4 * d, control_seed=1000 + seed))
    sd = reads[0].depth_sd
    for values in ([r.depth for r in reads], [r.control_depth for r in reads]):
        assert abs(np.mean(values)) < 4 * sd / math.sqrt(len(values))
        # the spread is the stated one (within 30% on 60 draws)
        assert np.std(values) == pytest.approx(sd, rel=0.3)


def test_a_stream_that_collapses_as_a_whole_reads_no_depth():
    """The old Delta_gamma's failure: the whole bottom of the spectrum falls (the smallest
    eigenvalue over the mean from 1e-2 to 1e-6) in a basis unrelated to v*. Every direction's
    Schur complement falls ~1e4x, but the depth stays ~0."""
    d = 128
    rng = np.random.default_rng(5)
    gamma = make_gamma(d, 5).double()
    q = random_basis(d, rng)
    early = 10.0 ** np.linspace(-2, 0, d)
    late = 10.0 ** np.concatenate([np.linspace(-6, -2, d // 4), np.linspace(-2, 0, d - d // 4)])
    for lam in (early, late):
        read = direction_depth(torch.from_numpy(q @ np.diag(lam) @ q.T), gamma, 4 * d)
        assert abs(read.depth_z) < 4


def test_depth_from_rows_of_a_planted_stream():
    """Rows whose variance along v* is 1e-4 of the rest: read through StreamingCovariance."""
    d, n = 48, 4096
    gamma = make_gamma(d, 2).double()
    v = gamma_read(gamma).v_star
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    x = x - 0.99 * (x @ v)[:, None] * v[None, :] + 5.0  # keeps 1% of the amplitude along v*
    acc = StreamingCovariance(d)
    acc.update(x)
    read = direction_depth(acc.covariance(), gamma, acc.count)
    assert read.reason is None
    depth, _, _ = numpy_depth(acc.covariance().numpy(), v.numpy())
    assert read.depth == pytest.approx(depth, abs=1e-9)
    assert 3.5 < read.depth < 4.5  # 4 decades of variance, up to sampling of the others


def test_rank_deficient_input_reads_on_the_live_subspace():
    """A ViT-like entry: rank 40 of d = 64. The read is finite, on the live subspace."""
    d, m = 64, 40
    rng = np.random.default_rng(9)
    basis = random_basis(d, rng)[:, :m]
    c = basis @ np.diag(10.0 ** rng.uniform(-2, 0, m)) @ basis.T
    c = (c + c.T) / 2
    gamma = make_gamma(d, 9).double()
    read = direction_depth(torch.from_numpy(c), gamma, 4 * d)
    assert read.reason is None and read.live_dim == m and read.rank_deficient
    v = gamma_read(gamma).v_star.numpy()
    depth, sd, live = numpy_depth(c, v)
    assert live == m
    assert read.depth == pytest.approx(depth, abs=1e-9) and math.isfinite(read.depth)
    assert read.depth_sd == pytest.approx(sd, rel=1e-9)
    assert read.live_share == pytest.approx(float(((basis.T @ v) ** 2).sum()), abs=1e-12)
    outside = np.linalg.qr(np.column_stack([basis, rng.standard_normal(d)]))[0][:, m]
    gamma_out = torch.from_numpy(1.0 / outside)  # v* orthogonal to every live direction
    assert direction_depth(torch.from_numpy(c), gamma_out, 4 * d).reason == "outside_live_space"


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"placement": "post"}, "post_norm"),
        ({"declared_kind": "rmsnorm"}, "no_gamma_kernel"),
        ({"n_rows": 7}, "insufficient_rows"),
        ({"gamma": torch.tensor([1.0, 0.0, 1.0, 1.0])}, "dead_channels"),
        ({"gamma": torch.tensor([1.0, math.nan, 1.0, 1.0])}, "non_finite_gamma"),
        ({"c": torch.full((4, 4), math.nan)}, "non_finite_covariance"),
        ({"c": torch.zeros(4, 4)}, "zero_covariance"),
    ],
)
def test_nan_reads_carry_a_reason(kwargs, reason):
    args = {"c": torch.eye(4, dtype=torch.float64), "gamma": torch.ones(4), "n_rows": 8}
    args.update(kwargs)
    read = direction_depth(args.pop("c"), args.pop("gamma"), args.pop("n_rows"), **args)
    assert isinstance(read, DepthRead) and read.reason == reason
    assert all(math.isnan(x) for k, x in read.as_dict().items() if k != "live_dim")


def test_flat_spectrum_reads_zero_and_z_zero():
    read = direction_depth(torch.eye(8, dtype=torch.float64) * 3.0, torch.ones(8), 16)
    assert read.depth == pytest.approx(0.0, abs=1e-14) and read.depth_z == 0.0
    assert read.depth_sd == pytest.approx(0.0, abs=1e-14)


def test_bad_arguments_raise():
    c = torch.eye(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="placement"):
        direction_depth(c, torch.ones(4), 8, placement="middle")
    with pytest.raises(ValueError, match="gamma has 3 entries"):
        direction_depth(c, torch.ones(3), 8)
    with pytest.raises(ValueError, match="live_tol"):
        direction_depth(c, torch.ones(4), 8, live_tol=-1.0)


def test_spectral_depth_of_eigenvectors():
    lam = torch.tensor([1e-4, 1e-2, 1.0, 1.0], dtype=torch.float64)
    u = torch.eye(4, dtype=torch.float64)
    # mean log10 = -1.5; e_0 sits at -4, e_3 at 0
    out = spectral_depth(lam, u, u[:, [0, 3]])
    assert out.tolist() == pytest.approx([2.5, -1.5], abs=1e-15)


# ------------------------------------------------------------ one eigh for every input read
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spread", [1.0, 3.0, 6.0])
def test_input_reads_equal_the_separate_reads(seed: int, spread: float) -> None:
    """``input_reads`` takes one ``eigh``; its depth is ``direction_depth``'s bit for bit and
    its Schur quotient ``schur_quotient``'s (a Cholesky factor) to 1e-9 relative: the same
    ridged forms summed over eigenpairs instead of solved (``spread`` decades of eigenvalues,
    up to 1e-6 of the top)."""
    from normscope.functional import schur_quotient
    from normscope.functional.depth import input_reads

    g = torch.Generator().manual_seed(seed)
    d = 48
    q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    lam = 10.0 ** (-spread * torch.rand(d, generator=g, dtype=torch.float64))
    c = q @ torch.diag(lam) @ q.T
    gamma = torch.exp(0.5 * torch.randn(d, generator=g, dtype=torch.float64))
    import numpy as np

    shared = input_reads(c, gamma, 4 * d)
    assert shared.depth == direction_depth(c, gamma, 4 * d)
    # the depth against numpy's own eigh (1e-9 decades: both float64 decompositions)
    lam_np, u_np = np.linalg.eigh(c.numpy())
    v = (1 / gamma).numpy()
    w = (u_np.T @ (v / np.linalg.norm(v))) ** 2
    want = float(np.log10(lam_np).mean() - w @ np.log10(lam_np))
    assert shared.depth.depth == pytest.approx(want, abs=1e-9)
    ref = schur_quotient(c, gamma, 4 * d)
    assert shared.schur.schur_quotient == pytest.approx(ref.schur_quotient, rel=1e-9)
    assert shared.schur.schur_complement == pytest.approx(ref.schur_complement, rel=1e-9)
    assert shared.schur.reason is ref.reason is None


@pytest.mark.parametrize("seed", range(6))
def test_rank_one_floor_is_the_second_moments_bottom(seed: int) -> None:
    """``lambda_min(C + m m^T)`` by the secular equation equals numpy's ``eigvalsh`` of the
    second moment to 1e-12 of its top eigenvalue (float64 eigensolvers are accurate to a few
    ulps of the largest eigenvalue), on covariances 0-8 decades deep, a mean large or small."""
    import numpy as np

    from normscope.functional.depth import rank_one_floor

    g = torch.Generator().manual_seed(seed)
    d = 32
    x = torch.randn(4 * d, d, generator=g, dtype=torch.float64)
    x = x * 10.0 ** (-(seed + 2) * torch.rand(d, generator=g, dtype=torch.float64))
    mean = torch.randn(d, generator=g, dtype=torch.float64) * (10.0 ** (seed - 3))
    c = torch.cov(x.T, correction=0)
    evals, evecs = torch.linalg.eigh(c)
    s = (c + torch.outer(mean, mean)).numpy()
    ref = np.linalg.eigvalsh(s)
    got = rank_one_floor(evals, evecs, mean)
    assert abs(got - ref[0]) <= 1e-12 * ref[-1], (got, ref[0])
