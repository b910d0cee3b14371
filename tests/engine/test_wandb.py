"""W&B done right, on a real offline run read back from its own files: the summary of the
run-level minima is the run's minimum (``define_metric(summary="min")``), the charts come at
their cadence, ``log_per_layer`` keeps the run-level keys and the worst layers."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch

from normscope import DeadDirectionMonitor
from normscope.runs import read_wandb_run, wandb_records
from tests.support import loops
from tests.support.fits import wait_for_summary
from tests.support.tiny_models import LitTiny, cpu_trainer, token_loader

pytestmark = pytest.mark.filterwarnings("ignore")


class CancelWindow(LitTiny):
    """The cancelling branch on for steps 4 and 5 only: the ratio dips, then recovers, so the
    run's minimum is not its last read."""

    def on_train_batch_start(self, batch, batch_idx):
        block = self.model.h[1]
        if self.global_step == 4:
            self.model.set_cancel(1, 0.95)
        elif self.global_step == 6:
            block.cancel = 0.0


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    from lightning.pytorch.loggers import WandbLogger

    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    tmp = tmp_path_factory.mktemp("wandb")
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(
        every_n_steps=1, verbose=False, alerts=(), overhead_warn=None, log_per_layer=1
    )
    monitor.charts_every_n_reads = 4
    logger = WandbLogger(project="normscope-test", save_dir=str(tmp))
    trainer = cpu_trainer(12, [monitor], logger=logger)
    trainer.fit(CancelWindow(lr=1e-3), train_dataloaders=token_loader())
    logger.experiment.finish()
    mp.undo()
    wait_for_summary(tmp)
    return tmp, monitor, trainer


def test_summary_of_the_ratio_minimum_is_the_runs_minimum(wandb_run):
    tmp, monitor, _ = wandb_run
    run = read_wandb_run(tmp)
    steps, ratios = run.series("dd/sigma_min_ratio_min")
    assert len(steps) == monitor.reads == 11  # every step but 0, residual discovery's
    assert ratios.min() < 0.8 < ratios[-1]  # the dip, and the recovery after it
    # W&B keeps a defined summary as {"min": value}
    assert run.summary["dd/sigma_min_ratio_min"] == {"min": ratios.min()}
    assert run.summary["dd/rows_rejected"] == {"max": 0}
    assert run.summary["dd/worst_point_step"] == steps[ratios.argmin()]


def test_charts_come_at_their_cadence(wandb_run):
    """``charts_every_n_reads=4``: the profile chart and the spectrum table at reads 1, 5 and 9
    (steps 2, 6, 10: step 0's forward is residual discovery's), not at all 11 reads."""
    tmp, _, _ = wandb_run
    chart_steps = []
    for record in wandb_records(read_wandb_run(tmp).path):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
        if any(k.startswith("dd/spectrum_bottom/") for k in items):
            assert any(k.startswith("dd/sigma_min_profile") for k in items)
            chart_steps.append(json.loads(items["trainer/global_step"]))
    assert chart_steps == [2, 6, 10]


def test_log_per_layer_keeps_run_level_keys_and_the_worst_layers(wandb_run):
    """``log_per_layer=1``: every run-level key; per-layer keys of at most 4 layers a read (the
    worst of each ranking: sigma_min_step, kernel_residual, delta_gamma, attention max_logit),
    among them the point the cancelling branch hit during the dip;
    the rules saw every layer (``callback_metrics`` holds them all)."""
    tmp, monitor, trainer = wandb_run
    run = read_wandb_run(tmp)
    rows = [r for r in run.history if "dd/sigma_min_ratio_min" in r]
    full = monitor.last_report.as_dict()
    # every run-level key but the growth since the previous read (none at the first read)
    run_level = {k for k in full if k.count("/") == 1 and k != "dd/rms_growth_max"}
    for row in rows:
        keys = {k for k in row if k.startswith("dd/")}
        assert run_level <= keys
        layers = {k.rsplit("/", 1)[0] for k in keys if k.count("/") > 1}
        assert 1 <= len(layers) <= 4
    dip = min(rows, key=lambda r: r["dd/sigma_min_ratio_min"])
    assert "dd/model.ln_f/sigma_min_step" in dip  # the sublayer that shrank the stream
    assert set(full) <= set(trainer.callback_metrics)
    assert len(full) > len({k for k in rows[-1] if k.startswith("dd/")})


