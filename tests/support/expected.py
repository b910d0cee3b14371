"""What the DDP tests compare a rank's reads with: one process's tracker on the union of the rows."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from normscope import DeadDirectionConfig, DeadDirectionTracker
from tests.support.shards import EXACT_WINDOWS, shard_batches, source_batches

HISTORY = "rms_growth"  # against the previous read: the reference reads only these windows


def single_process_reads(
    module: torch.nn.Module, reads: list[dict[str, Any]], sources: str | None = None
) -> list[dict]:
    """The reference: one process, one tracker, fed every rank's batch of each read's window
    (``EXACT_WINDOWS``) with ``module``'s weights, no row subsampling; with ``sources`` (the
    batch field naming each sample's source) the per-source fit's batches, read per source.
    Forwards in train mode with grad on, like the fit's: ``nn.MultiheadAttention``'s no-grad
    eval fast path (what ``scan_model`` runs) rounds differently in float32, about 1e-8
    relative in these reads."""
    batches = source_batches if sources is not None else shard_batches
    module.train()
    tracker = DeadDirectionTracker(
        DeadDirectionConfig(rows_per_read="all", sources=sources), module
    )
    first = batches(0)[0]
    with torch.no_grad():
        tracker.attach(forward=lambda: module(first["input_ids"]))
    out = []
    for read, window in zip(reads, EXACT_WINDOWS):
        for batch in batches(window):
            with tracker.gate.sampling(mask=batch["attention_mask"], sources=tracker.label(batch)):
                module(batch["input_ids"])
        out.append(tracker.read(step=read["step"], reduce=False).as_dict())
    tracker.detach()
    return out


def floats(metrics: dict[str, Any]) -> dict[str, float]:
    """A rank's logged metrics as floats (NaN/inf were written to JSON as repr strings)."""
    return {k: float(v) for k, v in metrics.items()}


def assert_reads_equal(reads: list[dict[str, Any]], expected: list[dict[str, float]]) -> None:
    """Every read's keys are the single-process read's, and every number equals it to 1e-10
    (only the order of the float64 sums differs), and every number is finite."""
    assert len(reads) == len(expected)
    for read, want in zip(reads, expected):
        got = floats(read["metrics"])
        assert {k for k in got if HISTORY not in k} == {k for k in want if HISTORY not in k}
        for key, value in want.items():
            if HISTORY in key:
                continue
            assert math.isfinite(value), key
            assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-10), key
