"""Property tests (hypothesis) of the accumulator and the reads over shapes, dtypes, masks and
batch splits. Modest ``max_examples``; ``deadline=None`` (timing is not the property).

tests/functional/test_covariance.py already has: merge order, fifty uneven batches of one
covariance, masks on a fixed example, low-precision floats on fixed examples. These add the
*reads* on top (kernel, Schur quotient, sigma_min), integer and bool rows, masks against row
selection with NaN padding, and LayerNorm outputs of random leading shapes.

Tolerances: float64 rows reduced in different orders agree to a few ulps times the number of
rows; 1e-12 on covariances (relative to their norm), 1e-9 on reads (an eigenvector's error is
the covariance's over the spectral gap, and the gaps here are >= 1e-3 of the top). The
uncentred sigma_min is as accurate as ``eps * lambda_max(S) / sigma_min`` allows (any float64
method is); with offsets that bound is the tolerance.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from normscope.functional import StreamingCovariance
from normscope.functional.dead_direction import kernel_read, schur_quotient
from normscope.functional.profile import sigma_min

EPS = float(np.finfo(np.float64).eps)
SETTINGS = settings(max_examples=25, deadline=None)


def layer_norm_rows(n: int, d: int, seed: int, offset: float, scale: float):
    """Input rows ``h`` (float64, offset and scaled) and their exact float64 LayerNorm output
    ``y``, with a gamma of mixed signs and magnitudes in [0.5, 2]."""
    g = torch.Generator().manual_seed(seed)
    h = scale * torch.randn(n, d, generator=g, dtype=torch.float64) + offset
    mags = 0.5 + 1.5 * torch.rand(d, generator=g, dtype=torch.float64)
    signs = torch.where(torch.rand(d, generator=g) < 0.3, -1.0, 1.0).to(torch.float64)
    gamma = mags * signs
    beta = torch.randn(d, generator=g, dtype=torch.float64)
    return h, F.layer_norm(h, (d,), gamma, beta, eps=1e-12), gamma


def accumulate(x: torch.Tensor, cuts: list[int]) -> StreamingCovariance:
    acc = StreamingCovariance(x.shape[-1])
    for part in torch.tensor_split(x, sorted(cuts)):
        acc.update(part)
    return acc


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


@SETTINGS
@given(
    d=st.integers(2, 12),
    extra=st.integers(0, 48),
    cut_points=st.lists(st.floats(0, 1), max_size=6),
    seed=st.integers(0, 2**16),
    offset=st.sampled_from([0.0, 3.0, 1e3, 1e6]),
)
def test_reads_do_not_depend_on_how_rows_are_split(d, extra, cut_points, seed, offset):
    """One batch or any split into batches (empty ones too): same count, covariance and every
    read -- kernel, Schur quotient, sigma_min.

    With an offset ``mu`` on a unit spread, merging batches carries the rounding of the batch
    means (``eps * mu``) into the co-moment at first order: the covariance is exact to about
    ``eps * mu`` relative (2e-10 at mu = 1e6; raw sums would lose ``eps * mu^2`` = 2e-4), so
    the tolerance is ``1e-12 + 4 eps mu``, and 100 times that for the Schur quotient (the
    condition number of these covariances is below 100)."""
    n = 4 * d + extra
    h, y, gamma = layer_norm_rows(n, d, seed, offset, 1.0)
    cuts = [int(c * n) for c in cut_points]
    tol = 1e-12 + 4 * EPS * offset
    for x, x_tol in ((h, tol), (y, 1e-12)):
        whole, split = accumulate(x, []), accumulate(x, cuts)
        assert whole.count == split.count == n
        assert rel(split.covariance(), whole.covariance()) <= x_tol
    hw, hs = accumulate(h, []), accumulate(h, cuts)
    yw, ys = accumulate(y, []), accumulate(y, cuts)
    kw = kernel_read(yw.covariance(), gamma, n, declared_kind="layernorm")
    ks = kernel_read(ys.covariance(), gamma, n, declared_kind="layernorm")
    assert kw.null_dim == ks.null_dim == 1
    assert abs(kw.gamma_alignment - ks.gamma_alignment) <= 1e-9 and kw.gamma_alignment > 0.9999
    assert abs(kw.kernel_residual - ks.kernel_residual) <= 1e-12
    sw = schur_quotient(hw.covariance(), gamma, n).schur_quotient
    ss = schur_quotient(hs.covariance(), gamma, n).schur_quotient
    assert math.isclose(sw, ss, rel_tol=max(1e-9, 100 * tol))
    s_whole = hw.second_moment()
    lam = torch.linalg.eigvalsh(s_whole)
    sig_w, sig_s = sigma_min(s_whole, n), sigma_min(hs.second_moment(), n)
    bound = 100 * d * EPS * float(lam[-1]) / (2 * max(sig_w, 1e-300))
    assert abs(sig_w - sig_s) <= max(bound, 1e-9 * sig_w)


@SETTINGS
@given(
    shape=st.tuples(st.integers(1, 5), st.integers(1, 9)),
    d=st.integers(1, 8),
    p_keep=st.floats(0, 1),
    mask_dtype=st.sampled_from([torch.bool, torch.int64, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_a_mask_equals_selecting_its_rows(shape, d, p_keep, mask_dtype, seed):
    """``update(x, mask)`` == ``update(x[mask])``, also when padded rows hold NaN (padding is
    skipped, not counted as rejected) and when kept rows hold Inf (rejected either way)."""
    g = torch.Generator().manual_seed(seed)
    x = 5 + torch.randn(*shape, d, generator=g)
    keep = torch.rand(shape, generator=g) < p_keep
    x[~keep] = math.nan  # padding full of garbage
    flat = x.reshape(-1, d)
    if keep.any():
        flat[torch.nonzero(keep.flatten())[0, 0], 0] = math.inf  # one corrupt real row
    x = flat.reshape(*shape, d)
    masked, selected = StreamingCovariance(d), StreamingCovariance(d)
    masked.update(x, mask=keep.to(mask_dtype))
    selected.update(x[keep])
    assert masked.count == selected.count == max(int(keep.sum()) - 1, 0)
    assert masked.rows_rejected == selected.rows_rejected == int(bool(keep.any()))
    if masked.count == 0:
        assert torch.isnan(masked.covariance()).all() and torch.isnan(selected.covariance()).all()
        return
    torch.testing.assert_close(masked.mean, selected.mean, rtol=1e-13, atol=0)
    scale = float(torch.linalg.matrix_norm(selected.comoment)) or 1.0
    assert float(torch.linalg.matrix_norm(masked.comoment - selected.comoment)) <= 1e-12 * scale


DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


@SETTINGS
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 40),
    d=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_any_dtype_accumulates_exactly_as_its_float64_upcast(dtype, n, d, seed):
    """Low-precision floats, integers and bools: the state is bit-identical to the one of the
    same rows converted to float64 first (the conversion is exact, and it is the first thing
    the accumulator does)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = (100 * torch.randn(n, d, generator=g)).to(dtype)
    elif dtype == torch.bool:
        x = torch.rand(n, d, generator=g) < 0.5
    else:
        info = torch.iinfo(dtype)
        x = torch.randint(max(info.min, -1000), min(info.max, 1000), (n, d), generator=g).to(dtype)
    low, high = StreamingCovariance(d), StreamingCovariance(d)
    low.update(x)
    high.update(x.to(torch.float64))
    assert low.count == high.count == n
    assert torch.equal(low.comoment, high.comoment) and torch.equal(low.mean, high.mean)


