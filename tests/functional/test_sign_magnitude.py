"""Sign–magnitude reads against the paper's synthetic facts and numpy references.

Tolerances are sampling error at these sizes, stated where each is used: a 1024 x 1024 Gaussian
matrix estimates 2/pi with a standard deviation of about 2e-4 (benchmarks/RESULTS.md, 5 seeds),
and the toy block with n = 1024 and 2048 sphere inputs gives its ratios to well under 1%.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from normscope.functional import (
    OutlierRead,
    asymmetry_ratio,
    asymmetry_theory,
    binary_quantization_error,
    binary_quantize,
    flip_perturbation,
    matched_magnitude_perturbation,
    outlier_amplitudes,
    probe_read,
    quant_transverse_rel,
    radial_fraction,
    sign_alignment,
    sign_churn,
    ternary_alignment,
    ternary_quantization_error,
    ternary_quantize,
    ternary_sparsity,
    transverse_energy,
    weight_read,
)

TWO_PI = 2 / math.pi


@pytest.fixture(scope="module")
def gaussian() -> torch.Tensor:
    return torch.randn(1024, 1024, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------- parameter reads
def test_gaussian_sign_and_ternary_alignment(gaussian):
    # 0.005 and 0.01 are > 10 standard deviations of these estimates at 1024 x 1024 (std ~2e-4)
    assert abs(sign_alignment(gaussian) - TWO_PI) < 0.005  # Bussgang constant
    assert abs(sign_alignment(gaussian, rowwise=True) - TWO_PI) < 0.005
    assert abs(ternary_alignment(gaussian) - 0.787) < 0.01
    # closed form P(|w| < E|w| / 2) = erf(1 / (2 sqrt(pi))) = 0.3101; binomial std ~5e-4
    assert abs(ternary_sparsity(gaussian) - math.erf(1 / (2 * math.sqrt(math.pi)))) < 0.005


def test_quantisers_match_numpy(gaussian):
    w = gaussian[:64, :96].numpy()
    s = np.abs(w).mean()
    q_np = np.clip(np.round(w / (s + 1e-8)), -1, 1)
    q, scale = ternary_quantize(torch.from_numpy(w))
    np.testing.assert_array_equal(q.numpy(), q_np)  # exact: no entry sits at a rounding edge
    assert set(np.unique(q.numpy())) == {-1.0, 0.0, 1.0}
    assert scale == pytest.approx(s, rel=1e-15)
    cos2 = (w * q_np).sum() ** 2 / ((w * w).sum() * (q_np * q_np).sum())
    assert ternary_alignment(torch.from_numpy(w)) == pytest.approx(cos2, rel=1e-12)
    assert ternary_sparsity(torch.from_numpy(w)) == (q_np == 0).mean()
    s_row = np.abs(w).mean(1, keepdims=True)
    b, s_row_t = binary_quantize(torch.from_numpy(w))
    # row means are summed in a different order by torch and numpy: equal to the last bit or two
    np.testing.assert_allclose(b.numpy(), s_row * np.sign(w), rtol=1e-15, atol=0)
    np.testing.assert_allclose(s_row_t.numpy(), s_row[:, 0], rtol=1e-15, atol=0)
    np.testing.assert_allclose(
        binary_quantization_error(torch.from_numpy(w)).numpy(), b.numpy() - w, rtol=0, atol=1e-15
    )
    np.testing.assert_allclose(
        ternary_quantization_error(torch.from_numpy(w)).numpy(), s * q_np - w, rtol=0, atol=1e-15
    )
    assert sign_alignment(torch.from_numpy(w)) == pytest.approx(
        np.abs(w).sum() ** 2 / (w.size * (w * w).sum()), rel=1e-12
    )
    per_row = np.abs(w).sum(1) ** 2 / (w.shape[1] * (w * w).sum(1))
    assert sign_alignment(torch.from_numpy(w), rowwise=True) == pytest.approx(per_row.mean())


def test_rowwise_alignment_is_binary_quantisation_alignment(gaussian):
    w = gaussian[:32, :200]
    b, _ = binary_quantize(w)
    per_row = [float((wi @ bi) ** 2 / ((wi @ wi) * (bi @ bi))) for wi, bi in zip(w, b)]
    assert sign_alignment(w, rowwise=True) == pytest.approx(np.mean(per_row), rel=1e-12)


def test_float32_weight_reads_in_float64():
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(9))  # float32
    assert ternary_quantize(w)[0].dtype == torch.float64
    assert sign_alignment(w) == pytest.approx(sign_alignment(w.double()), rel=1e-12)


def test_sign_churn_and_weight_read(gaussian):
    w = gaussian[:100, :100]
    prev = torch.sign(w).to(torch.int8)  # the monitor keeps int8 signs
    w2 = w.clone()
    w2[:10] *= -1  # 10% of entries flip sign
    assert sign_churn(prev, w2) == pytest.approx(0.1)
    assert math.isnan(sign_churn(None, w2))
    read = weight_read(w2, prev)
    assert read.sign_churn == pytest.approx(0.1)
    assert read.as_dict() == {
        "sign_alignment": sign_alignment(w2),
        "sign_alignment_rowwise": sign_alignment(w2, rowwise=True),
        "ternary_alignment": ternary_alignment(w2),
        "ternary_sparsity": ternary_sparsity(w2),
        "sign_churn": read.sign_churn,
    }
    with pytest.raises(ValueError, match="previous signs"):
        sign_churn(prev[:5], w2)


def test_sign_churn_counts_moves_to_and_from_zero():
    prev = torch.sign(torch.tensor([[1.0, 0.0, -2.0, 0.0]]))
    now = torch.tensor([[0.0, 3.0, -1.0, 0.0]])  # 1 -> 0 and 0 -> 1 change; -1 and 0 stay
    assert sign_churn(prev, now) == 0.5


# --------------------------------------------------------------------- degenerate input
def test_degenerate_input_reads_nan():
    for w in (torch.zeros(4, 4), torch.zeros(0, 5), torch.zeros(5, 0)):
        read = weight_read(w, torch.sign(w))
        assert math.isnan(read.sign_alignment) and math.isnan(read.sign_alignment_rowwise)
        assert math.isnan(read.ternary_alignment)
        assert torch.equal(matched_magnitude_perturbation(w, torch.ones(3)), torch.zeros_like(w))
        assert flip_perturbation(w, 0.5, torch.Generator().manual_seed(0)).shape == w.shape
    assert ternary_sparsity(torch.zeros(4, 4)) == 1.0  # every entry quantises to 0
    assert math.isnan(ternary_sparsity(torch.zeros(0, 5)))
    y = torch.zeros(0, 8)
    assert math.isnan(radial_fraction(y, y)) and math.isnan(transverse_energy(y, y))
    assert math.isnan(asymmetry_ratio(y, y, y)) and math.isnan(quant_transverse_rel(y, y))
    dead = torch.zeros(3, 8)  # rows without a direction are left out
    assert math.isnan(transverse_energy(dead, torch.ones(3, 8)))
    read = probe_read(torch.zeros(0, 1), {})
    assert all(math.isnan(v) for v in read.as_dict().values())
    for bad in (torch.zeros(8), torch.tensor([1.0, -1.0]), torch.tensor([1.0, math.nan])):
        assert math.isnan(outlier_amplitudes(bad).max_leverage)


def test_bad_shapes_and_arguments_raise():
    with pytest.raises(ValueError, match=r"\(out, in\)"):
        sign_alignment(torch.ones(3))
    with pytest.raises(ValueError, match=r"\(out, in\)"):
        ternary_quantize(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match=r"\(N, d\)"):
        radial_fraction(torch.ones(3, 2), torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"\(N, d\)"):
        transverse_energy(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"shape \(n,\)"):
        outlier_amplitudes(torch.ones(4, 4))
    with pytest.raises(ValueError, match="top_fraction"):
        outlier_amplitudes(torch.ones(4), top_fraction=1.0)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        flip_perturbation(torch.ones(2, 2), 1.5)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        asymmetry_theory(-0.1)
    with pytest.raises(ValueError, match="unknown perturbations.*accepted"):
        probe_read(torch.ones(2, 2), {"sign_flip": torch.ones(2, 2)})


# --------------------------------------------------------------------- probe reads
def toy_block(n: int = 1024, rows: int = 2048, seed: int = 1):
    """RMSNorm(W2 ReLU(W1 x)), x uniform on the sphere in R^n, W1, W2 ~ N(0, 1/n) (n x n).

    Returns ``y(W1) = W2 ReLU(W1 x)``, the rows the RMSNorm receives, its derivative along a
    perturbation ``dW1`` (linear response), and ``W1``.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, dtype=torch.float64, generator=g)
    x /= x.norm(dim=1, keepdim=True)
    w1 = torch.randn(n, n, dtype=torch.float64, generator=g) / math.sqrt(n)
    w2 = torch.randn(n, n, dtype=torch.float64, generator=g) / math.sqrt(n)
    gate = (x @ w1.T) > 0

    def y_of(w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w.T) @ w2.T

    def linear_dy(dw: torch.Tensor) -> torch.Tensor:
        return (gate * (x @ dw.T)) @ w2.T

    return y_of, linear_dy, w1


