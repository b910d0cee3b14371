"""The fast solvers (functional/solvers.py) against the dense route, number by number.

Every logged number of ``kernel_read`` and ``sigma_min`` is read twice from the same matrix,
``solver="fast"`` and ``solver="dense"``, and compared. Tolerances, and why:

* ``gamma_alignment``, ``subspace_alignment``, ``live_floor``: 1e-10 relative. Both routes
  read the same float64 matrix; their eigenvectors differ by about ``eps * lambda_d / gap``
  (each route's own rounding), far below 1e-10 on these spectra. Where the bottom gap is
  tiny (the clustered case), the bottom eigenvector itself is determined only to that
  bound, so ``gamma_alignment`` is compared to ``max(1e-10, 100 eps lambda_d / gap)``.
* ``bottom_eigenvalues`` (over ``lambda_d``) and ``kernel_residual``: 1e-10 absolute. A
  float64 eigensolver leaves an eigenvalue off by a few ``eps * lambda_d``, so on the ratio
  an absolute tolerance is the rounding floor; 1e-10 is the brief's figure (the fast route's
  error bound is 1e-12 of ``lambda_d``, the attained ~1e-16).
* ``null_dim``, ``norm_class``, ``kind_mismatch``: equal.
* ``sigma_min``: 1e-10 relative; where ``S`` is rank-deficient its true value is 0 and each
  route reads ``sqrt`` of its own rounding (``<= sqrt(64 d eps lambda_max)``), so there the
  two must both be under that.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import normscope.functional.solvers as solvers
from normscope.functional import StreamingCovariance, kernel_read, sigma_min, sigma_min_profile
from normscope.functional.eigh import symmetric_eigh, symmetric_eigvalsh
from normscope.functional.gamma import gamma_read, predicted_kernel
from normscope.functional.kernel import _restricted_floor, secular_floor
from normscope.functional.solvers import ShiftedCholesky, bottom_eigh, lambda_max

EPS = torch.finfo(torch.float64).eps
CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def fast_at_every_width(monkeypatch, request):
    """The fast route at the widths tested here (by default it starts at FAST_MIN_DIM)."""
    if "default_route" not in request.node.name:
        monkeypatch.setattr(solvers, "FAST_MIN_DIM", 1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cov(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    acc = StreamingCovariance(rows.shape[1])
    for chunk in rows.split(max(1, rows.shape[0] // 3)):
        acc.update(chunk)
    return acc.covariance(), acc.count


def _inputs(d: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    return torch.randn(4 * d, d, generator=g) * torch.logspace(0, -1, d) + 0.3


def _gamma(d: int, seed: int) -> torch.Tensor:
    return 0.5 + torch.rand(d, generator=_gen(seed + 100))


def layernorm(d: int, seed: int = 0, dead: int = 0, dtype=torch.float32):
    gamma = _gamma(d, seed)
    gamma[:dead] = 0.0
    y = F.layer_norm(_inputs(d, seed).to(dtype), (d,), gamma.to(dtype)).double()
    c, n = _cov(y)
    return c, gamma, n, "layernorm"


def rmsnorm(d: int, seed: int = 0):
    gamma = _gamma(d, seed)
    y = F.rms_norm(_inputs(d, seed), (d,), gamma).double()
    c, n = _cov(y)
    return c, gamma, n, "rmsnorm"


def zero_column(d: int, seed: int = 0):
    """Generic rows with one constant channel: one exact zero column (a unique ``u_1``)."""
    x = _inputs(d, seed).double()
    x[:, d // 3] = 1.5
    c, n = _cov(x)
    return c, _gamma(d, seed), n, "rmsnorm"


def spectrum(d: int, bottom: list[float], seed: int = 0, kind: str = "rmsnorm"):
    """``Q diag(lambda) Q^T``, ``lambda`` the given bottom values then log-spread to 1."""
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=_gen(seed), dtype=torch.float64))
    rest = torch.logspace(-2, 0, d - len(bottom), dtype=torch.float64)
    lam = torch.cat([torch.tensor(bottom, dtype=torch.float64), rest])
    c = (q * lam) @ q.T
    return (c + c.T) / 2, _gamma(d, seed), 4 * d, kind


def clustered(d: int, seed: int = 0):
    """Ten bottom eigenvalues 1e-7 of lambda_d apart at 1e-3 (near-repeated)."""
    return spectrum(d, [1e-3 + 1e-7 * i for i in range(10)], seed)


def repeated(d: int, seed: int = 0):
    """An exactly triple bottom eigenvalue (more copies than the first block of 2 holds)."""
    return spectrum(d, [2e-3, 2e-3, 2e-3, 3e-3, 4e-3], seed)


def power_law(d: int, seed: int = 0):
    """``lambda_i = i^-2``: a trained model's heavy tail, bottom values 0.5% apart."""
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=_gen(seed), dtype=torch.float64))
    c = (q * torch.arange(1, d + 1, dtype=torch.float64) ** -2.0) @ q.T
    return (c + c.T) / 2, _gamma(d, seed), 4 * d, "rmsnorm"


