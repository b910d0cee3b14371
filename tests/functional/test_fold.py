"""The cheaper fold (functional/fold.py) against the full-GEMM fold it replaced.

``ReferenceFold`` is the fold as it was before issue 14, verbatim. Every fold mode must give
its accumulator the same state within 1e-13 relative (Frobenius for matrices): a float64
centred co-moment is exact to a few ulps times sqrt(N), so this is rounding, not a tolerance
that would hide a missing or doubled block.
"""

from __future__ import annotations

import math
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from normscope.functional import StreamingCovariance
from normscope.functional.fold import add_gram_, fold_plan, mirror_upper_

MODES = ["auto", "gemm", "panels", "syrk"]
TOL = 1e-13


class ReferenceFold(StreamingCovariance):
    """The old fold: float64 copy, row-sum test, masked_fill, mean, centre, one full addmm_."""

    def _fold(self, rows: torch.Tensor, keep: torch.Tensor | None) -> None:
        rows = rows.to(device=self.device, dtype=torch.float64, copy=True)
        finite = torch.isfinite(rows.sum(dim=1))
        if keep is None:
            weight = finite
        else:
            keep = keep.to(self.device)
            weight = keep & finite
            finite = finite | ~keep
        self._rejected += (~finite).sum()
        rows.masked_fill_(~weight[:, None], 0.0)
        w = weight.to(torch.float64)
        n_b = w.sum()
        mean_b = rows.sum(dim=0) / n_b.clamp_min(1)
        rows.sub_(mean_b).mul_(w[:, None])
        self._comoment.addmm_(rows.mT, rows)
        self._merge_moments(n_b, mean_b, None)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(torch.linalg.vector_norm(b.double()))
    diff = float(torch.linalg.vector_norm((a - b).double()))
    return diff / scale if scale else diff


def assert_same(new: StreamingCovariance, ref: StreamingCovariance) -> None:
    assert new.count == ref.count and new.rows_rejected == ref.rows_rejected
    assert rel(new.mean, ref.mean) <= TOL
    assert rel(new.comoment, ref.comoment) <= TOL
    assert rel(new.covariance(), ref.covariance()) <= TOL
    assert rel(new.second_moment(), ref.second_moment()) <= TOL
    # the full symmetric matrix, not one triangle: both halves agree to rounding.
    m = new.comoment
    assert rel(m, m.T) <= TOL


def offset_batches(d: int, sizes: list[int], seed: int, offset: float = 1e4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(d, generator=gen, dtype=torch.float64) + 0.5
    return [offset + torch.randn(n, d, generator=gen, dtype=torch.float64) * scale for n in sizes]


def pair(d: int, mode: str, **kw) -> tuple[StreamingCovariance, StreamingCovariance]:
    return StreamingCovariance(d, fold=mode, **kw), ReferenceFold(d, fold="gemm", **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [1, 5, 40, 64, 200, 300])
def test_large_offset_equals_reference_and_np_cov(mode, d):
    # 9000 rows: more than one CPU chunk (functional/fold.py: chunk_rows) in one update.
    batches = offset_batches(d, [700, 1, 333, 1024] + ([9000] if d in (5, 64) else []), seed=d)
    new, ref = pair(d, mode)
    for b in batches:
        new.update(b.float() if d == 40 else b)  # float32 rows too (cast once, in the fold)
        ref.update(b.float() if d == 40 else b)
    assert_same(new, ref)
    union = torch.cat([b.float().double() if d == 40 else b for b in batches]).numpy()
    cov = np.cov(union, rowvar=False, bias=True).reshape(d, d)
    assert np.linalg.norm(new.covariance().numpy() - cov) <= 1e-12 * np.linalg.norm(cov)


@pytest.mark.parametrize("mode", MODES)
def test_masks_nan_inf_rows_and_subsampling_equal_reference(mode):
    d = 150  # panels of 64: two full panels and one of 22
    for kw in ({}, {"max_rows": 300, "seed": 5}):
        new, ref = pair(d, mode, **kw)
        for i, b in enumerate(offset_batches(d, [400, 5000, 64], seed=1)):
            b = b.clone()
            b[3, 7] = math.nan
            b[10, 0] = math.inf
            b[11, 149] = -math.inf
            b[12, 1] = 1e308  # finite, but its row sum overflows: rejected by both
            b[12, 2] = 1e308
            mask = torch.arange(len(b)) % 3 != i  # masked rows include bad ones
            new.update(b.reshape(1, -1, d), mask=mask.reshape(1, -1))
            ref.update(b.reshape(1, -1, d), mask=mask.reshape(1, -1))
            new.update(b[:20])
            ref.update(b[:20])
        assert new.rows_rejected > 0
        assert_same(new, ref)


def test_panel_state_is_mirrored_for_every_reader():
    d = 130  # panels of 64, 64, 2
    batches = offset_batches(d, [300, 200, 100], seed=2)
    new, ref = pair(d, "panels")
    assert new._plan == ("panels", 64)
    new.update(batches[0])
    ref.update(batches[0])
    assert new._stale_lower  # the lower blocks are not written by the fold ...
    assert_same(new, ref)  # ... and every read mirrors them first
    assert not new._stale_lower
    new.update(batches[1])
    ref.update(batches[1])
    # merge: a stale other into a stale self; the other is left readable and unchanged.
    other_new, other_ref = pair(d, "panels")
    other_new.update(batches[2])
    other_ref.update(batches[2])
    new.merge_state(other_new)
    ref.merge_state(other_ref)
    assert_same(new, ref)
    assert_same(other_new, other_ref)
    # to(): moves the mirrored matrix and keeps folding.
    new.update(batches[2])
    ref.update(batches[2])
    new.to("cpu")
    assert not new._stale_lower
    assert_same(new, ref)


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_round_trip_across_fold_modes(mode, tmp_path):
    d = 100
    batches = offset_batches(d, [256, 256, 256], seed=3)
    new, ref = pair(d, mode, max_rows=200, seed=9)
    new.update(batches[0])
    ref.update(batches[0])
    path = tmp_path / "acc.pt"
    torch.save(new.state_dict(), path)
    state = torch.load(path, weights_only=True)
    assert rel(state["_comoment"], ref.comoment) <= TOL  # the saved matrix is the full one
    for into in MODES:
        restored = StreamingCovariance(d, fold=into)
        restored.load_state_dict(state)
        ref_copy = ReferenceFold(d)
        ref_copy.load_state_dict(ref.state_dict())
        for b in batches[1:]:
            restored.update(b)
            ref_copy.update(b)
        assert_same(restored, ref_copy)


@pytest.mark.parametrize("mode", MODES)
def test_fake_two_rank_reduce_equals_reference(mode, monkeypatch):
    # Two identical ranks: all_reduce doubles every tensor. A stale lower triangle summed
    # that is never mirrored would show here.
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: t.mul_(2))
    d = 90
    new, ref = pair(d, mode)
    for b in offset_batches(d, [300, 50], seed=4):
        new.update(b)
        ref.update(b)
    new.reduce_()
    ref.reduce_()
    assert new.count == ref.count == 700
    assert_same(new, ref)


