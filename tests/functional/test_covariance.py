"""StreamingCovariance against numpy's two-pass covariance (np.cov(..., bias=True)), and as a
``torchmetrics.Metric`` (compute, merge_state, state_dict, ``.to()``, reset, sync).

Tolerances: a float64 two-pass covariance of N rows is exact to a few ulps times sqrt(N); the
1e-12 relative Frobenius bound used throughout leaves about three orders of magnitude of room,
while a raw-sum accumulation misses it by orders of magnitude on offset data.
"""

from __future__ import annotations

import copy
import math
import os
import socket
import warnings
import weakref
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torchmetrics import Metric
from torchmetrics.aggregation import SumMetric

from normscope.functional import (
    StreamingCovariance,
    fetch_counts,
    symmetric_eigh,
    symmetric_eigvalsh,
)


def rel_fro(a: torch.Tensor | np.ndarray, b: np.ndarray) -> float:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def offset_rows(n: int, d: int, seed: int, offset: float = 1e4) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return offset + rng.standard_normal((n, d)) @ np.diag(rng.uniform(0.5, 1.5, d))


def naive_raw_sum_covariance(batches: list[np.ndarray]) -> np.ndarray:
    """The textbook shortcut: float64 sums of x and x x^T, then S/n - mu mu^T."""
    d = batches[0].shape[1]
    s1, s2, n = np.zeros(d), np.zeros((d, d)), 0
    for b in batches:
        s1 += b.sum(0)
        s2 += b.T @ b
        n += len(b)
    mu = s1 / n
    return s2 / n - np.outer(mu, mu)


def test_large_offset_is_exact_and_raw_sums_are_not():
    d = 256
    x = offset_rows(8192, d, seed=0)
    batches = np.array_split(x, 16)
    acc = StreamingCovariance(d)
    for b in batches:
        acc.update(torch.from_numpy(b))
    reference = np.cov(x, rowvar=False, bias=True)
    ours = rel_fro(acc.covariance(), reference)
    naive = rel_fro(naive_raw_sum_covariance(batches), reference)
    assert ours <= 1e-12
    # eps * (mu/sigma)^2 = 2e-16 * 1e8: the raw sums keep only about eight digits.
    assert naive > 1e3 * ours and naive > 1e-10
    np.testing.assert_allclose(acc.mean.numpy(), x.mean(0), rtol=1e-14)
    assert acc.count == 8192


def test_second_moment_is_uncentred():
    x = offset_rows(1000, 8, seed=1, offset=3.0)
    acc = StreamingCovariance(8)
    acc.update(torch.from_numpy(x))
    assert rel_fro(acc.second_moment(), x.T @ x / len(x)) <= 1e-13


def test_fifty_uneven_batches_equal_one_pass():
    rng = np.random.default_rng(2)
    x = offset_rows(5000, 32, seed=2, offset=50.0)
    cuts = np.sort(rng.choice(np.arange(1, 5000), size=49, replace=False))
    chunks = np.split(x, cuts)
    assert len(chunks) == 50
    streamed, one_pass = StreamingCovariance(32), StreamingCovariance(32)
    for c in chunks:
        streamed.update(torch.from_numpy(c))
    one_pass.update(torch.from_numpy(x))
    assert rel_fro(streamed.covariance(), one_pass.covariance().numpy()) <= 1e-12
    assert rel_fro(streamed.covariance(), np.cov(x, rowvar=False, bias=True)) <= 1e-12


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=40), min_size=2, max_size=8),
    order_seed=st.integers(min_value=0, max_value=10_000),
)
def test_merge_order_does_not_matter(sizes, order_seed):
    d = 5
    rng = np.random.default_rng(order_seed)
    parts = [offset_rows(n, d, seed=order_seed + i, offset=100.0) for i, n in enumerate(sizes)]
    accs = []
    for p in parts:
        a = StreamingCovariance(d)
        a.update(torch.from_numpy(p))
        accs.append(a)
    forward, shuffled = StreamingCovariance(d), StreamingCovariance(d)
    for a in accs:
        forward.merge_state(a)
    for i in rng.permutation(len(accs)):
        shuffled.merge_state(accs[i])
    total = sum(sizes)
    assert forward.count == shuffled.count == total
    if total == 0:
        assert torch.isnan(forward.covariance()).all()
        return
    x = np.concatenate(parts)
    ref = np.cov(x, rowvar=False, bias=True) if total > 1 else np.zeros((d, d))
    scale = max(np.linalg.norm(ref), 1e-300)
    for acc in (forward, shuffled):
        # absolute error against the data's scale: a single row has covariance exactly 0.
        assert np.linalg.norm(acc.covariance().numpy() - ref) / scale <= 1e-11 or total == 1
        np.testing.assert_allclose(acc.mean.numpy(), x.mean(0), rtol=1e-13)


