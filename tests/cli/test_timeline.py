"""The story of a run (``normscope.cli.timeline``): which run-level reads left their own early
band first, and how many reads before the first alert and the loss move.

* synthetic histories: the order of the movers and their leads, the band taken before the
  first event, the loss move, and the one healthy line;
* the pathology zoo's saved reads (``benchmarks/pathology_zoo.py``, one seed, LayerNorm, a few
  runs shortened to the reads that matter): the first mover precedes the alert under norm-gain
  decay, precedes the loss under a diverging learning rate, and a healthy twin gets the line;
* one ``normscope report`` of a tiny Lightning fit whose cancelling branch makes it alert,
  logged to CSV: the timeline is printed, in ``report.json``, ``report.md``, ``report.html``
  and drawn as ``timeline.png``.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from normscope import DeadDirectionMonitor
from normscope.cli import progress
from normscope.cli.timeline import WATCHED, Timeline, find_loss, first_movers, loss_moved
from tests.support.cli import assert_drawn, load_json, run_cli
from tests.support.tiny_models import LitTiny, cpu_trainer, token_loader

torch.set_num_threads(1)

ZOO = Path(__file__).resolve().parents[2] / "benchmarks"


def history(n: int, moves: dict[str, tuple[int, float]]) -> dict[float, dict[str, float]]:
    """``n`` reads 10 steps apart of three steady keys; ``moves``: key -> (from read, value)."""
    steady = {"dd/sigma_min_ratio_min": 1.2, "dd/gamma_scale_min": 1.0, "dd/attn_logit_max": 2.0}
    reads = {}
    for i in range(1, n + 1):
        values = {k: v * (1 + 0.01 * (i % 2)) for k, v in steady.items()}  # a little noise
        values |= {k: v for k, (at, v) in moves.items() if i >= at}
        reads[10.0 * i] = values
    return reads


# ----------------------------------------------------------------------------- synthetic


def test_movers_come_in_the_order_they_left_their_bands_with_their_leads() -> None:
    reads = history(12, {"dd/attn_logit_max": (7, 80.0), "dd/gamma_scale_min": (5, 0.3)})
    t = first_movers(reads, alert_steps=[80.0, 110.0])
    assert [(m.key, m.read, m.step) for m in t.movers] == [
        ("dd/gamma_scale_min", 5, 50.0),
        ("dd/attn_logit_max", 7, 70.0),
    ]
    assert (t.alert_step, t.alert_read, t.lead(t.alert_read)) == (80.0, 8, 3)
    assert t.baseline == 3 and not t.healthy and t.loss_step is None
    band = t.bands["dd/gamma_scale_min"]  # a scale: its band from its definition, 1 at start
    assert (band.worse, band.lo, band.hi, band.n) == ("down", 1 / 3, 3.0, 0)
    assert t.bands["dd/sigma_min_ratio_min"].lo == pytest.approx(1.2 / 1.5, rel=1e-9)
    assert t.bands["dd/attn_logit_max"].hi == 10.0  # the floor: a logit under 10 is no news
    lines = t.lines()
    assert lines[1].startswith("  read 5 (step 50): dd/gamma_scale_min 0.3 left its band")
    assert "first alert at step 80 (read 8): the first mover led it by 3 read(s)" in lines[3]
    assert json.dumps(t.as_dict())  # plain data for report.json
    assert t.as_dict()["lead_over_alert"] == 3


def test_a_move_to_the_better_side_is_no_news() -> None:
    reads = history(8, {"dd/sigma_min_ratio_min": (4, 9.0), "dd/gamma_scale_min": (4, 3.0)})
    assert first_movers(reads).movers == []


def test_the_band_is_taken_before_the_first_event() -> None:
    """An alert at read 2 leaves one read for the band, and the note says so."""
    reads = history(6, {"dd/attn_logit_max": (2, 500.0), "dd/gamma_scale_min": (4, 0.2)})
    t = first_movers(reads, alert_steps=[20.0])
    assert t.baseline == 1 and "takes 1 read(s), not 3" in t.notes[0]
    assert [(m.key, m.read) for m in t.movers] == [
        ("dd/attn_logit_max", 2),
        ("dd/gamma_scale_min", 4),
    ]
    assert t.lead(t.alert_read) == 0


def test_a_gain_scale_is_judged_from_read_1_and_the_notes_say_what_the_band_holds() -> None:
    """The gains' scale has its band from its definition, so it can leave at read 1; a short
    run's note says it is short; an alert at read 1 is in the band, and the note says so."""
    t = first_movers({1.0: {"dd/gamma_scale_min": 0.3}, 2.0: {"dd/gamma_scale_min": 0.2}})
    assert [(m.key, m.read) for m in t.movers] == [("dd/gamma_scale_min", 1)]
    assert t.notes == ["the band takes 2 read(s), not 3: the run has 2 read(s)"]
    reads = {1.0: {"dd/sigma_min_ratio_min": 0.1}, 2.0: {"dd/sigma_min_ratio_min": 0.01}}
    t = first_movers(reads, alert_steps=[1.0])
    assert t.lead(t.alert_read) == -1 and "the band holds it" in t.notes[0]
    assert "the first mover came 1 read(s) after it" in "\n".join(t.lines())


