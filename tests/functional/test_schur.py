"""The Schur quotient, its complement ``s`` and Delta_gamma against a baseline (docs/metrics.md
§1.3) against numpy references on the same float64 covariance.

Tolerances (each also stated where it is used): relative 1e-9 against numpy's explicit inverse
of the same ridged float64 matrix (condition numbers up to 1e6, so both lose about
``eps * kappa`` ~ 2e-10); 1e-8 on random SPD matrices; 1e-5 against the Sherman-Morrison closed
form, which has no ridge (the 1e-12 ridge moves R by about ``ridge / s``); 1e-12 absolute where
the exact answer is 1 (an eigenvector).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from normscope.functional import deepening, gamma_read, schur_quotient
from normscope.functional.dead_direction import rows_comparable
from tests.support.norm_rows import accumulate, make_gamma, make_inputs

torch.set_num_threads(1)


def numpy_schur(c: np.ndarray, v: np.ndarray, ridge: float = 1e-12) -> float:
    cr = c + ridge * np.trace(c) / len(v) * np.eye(len(v))
    return 1.0 / ((v @ np.linalg.inv(cr) @ v) * (v @ cr @ v))


def numpy_schur_complement(c: np.ndarray, v: np.ndarray, ridge: float = 1e-12) -> float:
    """s = [1 / (v^T C^-1 v)] / [tr(C) / d], on the same ridged matrix."""
    d = len(v)
    cr = c + ridge * np.trace(c) / d * np.eye(d)
    return (1.0 / (v @ np.linalg.inv(cr) @ v)) / (np.trace(c) / d)


def test_schur_quotient_is_one_on_an_eigenvector():
    d = 48
    gamma = make_gamma(d, seed=10).double()
    v = gamma_read(gamma).v_star.numpy()
    rng = np.random.default_rng(10)
    basis = np.linalg.qr(np.column_stack([v, rng.standard_normal((d, d - 1))]))[0]
    c = basis @ np.diag(rng.uniform(0.1, 10, d)) @ basis.T
    read = schur_quotient(torch.from_numpy(c), gamma, 4 * d)
    assert read.reason is None
    assert read.schur_quotient == pytest.approx(1.0, abs=1e-12)
    # Delta_gamma needs a baseline (it used to be 1 - R_q: issue 18)
    assert math.isnan(read.delta_gamma) and read.delta_reason == "no_baseline"


def test_schur_quotient_is_small_when_a_near_dead_direction_overlaps_v_star():
    d = 48
    gamma = make_gamma(d, seed=11).double()
    v = gamma_read(gamma).v_star.numpy()
    rng = np.random.default_rng(11)
    w = v + rng.standard_normal(d) / math.sqrt(d)
    w /= np.linalg.norm(w)
    s = 1e-6  # the near-dead direction's variance
    c = np.eye(d) - (1 - s) * np.outer(w, w)
    read = schur_quotient(torch.from_numpy(c), gamma, 4 * d)
    cos2 = (w @ v) ** 2
    closed_form = 1 / ((1 + (1 / s - 1) * cos2) * (1 - (1 - s) * cos2))  # Sherman-Morrison
    assert read.schur_quotient < 1e-4
    # The 1e-12 ridge moves R by about ridge / s = 1e-6 relative; numpy uses the same ridge.
    assert read.schur_quotient == pytest.approx(closed_form, rel=1e-5)
    assert read.schur_quotient == pytest.approx(numpy_schur(c, v), rel=1e-9)
    # against an isotropic baseline (s = 1): s_now = 1 / (v*^T C^-1 v*) / (tr C / d)
    base = schur_quotient(torch.eye(d), gamma, 4 * d)
    assert base.schur_complement == pytest.approx(1.0, rel=1e-10)
    now = schur_quotient(torch.from_numpy(c), gamma, 4 * d, baseline=base)
    s_ref = numpy_schur_complement(c, v)
    assert now.schur_complement == pytest.approx(s_ref, rel=1e-9)
    assert now.delta_gamma == pytest.approx(1 - s_ref, rel=1e-9) and now.delta_gamma > 0.999
    assert now.deepening == pytest.approx(1 / s_ref, rel=1e-9)
    assert deepening(1.0, now.schur_complement) == pytest.approx(now.deepening, rel=1e-12)


def test_schur_quotient_falls_back_when_cholesky_fails():
    """ridge = 0 on a singular C_h: the eigen fallback floors the null eigenvalue, R stays in
    (0, 1] and tiny (v* overlaps the exact null direction)."""
    d = 16
    gamma = make_gamma(d, seed=12).double()
    c = torch.eye(d, dtype=torch.float64)
    c[0, 0] = 0.0
    read = schur_quotient(c, gamma, 4 * d, ridge=0.0)
    assert read.reason is None and 0 < read.schur_quotient < 1e-6


def test_deepening_edge_cases():
    assert deepening(0.5, 0.25) == 2.0
    assert math.isnan(deepening(0.5, 0.0)) and math.isnan(deepening(math.nan, 0.5))


@settings(max_examples=60, deadline=None)
@given(d=st.integers(2, 12), seed=st.integers(0, 2**31 - 1), spread=st.floats(0.0, 6.0))
def test_schur_quotient_lies_in_zero_one_on_random_spd(d, seed, spread):
    """0 < R <= 1 (Cauchy-Schwarz) and numpy's explicit-inverse formula agrees.

    Condition numbers reach 10^6 (``spread``); the inverse formula then loses about
    ``eps * kappa`` ~ 1e-10 relative, hence rel=1e-8."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    c = basis @ np.diag(10.0 ** rng.uniform(-spread, 0, d)) @ basis.T
    gamma = torch.from_numpy(rng.uniform(0.2, 2, d) * rng.choice([-1, 1], d))
    read = schur_quotient(torch.from_numpy(c), gamma, 2 * d)
    assert read.reason is None
    assert 0 < read.schur_quotient <= 1
    v = gamma_read(gamma).v_star.numpy()
    assert read.schur_quotient == pytest.approx(min(numpy_schur(c, v), 1.0), rel=1e-8)
    # a GammaRead passed for gamma (the monitor reuses its gamma read) gives the same read
    again = schur_quotient(torch.from_numpy(c), gamma_read(gamma), 2 * d)
    assert again.as_dict() == read.as_dict() and again.reason is None