def test_mask_skips_rows():
    x = torch.randn(4, 10, 6, dtype=torch.float64)
    mask = torch.rand(4, 10) > 0.3
    acc = StreamingCovariance(6)
    acc.update(x, mask=mask)
    kept = x[mask].numpy()
    assert acc.count == len(kept)
    assert acc.rows_rejected == 0
    assert rel_fro(acc.covariance(), np.cov(kept, rowvar=False, bias=True)) <= 1e-13


def test_integer_attention_mask_and_shape_error():
    x = torch.randn(2, 5, 3)
    acc = StreamingCovariance(3)
    acc.update(x, mask=torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]))
    assert acc.count == 4
    with pytest.raises(ValueError, match="mask must have the shape"):
        acc.update(x, mask=torch.ones(2, 4))


def test_nan_and_inf_rows_are_dropped_and_counted():
    x = torch.randn(100, 4, dtype=torch.float64)
    x[3, 1] = math.nan
    x[10, 0] = math.inf
    x[11, 2] = -math.inf
    mask = torch.ones(100, dtype=torch.bool)
    mask[3] = False  # masked padding holding NaN is padding, not a rejected row
    acc = StreamingCovariance(4)
    acc.update(x, mask=mask)
    good = np.delete(x.numpy(), [3, 10, 11], axis=0)
    assert acc.count == 97
    assert acc.rows_rejected == 2
    assert torch.isfinite(acc.covariance()).all()
    assert rel_fro(acc.covariance(), np.cov(good, rowvar=False, bias=True)) <= 1e-13


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_input_is_accumulated_in_float64(dtype):
    x = torch.randn(512, 16).to(dtype)
    acc = StreamingCovariance(16)
    acc.update(x)
    assert acc.covariance().dtype == torch.float64
    # the reference sees the same rounded values, so only float64 rounding separates them.
    ref = np.cov(x.to(torch.float64).numpy(), rowvar=False, bias=True)
    assert rel_fro(acc.covariance(), ref) <= 1e-13


def test_empty_updates_change_nothing():
    acc = StreamingCovariance(3)
    acc.update(torch.empty(0, 3))
    acc.update(torch.empty(2, 0, 3))
    acc.update(torch.randn(4, 3), mask=torch.zeros(4))
    assert acc.count == 0
    assert torch.isnan(acc.covariance()).all()
    x = torch.randn(10, 3, dtype=torch.float64)
    acc.update(x)
    acc.update(torch.empty(0, 3))
    assert rel_fro(acc.covariance(), np.cov(x.numpy(), rowvar=False, bias=True)) <= 1e-13


def test_dimension_mismatch_is_a_clear_error():
    acc = StreamingCovariance(8)
    with pytest.raises(ValueError, match=r"width d=8.*\(4, 7\)"):
        acc.update(torch.randn(4, 7))
    with pytest.raises(ValueError, match="dimensions differ"):
        acc.merge_state(StreamingCovariance(9))
    with pytest.raises(ValueError, match="positive int"):
        StreamingCovariance(0)


def test_subsampling_is_uniform_seeded_and_bounded():
    x = torch.randn(1000, 4, dtype=torch.float64)
    a, b = (
        StreamingCovariance(4, max_rows=100, seed=7),
        StreamingCovariance(4, max_rows=100, seed=7),
    )
    a.update(x)
    b.update(x)
    assert a.count == 100
    assert torch.equal(a.covariance(), b.covariance())
    c = StreamingCovariance(4, max_rows=100, seed=8)
    c.update(x)
    assert not torch.equal(a.covariance(), c.covariance())


