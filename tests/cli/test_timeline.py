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
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from normscope import DeadDirectionMonitor
from normscope.cli import report
from normscope.cli.timeline import Timeline, find_loss, first_movers, loss_moved
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
    band = t.bands["dd/gamma_scale_min"]
    assert band.worse == "down" and band.lo == pytest.approx(1.0 / 1.5, rel=1e-9)
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
def zoo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Timeline]:
    """The zoo's runs (seed 0, LayerNorm) saved as its JSONL records, read back by its own
    ``load``, each turned into a timeline."""
    zoo = _zoo()
    path = tmp_path_factory.mktemp("zoo") / "reads.jsonl"
    data = zoo._data()
    with warnings.catch_warnings(), path.open("w") as fh:
        warnings.simplefilter("ignore")
        for name, arm, steps in ZOO_RUNS:
            records = zoo.run_one(zoo.PATHOLOGIES[name], arm, "layernorm", 0, steps, data)
            fh.writelines(json.dumps(r) + "\n" for r in records)
    runs, reads = zoo.load([str(path)])
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
    monkeypatch.setattr(report, "PROGRESS_AFTER_S", 0.0)  # every phase says so
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
