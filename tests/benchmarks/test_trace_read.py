"""One sampled read stays inside a few files of the upper floors (``benchmarks/trace_read.py``):
at most 7 normscope files outside ``functional/``, a longest chain of at most 7 cross-file hops,
and no call back into a file already left."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import trace_read  # noqa: E402


def test_one_read_touches_few_files_in_short_chains(tmp_path):
    summary = trace_read.summary(trace_read.trace_read(tmp_path))
    assert summary["calls"] > 100  # the read was traced: the reads, the rules, the logger
    assert "engine/monitor.py" in summary["files_outside_functional"]
    # 7 since issue 32's attention-logit read: its hooks (taps/attention.py) run in the
    # sampled forward beside the accumulators' (taps/hooks.py)
    assert len(summary["files_outside_functional"]) <= 7, summary["files_outside_functional"]
    assert summary["longest_hops"] <= 7, summary["longest_chain"]
    assert summary["hops_back"] == []
