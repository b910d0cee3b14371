"""Per-source reads (``sources=``) under real 2-process gloo DDP (``fit_sources`` in
``distributed_fits.py``): rank 0 sees sources ``a`` and ``c``, rank 1 ``a`` and ``b``, and in
the first window rank 1 folds no row at all. The names are agreed across ranks before the
reduce, so both ranks hold every source, and each source's read equals a single-process tracker
fed both shards."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.expected import floats, single_process_reads
from tests.support.shards import LitSources


def test_per_source_reads_reduce_exactly_across_ranks(distributed_run):
    r0, r1 = (distributed_run["results"]["sources", r] for r in (0, 1))
    assert r0["failure"] is None and r1["failure"] is None
    assert r0["names"] == r1["names"] == ["a", "b", "c"]  # b and c each seen by one rank only
    assert [r["metrics"] for r in r0["reads"]] == [r["metrics"] for r in r1["reads"]]
    module = LitSources(lr=0.0)
    module.load_state_dict(torch.load(distributed_run["out"] / "sources_weights.pt"))
    reads = r0["reads"]
    assert [r["step"] for r in reads] == [1, 3, 6]
    for read, expected in zip(reads, single_process_reads(module, reads, sources="source")):
        got = floats(read["metrics"])
        assert set(got) == set(expected)
        assert any(k.startswith("dd.b/") for k in got) and any(k.startswith("dd.c/") for k in got)
        for key, value in expected.items():
            if math.isnan(value):
                assert math.isnan(got[key]), key  # rows too few there, in both
                continue
            assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-10), key
    first = floats(reads[0]["metrics"])
    # window 0: rank 1 is all padding, so source b has no row; c and a have rank 0's
    assert first["dd.b/n_rows"] == 0.0 and math.isnan(first["dd.b/sigma_min_ratio_min"])
    assert first["dd.c/n_rows"] > 0 and first["dd.a/n_rows"] > 0
    later = floats(reads[1]["metrics"])
    assert later["dd.b/n_rows"] > 0
    total = sum(later[f"dd.{s}/n_rows"] for s in "abc")
    pooled_rows = later["dd/model.h.0.ln_1/n_rows"]
    assert total == pooled_rows  # the sources split the pooled rows
