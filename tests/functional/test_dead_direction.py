"""The gamma and kernel reads and the norm-type classifier (docs/metrics.md §1.1–1.2) against
numpy references; the Schur quotient and Delta_gamma are in test_schur.py.

Outputs come from ``torch.nn.functional.layer_norm`` / ``rms_norm`` run in float32, as a model
would, and are accumulated by ``StreamingCovariance``. Every number is recomputed here from
the same covariance by an independent numpy/scipy implementation of the METRICS formula.

Tolerances, and why:

* 1e-10 (absolute) between our numbers and numpy's: both are float64 eigendecompositions of
  the same matrix by different LAPACK builds; the bottom eigenvalue of a LayerNorm output is
  separated from the next one by more than 1e-4 of ``lambda_d``, so eigenvectors agree to
  about ``eps * lambda_d / gap`` ~ 1e-12.
* ``kernel_residual <= 1e-10``: a float32 forward leaves ``C v*`` at about 1e-14 of
  ``lambda_d`` (rounding of ``y`` at 6e-8 relative, squared); 1e-10 is the paper's threshold
  with room to spare, and is still ten orders of magnitude below an RMSNorm's value.
* ``gamma_alignment >= 0.9999``: the paper's LayerNorm figure; here it is 1 - O(1e-12).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F

from normscope.functional import (
    StreamingCovariance,
    gamma_read,
    kernel_read,
    predicted_kernel,
    schur_quotient,
)
from normscope.functional.dead_direction import rmsnorm_alignment_max
from tests.support.norm_rows import accumulate, layer_norm_rows, make_gamma, make_inputs

torch.set_num_threads(1)
AGREE = 1e-10  # our float64 numbers vs numpy's (see module docstring)


def reference(c: np.ndarray, gamma: np.ndarray, null_tol: float = 1e-10, rms: bool = False):
    """docs/metrics.md §1.2 in numpy, written independently of the torch code."""
    d = len(gamma)
    w, u = np.linalg.eigh(c)
    dead = np.flatnonzero(np.abs(gamma) <= 1e-6 * np.abs(gamma).max())
    if len(dead):
        p = np.eye(d)[:, dead]
    else:
        p = (1 / gamma / np.linalg.norm(1 / gamma))[:, None]
    null = w <= null_tol * w[-1]
    restrict = p[:, :0] if (rms and not len(dead)) else p
    q = scipy.linalg.null_space(restrict.T) if restrict.shape[1] else np.eye(d)
    live = np.linalg.eigvalsh(q.T @ c @ q)
    return {
        "gamma_alignment": np.linalg.norm(p.T @ u[:, 0]),
        "kernel_residual": np.linalg.eigvalsh(p.T @ c @ p)[-1] / w[-1],
        "null_dim": int(null.sum()),
        "subspace_alignment": math.sqrt((np.linalg.norm(u[:, null].T @ p) ** 2) / p.shape[1]),
        "live_floor": live[0] / live.mean(),
        "bottom": w[:8] / w[-1],
    }


def assert_matches(read, ref) -> None:
    for key in ("gamma_alignment", "kernel_residual", "subspace_alignment", "live_floor"):
        assert abs(getattr(read, key) - ref[key]) <= AGREE, (key, getattr(read, key), ref[key])
    assert read.null_dim == ref["null_dim"]
    np.testing.assert_allclose(read.bottom_eigenvalues, ref["bottom"], rtol=0, atol=AGREE)


# ------------------------------------------------------------------------ gamma read
def test_gamma_read_matches_numpy():
    gamma = make_gamma(96, seed=0).double()
    g = gamma_read(gamma)
    ref = gamma.numpy()
    assert g.reason is None and g.dead_channels == 0 and g.dead_index == ()
    np.testing.assert_allclose(g.v_star.numpy(), (1 / ref) / np.linalg.norm(1 / ref), rtol=1e-15)
    assert g.v_star.dtype == torch.float64
    assert g.as_dict() == pytest.approx(
        {
            "dead_channels": 0.0,
            "gamma_min": ref.min(),
            "gamma_max": ref.max(),
            "gamma_spread": ref.std() / np.abs(ref).mean(),  # population std, ddof = 0
        },
        rel=1e-14,
    )
    assert set(g.as_dict()) == {"dead_channels", "gamma_min", "gamma_max", "gamma_spread"}


def test_gamma_read_dead_and_non_finite():
    gamma = make_gamma(32, seed=1).double()
    gamma[[3, 10, 20]] = torch.tensor([0.0, 1e-9 * gamma.max(), -0.0])
    g = gamma_read(gamma)
    assert g.dead_channels == 3 and g.dead_index == (3, 10, 20)
    assert g.v_star is None and g.reason == "dead_channels"
    kernel = predicted_kernel(g)
    assert kernel.shape == (32, 3)
    np.testing.assert_array_equal(kernel.numpy(), np.eye(32)[:, [3, 10, 20]])

    gamma[5] = math.nan
    bad = gamma_read(gamma)
    assert bad.reason == "non_finite_gamma" and bad.v_star is None
    assert math.isnan(bad.gamma_min) and math.isnan(bad.gamma_spread)
    assert predicted_kernel(bad).shape == (32, 0)
    assert gamma_read(torch.tensor([1.0, math.inf])).reason == "non_finite_gamma"


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match=r"1-D tensor \(d,\)"):
        gamma_read(torch.ones(2, 3))
    with pytest.raises(ValueError, match="square"):
        kernel_read(torch.ones(3, 4), torch.ones(3), 10)
    with pytest.raises(ValueError, match="gamma has 4 entries, the covariance is 3 x 3"):
        kernel_read(torch.eye(3), torch.ones(4), 10)
    with pytest.raises(ValueError, match="declared_kind"):
        kernel_read(torch.eye(3), torch.ones(3), 10, declared_kind="batchnorm")
    with pytest.raises(ValueError, match="n_rows"):
        schur_quotient(torch.eye(3), torch.ones(3), -1)
    with pytest.raises(ValueError, match="square"):
        schur_quotient(torch.ones(3), torch.ones(3), 10)


# ----------------------------------------------------------------------- kernel read
@pytest.mark.parametrize(("d", "seed"), [(64, 0), (128, 1), (256, 2)])
def test_layernorm_kernel_is_predicted_by_gamma(d, seed):
    gamma = make_gamma(d, seed)
    y = layer_norm_rows(make_inputs(d, 4 * d, seed), gamma, seed)
    acc = accumulate(y)
    read = kernel_read(acc.covariance(), gamma, acc.count, declared_kind="layernorm")
    assert read.reason is None and read.n_rows == 4 * d
    assert read.gamma_alignment >= 0.9999
    assert read.kernel_residual <= 1e-10
    assert read.null_dim == 1
    assert read.subspace_alignment == pytest.approx(1.0, abs=1e-10)
    assert read.norm_class == "layernorm-like" and not read.kind_mismatch
    assert 0 < read.live_floor < 1
    assert len(read.bottom_eigenvalues) == 8 and read.bottom_eigenvalues[0] <= 1e-10
    assert_matches(read, reference(acc.covariance().numpy(), gamma.double().numpy()))
    assert set(read.as_dict()) == {
        "gamma_alignment",
        "kernel_residual",
        "null_dim",
        "subspace_alignment",
        "live_floor",
        "kind_mismatch",
    }
    # The same output declared as an RMSNorm is reported, not silently accepted.
    assert kernel_read(acc.covariance(), gamma, acc.count, declared_kind="rmsnorm").kind_mismatch


def rms_inputs_with_known_bottom(gamma: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Rows whose RMSNorm output has its bottom direction orthogonal to v*.

    A direction ``w`` squeezed to 3% of the spread puts the output's bottom eigenvector at
    ``u ~ w / gamma``, and ``<u, v*> ~ sum_i w_i / gamma_i^2``. Choosing ``w`` orthogonal to
    ``gamma^-2`` makes the true answer 0. (With isotropic inputs, an RMSNorm's bottom direction
    follows the smallest gammas, exactly where ``v*`` concentrates: the alignment is then about
    ``sqrt(sum gamma^-4) / sum gamma^-2``, 0.1-0.5 for these gammas at d <= 256; see
    ``test_rmsnorm_is_never_read_as_layernorm``.)
    """
    d = gamma.numel()
    g = torch.Generator().manual_seed(seed + 99)
    q = gamma.double() ** -2
    q = q / q.norm()
    w = torch.randn(d, generator=g, dtype=torch.float64)
    w = w - (w @ q) * q
    w = w / w.norm()
    squeeze = torch.eye(d, dtype=torch.float64) - 0.97 * torch.outer(w, w)
    return (torch.randn(n, d, generator=g, dtype=torch.float64) @ squeeze).float()


