"""DeadDirectionMonitor under real DDP: ``Trainer(strategy="ddp", devices=2, accelerator="cpu")``
with gloo. The fits run in ``tests/support/distributed_fits.py`` (fixture ``distributed_run``,
conftest.py); each rank wrote what it saw as JSON."""

from __future__ import annotations

import math

import pytest
import torch

from normscope.runs import read_wandb_run
from tests.support.expected import assert_reads_equal, floats, single_process_reads
from tests.support.fits import read_csv
from tests.support.shards import EXACT_MAX_STEPS, EXACT_STOP, LitDict, shard_batches


def test_reads_equal_the_single_process_reads_on_the_union_of_rows(distributed_run):
    """Learning rate 0 (the weights stay those of step 0), no row subsampling, each rank a
    disjoint shard (``DistributedSampler(shuffle=False)``): every logged number of every read
    equals a single-process tracker fed both shards with the same weights, to 1e-10 (measured:
    <= 5e-15; only the order of the float64 sums differs)."""
    reads = distributed_run["results"]["exact", 0]["reads"]
    assert [r["step"] for r in reads] == [1, 3, 6]
    module = LitDict(lr=0.0)
    module.load_state_dict(torch.load(distributed_run["out"] / "exact_weights.pt"))
    assert_reads_equal(reads, single_process_reads(module, reads))
    # the attention logits too: the all-reduced maximum of the ranks' maxima (both modules)
    assert all(r["metrics"]["dd/attn_modules_read"] == 2 for r in reads)
    assert all(math.isfinite(r["metrics"]["dd/attn_logit_max"]) for r in reads)


def test_a_cheap_window_folds_diagonals_on_every_rank_and_reads_the_union(distributed_run):
    """``spectral_every=2`` under DDP: both ranks fold each window in the mode of its read (the
    schedule is a count, the same on every rank); the cheap read (step 3) holds the cheap keys
    only, and they equal the single-process full read's on the union of the rows, to 1e-10."""
    from normscope.families.dead_direction.report import cheap_key

    ranks = [distributed_run["results"]["tiers", r] for r in (0, 1)]
    assert all(r["failure"] is None for r in ranks)
    reads = ranks[0]["reads"]
    assert [r["step"] for r in reads] == [1, 3, 6]
    for rank in ranks:
        assert [r["full"] for r in rank["reads"]] == [True, False, True]
        assert [r["metrics"] for r in rank["reads"]] == [r["metrics"] for r in reads]
    module = LitDict(lr=0.0)
    module.load_state_dict(torch.load(distributed_run["out"] / "tiers_weights.pt"))
    for read, want in zip(reads, single_process_reads(module, reads)):
        got = floats(read["metrics"])
        if not read["full"]:
            want = {k: v for k, v in want.items() if cheap_key(k)}
            assert "dd/sigma_min_ratio_min" not in got
        assert {k for k in got if "rms_growth" not in k} == {
            k for k in want if "rms_growth" not in k
        }
        for key, value in want.items():
            if "rms_growth" not in key:
                assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-10), key


def test_a_rank_with_only_padding_in_a_window_neither_hangs_nor_counts(distributed_run):
    """Rank 1's batch of step 0 is all padding (``attention_mask`` zeros): it folds no row,
    takes part in every collective, and the read holds rank 0's rows alone."""
    first = floats(distributed_run["results"]["exact", 0]["reads"][0]["metrics"])
    rank0_rows, rank1_rows = (int(b["attention_mask"].sum()) for b in shard_batches(0))
    assert rank1_rows == 0 and rank0_rows > 32
    assert first["dd/model.ln_f/n_rows"] == rank0_rows
    assert first["dd/model.h.0.ln_1/n_rows"] == rank0_rows
    later = floats(distributed_run["results"]["exact", 0]["reads"][1]["metrics"])
    assert later["dd/model.ln_f/n_rows"] == sum(
        int(b["attention_mask"].sum()) for b in shard_batches(2)
    )


def test_every_rank_holds_the_same_read(distributed_run):
    for fit in ("exact", "stop"):
        rank0, rank1 = (distributed_run["results"][fit, r] for r in (0, 1))
        assert rank0["failure"] is None and rank1["failure"] is None
        assert rank0["reads"] == rank1["reads"]  # bit-identical: one all-reduce, same bytes


def test_a_stop_decision_taken_on_one_rank_stops_both(distributed_run):
    """A rule that fires on rank 1 alone at the read of step 6: both ranks stop there (the
    decision is reduced with "any"), not at max_steps."""
    rank0, rank1 = (distributed_run["results"]["exact", r] for r in (0, 1))
    assert [a["rule"] for a in rank1["fired"]] == ["rank_one_only"]
    assert rank0["fired"] == []
    assert rank0["global_step"] == rank1["global_step"] == EXACT_STOP < EXACT_MAX_STEPS


def test_a_collapse_on_one_rank_alerts_once_and_stops_both(distributed_run):
    """From step 3 rank 1's block 1 cancels 95% of the stream; rank 0 stays healthy. The read
    is global (half the rows collapsed: step ratio about 0.70, healthy reads >= 0.93; the fit
    sets the floor to 0.9, since half the rows cannot take the pooled ratio under the default
    0.6), so the alert fires on both ranks at the next read (step 4), both stop there, and
    only rank 0 delivers it to the sinks."""
    rank0, rank1 = (distributed_run["results"]["stop", r] for r in (0, 1))
    for result in (rank0, rank1):
        assert result["global_step"] == 4
        assert [(a["rule"], a["step"], a["sublayer"]) for a in result["fired"]] == [
            ("sigma_min_collapse", 4, "mlp")
        ]
    assert [a["step"] for a in rank0["delivered"]] == [4]
    assert rank1["delivered"] == []
    before = floats(rank0["reads"][-2]["metrics"])
    assert before["dd/sigma_min_step_min"] > 0.8  # healthy until the cancellation