def test_the_loss_moves_when_its_trailing_mean_rises_over_its_best() -> None:
    falling = [(float(s), 4.0 - 0.05 * s) for s in range(40)]
    assert loss_moved(falling) is None
    noisy = [(s, v + (0.8 if int(s) % 2 else 0.0)) for s, v in falling]  # noise, no rise
    assert loss_moved(noisy) is None
    blown = falling + [(40.0, 9.0), (41.0, 12.0)]
    assert loss_moved(blown) == 40.0
    assert loss_moved(falling[:5] + [(5.0, float("nan"))]) == 5.0
    rows = [{"step": 2.0, "train/loss": 3.0}, {"step": 1.0, "train/loss": 4.0}, {"step": 1.0}]
    assert find_loss(rows) == ("train/loss", [(1.0, 4.0), (2.0, 3.0)])
    assert find_loss([{"step": 1.0, "val/loss": 1.0}]) == ("", [])

    reads = history(10, {"dd/gamma_scale_min": (5, 0.3)})
    t = first_movers(reads, loss=[(10.0 * i, 3.0) for i in range(1, 8)] + [(75.0, 20.0)],
                     loss_key="train/loss")  # fmt: skip
    assert (t.loss_step, t.loss_read, t.lead(t.loss_read)) == (75.0, 8, 3)
    assert "the loss (train/loss) moved at step 75 (read 8): the first mover led it by 3" in (
        "\n".join(t.lines())
    )


def test_a_healthy_history_says_so_in_one_line() -> None:
    t = first_movers(history(12, {}), loss=[(10.0 * i, 3.0 - 0.1 * i) for i in range(1, 13)],
                     loss_key="train/loss")  # fmt: skip
    assert t.healthy
    assert t.lines() == [
        "timeline: healthy: no read left its band, no alert, the loss (train/loss) did not "
        "move (bands from the first 3 read(s))"
    ]
    assert first_movers({}).healthy  # no read at all: nothing to tell


# ----------------------------------------------------------------------------- the zoo


def _zoo():
    sys.path.insert(0, str(ZOO))
    try:
        import pathology_zoo
    finally:
        sys.path.remove(str(ZOO))
    return pathology_zoo


def zoo_timeline(meta: dict, reads: list[dict]) -> Timeline:
    """A zoo run's saved records as the report's inputs: the reads at the step the monitor
    logged them (``log_step``), the alerts the live monitor fired, and the ground truth's
    per-step loss, logged (as Lightning would) at the global step after its batch."""
    by_step = {
        float(r["log_step"]): {k: v for k, v in r["metrics"].items() if isinstance(v, float)}
        for r in reads
    }
    loss = sorted(
        (float(s) + 1.0, float(gt["loss"])) for s, gt in meta["per_step"].items() if "loss" in gt
    )
    alerts = [float(a["step"]) for a in meta["alerts_fired"]]
    return first_movers(by_step, alerts, loss, loss_key="loss")


#: (pathology, arm, steps): long enough for the alert and the loss move, no longer
ZOO_RUNS = (("gain_decay", "pathology", 80), ("gain_decay", "twin", 80),
            ("lr_divergence_warmup", "pathology", 90))  # fmt: skip


@pytest.fixture(scope="module")
def zoo_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The zoo's runs (seed 0, LayerNorm) saved as its JSONL records."""
    zoo = _zoo()
    path = tmp_path_factory.mktemp("zoo") / "reads.jsonl"
    data = zoo._data()
    with warnings.catch_warnings(), path.open("w") as fh:
        warnings.simplefilter("ignore")
        for name, arm, steps in ZOO_RUNS:
            records = zoo.run_one(zoo.PATHOLOGIES[name], arm, "layernorm", 0, steps, data)
            fh.writelines(json.dumps(r) + "\n" for r in records)
    return path