def rank_deficient(d: int, seed: int = 0):
    """``S`` of rows with three exactly dependent columns (three zero eigenvalues)."""
    x = _inputs(d, seed).double()
    x[:, 0] = x[:, 1] + x[:, 2]
    x[:, 3] = 2 * x[:, 4]
    x[:, 5] = x[:, 6] - x[:, 7]
    acc = StreamingCovariance(d)
    acc.update(x)
    return acc.second_moment(), _gamma(d, seed), acc.count, "rmsnorm"


CASES = {
    "layernorm": (layernorm, {}, 1e-10),
    "layernorm-bf16": (layernorm, {"dtype": torch.bfloat16}, 1e-4),
    "rmsnorm": (rmsnorm, {}, 1e-10),
    "dead-channels": (layernorm, {"dead": 3}, 1e-10),
    "zero-column": (zero_column, {}, 1e-10),
    "clustered": (clustered, {}, 1e-10),
    "repeated": (repeated, {}, 1e-10),
    "rank-deficient": (rank_deficient, {}, 1e-10),
    "power-law": (power_law, {}, 1e-10),
}
ILL_POSED_U1 = {"repeated"}  # a repeated bottom eigenvalue: u_1 is any vector of its space


def bottom_gap(c: torch.Tensor) -> float:
    ev = torch.linalg.eigvalsh(c)
    return float(ev[1] - ev[0]) / float(ev[-1])


def assert_reads_equal(fast, dense, c, case: str) -> None:
    assert fast.solver == "fast" and fast.dense_fallbacks == 0, (fast.solver, case)
    assert dense.solver == "dense" and dense.dense_fallbacks == 0
    assert (fast.null_dim, fast.norm_class, fast.kind_mismatch, fast.reason) == (
        dense.null_dim,
        dense.norm_class,
        dense.kind_mismatch,
        dense.reason,
    ), case
    assert len(fast.bottom_eigenvalues) == len(dense.bottom_eigenvalues) == 8
    for a, b in zip(fast.bottom_eigenvalues, dense.bottom_eigenvalues):
        assert abs(a - b) <= 1e-10, (case, a, b)
    assert abs(fast.kernel_residual - dense.kernel_residual) <= 1e-10, case
    a, b = fast.subspace_alignment, dense.subspace_alignment
    assert a == pytest.approx(b, rel=1e-10, abs=1e-300), (case, a, b)
    # live_floor = smallest / mean: where the smallest is a rounding zero (a kernel left in the
    # live space) each route reads its own rounding, a few eps * lambda_d over the mean
    lam, mean = float(torch.linalg.eigvalsh(c)[-1]), float(torch.trace(c)) / c.shape[0]
    a, b = fast.live_floor, dense.live_floor
    assert a == pytest.approx(b, rel=1e-10, abs=1e3 * EPS * lam / mean), (case, a, b)
    if case not in ILL_POSED_U1:
        tol = max(1e-10, 100 * EPS / max(bottom_gap(c), 1e-300))
        a, b = fast.gamma_alignment, dense.gamma_alignment
        assert abs(a - b) <= tol * max(abs(b), 1e-3), (case, a, b, tol)


