"""The norm-type classifier decided by ``centring_residual`` (issue 33) and the headline
``kernel_alignment`` of a norm whose input does not span, against numpy references.

Tolerances: ``centring_residual`` relative 1e-12 against numpy on the same float64 covariance
(a quadratic form and a weighted trace: a few ulps); ``subspace_alignment`` absolute 1e-9
against numpy's ``eigh`` (the null space of an LN output is separated from the live spectrum
by ~1e8 of its scale, so its basis is determined to ~eps / gap).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from normscope.functional import StreamingCovariance, kernel_read
from normscope.functional.kernel import centring_residual

torch.set_num_threads(1)


def rows(d: int, n: int, seed: int, anisotropic: bool, rank: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, rank or d, generator=g, dtype=torch.float64)
    if rank is not None:
        z = z @ torch.linalg.qr(torch.randn(d, rank, generator=g, dtype=torch.float64)).Q.T
    if anisotropic:
        q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
        z = (z * 10.0 ** (-3.0 * torch.rand(d, generator=g, dtype=torch.float64))) @ q.T
    return (z + torch.randn(d, generator=g, dtype=torch.float64)).float()


def covariance(y: torch.Tensor) -> StreamingCovariance:
    acc = StreamingCovariance(y.shape[-1])
    acc.update(y)
    return acc


def test_centring_residual_matches_numpy():
    d = 40
    rng = np.random.default_rng(0)
    a = rng.standard_normal((d, d))
    c = a @ a.T
    gamma = np.exp(rng.standard_normal(d))
    inv = 1 / gamma
    ref = (inv @ c @ inv) / np.sum(np.diag(c) * inv**2)
    got = centring_residual(torch.from_numpy(c), torch.from_numpy(gamma))
    assert got == pytest.approx(ref, rel=1e-12)
    # invariant to the scale of gamma and equal through a GammaRead
    from normscope.functional import gamma_read

    assert centring_residual(torch.from_numpy(c), torch.from_numpy(3 * gamma)) == pytest.approx(
        ref, rel=1e-12
    )
    g_read = gamma_read(torch.from_numpy(gamma))
    assert centring_residual(torch.from_numpy(c), g_read) == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("d", [32, 256])
@pytest.mark.parametrize("sigma", [1.0, 2.0])
@pytest.mark.parametrize("anisotropic", [False, True])
def test_uneven_gains_are_decided(d, sigma, anisotropic):
    """Log-normal gains up to sigma = 2 (where kernel_residual sat inside the undecided band
    for every RMSNorm): both kinds are decided, and right."""
    g = torch.Generator().manual_seed(d)
    gamma = torch.exp(sigma * torch.randn(d, generator=g))
    x = rows(d, 8 * d, d, anisotropic)
    beta = 0.1 * torch.randn(d, generator=g)
    ln = kernel_read(
        covariance(F.layer_norm(x, (d,), gamma, beta)).covariance(), gamma.double(), 8 * d
    )
    rms = kernel_read(covariance(F.rms_norm(x, (d,), gamma)).covariance(), gamma.double(), 8 * d)
    assert ln.norm_class == "layernorm-like" and ln.centring_residual < 1e-10
    assert rms.norm_class == "rmsnorm-like" and rms.centring_residual > 1e-2


def test_layernorm_on_an_input_that_does_not_span_keeps_its_headline_alignment():
    """A ViT-like input of rank 30 < d = 64: the LN output's null space has 33 dimensions, u_1
    is any vector in it, gamma_alignment reads like a random direction; kernel_alignment is the
    subspace alignment, ~1, and the class is still layernorm-like. (The rows are an affine
    30-dimensional set: with the offset they span 31 dimensions, the output 31 live ones.)"""
    d, m = 64, 30
    gamma = torch.exp(0.3 * torch.randn(d, generator=torch.Generator().manual_seed(5)))
    y = F.layer_norm(rows(d, 16 * d, 5, False, rank=m), (d,), gamma)
    acc = covariance(y)
    read = kernel_read(acc.covariance(), gamma.double(), acc.count, declared_kind="layernorm")
    assert read.null_dim == d - (m + 1)
    assert read.kernel_alignment == read.subspace_alignment
    assert read.kernel_alignment == pytest.approx(1.0, abs=1e-9)
    assert read.norm_class == "layernorm-like"
    c = acc.covariance().numpy()
    lam, u = np.linalg.eigh((c + c.T) / 2)
    u0 = u[:, lam <= 1e-10 * lam[-1]]
    v = (1 / gamma.double()).numpy()
    v /= np.linalg.norm(v)
    assert read.subspace_alignment == pytest.approx(np.linalg.norm(u0.T @ v), abs=1e-9)


def test_full_rank_input_headline_is_gamma_alignment():
    d = 32
    gamma = torch.linspace(0.5, 2.0, d)
    acc = covariance(F.layer_norm(rows(d, 8 * d, 1, False), (d,), gamma))
    read = kernel_read(acc.covariance(), gamma.double(), acc.count)
    assert read.null_dim == 1 and read.kernel_alignment == read.gamma_alignment > 0.9999


def _through_real_norm(norm: str, d: int, sigma: float, seed: int):
    """Rows through a real ``nn.LayerNorm`` / ``nn.RMSNorm`` with log-normal gains, read."""
    g = torch.Generator().manual_seed(seed * 101 + d)
    m = torch.nn.LayerNorm(d) if norm == "layernorm" else torch.nn.RMSNorm(d)
    with torch.no_grad():
        m.weight.copy_(torch.exp(sigma * torch.randn(d, generator=g)))
        if norm == "layernorm":
            m.bias.copy_(0.1 * torch.randn(d, generator=g))
        x = torch.randn(4 * d, d, generator=g) * torch.rand(d, generator=g) ** 4
        y = m(x + torch.randn(d, generator=g))
    acc = StreamingCovariance(d)
    acc.update(y)
    return kernel_read(acc.covariance(), m.weight.detach().double(), acc.count)


def test_the_classifier_decides_across_widths_and_uneven_gains():
    """Issue 41: widths 32-1024, log-normal gains up to sigma 3 (channels under the dead
    tolerance, none zero): no LayerNorm whose kernel is there (centring residual under 1e-8,
    which bounds ``kernel_residual``) is left undecided, none wrong."""
    for norm, want in (("layernorm", "layernorm-like"), ("rmsnorm", "rmsnorm-like")):
        for d in (32, 128, 256, 1024):
            for sigma in (0.5, 2.0, 3.0) if d < 1024 else (3.0,):
                read = _through_real_norm(norm, d, sigma, seed=0)
                if norm == "rmsnorm" and read.reason == "dead_channels":
                    # gains under the dead tolerance: only a LayerNorm's centring decides
                    assert (read.norm_class, read.class_reason) == ("indeterminate", read.reason)
                    continue
                assert read.norm_class == want, (norm, d, sigma, read)
                assert read.class_reason is None


def test_a_zero_gain_leaves_the_class_undecided_with_the_reason():
    d = 16
    gamma = torch.ones(d)
    gamma[3] = 0.0
    y = torch.nn.functional.layer_norm(torch.randn(256, d), (d,), gamma)
    acc = StreamingCovariance(d)
    acc.update(y)
    read = kernel_read(acc.covariance(), gamma, acc.count)
    assert (read.norm_class, read.class_reason) == ("indeterminate", "dead_channels")