@pytest.fixture(scope="module")
def zoo_runs(zoo_saved: Path) -> dict[tuple[str, str], Timeline]:
    """The saved runs read back by the zoo's own ``load``, each turned into a timeline."""
    runs, reads = _zoo().load([str(zoo_saved)])
    return {(m["pathology"], m["arm"]): zoo_timeline(m, reads[run]) for run, m in runs.items()}


def test_gain_decay_moves_its_gains_before_the_alert(zoo_runs) -> None:
    t = zoo_runs["gain_decay", "pathology"]
    assert t.alert_read is not None and t.movers, t.lines()
    assert t.movers[0].key == "dd/gamma_scale_min", t.lines()
    assert t.movers[0].read < t.alert_read and t.lead(t.alert_read) >= 1, t.lines()


def test_a_diverging_learning_rate_moves_reads_before_the_loss(zoo_runs) -> None:
    """The alert comes at the second read (the first is the band): the first mover is with it,
    and ahead of the loss."""
    t = zoo_runs["lr_divergence_warmup", "pathology"]
    assert t.alert_read is not None and t.loss_read is not None and t.movers, t.lines()
    assert t.movers[0].read <= t.alert_read < t.loss_read, t.lines()
    assert t.lead(t.loss_read) >= 3, t.lines()


def test_the_healthy_twin_gets_the_healthy_line(zoo_runs) -> None:
    t = zoo_runs["gain_decay", "twin"]
    assert t.healthy, t.lines()
    assert len(t.lines()) == 1 and t.lines()[0].startswith("timeline: healthy:")


def test_normscope_report_on_a_zoo_run_tells_the_same_story(zoo_saved, tmp_path) -> None:
    """``pathology_zoo.py --timeline``: a saved run written as a Lightning CSV log (the live
    alerts as ``dd/alert/<rule>`` keys, the loss as ``train_loss``) and read back by
    ``normscope report`` gets the timeline built straight from its records."""
    zoo = _zoo()
    runs, reads = zoo.load([str(zoo_saved)])
    name = next(n for n, m in runs.items() if (m["pathology"], m["arm"]) == ("gain_decay",
                                                                              "pathology"))  # fmt: skip
    one = tmp_path / "one.jsonl"
    one.write_text(
        "".join(line for line in zoo_saved.read_text().splitlines(True) if f'"{name}"' in line)
    )
    [told] = zoo.timelines([str(one)], str(tmp_path / "csv"))
    direct = zoo_timeline(runs[name], reads[name]).as_dict()
    story = told["timeline"]
    assert story["movers"] == direct["movers"] and story["first_alert"] == direct["first_alert"]
    assert story["loss"]["key"] == "train_loss" and story["loss"]["read"] == direct["loss"]["read"]
    assert story["lead_over_alert"] == direct["lead_over_alert"] >= 1


# ----------------------------------------------------------------------------- a saved slice

#: the watched keys of 16 zoo runs (seed 0: gain_decay, lr_divergence_warmup, logit_growth, each
#: pathology and twin, both norms; seed 1: the twins of logit_growth and ssl_collapse_nobias,
#: which the bands before issue 43's fixes took for sick), their live alerts and per-step loss
SAVED = Path(__file__).with_name("zoo_timeline_slice.json")


def _saved() -> dict[str, dict]:
    data = json.loads(SAVED.read_text())
    runs = {}
    for r in data["runs"]:
        reads = {float(row[0]): dict(zip(data["keys"], map(float, row[1:]))) for row in r["reads"]}
        loss = [(float(r["loss_first_step"] + i), v) for i, v in enumerate(r["loss"])]
        t = first_movers(reads, [float(a) for a in r["alert_steps"]], loss, loss_key="loss")
        runs[r["run"]] = {"reads": reads, "t": t, "gt_read": r["gt_read"]}
    return runs


