"""One sampled read stays inside a few packages of the upper floors
(``benchmarks/trace_read.py``): at most 6 normscope packages outside ``functional/``, a longest
chain of at most 9 cross-file hops, and no call back into a file already left."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import trace_read  # noqa: E402


def test_one_read_touches_few_files_in_short_chains(tmp_path):
    summary = trace_read.summary(trace_read.trace_read(tmp_path))
    assert summary["calls"] > 100  # the read was traced: the reads, the rules, the logger
    assert "engine/monitor.py" in summary["files_outside_functional"]
    packages = summary["packages_outside_functional"]
    assert "engine" in packages and "functional" not in packages
    assert len(packages) <= 6, packages
    assert summary["longest_hops"] <= 9, summary["longest_chain"]
    assert summary["hops_back"] == []