def test_toy_block_asymmetry_and_radial_fractions():
    """The perturbed layer is W1; dy is the exact finite difference at the RMSNorm's input
    y = W2 ReLU(W1 x). Measured (seed 1): asymmetry 2.649 vs c(0.01) = 2.609 (+1.5%), radial
    fractions flip 0.013, magnitude 0.641, quant_binary 0.366, quant_ternary 0.660."""
    y_of, linear_dy, w1 = toy_block()
    y = y_of(w1)
    p = 0.01
    flip = flip_perturbation(w1, p, torch.Generator().manual_seed(2))
    mag = matched_magnitude_perturbation(w1, flip)
    assert float(mag.norm()) == pytest.approx(float(flip.norm()), rel=1e-12)
    dy = {
        "flip": y_of(w1 + flip) - y,
        "magnitude": y_of(w1 + mag) - y,
        "quant_binary": y_of(w1 + binary_quantization_error(w1)) - y,
        "quant_ternary": y_of(w1 + ternary_quantization_error(w1)) - y,
    }
    ratio = asymmetry_ratio(y, dy["flip"], dy["magnitude"])
    # 5% (the brief's bound): the seed-to-seed std is 0.15% (RESULTS.md); the +1.5% offset is
    # systematic, the ReLU saturation of the magnitude perturbation that c(p) leaves out
    assert abs(ratio / asymmetry_theory(p) - 1) < 0.05
    read = probe_read(y, dy)
    assert read.asymmetry_ratio == ratio
    # +/- 0.01 is > 5 seed-to-seed stds (0.001) of this read; 0.365 is the paper's post-ReLU value
    assert abs(read.radial_fraction_quant_binary - 0.365) < 0.01
    assert abs(read.radial_fraction_quant_ternary - 0.66) < 0.02  # std 0.004
    # loose, as the toy theory is: flip ~ p (measured 0.013), magnitude ~ 2/pi (measured 0.641,
    # seed-to-seed std 0.007 from W2's finite size)
    assert abs(read.radial_fraction_flip - p) < 0.01
    assert abs(read.radial_fraction_magnitude - TWO_PI) < 0.03
    assert read.quant_transverse_rel == quant_transverse_rel(y, dy["quant_ternary"])
    assert 0.05 < read.quant_transverse_rel < 0.15  # measured 0.085

    # Where c(p) comes from, term by term. Linear response removes ReLU saturation: the ratio is
    # then (1 - p) / (1 - 2/pi) (measured -0.4%; 1.5% bound for W2's finite-size spread) ...
    lin_flip, lin_mag = linear_dy(flip), linear_dy(mag)
    lin_ratio = asymmetry_ratio(y, lin_flip, lin_mag)
    assert abs(lin_ratio / ((1 - p) / (1 - TWO_PI)) - 1) < 0.015
    # ... and the flip's full / linear energy is c(p)'s saturation factor (measured -0.5%)
    saturation = float(dy["flip"].square().sum() / lin_flip.square().sum())
    assert abs(saturation / (1 - 4 * math.sqrt(p) / (3 * math.pi)) - 1) < 0.015
    # The magnitude perturbation saturates too (its transverse part), which c(p) omits: this is
    # the measured excess of the ratio over c(p)
    mag_saturation = transverse_energy(y, dy["magnitude"]) / transverse_energy(y, lin_mag)
    assert 0.95 < mag_saturation < 0.99  # measured 0.977
    # c(p) with that factor put back: 0.8% above the measured ratio here
    # (5 seeds in RESULTS.md: 0.7%, seed-to-seed std 0.15%)
    assert abs(ratio / (asymmetry_theory(p) / mag_saturation) - 1) < 0.015