def test_only_rank_zero_writes_the_logs(distributed_run):
    """One CSV file per fit, each read's step once (a second writer would duplicate rows), with
    the reduced values; one W&B run, holding the alert."""
    for fit in ("exact", "stop"):
        result = distributed_run["results"][fit, 0]
        rows = [r for r in read_csv(result["log_dir"]) if r.get("dd/sigma_min_ratio_min")]
        assert [int(r["step"]) for r in rows] == [r["step"] for r in result["reads"]]
        for row, read in zip(rows, result["reads"]):
            assert float(row["dd/model.ln_f/gamma_alignment"]) == float(
                read["metrics"]["dd/model.ln_f/gamma_alignment"]
            )
    # rglob does not follow the latest-run link that W&B adds beside the run folder
    runs = list((distributed_run["out"] / "wandb_stop").rglob("run-*.wandb"))
    assert len(runs) == 1
    log = read_wandb_run(runs[0])
    reads = distributed_run["results"]["stop", 0]["reads"]
    rows = [row for row in log.history if "dd/sigma_min_ratio_min" in row]
    assert [row["step"] for row in rows] == [r["step"] for r in reads] == [1, 2, 4]
    for row, read in zip(rows, reads):
        logged, sent = {k: row[k] for k in read["metrics"]}, floats(read["metrics"])
        assert logged == sent
    assert [(a["step"], a["title"]) for a in log.alerts] == [
        (4, "normscope: sigma_min_collapse at mlp")
    ]


@pytest.mark.parametrize("what", ["snapshot_gammas", "min_rows", "as_dict"])
def test_a_failure_on_one_rank_stalls_no_rank(distributed_run, what):
    """The monitor breaks on rank 1 alone at step 3 (a sampled window: reads at 0, 1, 3, ...):
    before any collective, just before the end-of-window handshake, or after the reduce (with
    stop_on_alert, so rank 0 waits for rank 1's stop vote). Both ranks finish every step (the
    subprocess has a timeout: a rank left waiting fails the fixture), rank 1 names its failure,
    rank 0 stops reading at the next handshake, and neither reads after it."""
    from tests.support.distributed_fits import FAIL_STEPS

    r0 = distributed_run["results"]["fail", 0][what]
    r1 = distributed_run["results"]["fail", 1][what]
    assert r0["global_step"] == r1["global_step"] == FAIL_STEPS
    assert r1["disabled"] and f"injected on rank 1: {what}" in r1["failure"]
    assert r0["disabled"] and "another rank failed" in r0["failure"]
    # Windows 0 and 1 were read on both ranks (logged at global steps 1 and 2); window 3's read
    # (logged at 4) happened on both only when rank 1 failed after the reduce (its counters
    # were set before as_dict); nothing after.
    step = 4 if what == "as_dict" else 2
    assert r0["last_read_step"] == r1["last_read_step"] == step


def test_sign_magnitude_outlier_reads_cover_every_rank(distributed_run):
    """SignMagnitudeMonitor under DDP: each layer's outlier moments are summed over the ranks
    (one all-reduce after the window's handshake), so both ranks log the same outlier reads,
    equal to one process fed both ranks' rows of the window (step 5) with the same weights
    (float64 sums in another order: 1e-10). Weights are replicated: their reads match too."""
    from normscope import SignMagnitudeConfig, SignMagnitudeTracker
    from tests.support.distributed_fits import SM_STEPS

    r0, r1 = (distributed_run["results"]["sm", rank] for rank in (0, 1))
    assert r0["failure"] is None and r1["failure"] is None
    assert r0["reads"] == r1["reads"] == 3
    got0, got1 = floats(r0["last"]), floats(r1["last"])
    module = LitDict(lr=0.0)
    module.load_state_dict(torch.load(distributed_run["out"] / "sm_weights.pt"))
    module.train()
    tracker = SignMagnitudeTracker(module, SignMagnitudeConfig())
    tracker.attach()
    tracker.gate.open = True
    with torch.no_grad():
        for batch in shard_batches(SM_STEPS - 1):
            module(batch["input_ids"])
    tracker.gate.open = False
    expected = tracker.read(step=SM_STEPS).as_dict()
    leverage = [k for k in expected if k.endswith("leverage")]
    assert len(leverage) >= 4
    for key in leverage:
        assert math.isfinite(expected[key]), key
        assert got0[key] == pytest.approx(expected[key], rel=1e-10), key
        assert got1[key] == got0[key], key
    for key in [k for k in expected if k.endswith("/sign_alignment")]:
        assert got0[key] == pytest.approx(expected[key], rel=1e-12), key


def test_sign_magnitude_failure_on_one_rank_stalls_no_rank(distributed_run):
    from tests.support.distributed_fits import FAIL_STEPS

    f0, f1 = (distributed_run["results"]["sm", rank]["fail"] for rank in (0, 1))
    assert f0["global_step"] == f1["global_step"] == FAIL_STEPS
    assert f1["disabled"] and "injected on rank 1: attach" in f1["failure"]
    assert f0["disabled"] and "another rank failed" in f0["failure"]
    assert f0["reads"] == f1["reads"] == 2  # windows 0 and 1; none from window 3 on
