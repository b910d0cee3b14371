"""Reads split across ranks, and asynchronous reads, under real DDP (2 CPU processes, gloo;
the fits ``exact`` and ``exact_async`` of ``tests/support/distributed_fits.py``).

After the reduce every rank holds the same accumulators; each solves a round-robin share of the
jobs (norm layers, residual points) and the records are gathered: every rank ends with
the same full report, equal to one process's."""

from __future__ import annotations

import pytest
import torch

from tests.support.expected import assert_reads_equal, single_process_reads
from tests.support.shards import EXACT_STOP, LitDict


@pytest.mark.parametrize("fit", ["exact", "exact_async"])
def test_each_rank_solves_only_its_share(distributed_run, fit):
    rank0, rank1 = (distributed_run["results"][fit, r] for r in (0, 1))
    jobs = rank0["jobs"]
    assert jobs == rank1["jobs"] > 4
    assert rank0["solves"] and len(rank0["solves"]) == len(rank1["solves"])
    for s0, s1 in zip(rank0["solves"], rank1["solves"]):
        assert s0 + s1 == jobs  # every job solved once, by one rank
        assert abs(s0 - s1) <= 1  # round robin: halves


def test_async_reads_under_ddp_equal_the_single_process_reads(distributed_run):
    """``async_reads=True`` under DDP: the same reads as one process on the union of the rows
    (to 1e-10, as the synchronous fit), the same on both ranks."""
    rank0, rank1 = (distributed_run["results"]["exact_async", r] for r in (0, 1))
    assert rank0["failure"] is None and rank1["failure"] is None
    assert rank0["reads"] == rank1["reads"]
    reads = rank0["reads"]
    assert [r["step"] for r in reads] == [1, 3, 6]
    module = LitDict(lr=0.0)
    module.load_state_dict(torch.load(distributed_run["out"] / "exact_async_weights.pt"))
    assert_reads_equal(reads, single_process_reads(module, reads))
    sync = distributed_run["results"]["exact", 0]["reads"]
    assert reads == sync  # bit for bit the synchronous DDP reads


def test_async_stop_under_ddp_comes_at_the_publish_on_both_ranks(distributed_run):
    """Rank 1 alone fires at the read of step 6; under DDP that read is published at the end
    of the next optimiser step, where both ranks decide and stop together."""
    rank0, rank1 = (distributed_run["results"]["exact_async", r] for r in (0, 1))
    assert [a["rule"] for a in rank1["fired"]] == ["rank_one_only"]
    assert rank0["global_step"] == rank1["global_step"] == EXACT_STOP + 1


@pytest.mark.parametrize("what", ["min_rows", "as_dict", "result"])
def test_an_async_failure_on_one_rank_stalls_no_rank(distributed_run, what):
    """Rank 1's monitor fails with a read in flight (``result``: at the publish, before the
    gather it still joins with an error record; ``as_dict``: after the gather, before the stop
    vote it still casts) or at a window's end: both ranks finish the fit, both stop reading,
    no worker thread is left."""
    r0 = distributed_run["results"]["fail_async", 0][what]
    r1 = distributed_run["results"]["fail_async", 1][what]
    assert r0["global_step"] == r1["global_step"] == 8
    assert r1["disabled"] and f"injected on rank 1: {what}" in r1["failure"]
    assert r0["disabled"] and "another rank failed" in r0["failure"]
    assert r0["threads"] == r1["threads"] == []