def test_kernel_edges_any_panel_width():
    # add_gram_ + mirror_upper_ on their own: panel widths that do and do not divide d, one
    # column panels, a panel as wide as d (one GEMM).
    gen = torch.Generator().manual_seed(0)
    for d in (1, 2, 7, 30, 64):
        x = torch.randn(50, d, dtype=torch.float64, generator=gen)
        full = x.T @ x
        for panel in (1, 3, 7, 16, d, d + 5):
            m = torch.full((d, d), 0.5, dtype=torch.float64)
            if add_gram_(m, x, "panels", panel):
                mirror_upper_(m, panel)
            assert rel(m - 0.5, full) <= TOL, (d, panel)
    with pytest.raises(ValueError, match="fold must be"):
        StreamingCovariance(4, fold="fast")
    assert fold_plan(40, torch.device("cpu"), "panels") == ("gemm", 0)  # d under one panel
    assert fold_plan(1, torch.device("cpu")) == ("gemm", 0)
    acc = StreamingCovariance(8, fold="syrk")
    acc.update(torch.randn(20, 8))
    with pytest.raises(ValueError, match="CPU accumulators only"):
        acc.to("cuda")  # refused before anything moves (no GPU needed to check)
    assert acc.device == torch.device("cpu") and acc.count == 20


def test_fold_leaves_the_callers_rows_alone_and_accumulators_independent():
    d = 48
    x = offset_batches(d, [128], seed=6)[0]
    keep = x.clone()
    a, b = StreamingCovariance(d), StreamingCovariance(d)  # share this thread's scratch
    a.update(x)
    b.update(x[:10] * 2)
    a.update(x)
    assert torch.equal(x, keep)
    ref = ReferenceFold(d)
    ref.update(x)
    ref.update(x)
    assert_same(a, ref)


# ------------------------------------------------------------------- two real processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reduce_worker(rank: int, world: int, port: int, parts: list[torch.Tensor], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # the same rows and the same reduce_, old fold and panel fold side by side.
        for name, acc in (
            ("panels", StreamingCovariance(parts[rank].shape[1], fold="panels")),
            ("ref", ReferenceFold(parts[rank].shape[1])),
        ):
            acc.update(parts[rank])
            acc.reduce_()
            torch.save(acc.state_dict(), f"{out}/{name}{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_process_reduce_of_panel_folds_equals_reference(tmp_path):
    d = 200
    parts = offset_batches(d, [500, 300], seed=7)
    mp.spawn(_reduce_worker, args=(2, _free_port(), parts, str(tmp_path)), nprocs=2, join=True)
    union = ReferenceFold(d)
    union.update(torch.cat(parts))
    for rank in range(2):
        acc, ref = StreamingCovariance(d), ReferenceFold(d)
        acc.load_state_dict(torch.load(tmp_path / f"panels{rank}.pt", weights_only=True))
        ref.load_state_dict(torch.load(tmp_path / f"ref{rank}.pt", weights_only=True))
        assert_same(acc, ref)
        assert acc.count == 800 and rel(acc.covariance(), union.covariance()) <= 1e-12