# ------------------------------------------------- Delta_gamma against a baseline (issue 18)
def test_delta_gamma_is_zero_at_its_baseline_and_rises_as_a_direction_dies():
    """The baseline read against itself: Delta_gamma = 0, deepening = 1 exactly. The same
    inputs with the direction ``v*`` squeezed (a dead direction dug by training): s falls by the
    squeeze, Delta_gamma -> 1; numpy float64 reference of s on the same covariance."""
    d, n = 64, 16 * 64
    gamma = make_gamma(d, seed=20)
    x = make_inputs(d, n, seed=20).double()
    base = schur_quotient(accumulate(x).covariance(), gamma, n)
    again = schur_quotient(accumulate(x).covariance(), gamma, n, baseline=base)
    assert again.delta_gamma == 0.0 and again.deepening == 1.0 and again.delta_reason is None
    v = gamma_read(gamma).v_star.double()
    squeeze = torch.eye(d, dtype=torch.float64) - (1 - 1e-3) * torch.outer(v, v)
    acc = accumulate(x @ squeeze)
    read = schur_quotient(acc.covariance(), gamma, n, baseline=base)
    s_ref = numpy_schur_complement(acc.covariance().numpy(), v.numpy())
    assert read.schur_complement == pytest.approx(s_ref, rel=1e-9)
    assert read.delta_gamma == pytest.approx(1 - s_ref / base.schur_complement, rel=1e-9)
    assert read.delta_gamma > 0.99 and read.deepening > 100
    assert set(read.as_dict()) == {"schur_quotient", "schur_complement", "delta_gamma"}


def test_rmsnorm_carries_no_delta_gamma():
    d = 32
    gamma = make_gamma(d, seed=21)
    c = accumulate(make_inputs(d, 8 * d, seed=21)).covariance()
    base = schur_quotient(c, gamma, 8 * d)
    read = schur_quotient(c, gamma, 8 * d, declared_kind="rmsnorm", baseline=base)
    assert read.reason == read.delta_reason == "no_gamma_kernel"
    assert all(math.isnan(x) for x in (*read.as_dict().values(), read.deepening))
    with pytest.raises(ValueError, match="declared_kind"):
        schur_quotient(c, gamma, 8 * d, declared_kind="batchnorm")


def test_delta_gamma_needs_comparable_row_counts():
    """|d/N - d/N_base| <= 0.02: at d = 64, 1536 rows (0.042) compare with 2048 (0.031), not
    with 512 (0.125). The Schur complement itself is still read."""
    d = 64
    gamma = make_gamma(d, seed=22)
    x = make_inputs(d, 2048, seed=22)
    base = schur_quotient(accumulate(x).covariance(), gamma, 2048)
    near = schur_quotient(accumulate(x[:1536]).covariance(), gamma, 1536, baseline=base)
    far = schur_quotient(accumulate(x[:512]).covariance(), gamma, 512, baseline=base)
    assert near.delta_reason is None and math.isfinite(near.delta_gamma)
    assert far.delta_reason == "rows_not_comparable" and math.isnan(far.delta_gamma)
    assert math.isfinite(far.schur_complement) and math.isnan(far.deepening)
    assert rows_comparable(2048, 2048, d) and not rows_comparable(0, 2048, d)
    nan_base = dataclasses.replace(base, schur_complement=math.nan)
    assert schur_quotient(
        accumulate(x).covariance(), gamma, 2048, baseline=nan_base
    ).delta_reason == ("baseline_unavailable")