@pytest.mark.parametrize("d", [256, 512])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_read_fast_equals_dense(case: str, d: int) -> None:
    build, kw, null_tol = CASES[case]
    c, gamma, n, kind = build(d, **kw)
    fast = kernel_read(c, gamma, n, null_tol=null_tol, declared_kind=kind)
    dense = kernel_read(c, gamma, n, null_tol=null_tol, declared_kind=kind, solver="dense")
    assert_reads_equal(fast, dense, c, case)
    expected_null = {"dead-channels": 3, "zero-column": 1, "rank-deficient": 3}
    if case in expected_null:
        assert fast.null_dim == expected_null[case]
    if case.startswith("layernorm"):
        assert fast.null_dim == 1
    if case == "layernorm":
        assert fast.norm_class == "layernorm-like"
    # the other kind's reading of the same matrix: the live floor with v* removed or not
    other = "rmsnorm" if kind == "layernorm" else "layernorm"
    fast = kernel_read(c, gamma, n, null_tol=null_tol, declared_kind=other)
    dense = kernel_read(c, gamma, n, null_tol=null_tol, declared_kind=other, solver="dense")
    assert_reads_equal(fast, dense, c, case)


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("case", ["layernorm", "rmsnorm", "dead-channels", "rank-deficient"])
def test_small_widths_forced_fast(case: str, d: int) -> None:
    """Small widths (dense by default, faster there) with the fast route forced."""
    build, kw, null_tol = CASES[case]
    c, gamma, n, kind = build(d, **kw)
    k = 3 if d == 16 else 8
    fast = kernel_read(c, gamma, n, null_tol=null_tol, declared_kind=kind, bottom_k=k)
    dense = kernel_read(
        c, gamma, n, null_tol=null_tol, declared_kind=kind, bottom_k=k, solver="dense"
    )
    assert fast.solver == "fast"
    assert (fast.null_dim, fast.norm_class) == (dense.null_dim, dense.norm_class)
    for a, b in zip(fast.bottom_eigenvalues, dense.bottom_eigenvalues):
        assert abs(a - b) <= 1e-10
    assert fast.live_floor == pytest.approx(dense.live_floor, rel=1e-10)
    assert fast.subspace_alignment == pytest.approx(dense.subspace_alignment, rel=1e-10)


@pytest.mark.parametrize("d", [256, 512])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sigma_min_fast_equals_dense(case: str, d: int) -> None:
    build, kw, _ = CASES[case]
    c, _, n, _ = build(d, **kw)
    s = c + 0.0  # a covariance is a second moment of centred rows
    fast, dense = sigma_min(s, n), sigma_min(s, n, solver="dense")
    lam = float(torch.linalg.eigvalsh(s)[-1])
    floor = math.sqrt(64 * d * EPS * lam)
    if case in {"rank-deficient", "layernorm", "dead-channels", "zero-column"}:
        # a true zero (LayerNorm's kernel, dead channels, dependent columns): rounding only
        assert fast <= floor and dense <= floor, (case, fast, dense)
    else:
        assert fast == pytest.approx(dense, rel=1e-10), (case, fast, dense)


def test_profile_counts_and_matches() -> None:
    d = 256
    moments = [rmsnorm(d, seed=s)[0] for s in range(3)]
    names, rows, subs = ["p0", "p1", "p2"], [4 * d] * 3, [None, "attn", "mlp"]
    fast = sigma_min_profile(names, moments, rows, subs)
    dense = sigma_min_profile(names, moments, rows, subs, solver="dense")
    assert fast.dense_fallbacks == dense.dense_fallbacks == 0
    for a, b in zip(fast.points, dense.points):
        assert a.sigma_min == pytest.approx(b.sigma_min, rel=1e-10)