def test_on_the_saved_slice_the_first_mover_precedes_every_alert_the_data_can_precede() -> None:
    """Every pathology run whose alert comes before its ground truth (a lead): the first mover
    comes before the alert under ``gain_decay`` (the gains' scale at read 5, a read before
    ``norm_gain_drift``, both norms); where it comes with the alert (``lr_divergence_warmup``:
    the alert at read 2, after one read at step 1; ``logit_growth`` under RMSNorm: read 3), no
    read before the alert lies outside the range the healthy twins take at that read, widened
    by the watched key's factor: the data holds no earlier mover to find."""
    runs = _saved()
    twins = [r for name, r in runs.items() if " twin " in name]
    with_lead = {n: r for n, r in runs.items() if r["t"].alert_read and r["gt_read"] and
                 r["t"].alert_read < r["gt_read"]}  # fmt: skip
    assert sorted(with_lead) == [
        "gain_decay pathology layernorm seed 0", "gain_decay pathology rmsnorm seed 0",
        "logit_growth pathology rmsnorm seed 0",
        "lr_divergence_warmup pathology layernorm seed 0",
        "lr_divergence_warmup pathology rmsnorm seed 0",
    ]  # fmt: skip
    for name, r in with_lead.items():
        t = r["t"]
        assert t.movers and t.movers[0].read <= t.alert_read, (name, t.lines())
        steps = sorted(r["reads"])
        earlier = []  # (read, key): outside every twin's range at that read, on the worse side
        for i, step in enumerate(steps[: t.alert_read - 1]):
            for w in WATCHED:
                at = [tw["reads"][sorted(tw["reads"])[i]].get(w.key, math.nan) for tw in twins]
                at = [v for v in at if math.isfinite(v)]
                v = r["reads"][step].get(w.key, math.nan)
                if at and (v > max(at) * w.factor if w.worse == "up" else v < min(at) / w.factor):
                    earlier.append((i + 1, w.key))
        if t.movers[0].read == t.alert_read:  # with the alert: the data holds no earlier mover
            assert not earlier, (name, earlier, t.lines())
        assert (t.movers[0].read < t.alert_read) == ("gain_decay" in name), (name, t.lines())
    for norm in ("layernorm", "rmsnorm"):
        t = runs[f"gain_decay pathology {norm} seed 0"]["t"]
        first = t.movers[0]
        assert (first.key, first.read, t.alert_read) == ("dd/gamma_scale_min", 5, 6), t.lines()
        assert first.band.n == 0 and first.band.lo == 1 / 3  # from the read's definition
        assert "  first alert at step 50 (read 6): the first mover led it by 1 read(s)" in (
            t.lines()
        )


def test_on_the_saved_slice_every_healthy_twin_says_so_in_one_line() -> None:
    """Every twin prints the one healthy line, those the bands before issue 43 took for sick
    included: a ``logit_growth`` twin (learning rate 0.03) whose gains drift to 0.39 of their
    start in 150 steps, with one of 64 crossing zero, and whose centred RankMe falls 15x from
    initialisation (a band from the first 3 reads widened 3x, as it was, had it leave at read
    5); a self-supervised twin whose offset share wanders between 0.004 and 0.09."""
    runs = _saved()
    for name, r in runs.items():
        if " twin " in name:
            assert r["t"].healthy and len(r["t"].lines()) == 1, (name, r["t"].lines())
            assert r["t"].lines()[0].startswith("timeline: healthy: no read left its band")

    def series(name: str, key: str) -> list[float]:
        return [v[key] for _, v in sorted(runs[name]["reads"].items())]

    rankme = series("logit_growth twin layernorm seed 0", "dd/final_rankme_centred")
    assert rankme[4] < min(rankme[:3]) / 3 and min(rankme) < rankme[0] / 15
    assert all(w.key != "dd/final_rankme_centred" for w in WATCHED)
    gains = series("logit_growth twin rmsnorm seed 1", "dd/gamma_scale_min")
    assert 1 / 3 < min(gains) < 0.39
    assert max(series("logit_growth twin rmsnorm seed 1", "dd/gamma_crossed_max")) == 1 / 64
    shares = series("ssl_collapse_nobias twin layernorm seed 1", "dd/final_out_offset_share")
    assert max(shares[3:]) > 1.5 * max(shares[:3]) and max(shares) < 0.1


# ----------------------------------------------------------------------------- the report


def test_report_of_an_alerting_csv_run_prints_and_draws_its_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False, alerts=())
    trainer = cpu_trainer(
        14, [monitor], logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LitTiny(cancel_at_step=6, cancel_layer=1), train_dataloaders=token_loader())
    assert monitor.alerts_fired, "the cancelling branch must make the monitor alert"
    out = tmp_path / "out"
    monkeypatch.setattr(progress, "PROGRESS_AFTER_S", 0.0)  # every phase says so
    code, stdout, stderr = run_cli("report", tmp_path / "csv" / "version_0", "--out", out)
    assert code == 0
    assert "normscope report: read the csv run (" in stderr and "drew 6 figures in" in stderr
    story = load_json(out / "report.json")["timeline"]
    assert not story["healthy"] and story["first_alert"]["step"] == monitor.alerts_fired[0].step
    assert story["loss"]["key"] == "train/loss"
    assert story["lines"][0].startswith("timeline (bands from the first")
    assert "\n".join(story["lines"]) in stdout
    assert "## Timeline" in (out / "report.md").read_text()
    assert "<h2>Timeline</h2>" in (out / "report.html").read_text()
    assert_drawn(out / "timeline.png")
