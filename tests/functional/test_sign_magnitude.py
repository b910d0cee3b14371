"""Sign–magnitude reads against the paper's synthetic facts and numpy references.

Tolerances are sampling error: a 1024 x 1024 Gaussian matrix estimates 2/pi to about 1e-3; the
toy block with n = 1024 and 2048 sphere inputs gives c(p) to about 2% (the test allows 5%).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from normscope.functional.sign_magnitude import (
    asymmetry_ratio,
    asymmetry_theory,
    binary_quantization_error,
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


@pytest.fixture(scope="module")
def gaussian() -> torch.Tensor:
    return torch.randn(1024, 1024, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def test_gaussian_sign_and_ternary_alignment(gaussian):
    assert abs(sign_alignment(gaussian) - 2 / math.pi) < 0.005  # Bussgang constant
    assert abs(sign_alignment(gaussian, rowwise=True) - 2 / math.pi) < 0.005
    assert abs(ternary_alignment(gaussian) - 0.787) < 0.01
    assert abs(ternary_sparsity(gaussian) - 0.31) < 0.01


def test_quantisers_match_numpy(gaussian):
    w = gaussian[:64, :96].numpy()
    s = np.abs(w).mean()
    q_np = np.clip(np.round(w / (s + 1e-8)), -1, 1)
    q, scale = ternary_quantize(torch.from_numpy(w))
    np.testing.assert_array_equal(q.numpy(), q_np)
    assert scale == pytest.approx(s, rel=1e-15)
    cos2 = (w * q_np).sum() ** 2 / ((w * w).sum() * (q_np * q_np).sum())
    assert ternary_alignment(torch.from_numpy(w)) == pytest.approx(cos2, rel=1e-12)
    b = np.abs(w).mean(1, keepdims=True) * np.sign(w)
    np.testing.assert_allclose(
        binary_quantization_error(torch.from_numpy(w)).numpy(), b - w, rtol=0, atol=1e-15
    )
    np.testing.assert_allclose(
        ternary_quantization_error(torch.from_numpy(w)).numpy(), s * q_np - w, rtol=0, atol=1e-15
    )
    assert sign_alignment(torch.from_numpy(w)) == pytest.approx(
        np.abs(w).sum() ** 2 / (w.size * (w * w).sum())
    )


def test_sign_churn_and_weight_read(gaussian):
    w = gaussian[:100, :100]
    prev = torch.sign(w)
    w2 = w.clone()
    w2[:10] *= -1  # 10% of entries flip sign
    assert sign_churn(prev, w2) == pytest.approx(0.1)
    assert math.isnan(sign_churn(None, w2))
    read = weight_read(w2, prev)
    assert set(read.as_dict()) == {
        "sign_alignment",
        "sign_alignment_rowwise",
        "ternary_alignment",
        "ternary_sparsity",
        "sign_churn",
    }
    with pytest.raises(ValueError, match="previous signs"):
        sign_churn(prev[:5], w2)


def test_degenerate_and_bad_input():
    z = torch.zeros(4, 4)
    assert math.isnan(sign_alignment(z)) and math.isnan(ternary_alignment(z))
    assert math.isnan(outlier_amplitudes(torch.zeros(8)).max_leverage)
    with pytest.raises(ValueError, match=r"\(out, in\)"):
        sign_alignment(torch.ones(3))
    with pytest.raises(ValueError, match=r"\(N, d\)"):
        radial_fraction(torch.ones(3, 2), torch.ones(3, 4))


def toy_block(n: int = 1024, rows: int = 2048, seed: int = 1):
    """RMSNorm(W2 ReLU(W1 x)): x uniform on the sphere, W ~ N(0, 1/n). Returns y(W1) and W1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, dtype=torch.float64, generator=g)
    x /= x.norm(dim=1, keepdim=True)
    w1 = torch.randn(n, n, dtype=torch.float64, generator=g) / math.sqrt(n)
    w2 = torch.randn(n, n, dtype=torch.float64, generator=g) / math.sqrt(n)
    return (lambda w: torch.relu(x @ w.T) @ w2.T), w1