def test_fallback_taken_and_counted(monkeypatch) -> None:
    c, gamma, n, kind = layernorm(256)
    dense = kernel_read(c, gamma, n, declared_kind=kind, solver="dense")
    monkeypatch.setattr(solvers, "MAX_ITER", 1)
    monkeypatch.setattr(solvers, "KRYLOV_SHARE", 0.0)
    read = kernel_read(c, gamma, n, declared_kind=kind)
    assert (read.solver, read.dense_fallbacks) == ("dense", 1)
    assert read == dataclass_replace(dense, dense_fallbacks=1)
    moments = [rmsnorm(256, seed=s)[0] for s in range(2)]
    prof = sigma_min_profile(["a", "b"], moments, [1024, 1024], [None, "block"])
    assert prof.dense_fallbacks == 2
    ref = sigma_min_profile(["a", "b"], moments, [1024, 1024], [None, "block"], solver="dense")
    assert [p.sigma_min for p in prof.points] == [p.sigma_min for p in ref.points]
    # the monitor logs the read's count as one run-level key
    from normscope.families.dead_direction.report import DeadDirectionReport

    report = DeadDirectionReport(0, {}, prof, None, 0, sources={"web": prof})
    assert report.as_dict()["dd/solver_fallbacks"] == 4.0
    assert DeadDirectionReport(0, {}, ref, None, 0).as_dict()["dd/solver_fallbacks"] == 0.0


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_dense_is_the_old_route_exactly() -> None:
    """``solver="dense"`` is one eigh of C; the live floor comes from its eigenpairs by the
    secular equation (exactly :func:`secular_floor`), equal to the old second decomposition
    (eigvalsh of Q^T C Q) up to the rounding of C's spectrum (eps ||C||, in the floor's units
    ``lambda_max / mean``)."""
    c, gamma, n, kind = layernorm(256)
    read = kernel_read(c, gamma, n, declared_kind=kind, solver="dense")
    evals, evecs = symmetric_eigh(c)
    lam = float(evals[-1])
    p = predicted_kernel(gamma_read(gamma))
    null = evals <= 1e-10 * lam
    assert read.null_dim == int(null.sum())
    assert read.bottom_eigenvalues == tuple((evals[:8] / lam).tolist())
    assert read.gamma_alignment == min(float(torch.linalg.vector_norm(p.T @ evecs[:, 0])), 1.0)
    assert read.kernel_residual == float(symmetric_eigvalsh(p.T @ c @ p)[-1] / lam)
    assert read.live_floor == secular_floor(evals, evecs, p[:, 0])
    scale = lam / float(evals.mean())
    assert abs(read.live_floor - _restricted_floor(c, p)) <= 1e-13 * scale
    s = c + torch.outer(c[0], c[0]) * 0  # any PSD matrix
    assert sigma_min(s, n, solver="dense") == math.sqrt(max(float(symmetric_eigvalsh(s)[0]), 0))


def test_default_route_by_width() -> None:
    """Dense below FAST_MIN_DIM (no fallback counted), fast from there."""
    for d in (64, solvers.FAST_MIN_DIM):
        c, gamma, n, kind = layernorm(d)
        read = kernel_read(c, gamma, n, declared_kind=kind)
        fast = d >= solvers.FAST_MIN_DIM
        assert (read.solver, read.dense_fallbacks) == ("fast" if fast else "dense", 0)


def test_bad_solver_name() -> None:
    c, gamma, n, kind = layernorm(16)
    with pytest.raises(ValueError, match="solver"):
        kernel_read(c, gamma, n, solver="lobpcg")
    with pytest.raises(ValueError, match="solver"):
        sigma_min(c, n, solver="eig")


def test_bottom_eigh_primitives() -> None:
    """The primitives alone: exact zero columns, a dependent column, lambda_max."""
    c, *_ = layernorm(256, dead=2)
    lam, ok = lambda_max(c)
    assert ok and lam == pytest.approx(float(torch.linalg.eigvalsh(c)[-1]), rel=1e-13)
    f = ShiftedCholesky(c, lam)
    assert f.ok and f.zero.tolist() == [0, 1]
    out = bottom_eigh(c, 8, lam, factor=f, null_tol=1e-10)
    assert out.converged and out.null_dim == 2
    ref = torch.linalg.eigvalsh(c)[:8]
    assert float((out.values[:8] - ref).abs().max()) <= 1e-12 * lam
    # the null pairs are exact; the others are held to their values' error bound only
    resid = torch.linalg.vector_norm(c @ out.vectors - out.vectors * out.values, dim=0)
    assert float(resid[:2].max()) == 0.0
    # one vector read (vectors=1): the bottom pair to the tight tolerance
    out = bottom_eigh(c[2:, 2:], 4, lam, vectors=1)
    r = torch.linalg.vector_norm(c[2:, 2:] @ out.vectors[:, 0] - out.values[0] * out.vectors[:, 0])
    assert out.converged and float(r) <= solvers.TIGHT_TOL * lam


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("case", ["layernorm", "rmsnorm", "dead-channels", "clustered"])
def test_cuda_fast_equals_dense(case: str) -> None:
    build, kw, null_tol = CASES[case]
    c, gamma, n, kind = build(512, **kw)
    c, gamma = c.cuda(), gamma.cuda()
    fast = kernel_read(c, gamma, n, null_tol=null_tol, declared_kind=kind)
    dense = kernel_read(c, gamma, n, null_tol=null_tol, declared_kind=kind, solver="dense")
    assert_reads_equal(fast, dense, c, case)
    assert sigma_min(c, n) == pytest.approx(sigma_min(c, n, solver="dense"), rel=1e-10, abs=1e-6)