@pytest.mark.parametrize(("d", "seed"), [(64, 3), (256, 4)])
def test_rmsnorm_has_no_gamma_kernel(d, seed):
    gamma = make_gamma(d, seed)
    y = F.rms_norm(rms_inputs_with_known_bottom(gamma, 4 * d, seed), (d,), gamma, eps=1e-6)
    acc = accumulate(y)
    read = kernel_read(acc.covariance(), gamma, acc.count, declared_kind="rmsnorm")
    assert read.reason is None
    assert read.gamma_alignment <= 0.10
    assert read.norm_class == "rmsnorm-like" and not read.kind_mismatch
    assert read.null_dim == 0 and read.subspace_alignment == 0.0
    assert read.kernel_residual > 1e-4  # v* is no kernel: a real share of the variance
    ref = reference(acc.covariance().numpy(), gamma.double().numpy(), rms=True)
    assert_matches(read, ref)
    # Declared a LayerNorm, it is flagged.
    assert kernel_read(acc.covariance(), gamma, acc.count, declared_kind="layernorm").kind_mismatch


def test_rmsnorm_is_never_read_as_layernorm():
    """Isotropic inputs: alignment is above the 0.1 line (see above), the residual is not."""
    d = 128
    gamma = make_gamma(d, seed=5)
    x = torch.randn(4 * d, d, generator=torch.Generator().manual_seed(5))
    acc = accumulate(F.rms_norm(x, (d,), gamma, eps=1e-6))
    read = kernel_read(acc.covariance(), gamma, acc.count, declared_kind="rmsnorm")
    assert read.kernel_residual > 1e-3 and read.null_dim == 0
    assert read.norm_class != "layernorm-like" and not read.kind_mismatch
    assert_matches(read, reference(acc.covariance().numpy(), gamma.double().numpy(), rms=True))


