"""``secular_floor``: the live floor from the eigendecomposition ``kernel_read`` already took
(the secular equation of the compression to ``v*``'s complement), against the second
decomposition it replaces (a complete QR and ``eigvalsh`` of ``Q^T C Q``)."""

from __future__ import annotations

import pytest
import torch

from normscope.functional import gamma_read
from normscope.functional.kernel import secular_floor

torch.set_num_threads(1)


def restricted_floor(c: torch.Tensor, v: torch.Tensor) -> float:
    q = torch.linalg.qr(v[:, None], mode="complete").Q[:, 1:]
    ev = torch.linalg.eigvalsh(q.T @ c @ q)
    return float(ev[0] / ev.mean())


@pytest.mark.parametrize("d", [8, 64, 257])
@pytest.mark.parametrize("layernorm", [True, False])
def test_secular_floor_equals_the_restricted_eigenvalues(d, layernorm):
    """Both are exact up to the rounding of ``C``'s spectrum, ``eps ||C||``: the difference,
    in units of ``lambda_max / mean`` (the floor's scale), stays under 1e-13 (seen 7e-17),
    on a LayerNorm's output (``v*`` almost the kernel: the floor sits just under
    ``lambda_2``) and on a plain anisotropic covariance."""
    g = torch.Generator().manual_seed(d)
    gamma = torch.exp(0.5 * torch.randn(d, generator=g, dtype=torch.float64))
    x = torch.randn(4 * d, d, generator=g, dtype=torch.float64)
    x = x @ torch.randn(d, d, generator=g, dtype=torch.float64)
    y = torch.nn.functional.layer_norm(x, (d,)) * gamma if layernorm else x
    c = torch.cov(y.T, correction=0)
    v = gamma_read(gamma).v_star
    lam, u = torch.linalg.eigh(c)
    got, want = secular_floor(lam, u, v), restricted_floor(c, v)
    scale = float(lam[-1] / lam.mean())
    assert abs(got - want) <= 1e-13 * scale, (got, want)
    assert secular_floor(lam, u) == pytest.approx(float(lam[0] / lam.mean()), rel=1e-15)


def test_secular_floor_degenerate_cases():
    """``v`` orthogonal to the bottom eigenvector: ``lambda_1`` stays (``z_1 = 0``);
    ``v`` orthogonal to the second: the floor is ``lambda_2`` exactly (``z_2 = 0``)."""
    lam = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    u = torch.eye(4, dtype=torch.float64)
    v = torch.tensor([0.0, 0.0, 0.6, 0.8], dtype=torch.float64)
    mean = (12.0 - (0.36 * 3 + 0.64 * 6)) / 3
    assert secular_floor(lam, u, v) == pytest.approx(1.0 / mean, rel=1e-15)
    v = torch.tensor([0.6, 0.0, 0.0, 0.8], dtype=torch.float64)
    mean = (12.0 - (0.36 * 1 + 0.64 * 6)) / 3
    assert secular_floor(lam, u, v) == pytest.approx(2.0 / mean, rel=1e-15)