def test_state_dict_round_trip_keeps_device_and_values(tmp_path):
    acc = StreamingCovariance(6, max_rows=50, seed=3)
    acc.update(torch.randn(80, 6) + 1e3)
    acc.update(torch.full((2, 6), math.nan))
    path = tmp_path / "acc.pt"
    torch.save(acc.state_dict(), path)
    restored = StreamingCovariance(6, device="cpu")
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert restored.device == torch.device("cpu")
    assert restored.mean.device == torch.device("cpu")
    assert restored.count == acc.count and restored.rows_rejected == acc.rows_rejected == 2
    assert torch.equal(restored.covariance(), acc.covariance())
    # the subsampling generator continues where it was.
    nxt = torch.randn(80, 6)
    acc.update(nxt)
    restored.update(nxt)
    assert torch.equal(restored.covariance(), acc.covariance())
    with pytest.raises(ValueError, match="d=6"):
        StreamingCovariance(5).load_state_dict(acc.state_dict())


# ------------------------------------------------------------------- as a torchmetrics.Metric
def test_compute_is_numpy_covariance_and_follows_updates():
    x = offset_rows(3000, 12, seed=20, offset=1e3)
    acc = StreamingCovariance(12)
    assert isinstance(acc, Metric)
    for chunk in np.array_split(x, 7):
        acc.update(torch.from_numpy(chunk))
    assert acc.update_count == 7
    c = acc.compute()
    assert c.dtype == torch.float64
    assert rel_fro(c, np.cov(x, rowvar=False, bias=True)) <= 1e-12
    more = offset_rows(500, 12, seed=21, offset=1e3)
    acc.update(torch.from_numpy(more))  # the cached value is dropped by an update
    both = np.concatenate([x, more])
    assert rel_fro(acc.compute(), np.cov(both, rowvar=False, bias=True)) <= 1e-12


def test_merge_state_equals_one_accumulator_over_all_rows():
    d, sizes = 150, (400, 0, 1, 650)  # d = 150: panel folds, whose lower blocks wait for a read
    parts = [offset_rows(n, d, seed=30 + i, offset=1e4 * (i + 1)) for i, n in enumerate(sizes)]
    single, merged = StreamingCovariance(d), StreamingCovariance(d)
    single.update(torch.from_numpy(np.concatenate(parts)))
    for i, part in enumerate(parts):
        other = StreamingCovariance(d)
        other.update(torch.from_numpy(part))
        other.update(torch.full((2, d), math.nan))  # rejected rows merge too
        # a StreamingCovariance, or its metric_state dict (what torchmetrics hands around)
        merged.merge_state(other if i % 2 else other.metric_state)
    assert merged.count == single.count == sum(sizes) and merged.rows_rejected == 8
    # Chan's merge against one fold of every row: the same float64 numbers up to rounding
    assert rel_fro(merged.covariance(), single.covariance().numpy()) <= 1e-12
    np.testing.assert_allclose(merged.mean.numpy(), single.mean.numpy(), rtol=1e-13)
    assert merged.update_count == 1 + 2 + 1 + 2  # a dict counts 1, an accumulator its own
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compute before update" warning after merges
        assert rel_fro(merged.compute(), single.covariance().numpy()) <= 1e-12
    with pytest.raises(ValueError, match="instance of StreamingCovariance"):
        merged.merge_state(SumMetric())
    with pytest.raises(ValueError, match="dimensions differ"):
        merged.merge_state(StreamingCovariance(9))


def test_forward_folds_the_rows_and_returns_the_batch_covariance():
    a, b = offset_rows(300, 5, seed=40), offset_rows(200, 5, seed=41)
    acc = StreamingCovariance(5)
    acc.update(torch.from_numpy(a))
    batch = acc(torch.from_numpy(b))
    assert rel_fro(batch, np.cov(b, rowvar=False, bias=True)) <= 1e-12
    both = np.concatenate([a, b])
    assert acc.count == 500
    assert rel_fro(acc.covariance(), np.cov(both, rowvar=False, bias=True)) <= 1e-12


