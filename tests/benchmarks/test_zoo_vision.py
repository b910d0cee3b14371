"""benchmarks/zoo_vision.py --quick: the pathology zoo's vision arm (issue 41) in a few seconds:
a Hugging Face ViT (width 64 x 2 layers, patch 4) on drawn images under a real Trainer, the SSL
collapse and the non-finite batch each beside its twin; the records judged by the zoo's own
``judge_run`` and ``--judge`` CLI, unchanged."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

import pytest

from tests.support.bench import BENCH, bench_module, run_quick

SCRIPT = BENCH / "zoo_vision.py"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("vit") / "reads.jsonl"
    run_quick("zoo_vision.py", out)
    return out


@pytest.fixture(scope="module")
def loaded(quick):
    return bench_module("pathology_zoo").load([str(quick)])


def _arm(loaded, name: str, arm: str):
    runs, reads = loaded
    meta = next(m for m in runs.values() if m["pathology"] == name and m["arm"] == arm)
    return (
        meta,
        reads[meta["run"]],
        bench_module("pathology_zoo").judge_run(meta, reads[meta["run"]], "today"),
    )


def test_records_are_the_zoos_with_the_vits_shape(loaded):
    runs, reads = loaded
    arms = defaultdict(set)
    for meta in runs.values():
        arms[meta["pathology"]].add(meta["arm"])
        assert (meta["arch"], meta["width"], meta["depth"]) == ("vit", 64, 2)
        # normscope found the ViT's five LayerNorms and its residual stream
        assert len(meta["kinds"]) == 5 and set(meta["kinds"].values()) == {"layernorm"}
        assert list(meta["sublayers"].values()) == [None, "attn", "mlp", "attn", "mlp"]
        rs = reads[meta["run"]]
        assert meta["reads"] == len(rs) >= 3
        assert rs[0]["metrics"]["dd/attn_modules_read"] == 2.0  # both layers' attention
        assert [r["read"] for r in rs] == list(range(1, len(rs) + 1))
        for r in rs:
            assert r["step"] == r["log_step"] - 1 and r["width"] == 64
            assert str(r["gt"]["loss"]) == str(meta["per_step"][str(r["step"])]["loss"])
    assert arms == {"ssl_collapse": {"pathology", "twin"}, "nonfinite": {"pathology", "twin"}}


def test_nonfinite_crosses_at_the_poisoned_step_and_is_caught_there(loaded):
    meta, _, sick = _arm(loaded, "nonfinite", "pathology")
    _, _, twin = _arm(loaded, "nonfinite", "twin")
    assert sick["gt_cross"]["step"] == meta["settings"]["poison_at"] == 30
    assert sick["first_alert"]["read"] == sick["gt_cross"]["read"]
    assert "non_finite_rows" in {a["rule"] for a in sick["alerts"]}
    assert twin["gt_cross"] is None and twin["alerts"] == []


def test_ssl_pathology_loses_its_spread_and_the_twin_keeps_it(loaded):
    meta, _, _ = _arm(loaded, "ssl_collapse", "pathology")
    twin, _, judged = _arm(loaded, "ssl_collapse", "twin")
    last = str(meta["steps"] - 1)
    sick_z, twin_z = meta["per_step"][last]["z_std"], twin["per_step"][last]["z_std"]
    assert sick_z < twin_z - 0.1, (sick_z, twin_z)
    assert judged["gt_cross"] is None  # InfoNCE keeps z_std over the line


def test_todays_rules_replay_the_live_alerts(loaded):
    runs, reads = loaded
    zoo = bench_module("pathology_zoo")
    for meta in runs.values():
        verdict = zoo.judge_run(meta, reads[meta["run"]], "today")
        by_read = {r["read"]: r["log_step"] for r in reads[meta["run"]]}
        got = sorted((by_read[a["read"]], a["rule"]) for a in verdict["alerts"])
        assert got == sorted((a["step"], a["rule"]) for a in meta["alerts_fired"]), meta["run"]


def test_the_zoos_judge_cli_and_the_per_run_table_read_the_records(quick):
    zoo = subprocess.run(
        [sys.executable, str(BENCH / "pathology_zoo.py"), "--judge", str(quick)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert zoo.returncode == 0, zoo.stderr[-3000:]
    for name in ("nonfinite", "ssl_collapse"):  # the shape column: arch, width x depth, norm
        assert f"| {name} | vit 64x2 layernorm |" in zoo.stdout
    rows = {r[0]: r for r in bench_module("zoo_vision").run_table([str(quick)])}
    assert rows["nonfinite"][6] == "caught" and rows["nonfinite"][9].startswith("0 in")