def test_radial_and_transverse_match_numpy():
    g = np.random.default_rng(3)
    y, dy = g.standard_normal((50, 8)), g.standard_normal((50, 8))
    yh = y / np.linalg.norm(y, axis=1, keepdims=True)
    radial = ((yh * dy).sum(1) ** 2).sum()
    total = (dy**2).sum()
    yt, dyt = torch.from_numpy(y), torch.from_numpy(dy)
    assert radial_fraction(yt, dyt) == pytest.approx(radial / total, rel=1e-12)
    assert transverse_energy(yt, dyt) == pytest.approx(total - radial, rel=1e-12)
    assert quant_transverse_rel(yt, dyt) == pytest.approx((total - radial) / (y**2).sum())
    assert asymmetry_ratio(yt, dyt, 2 * dyt) == pytest.approx(0.25, rel=1e-12)
    # float32 rows are read in float64: the same numbers up to float32 rounding of the inputs
    assert radial_fraction(yt.float(), dyt.float()) == pytest.approx(radial / total, rel=1e-6)


def test_radial_change_has_no_transverse_energy():
    y = torch.randn(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    scale = torch.rand(64, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    dy = scale * y  # what a normaliser removes entirely
    assert radial_fraction(y, dy) == pytest.approx(1.0, abs=1e-14)
    # projected, not subtracted: total - radial would leave ~1e-16 of the total, either sign
    assert abs(transverse_energy(y, dy)) < 1e-26 * float(dy.square().sum())
    # a transverse part 1e-9 of the radial one is read to 1e-6 (its energy is 1e-18 of the
    # total, below what the subtraction resolves); z is orthogonal to y row by row, in numpy
    yn, r = y.numpy(), np.random.default_rng(6).standard_normal((64, 32))
    z = r - (r * yn).sum(1, keepdims=True) / (yn * yn).sum(1, keepdims=True) * yn
    small = dy + 1e-9 * torch.from_numpy(z)
    assert transverse_energy(y, small) == pytest.approx(1e-18 * float((z**2).sum()), rel=1e-6)


def test_asymmetry_theory_limits():
    assert asymmetry_theory(0.0) == pytest.approx(math.pi / (math.pi - 2))
    assert asymmetry_theory(0.01) == pytest.approx(0.99 / (1 - TWO_PI) * (1 - 0.4 / (3 * math.pi)))
    values = [asymmetry_theory(p) for p in (0.0, 0.01, 0.02, 0.05, 0.1)]
    assert values == sorted(values, reverse=True)


# --------------------------------------------------------------------- perturbations
def test_flip_perturbation_is_seeded():
    w = torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    a = flip_perturbation(w, 0.1, torch.Generator().manual_seed(5))
    b = flip_perturbation(w, 0.1, torch.Generator().manual_seed(5))
    c = flip_perturbation(w, 0.1, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    flipped = a != 0
    # 4096 Bernoulli(0.1) draws: std of the share 0.0047, so 0.02 is > 4 std
    assert abs(float(flipped.double().mean()) - 0.1) < 0.02
    assert torch.equal(a[flipped], -2 * w[flipped])
    assert torch.equal(torch.sign(w + a)[flipped], -torch.sign(w)[flipped])
    assert not flip_perturbation(w, 0.0, torch.Generator().manual_seed(5)).any()


def test_matched_magnitude_perturbation_preserves_signs():
    w = torch.randn(40, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    ref = flip_perturbation(w, 0.05, torch.Generator().manual_seed(1))
    dw = matched_magnitude_perturbation(w, ref)
    assert float(dw.norm()) == pytest.approx(float(ref.norm()), rel=1e-12)
    delta = dw.abs().unique()
    assert delta.numel() == 1  # one constant
    assert torch.equal(torch.sign(dw), torch.sign(w))


# --------------------------------------------------------------------- outlier reads
@pytest.mark.parametrize("alpha2", [0.05, 0.2, 0.5])
def test_planted_outlier_leverage_is_n_alpha_squared(alpha2):
    n = 512
    m = torch.full((n,), (1 - alpha2) / (n - 1), dtype=torch.float64)
    m[17] = alpha2  # channel 17 carries alpha^2 of E||x||^2
    read = outlier_amplitudes(m * 3.7)  # the scale of the second moments does not matter
    assert read.max_leverage == pytest.approx(n * alpha2, rel=1e-12)
    assert read.top_channels[0] == 17
    k = int(0.05 * n)  # 25 outlier channels: the planted one and 24 delocalised ones
    top = (n * alpha2 + (k - 1) * n * (1 - alpha2) / (n - 1)) / k
    rest = n * (1 - alpha2) / (n - 1)
    assert read.outlier_leverage == pytest.approx(top / rest, rel=1e-10)
    assert set(read.as_dict()) == {"max_leverage", "outlier_leverage"}


def test_outlier_leverage_from_sampled_inputs():
    n, rows = 256, 20_000
    x = torch.randn(rows, n, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    x[:, 3] *= 4.0  # E[x_3^2] = 16: alpha_3^2 = 16 / 271
    read = outlier_amplitudes(x.square().mean(0))
    # sampling error of a chi-square mean over 20000 rows: 1%; 3% allowed
    assert read.max_leverage == pytest.approx(n * 16 / (n - 1 + 16), rel=0.03)
    assert read.top_channels[0] == 3
    assert outlier_amplitudes(torch.ones(n)) == OutlierRead(1.0, 1.0, tuple(range(8)))


def test_outlier_leverage_is_infinite_when_the_rest_is_silent():
    m = torch.zeros(40)
    m[[5, 9]] = 1.0  # 2 of the 40 channels (the top 5%) carry everything
    read = outlier_amplitudes(m)
    assert read.max_leverage == 20.0 and read.outlier_leverage == math.inf
    assert read.top_channels[:2] == (5, 9)