def test_toy_block_asymmetry_and_radial_fractions():
    y_of, w1 = toy_block()
    y = y_of(w1)
    flip = flip_perturbation(w1, 0.01, torch.Generator().manual_seed(2))
    mag = matched_magnitude_perturbation(w1, flip)
    assert float(mag.norm()) == pytest.approx(float(flip.norm()), rel=1e-12)
    dy = {
        "flip": y_of(w1 + flip) - y,
        "magnitude": y_of(w1 + mag) - y,
        "quant_binary": y_of(w1 + binary_quantization_error(w1)) - y,
        "quant_ternary": y_of(w1 + ternary_quantization_error(w1)) - y,
    }
    ratio = asymmetry_ratio(y, dy["flip"], dy["magnitude"])
    assert abs(ratio / asymmetry_theory(0.01) - 1) < 0.05  # measured here: 2.649 vs 2.609
    read = probe_read(y, dy)
    assert read.asymmetry_ratio == ratio
    assert abs(read.radial_fraction_quant_binary - 0.365) < 0.01  # measured: 0.366
    assert abs(read.radial_fraction_quant_ternary - 0.66) < 0.02  # measured: 0.660
    assert abs(read.radial_fraction_flip - 0.01) < 0.01  # about p
    assert abs(read.radial_fraction_magnitude - 2 / math.pi) < 0.03  # about 2/pi
    assert 0 < read.quant_transverse_rel < 1
    assert read.quant_transverse_rel == quant_transverse_rel(y, dy["quant_ternary"])


def test_radial_and_transverse_match_numpy():
    g = np.random.default_rng(3)
    y, dy = g.standard_normal((50, 8)), g.standard_normal((50, 8))
    yh = y / np.linalg.norm(y, axis=1, keepdims=True)
    radial = ((yh * dy).sum(1) ** 2).sum()
    total = (dy**2).sum()
    assert radial_fraction(torch.from_numpy(y), torch.from_numpy(dy)) == pytest.approx(
        radial / total, rel=1e-12
    )
    assert transverse_energy(torch.from_numpy(y), torch.from_numpy(dy)) == pytest.approx(
        total - radial, rel=1e-12
    )


def test_asymmetry_theory_limits():
    assert asymmetry_theory(0.0) == pytest.approx(math.pi / (math.pi - 2))
    assert asymmetry_theory(0.01) == pytest.approx(
        0.99 / (1 - 2 / math.pi) * (1 - 0.4 / (3 * math.pi))
    )


def test_flip_perturbation_is_seeded():
    w = torch.randn(64, 64, dtype=torch.float64)
    a = flip_perturbation(w, 0.1, torch.Generator().manual_seed(5))
    b = flip_perturbation(w, 0.1, torch.Generator().manual_seed(5))
    c = flip_perturbation(w, 0.1, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    flipped = a != 0
    assert abs(float(flipped.double().mean()) - 0.1) < 0.02
    assert torch.equal(a[flipped], -2 * w[flipped])


@pytest.mark.parametrize("alpha2", [0.05, 0.2, 0.5])
def test_planted_outlier_leverage_is_n_alpha_squared(alpha2):
    n = 512
    m = torch.full((n,), (1 - alpha2) / (n - 1), dtype=torch.float64)
    m[17] = alpha2  # channel 17 carries alpha^2 of E||x||^2
    read = outlier_amplitudes(m * 3.7)  # the scale of the second moments does not matter
    assert read.max_leverage == pytest.approx(n * alpha2, rel=1e-12)
    assert read.top_channels[0] == 17
    k = int(0.05 * n)
    top = (n * alpha2 + (k - 1) * n * (1 - alpha2) / (n - 1)) / k
    rest = n * (1 - alpha2) / (n - 1)
    assert read.outlier_leverage == pytest.approx(top / rest, rel=1e-10)