def test_state_dict_holds_persistent_states_inside_a_parent_module(tmp_path):
    parent = nn.Module()
    parent.acc = StreamingCovariance(7, max_rows=40, seed=5)
    parent.acc.update(torch.randn(100, 7) + 50.0)
    state = parent.state_dict()
    keys = {"acc._n", "acc._mean", "acc._comoment", "acc._rejected", "acc._extra_state"}
    assert set(state) == keys
    torch.save(state, tmp_path / "parent.pt")
    twin = nn.Module()
    twin.acc = StreamingCovariance(7)
    twin.load_state_dict(torch.load(tmp_path / "parent.pt", weights_only=True))
    assert twin.acc.count == 40 and twin.acc.max_rows == 40 and twin.acc.update_count == 1
    assert torch.equal(twin.acc.covariance(), parent.acc.covariance())
    twin.acc.update(torch.ones(3, 7))  # the loaded tensors are copies, not the saved ones
    assert torch.equal(state["acc._n"], torch.tensor(40.0, dtype=torch.float64))


def test_to_moves_every_state_and_keeps_float64():
    acc = StreamingCovariance(6)
    acc.update(torch.randn(20, 6))
    before = acc.covariance().clone()
    assert acc.to(torch.float32) is acc and acc.set_dtype(torch.float16) is acc
    assert {t.dtype for t in acc.metric_state.values()} == {torch.float64, torch.int64}
    assert torch.equal(acc.covariance(), before) and acc.dtype == torch.float64
    acc.to("meta")  # a real move without a GPU: every state, the defaults, the device
    assert acc.device == torch.device("meta")
    assert {t.device.type for t in (*acc.metric_state.values(), *acc._defaults.values())} == {
        "meta"
    }
    made = StreamingCovariance(6, device="meta")  # made there, reset there
    made.reset()
    assert {t.device.type for t in made.metric_state.values()} == {"meta"}
    with pytest.raises(ValueError, match="MPS has no float64"):
        StreamingCovariance(6).to("mps")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_to_cuda_and_back_keeps_the_values():
    acc = StreamingCovariance(6)
    acc.update(torch.randn(20, 6))
    before = acc.covariance().clone()
    acc.cuda()
    assert acc.device.type == "cuda" and acc.comoment.device.type == "cuda"
    acc.update(torch.randn(5, 6, device="cuda"))
    acc.cpu()
    assert acc.count == 25 and not torch.equal(acc.covariance(), before)


def test_reset_gives_new_zero_tensors_and_holds_one_state():
    d = 64
    acc = StreamingCovariance(d)
    acc.update(torch.randn(100, d))
    old = acc.comoment
    acc.reset()
    assert acc.count == 0 and acc.update_count == 0 and torch.isnan(acc.covariance()).all()
    assert acc.comoment is not old and float(old.abs().sum()) > 0  # a held window survives
    # the defaults reset() clones are broadcast zeros: one dense d x d per accumulator
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in acc._defaults.values()
    }
    assert sum(held.values()) <= 16
    assert acc.memory_bytes() == 8 * d * d


def test_a_shallow_copy_is_a_view_freed_at_once():
    """A read's frozen window is ``copy.copy(acc)``: the same tensors, until the live one is
    reset; dropped, it frees them at once (no reference cycle through torchmetrics' wrappers)."""
    acc = StreamingCovariance(8)
    acc.update(torch.randn(30, 8))
    view = copy.copy(acc)
    assert view.comoment is acc.comoment and view.count == 30
    acc.reset()
    assert view.count == 30 and acc.count == 0
    gone = weakref.ref(view)
    del view
    assert gone() is None


def test_a_gathering_sync_is_refused():
    acc = StreamingCovariance(3)
    acc.update(torch.randn(4, 3))
    with pytest.raises(ValueError, match="not by a gather"):
        acc.sync(dist_sync_fn=lambda t, group=None: [t, t], distributed_available=lambda: True)