@pytest.mark.parametrize("tiny", [0.0, 1e-9])
def test_layernorm_with_dead_channels_is_not_misaligned(tiny):
    d = 64
    gamma = make_gamma(d, seed=6)
    dead = [5, 17, 40]
    gamma[dead] = tiny * gamma.max()
    y = layer_norm_rows(make_inputs(d, 4 * d, seed=6), gamma, seed=6)
    acc = accumulate(y)
    g = gamma_read(gamma)
    assert g.dead_channels == 3 and g.v_star is None
    read = kernel_read(acc.covariance(), g, acc.count, declared_kind="layernorm")
    assert read.reason == "dead_channels"
    assert read.null_dim == 3  # span{e_i : i dead}, and nothing else
    assert read.subspace_alignment == pytest.approx(1.0, abs=1e-10)
    assert read.gamma_alignment == pytest.approx(1.0, abs=1e-10)  # u_1 lies in the dead span
    assert read.kernel_residual <= 1e-10
    assert read.norm_class != "rmsnorm-like" and not read.kind_mismatch
    assert_matches(read, reference(acc.covariance().numpy(), gamma.double().numpy()))
    assert math.isnan(schur_quotient(acc.covariance(), g, acc.count).schur_quotient)


def test_live_floor_sees_a_training_made_dead_direction():
    """An input direction squeezed to 1e-4 of its spread shows up in live_floor (and not in
    the predicted kernel). ``w`` is taken orthogonal to the ones vector and to the rows' mean:
    otherwise LayerNorm's mean removal, and its division by a per-row std of the constant
    ``<w, mean>``, would put variance back along it."""
    d = 64
    gamma = make_gamma(d, seed=8)
    x = make_inputs(d, 8 * d, seed=8).double()
    w = torch.randn(d, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    both = torch.linalg.qr(torch.stack([torch.ones(d, dtype=torch.float64), x.mean(0)], 1)).Q
    w = w - both @ (both.T @ w)
    w = w / w.norm()
    x = x - 0.9999 * (x - x.mean(0)) @ torch.outer(w, w)
    acc = accumulate(layer_norm_rows(x.float(), gamma, seed=8))
    healthy = accumulate(layer_norm_rows(make_inputs(d, 8 * d, seed=8), gamma, seed=8))
    read = kernel_read(acc.covariance(), gamma, acc.count)
    base = kernel_read(healthy.covariance(), gamma, healthy.count)
    assert read.norm_class == "layernorm-like" and read.null_dim == 1
    assert read.live_floor < 1e-3 * base.live_floor
    assert_matches(read, reference(acc.covariance().numpy(), gamma.double().numpy()))


def test_insufficient_rows_and_bad_data_give_nan_and_a_reason():
    d = 32
    gamma = make_gamma(d, seed=9)
    acc = accumulate(layer_norm_rows(make_inputs(d, 2 * d - 1, seed=9), gamma, seed=9))
    for read in (
        kernel_read(acc.covariance(), gamma, acc.count),
        schur_quotient(acc.covariance(), gamma, acc.count),
    ):
        assert read.reason == "insufficient_rows"
        assert all(math.isnan(v) for v in read.as_dict().values() if v != 0.0)
    kr = kernel_read(acc.covariance(), gamma, acc.count)
    assert math.isnan(kr.null_dim) and kr.bottom_eigenvalues == ()
    assert kr.norm_class == "indeterminate"
    empty = StreamingCovariance(d)  # no rows at all: a NaN covariance, still no exception
    assert kernel_read(empty.covariance(), gamma, empty.count).reason == "insufficient_rows"

    acc = accumulate(layer_norm_rows(make_inputs(d, 4 * d, seed=9), gamma, seed=9))
    nan_gamma = gamma.clone()
    nan_gamma[0] = math.nan
    kr = kernel_read(acc.covariance(), nan_gamma, acc.count)
    assert kr.reason == "non_finite_gamma" and math.isnan(kr.gamma_alignment)
    assert kr.null_dim == 1  # read from C alone
    sr = schur_quotient(acc.covariance(), nan_gamma, acc.count)
    assert sr.reason == "non_finite_gamma" and math.isnan(sr.delta_gamma)

    bad_c = acc.covariance().clone()
    bad_c[1, 2] = math.inf
    assert kernel_read(bad_c, gamma, acc.count).reason == "non_finite_covariance"
    assert schur_quotient(bad_c, gamma, acc.count).reason == "non_finite_covariance"
    zero = torch.zeros(d, d)
    assert kernel_read(zero, gamma, 4 * d).reason == "zero_covariance"
    assert schur_quotient(zero, gamma, 4 * d).reason == "zero_covariance"


# ------------------------------------------------------ width-aware classifier (issue 18)
@pytest.mark.parametrize("d", [32, 64, 128, 256, 512, 1024])
def test_classifier_is_right_at_every_width_with_uneven_gammas(d):
    """LayerNorm and RMSNorm (torch's own, float32) on anisotropic inputs with a channel
    offset, gammas uniform in [0.1, 2] and log-normal (sigma 0.5): zero misclassified. The
    old fixed 0.1 alignment cut called RMSNorm "indeterminate" here (alignment up to
    4.7 / sqrt(d), measured); the cut min(0.9, 8 / sqrt(d)) and kernel_residual (LayerNorm
    ~1e-15, RMSNorm >= 2.6e-3) separate them."""
    n = 4 * d if d >= 512 else 8 * d
    wrong = []
    for seed in range(2 if d >= 512 else 3):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(d, d, generator=g) / math.sqrt(d) * torch.logspace(0, -1.5, d)
        x = torch.randn(n, d, generator=g) @ a + 0.5 * torch.randn(d, generator=g)
        gammas = (
            0.1 + 1.9 * torch.rand(d, generator=g),
            torch.exp(0.5 * torch.randn(d, generator=g)),
        )
        for gamma in gammas:
            for kind, expect in (("layernorm", "layernorm-like"), ("rmsnorm", "rmsnorm-like")):
                norm = torch.nn.LayerNorm(d) if kind == "layernorm" else torch.nn.RMSNorm(d)
                with torch.no_grad():
                    norm.weight.copy_(gamma)
                    acc = accumulate(norm(x))
                read = kernel_read(acc.covariance(), gamma, acc.count, declared_kind=kind)
                if read.norm_class != expect or read.kind_mismatch:
                    wrong.append((seed, kind, read.kernel_residual, read.gamma_alignment))
    assert wrong == []
    assert rmsnorm_alignment_max(d) == min(0.9, 8 / math.sqrt(d))
