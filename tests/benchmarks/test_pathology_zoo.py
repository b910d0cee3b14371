"""benchmarks/pathology_zoo.py --quick: a slice of the pathology zoo (issue 32), one seed,
LayerNorm, a few steps per run, every pathology beside its healthy twin under a real Trainer;
then ``--judge`` on its reads, with a rule set plugged in from a file. And one shape of issue
41: a Hugging Face Llama (BPE tokens, width 64) under ``transformers.Trainer``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.bench import bench_module, run_quick

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pathology_zoo.py"

PLUGIN = """
from normscope.alerts import CallableRule


@register_rule_set("rows_rejected")
def _rows(meta):
    def fn(metrics, step):
        if metrics.get("dd/rows_rejected", 0) > 0:
            return f"non-finite rows at step {step}"
        return None

    return [CallableRule("rows_rejected", fn)]
"""


def _zoo():
    return bench_module("pathology_zoo")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "reads.jsonl"
    return run_quick("pathology_zoo.py", out), out


@pytest.fixture(scope="module")
def loaded(quick):
    return _zoo().load([str(quick[1])])


def _judged(loaded, name, arm, rule_set="today"):
    runs, reads = loaded
    meta = next(m for m in runs.values() if m["pathology"] == name and m["arm"] == arm)
    return meta, _zoo().judge_run(meta, reads[meta["run"]], rule_set)


def test_every_run_has_both_arms_and_one_record_per_read(loaded):
    runs, reads = loaded
    zoo = _zoo()
    arms = defaultdict(set)
    for meta in runs.values():
        arms[meta["pathology"]].add(meta["arm"])
        rs = reads[meta["run"]]
        assert meta["reads"] == len(rs) >= 1, meta["run"]
        assert [r["read"] for r in rs] == list(range(1, len(rs) + 1))
        steps = [r["log_step"] for r in rs]
        assert steps == sorted(set(steps))  # one record per read, in order
        for r in rs:
            assert any(k.startswith("dd/") for k in r["metrics"])
            assert r["step"] == r["log_step"] - 1  # the batch the read consumed
            assert "loss" in r["gt"]  # the ground truth at the read's own step
            same = meta["per_step"][str(r["step"])]
            assert all(str(r["gt"][k]) == str(v) for k, v in same.items())
    assert arms == {
        name: {"pathology", "twin"} for name in zoo.PATHOLOGIES if zoo.applies(name, "zoo")
    }


def test_ssl_collapse_ground_truth_crosses_in_the_pathology_and_not_in_its_twin(loaded):
    for name in ("ssl_collapse", "ssl_collapse_nobias"):
        _, sick = _judged(loaded, name, "pathology")
        _, twin = _judged(loaded, name, "twin")
        assert sick["gt_cross"] is not None and sick["gt_cross"]["read"] is not None, name
        assert twin["gt_cross"] is None, name


def test_nonfinite_ground_truth_crosses_at_the_poisoned_step_only(loaded):
    meta, sick = _judged(loaded, "nonfinite", "pathology")
    _, twin = _judged(loaded, "nonfinite", "twin")
    assert sick["gt_cross"]["step"] == meta["settings"]["poison_at"] == 30
    assert twin["gt_cross"] is None


def test_rank_collapse_is_there_from_the_first_read_and_the_skips_prevent_it(loaded):
    _, sick = _judged(loaded, "rank_collapse", "pathology")
    _, twin = _judged(loaded, "rank_collapse", "twin")
    assert sick["gt_cross"]["read"] == 1 and twin["gt_cross"] is None


def test_judging_with_todays_rules_replays_the_live_monitors_alerts(loaded):
    runs, reads = loaded
    zoo = _zoo()
    live = replayed = 0
    for meta in runs.values():
        verdict = zoo.judge_run(meta, reads[meta["run"]], "today")
        by_read = {r["read"]: r["log_step"] for r in reads[meta["run"]]}
        got = sorted((by_read[a["read"]], a["rule"]) for a in verdict["alerts"])
        want = sorted((a["step"], a["rule"]) for a in meta["alerts_fired"])
        assert got == want, meta["run"]
        live, replayed = live + len(want), replayed + len(got)
    assert live == replayed


def test_the_post_norm_control_runs_without_the_sigma_rule(loaded):
    meta, verdict = _judged(loaded, "post_norm", "pathology")
    assert meta["sublayers"] is None and "sigma_min_collapse" not in meta["live_rules"]
    assert verdict["alerts"] == [] and verdict["gt_cross"] is None


def test_judge_cli_takes_a_plugged_in_rule_set(quick, tmp_path):
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--judge",
            str(quick[1]),
            "--plugin",
            str(plugin),
            "--rules",
            "today,rows_rejected",
            "--summary",
            str(summary),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "## rule set `rows_rejected`" in proc.stdout
    result = json.loads(summary.read_text())
    rows = {r[0]: r for r in result["rows_rejected"]["rows"]}
    # the NaN batch is rejected row by row at the next read that has it: caught, no twin alarm
    assert rows["nonfinite"][4].startswith("1/1") and rows["nonfinite"][7].startswith("0 in")
    assert rows["ssl_collapse"][4].startswith("0/1")
    assert result["live_alerts"] == result["today_replayed"]


def test_seed_offset_plans_the_held_out_seeds():
    runs = list(_zoo().plan(False, 3, ["post_norm"], ["layernorm"], seed_offset=5))
    assert [(r[1], r[3]) for r in runs] == [
        (arm, seed) for seed in (5, 6, 7) for arm in ("pathology", "twin")
    ]


@pytest.fixture(scope="module")
def llama_hf(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo_hf") / "reads.jsonl"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "llama", "--width", "64", "--quick"]
        + ["--only", "nonfinite", "--trainer", "hf", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _zoo().load([str(out)])


def test_a_hugging_face_llama_under_the_hf_trainer_is_judged_against_its_own_ground_truth(
    llama_hf,
):
    runs, reads = llama_hf
    zoo = _zoo()
    by_arm = {m["arm"]: m for m in runs.values()}
    assert set(by_arm) == {"pathology", "twin"}
    for meta in by_arm.values():
        shape = [meta[k] for k in ("arch", "width", "depth", "tokenizer", "trainer", "norm")]
        assert shape == ["llama", 64, 4, "bpe", "hf", "rmsnorm"]
        assert all(r["arch"] == "llama" and r["width"] == 64 for r in reads[meta["run"]])
        assert meta["reads"] == len(reads[meta["run"]]) >= 5
    sick = zoo.judge_run(by_arm["pathology"], reads[by_arm["pathology"]["run"]], "today")
    twin = zoo.judge_run(by_arm["twin"], reads[by_arm["twin"]["run"]], "today")
    assert sick["gt_cross"]["step"] == 30 and twin["gt_cross"] is None
    assert sick["first_alert"]["read"] <= sick["gt_cross"]["read"]
    assert twin["alerts"] == []
    rows, _ = zoo.zoo_table(runs, reads, "today")
    assert rows[0][1] == "llama 64x4 bpe hf rmsnorm" and rows[0][5].startswith("1/1")


def test_the_ground_truths_attention_wrapper_sees_the_logits_normscope_reads(llama_hf):
    # two independent reads of the largest pre-softmax logit: the benchmark's wrapper of HF's
    # eager attention, and normscope's softmax tap (one window = one forward from read 2 on)
    runs, reads = llama_hf
    twin = next(m for m in runs.values() if m["arm"] == "twin")
    pairs = [(r["metrics"]["dd/attn_logit_max"], r["gt"]["max_logit"]) for r in reads[twin["run"]]]
    assert len(pairs) >= 5 and all(gt > 0 for _, gt in pairs)
    for dd, gt in pairs[1:]:
        assert dd == pytest.approx(gt, rel=1e-5)