def test_symmetric_eigh_matches_numpy():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((20, 20))
    a = a @ a.T
    evals, evecs = symmetric_eigh(torch.from_numpy(a))
    np.testing.assert_allclose(evals.numpy(), np.linalg.eigvalsh(a), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        evecs.numpy() @ np.diag(evals.numpy()) @ evecs.numpy().T, a, atol=1e-10
    )
    with pytest.raises(ValueError, match="square"):
        symmetric_eigh(torch.zeros(3, 4))
    # Values only (the reads' cheaper solve): the same spectrum, from a float32 input too; the
    # 1e-12 relative bound is a few hundred ulps of lambda_max of a 20 x 20 Gram matrix.
    values = symmetric_eigvalsh(torch.from_numpy(a))
    assert values.dtype == torch.float64
    np.testing.assert_allclose(values.numpy(), np.linalg.eigvalsh(a), rtol=1e-12, atol=1e-12)
    values32 = symmetric_eigvalsh(torch.from_numpy(a).float())
    np.testing.assert_allclose(
        values32.numpy(),
        np.linalg.eigvalsh(a.astype(np.float32).astype(np.float64)),
        rtol=1e-12,
        atol=1e-12,
    )
    with pytest.raises(ValueError, match="square"):
        symmetric_eigvalsh(torch.zeros(3, 4))


# ------------------------------------------------------------------- two real processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _filled(part: np.ndarray) -> StreamingCovariance:
    acc = StreamingCovariance(part.shape[1])
    acc.update(torch.from_numpy(part))
    acc.update(torch.full((3, part.shape[1]), math.nan, dtype=torch.float64))
    return acc


