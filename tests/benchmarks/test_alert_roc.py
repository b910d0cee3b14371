"""benchmarks/alert_roc.py --quick: a small slice of the alert sweep keeps the operating point
honest. Real demo-GPT runs (4 layers, widths 32 and 64, LayerNorm and RMSNorm, 30 steps), six
real monitors per healthy run (every_n_steps 1 and 5 x max_rows 512 and 4096, first read
included) and a cancelling branch at strength 0.95 switched on at a random step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench import bench_module, run_quick

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "alert_roc.py"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("roc") / "reads.jsonl"
    stdout = run_quick("alert_roc.py", out)
    return stdout, [json.loads(line) for line in out.read_text().splitlines()], out


def _judge(records):
    return bench_module("alert_roc").judge(records)


def test_the_default_rule_is_silent_on_healthy_runs_where_version_1_was_not(quick):
    _, records, _ = quick
    verdict = _judge(records)
    healthy = verdict["healthy"]
    assert healthy["default"]["reads"] > 250 and healthy["default"]["alerts"] == 0
    # version 1's rule (raw ratios under 0.8, reads from 2 d rows) on the same runs: measured
    # 33 false alarms in 296 reads, all at N/d <= 8
    assert healthy["v1"]["alerts"] > 0
    # the first read of every healthy monitor is in the sweep
    firsts = {}
    for r in records:
        if r["kind"] == "healthy":
            key = (r["run"], r["every"], r["max_rows"], r["per_dim"])
            firsts[key] = min(firsts.get(key, 10**9), r["step"])
    assert firsts and max(firsts.values()) <= 2


def test_the_default_rule_catches_every_strong_collapse_within_two_reads(quick):
    _, records, _ = quick
    caught = _judge(records)["collapse"]["default"]
    assert len(caught) == 8  # 2 widths x 2 norms x 2 row caps
    assert all(c["delay"] is not None and c["delay"] <= 2 for c in caught), caught
    assert all(c["early_alerts"] == 0 for c in caught)  # nothing before the switch


def test_the_printed_tables_and_a_rejudged_log_agree(quick):
    """``--judge`` on the saved reads prints the tables the sweep printed (the rules are judged
    on the same reads, so a rule can be tried again without training anything)."""
    stdout, _, out = quick
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--judge", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]

    def tables(text):
        return [line for line in text.splitlines() if line.startswith("| ")]

    assert tables(again.stdout) == tables(stdout)
    assert any(
        line.startswith("| default | ") and line.endswith(" 0 | 0.0 |") for line in tables(stdout)
    )
