"""DeadDirectionMonitor with the real loggers, read back from what they wrote to disk.

One fit logs to a ``CSVLogger``, a ``TensorBoardLogger`` and an offline ``WandbLogger`` at once;
a cancelling MLP branch switched on at step 4 makes the sigma_min alert fire. Every logged read
is compared with the monitor's own numbers (every read's ``as_dict()``, as the rules saw it, and
``last_report.as_dict()``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from normscope import DeadDirectionMonitor
from normscope.alerts import CallableRule, alert_text
from normscope.runs import read_csv_run, read_tensorboard_run, read_wandb_run
from tests.support.tiny_models import LitTiny, token_loader

STEPS = 8
EVERY = 2  # reads after steps 1, 2, 4, 6, 8 (windows: steps 0, 1, 3, 5, 7)
CANCEL_AT = 3  # the cancelling branch is on from the window of the read at step 4


@pytest.fixture(scope="module")
def logged_fit(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("loggers")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    torch.manual_seed(0)
    reads: list[tuple[int, dict[str, float]]] = []
    monitor = DeadDirectionMonitor(
        every_n_steps=EVERY,
        rules=[CallableRule("record", lambda m, step: reads.append((step, dict(m))))],
        alerts=("wandb",),
        verbose=False,
    )
    csv_logger = CSVLogger(out, name="csv")
    tb_logger = TensorBoardLogger(out, name="tb")
    wandb_logger = WandbLogger(project="normscope-loggers", save_dir=str(out / "wandb"))
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=[csv_logger, tb_logger, wandb_logger],
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    try:
        trainer.fit(
            LitTiny(cancel_at_step=CANCEL_AT, cancel_layer=1), train_dataloaders=token_loader()
        )
        wandb_logger.experiment.finish()
    finally:
        mp.undo()
    assert monitor.failure is None and not monitor.disabled
    return {
        "monitor": monitor,
        "reads": reads,
        "csv": csv_logger.log_dir,
        "tb": tb_logger.log_dir,
        # save_dir/wandb/offline-run-*/run-*.wandb (save_dir/wandb also holds a latest-run link)
        "wandb": next((out / "wandb" / "wandb").glob("offline-run-*")),
    }


def _rows_by_step(history: list[dict[str, float]], key: str) -> dict[int, dict[str, float]]:
    rows = [r for r in history if key in r]
    steps = [int(r["step"]) for r in rows]
    assert len(steps) == len(set(steps)), f"{key} logged twice at one step: {steps}"
    return dict(zip(steps, rows))


def _same(logged: float, value: float) -> bool:
    return (math.isnan(logged) and math.isnan(value)) or logged == value


def test_the_fit_read_on_schedule_and_fired_the_alert(logged_fit):
    monitor = logged_fit["monitor"]
    # the baseline window is step 1 (step 0's forward is residual discovery's)
    assert [s for s, _ in logged_fit["reads"]] == [2, 4, 6, 8]
    assert logged_fit["reads"][-1][1] == monitor.last_report.as_dict()
    assert [(a.rule, a.step, a.sublayer) for a in monitor.alerts_fired][:1] == [
        ("sigma_min_collapse", 4, "mlp")
    ]


def test_csv_holds_every_read_exactly(logged_fit):
    """CSVLogger writes ``str(float)``: the shortest repr that round-trips, so equal, not close."""
    rows = _rows_by_step(read_csv_run(logged_fit["csv"]).history, "dd/sigma_min_ratio_min")
    assert sorted(rows) == [s for s, _ in logged_fit["reads"]]
    for step, metrics in logged_fit["reads"]:
        for key, value in metrics.items():
            assert _same(rows[step][key], value), (step, key, rows[step][key], value)


def test_tensorboard_holds_every_read_to_float32(logged_fit):
    """A TensorBoard scalar summary stores ``simple_value``, a protobuf ``float`` (32 bits): the
    logged value is the float64 read rounded to the nearest float32, exactly, and no closer."""
    history = read_tensorboard_run(logged_fit["tb"]).history
    rows = _rows_by_step(history, "dd/sigma_min_ratio_min")
    assert sorted(rows) == [s for s, _ in logged_fit["reads"]]
    rounded_away = 0
    for step, metrics in logged_fit["reads"]:
        for key, value in metrics.items():
            expected = float(np.float32(value))
            assert _same(rows[step][key], expected), (step, key, rows[step][key], value)
            rounded_away += rows[step][key] != value
    assert rounded_away > 0  # float32 storage is real: most float64 reads do not survive it


def test_wandb_run_file_holds_the_reads_and_the_alert(logged_fit):
    """The offline run's transaction file: every read's keys and values (W&B serialises floats
    as JSON, so they round-trip exactly), and one ``alert`` record for the collapse."""
    log = read_wandb_run(logged_fit["wandb"])
    rows = _rows_by_step(log.history, "dd/sigma_min_ratio_min")
    assert sorted(rows) == [s for s, _ in logged_fit["reads"]]
    for step, metrics in logged_fit["reads"]:
        assert set(metrics) <= set(rows[step])
        for key, value in metrics.items():
            assert _same(rows[step][key], value), (step, key, rows[step][key], value)
    fired = logged_fit["monitor"].alerts_fired[0]
    assert len(log.alerts) == 1  # WandbSink rate-limits per (rule, key): 60 s
    alert = log.alerts[0]
    assert alert["title"] == fired.title == "normscope: sigma_min_collapse at mlp"
    assert alert["text"] == alert_text(fired)  # the message and what to try (issue 43)
    assert alert["step"] == fired.step == 4
    assert alert["level"] == "WARN"


def test_wandb_extras_are_in_the_run_file(logged_fit):
    """The profile chart and the spectrum table are logged as media (W&B writes a table as a
    nested record: ``<key>/_type``, ``<key>/path``, ...; a line chart under ``<key>_table``). The
    reader keeps scalars only, so they are looked up in the raw records: at the first read and
    every ``charts_every_n_reads``-th (10) one after it, not at every read."""
    from normscope.runs import wandb_records

    (run_file,) = Path(logged_fit["wandb"]).glob("run-*.wandb")
    media = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            keys = {item.key or "/".join(item.nested_key) for item in record.history.item}
            media += [k[: -len("/_type")] for k in keys if k.endswith("/_type")]
    n_charts = len(range(0, len(logged_fit["reads"]), 10))  # reads 1, 11, 21, ...
    assert (
        sorted(media)
        == ["dd/sigma_min_profile_table"] * n_charts + ["dd/spectrum_bottom"] * n_charts
    )