def _reduce_worker(rank: int, world: int, port: int, parts: list[np.ndarray], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        acc = _filled(parts[rank])
        acc.reduce_()
        torch.save(acc.state_dict(), f"{out}/rank{rank}.pt")
        # The Metric's way: compute() syncs and gives the local window back; sync() merges
        # through the accumulator's own dist_sync_fn. Every collective is recorded: the
        # co-moment must be all-reduced in place, and nothing gathered.
        metric = _filled(parts[rank])
        calls: list[tuple[int, int]] = []
        all_reduce = dist.all_reduce

        def recorded(t: torch.Tensor, *args, **kwargs):
            calls.append((t.data_ptr(), t.numel()))
            return all_reduce(t, *args, **kwargs)

        def gather(*args, **kwargs):
            raise AssertionError("a StreamingCovariance sync gathered")

        with (
            mock.patch.object(dist, "all_reduce", recorded),
            mock.patch.object(dist, "all_gather", gather),
            mock.patch.object(dist, "all_gather_into_tensor", gather),
        ):
            covariance = metric.compute()
            local = metric.count
            where = metric.comoment.data_ptr()
            metric.sync()
        synced = metric.state_dict()
        metric.unsync()
        torch.save(
            {
                "compute": covariance,
                "local_after_compute": local,
                "local_after_unsync": metric.count,
                "synced": synced,
                "calls": calls,
                "comoment_at": where,
            },
            f"{out}/metric{rank}.pt",
        )
        dist.barrier()  # neither rank tears gloo down while the other is inside a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rows", [(700, 300), (1000, 0)], ids=["uneven", "one-rank-empty"])
def test_two_process_reduce_equals_single_process(tmp_path, rows):
    d = 24
    parts = [offset_rows(n, d, seed=10 + i, offset=1e4 * (i + 1)) for i, n in enumerate(rows)]
    mp.spawn(_reduce_worker, args=(2, _free_port(), parts, str(tmp_path)), nprocs=2, join=True)
    union = np.concatenate(parts)
    single = StreamingCovariance(d)
    single.update(torch.from_numpy(union))
    reference = np.cov(union, rowvar=False, bias=True)
    for rank in range(2):
        state = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        acc = StreamingCovariance(d)
        acc.load_state_dict(state)
        assert acc.count == len(union)
        assert acc.rows_rejected == 6
        assert rel_fro(acc.covariance(), single.covariance().numpy()) <= 1e-12
        assert rel_fro(acc.covariance(), reference) <= 1e-12
        np.testing.assert_allclose(acc.mean.numpy(), union.mean(0), rtol=1e-14)
        # the Metric's compute() and sync(): the same merged numbers, bit for bit (the same
        # two all_reduces), the local window kept by compute() and given back by unsync()
        metric = torch.load(tmp_path / f"metric{rank}.pt", weights_only=True)
        assert torch.equal(metric["compute"], acc.covariance())
        synced = StreamingCovariance(d)
        synced.load_state_dict(metric["synced"])
        assert torch.equal(synced.covariance(), acc.covariance()) and synced.rows_rejected == 6
        assert metric["local_after_compute"] == metric["local_after_unsync"] == rows[rank]
        # two all_reduces per merge: [n, n mu, rejected], then the d x d co-moment in place
        d2 = [(d + 2), d * d]
        assert [numel for _, numel in metric["calls"]] == d2 + d2
        assert metric["calls"][-1] == (metric["comoment_at"], d * d)


def test_counts_reach_the_host_once_and_follow_the_state():
    """``count`` and ``rows_rejected`` are kept on the host until the state changes
    (fetch_counts: many accumulators in one copy); a fold, a reset or a load is seen."""
    a, b = StreamingCovariance(3), StreamingCovariance(3)
    a.update(torch.ones(4, 3))
    b.update(torch.tensor([[1.0, math.nan, 0.0], [1.0, 2.0, 3.0]]))
    fetch_counts([a, b, "not an accumulator"])
    assert (a.count, a.rows_rejected, b.count, b.rows_rejected) == (4, 0, 1, 1)
    b.update(torch.tensor([[math.inf, 0.0, 0.0]]))  # in place on the rejected count
    assert (b.count, b.rows_rejected) == (1, 2)
    a.update(torch.ones(2, 3))
    assert a.count == 6
    state = a.state_dict()
    a.reset()
    assert (a.count, a.rows_rejected) == (0, 0)
    a.load_state_dict(state)
    assert a.count == 6


# ------------------------------------------------------------- the diagonal-only mode
# Tolerance 1e-12 relative: the diagonal is the same centred sum as the full fold's, summed in
# another order (a column sum of squares against a GEMM's blocks): a few ulps times sqrt(N),
# against numpy's two-pass variance likewise; a raw-sum variance at these offsets (1e4, spread
# ~1) would miss it by about eight orders of magnitude (test_large_offset_is_exact...).


def _with_bad_rows(part: np.ndarray, seed: int) -> np.ndarray:
    rows = part.copy()
    rng = np.random.default_rng(seed)
    bad = rng.choice(len(rows), 5, replace=False)
    rows[bad[:3], rng.integers(0, rows.shape[1], 3)] = math.nan
    rows[bad[3:], 0] = math.inf
    return rows


def test_diagonal_mode_equals_numpy_over_updates_and_merges():
    d = 40
    parts = [_with_bad_rows(offset_rows(n, d, seed=n), n) for n in (300, 129, 517, 64)]
    parts[2:] = [p.astype(np.float32) for p in parts[2:]]  # float32 rows: folded in float64
    kept = np.concatenate([p[np.isfinite(p).all(1)].astype(np.float64) for p in parts])
    a, b = StreamingCovariance(d, full=False), StreamingCovariance(d, full=False)
    for part in parts[:2]:
        a.update(torch.from_numpy(part))
    for part in parts[2:]:
        b.update(torch.from_numpy(part))
    a.merge_state(b)
    assert (a.count, a.rows_rejected) == (len(kept), 20)
    assert a.comoment_diagonal().dtype == torch.float64 and a.comoment_diagonal().shape == (d,)
    variance = (a.comoment_diagonal() / a.count).numpy()
    np.testing.assert_allclose(variance, kept.var(0), rtol=1e-12)
    np.testing.assert_allclose(a.mean.numpy(), kept.mean(0), rtol=1e-14)
    # the same rows folded full: the same diagonal, mean and counts
    full = StreamingCovariance(d)
    for part in parts:
        full.update(torch.from_numpy(part))
    np.testing.assert_allclose(
        full.comoment_diagonal().numpy(), a.comoment_diagonal().numpy(), rtol=1e-12
    )
    assert torch.equal(full.comoment_diagonal(), full.comoment.diagonal())
    # a whole co-moment merges into a diagonal state by its diagonal; never the reverse
    c = StreamingCovariance(d, full=False)
    c.merge_state(full)
    np.testing.assert_allclose(c.comoment_diagonal().numpy(), variance * len(kept), rtol=1e-12)
    with pytest.raises(ValueError, match="diagonal-only"):
        StreamingCovariance(d).merge_state(a)


def test_full_matrix_reads_raise_on_a_diagonal_window():
    acc = StreamingCovariance(6, full=False)
    acc.update(torch.randn(20, 6))
    for read in (lambda: acc.comoment, acc.covariance, acc.second_moment, acc.compute):
        with pytest.raises(RuntimeError, match="diagonal only"):
            read()
    assert acc.count == 20 and acc.mean.shape == (6,) and acc.memory_bytes() == 8 * 36
    # a state dict keeps the mode: a full accumulator loads a diagonal window as one
    loaded = StreamingCovariance(6)
    loaded.load_state_dict(acc.state_dict())
    assert not loaded.full and loaded.count == 20
    assert torch.equal(loaded.comoment_diagonal(), acc.comoment_diagonal())
    # set_full: a change of mode empties the window; the same mode keeps it
    acc.set_full(False)
    assert acc.count == 20
    acc.set_full(True)
    assert acc.count == 0 and acc.comoment.shape == (6, 6)


def test_a_diagonal_window_gives_the_full_windows_offset_share_and_rms():
    from normscope.functional import stream_scales

    d = 64
    rows = torch.from_numpy(offset_rows(8 * d, d, seed=3, offset=30.0))
    accs = [
        StreamingCovariance(d, full=False),
        StreamingCovariance(d, fold="gemm"),
        StreamingCovariance(d, fold="panels"),
    ]
    for acc in accs:
        acc.update(rows)
    shares, rms = stream_scales(
        [a.mean for a in accs], [a.comoment_diagonal() / a.count for a in accs], [8 * d] * 3
    )
    for got in (shares, rms):
        assert all(math.isclose(v, got[0], rel_tol=1e-12) for v in got), got


def _reduce_diagonal_worker(rank: int, world: int, port: int, parts: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        acc = StreamingCovariance(parts[rank].shape[1], full=False)
        acc.update(torch.from_numpy(parts[rank]))
        sizes: list[int] = []
        all_reduce = dist.all_reduce

        def recorded(t: torch.Tensor, *args, **kwargs):
            sizes.append(t.numel())
            return all_reduce(t, *args, **kwargs)

        with mock.patch.object(dist, "all_reduce", recorded):
            acc.reduce_()
        torch.save({"state": acc.state_dict(), "sizes": sizes}, f"{out}/diag{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_process_reduce_of_diagonal_windows_sends_the_diagonal_only(tmp_path):
    d = 24
    parts = [_with_bad_rows(offset_rows(n, d, seed=20 + n, offset=1e4), n) for n in (700, 300)]
    args = (2, _free_port(), parts, str(tmp_path))
    mp.spawn(_reduce_diagonal_worker, args=args, nprocs=2, join=True)
    union = np.concatenate(parts)
    union = union[np.isfinite(union).all(1)]
    for rank in range(2):
        saved = torch.load(tmp_path / f"diag{rank}.pt", weights_only=True)
        acc = StreamingCovariance(d)
        acc.load_state_dict(saved["state"])
        assert not acc.full and (acc.count, acc.rows_rejected) == (len(union), 10)
        variance = (acc.comoment_diagonal() / acc.count).numpy()
        np.testing.assert_allclose(variance, union.var(0), rtol=1e-12)
        np.testing.assert_allclose(acc.mean.numpy(), union.mean(0), rtol=1e-14)
        assert saved["sizes"] == [d + 2, d]  # [n, n mu, rejected], then diag M: no d x d