def test_log_per_layer_on_32_layers():
    """A 32-layer model (65 norm layers, 65 residual points): ~1,600 keys a read with
    ``"all"``; ``log_per_layer=3`` logs the run-level keys and <= 12 layers; ``"none"`` the
    run-level keys alone; bad values are refused."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from normscope import DeadDirectionConfig, Monitor
    from normscope.engine.publish import select_layers
    from tests.support.tiny_models import TinyLM

    torch.manual_seed(0)
    model = TinyLM(d=8, layers=32, heads=2)
    logged = {}
    monitor = Monitor.of(
        DeadDirectionConfig(),
        model,
        every_n_steps=1,
        log_per_layer=3,
        log=logged.update,
        alerts=(),
        verbose=False,
    )
    x = torch.randint(0, 32, (4, 12))
    for _ in range(2):  # step 0's forward is residual discovery's; step 1 is read
        with monitor.step(x):
            model(x).sum().backward()
    full = monitor.last_report.as_dict()
    assert len(full) > 1200
    run_level = {k for k in full if k.count("/") == 1}
    assert run_level <= set(logged)
    layers = {k.rsplit("/", 1)[0] for k in set(logged) - run_level}
    # 4 rankings (sigma_min_step, kernel_residual, delta_gamma, attention max_logit) x 3;
    # measured 341 keys of 12 layers (338 before max_logit ranked; 299 with issue 32's stream
    # reads, 232 before them)
    assert 3 <= len(layers) <= 12 and len(logged) < 370, (len(layers), len(logged))
    assert all(loops.same_float(logged[k], full[k]) for k in logged)
    worst = min(
        (v, k) for k, v in full.items() if k.endswith("/sigma_min_step") and math.isfinite(v)
    )[1]
    assert worst in logged
    assert set(select_layers(full, "none")) == run_level
    assert select_layers(full, "all") == full
    for bad in (-1, "some", 1.5, True):
        with pytest.raises(MisconfigurationException, match="log_per_layer"):
            DeadDirectionMonitor(log_per_layer=bad)
    assert L  # lightning imported for the fixtures' Trainer


def test_plain_loop_with_wandb_log_summarises_the_minimum(tmp_path, wandb_offline):
    """``Monitor.of(DeadDirectionConfig(), model, log=wandb.log)``: the run-level keys are declared on the active run,
    so its summary of ``dd/sigma_min_ratio_min`` is the minimum over the reads, not the last."""
    import wandb

    from normscope import DeadDirectionConfig, Monitor
    from tests.support.tiny_models import TinyLM

    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randint(0, 32, (8, 16))
    run = wandb.init(project="normscope-test", dir=str(tmp_path))
    monitor = Monitor.of(DeadDirectionConfig(), model, every_n_steps=1, log=wandb.log, alerts=())
    ratios = []
    for step in range(5):
        if step == 2:
            model.set_cancel(1, 0.95)  # the dip: read after step 3
        elif step == 3:
            model.h[1].cancel = 0.0
        with monitor.step(x) as read:
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        if step == 0:
            assert read.report is None  # residual discovery watched this step's forward
        else:
            ratios.append(read.report.sigma_min_ratio_min)
    run.finish()
    wait_for_summary(tmp_path)
    logged = read_wandb_run(tmp_path)
    assert logged.series("dd/sigma_min_ratio_min")[1].tolist() == ratios
    assert min(ratios) < 0.8 < ratios[-1]
    assert logged.summary["dd/sigma_min_ratio_min"] == {"min": min(ratios)}