@SETTINGS
@given(
    lead=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    d=st.integers(3, 24),  # d = 2: every output row is +-gamma (x) (1, -1) + beta, no spread
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-3, 3),
    offset_ratio=st.floats(0, 10),
)
def test_layernorm_outputs_of_any_shape_have_the_exact_kernel(
    lead, d, seed, log_scale, offset_ratio
):
    """A float32 LayerNorm on rows of any leading shape, scale and offset: the centred output
    covariance has v* = gamma^-1/||gamma^-1|| as its kernel (alignment > 0.9999, residual at the
    float32 floor), however the rows are laid out."""
    g = torch.Generator().manual_seed(seed)
    rows = math.prod(lead)
    lead = [*lead[:-1], lead[-1] * math.ceil(4 * d / rows)]  # at least 4 d rows
    scale = 10.0**log_scale
    h = scale * (torch.randn(*lead, d, generator=g) + offset_ratio * torch.randn(d, generator=g))
    mags = 0.25 + 3.75 * torch.rand(d, generator=g)
    gamma = torch.where(torch.rand(d, generator=g) < 0.3, -mags, mags)
    y = F.layer_norm(h, (d,), gamma, torch.randn(d, generator=g))
    acc = StreamingCovariance(d)
    acc.update(y)
    assert acc.count == math.prod(lead) >= 4 * d
    read = kernel_read(acc.covariance(), gamma, acc.count, declared_kind="layernorm")
    assert read.gamma_alignment > 0.9999, read
    assert read.kernel_residual <= 1e-9 and read.null_dim == 1
    assert read.norm_class == "layernorm-like"


@SETTINGS
@given(
    d=st.integers(2, 10),
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-6, 6),
)
def test_centred_reads_do_not_depend_on_the_scale_of_the_activations(d, seed, log_scale):
    """Rows times 10^k for k in [-6, 6]: the Schur quotient and every kernel read are
    unchanged (they are ratios of the covariance's own numbers)."""
    h, y, gamma = layer_norm_rows(4 * d + 3, d, seed, 0.0, 1.0)
    c = 10.0**log_scale
    n = len(h)
    r1 = schur_quotient(accumulate(h, []).covariance(), gamma, n).schur_quotient
    rc = schur_quotient(accumulate(c * h, []).covariance(), gamma, n).schur_quotient
    assert math.isclose(r1, rc, rel_tol=1e-9)
    k1 = kernel_read(accumulate(y, []).covariance(), gamma, n)
    kc = kernel_read(accumulate(c * y, []).covariance(), gamma, n)
    assert abs(k1.gamma_alignment - kc.gamma_alignment) <= 1e-9
    assert k1.null_dim == kc.null_dim and math.isclose(k1.live_floor, kc.live_floor, rel_tol=1e-9)
