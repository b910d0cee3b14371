"""DeadDirectionMonitor in real Lightning fits (CPU, tiny models, seconds each)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from normscope import DeadDirectionMonitor
from tests.support.fits import fit, logged_steps, read_csv, rows_with, wait_for_summary
from tests.support.tiny_models import LitTiny, NoNormModule, token_loader


def test_fit_logs_dd_keys_on_schedule(tmp_path):
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=4, spectral_every=1, verbose=False)
    trainer = fit(tmp_path, LitTiny(), monitor, steps=8)
    rows = read_csv(trainer)
    reads = rows_with(rows, "dd/sigma_min_ratio_min")
    # step 0's forward is discovery's (the residual stream is found from the training
    # forward), so the baseline window is step 1, logged at 2; then after steps 4 and 8
    assert [int(r["step"]) for r in reads] == [2, 4, 8]
    keys = set(rows[0].keys())
    for layer in ("model.h.0.ln_1", "model.h.1.ln_2", "model.ln_f"):
        for metric in (
            "gamma_alignment",
            "kernel_residual",
            "null_dim",
            "delta_gamma",
            "dead_channels",
        ):
            assert f"dd/{layer}/{metric}" in keys, f"dd/{layer}/{metric}"
    last = reads[-1]
    # LayerNorm with a float32 forward: the exact kernel (docs/metrics.md §1.2 floor ~1e-14).
    assert float(last["dd/model.ln_f/gamma_alignment"]) >= 0.9999
    assert float(last["dd/model.ln_f/kernel_residual"]) <= 1e-10
    assert float(last["dd/model.ln_f/null_dim"]) == 1
    # each read folds rows_per_read's default, 8 d = 128 of its step's 16 x 16 = 256 rows
    assert float(last["dd/model.ln_f/n_rows"]) == 128
    ratio = float(last["dd/sigma_min_ratio_min"])
    assert 0 < ratio < 10
    assert "dd/sigma_min_ratio_min" in trainer.callback_metrics
    assert monitor.reads == 3
    assert float(last["dd/profile_points"]) == 5  # p_0 .. p_4 of 2 pre-norm blocks
    assert not monitor.alerts_fired


@pytest.mark.parametrize("async_reads", [False, True], ids=["sync", "async"])
def test_a_tiered_fit_reads_kernel_residual_on_spectral_reads_only(tmp_path, async_reads):
    """spectral_every=2: the spectral keys (kernel_residual among them since cheap windows fold
    the diagonals only) are logged at every second read; the cheap keys at every read;
    callback_metrics hold a spectral key's last value; nothing escalates. Asynchronous reads
    (the window swapped out, the next one folded meanwhile) keep the same schedule."""
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(
        every_n_steps=1, spectral_every=2, async_reads=async_reads, verbose=False
    )
    trainer = fit(tmp_path, LitTiny(), monitor, steps=9)
    rows = read_csv(trainer)
    reads = [int(r["step"]) for r in rows_with(rows, "dd/rows_rejected")]
    spectral = [int(r["step"]) for r in rows_with(rows, "dd/sigma_min_ratio_min")]
    assert len(reads) == monitor.reads >= 7 and spectral == reads[::2]
    for layer in ("model.h.0.ln_1", "model.ln_f"):
        assert logged_steps(rows, f"dd/{layer}/kernel_residual") == spectral
        assert logged_steps(rows, f"dd/{layer}/out_offset_share") == reads
    last_spectral = rows_with(rows, "dd/model.ln_f/kernel_residual")[-1]
    assert float(last_spectral["dd/model.ln_f/kernel_residual"]) <= 1e-10  # the exact kernel
    assert reads[-1] not in spectral  # the last read was cheap: the value is held
    held = float(trainer.callback_metrics["dd/model.ln_f/kernel_residual"])
    # callback_metrics are float32 tensors: the held value to float32's precision
    assert held == pytest.approx(float(last_spectral["dd/model.ln_f/kernel_residual"]), rel=1e-6)
    assert not any("escalat" in k for r in rows for k in r)
    assert not hasattr(monitor.engine.family.tracker, "escalated")


def test_rmsnorm_model_is_classified(tmp_path):
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    trainer = fit(tmp_path, LitTiny(norm="rmsnorm"), monitor, steps=2)
    last = rows_with(read_csv(trainer), "dd/sigma_min_ratio_min")[-1]
    assert float(last["dd/model.ln_f/gamma_alignment"]) <= 0.5  # d = 16: random is ~1/4
    assert float(last["dd/model.ln_f/null_dim"]) == 0


def test_collapse_alert_fires_at_the_cancelling_sublayer_and_stops(tmp_path):
    torch.manual_seed(0)
    caught = []
    monitor = DeadDirectionMonitor(
        every_n_steps=2, alerts=("log", caught.append), stop_on_alert=True, verbose=False
    )
    module = LitTiny(cancel_at_step=4, cancel_layer=1)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        trainer = fit(tmp_path, module, monitor, steps=20)
    assert caught, "the cancelling branch must raise an alert"
    alert = caught[0]
    assert alert.rule == "sigma_min_collapse"
    assert alert.sublayer == "mlp"
    assert "h.1" in alert.point or "ln_f" in alert.point
    assert alert.step >= 5 and alert.value < 0.8
    assert trainer.global_step < 20, "stop_on_alert must stop the fit"
    assert trainer.should_stop


def test_healthy_run_raises_no_alert(tmp_path):
    torch.manual_seed(1)
    caught = []
    monitor = DeadDirectionMonitor(every_n_steps=2, alerts=(caught.append,), verbose=False)
    fit(tmp_path, LitTiny(), monitor, steps=12)
    assert monitor.reads == 6  # windows 1, 3, ..., 11 (step 0's forward is discovery's)
    assert caught == []


def test_gradient_accumulation_reads_every_micro_batch(tmp_path):
    """The three micro-batches of a read's step share its row budget (8 d = 128 at d = 16):
    ceil(128 / 3) = 43 rows from each, 129 in all, not 128 from each."""
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    trainer = fit(tmp_path, LitTiny(), monitor, steps=4, accumulate_grad_batches=3)
    reads = rows_with(read_csv(trainer), "dd/sigma_min_ratio_min")
    # step 0 (all three micro-batches) is discovery's; the baseline is step 1's window
    assert [int(r["step"]) for r in reads] == [2, 4]
    assert float(reads[-1]["dd/model.ln_f/n_rows"]) == 3 * 43


def test_bf16_autocast_on_cpu(tmp_path):
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, null_tol=1e-4, verbose=False)
    trainer = fit(tmp_path, LitTiny(), monitor, steps=2, precision="bf16-mixed")
    last = rows_with(read_csv(trainer), "dd/sigma_min_ratio_min")[-1]
    # bf16 forwards keep the LayerNorm kernel only to the bf16 floor (~1e-5 of top).
    assert float(last["dd/model.ln_f/gamma_alignment"]) >= 0.99
    assert float(last["dd/model.ln_f/kernel_residual"]) <= 1e-3
    assert math.isfinite(float(last["dd/sigma_min_ratio_min"]))


def test_resume_continues_steps(tmp_path):
    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    first = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    fit(tmp_path, LitTiny(), [first, ckpt], steps=4, enable_checkpointing=True)
    second = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    trainer = L.Trainer(
        max_steps=8,
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name="resumed"),
        callbacks=[second],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(
        LitTiny(),
        train_dataloaders=token_loader(),
        ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"),
    )
    steps = [int(r["step"]) for r in rows_with(read_csv(trainer), "dd/sigma_min_ratio_min")]
    assert steps and min(steps) > 4 and steps == sorted(steps)
    assert second.reads == first.reads + len(steps)


def test_no_norm_model_is_refused_at_setup(tmp_path):
    module = NoNormModule()
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        callbacks=[DeadDirectionMonitor()],
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4
    )
    with pytest.raises(MisconfigurationException, match="no normalisation layer"):
        trainer.fit(module, train_dataloaders=data)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_every_n_steps_must_be_positive_int(bad):
    with pytest.raises(MisconfigurationException, match="every_n_steps"):
        DeadDirectionMonitor(every_n_steps=bad)


def test_unknown_layer_name_lists_available(tmp_path):
    monitor = DeadDirectionMonitor(layers=["model.h.9.ln_1"], verbose=False)
    with pytest.raises(MisconfigurationException, match="model.ln_f"):
        fit(tmp_path, LitTiny(), monitor, steps=1)


def test_monitor_failure_is_fail_open(tmp_path):
    """A read that raises: one warning naming it, hooks removed, the fit runs to the end."""
    torch.manual_seed(0)
    module = LitTiny()
    monitor = DeadDirectionMonitor(every_n_steps=1, verbose=False)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    monitor.setup(trainer, module, "fit")

    def broken_read(*args, **kwargs):
        raise RuntimeError("injected read failure")

    monitor.tracker.read = broken_read
    with pytest.warns(UserWarning, match="disabled itself.*injected read failure"):
        trainer.fit(module, train_dataloaders=token_loader())
    assert trainer.global_step == 3
    assert monitor.disabled
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def test_wandb_offline_run_gets_metrics_profile_and_alert(tmp_path, wandb_offline):
    """A real WandbLogger in offline mode: the run file holds the dd keys, the profile chart,
    and the alert record of a collapse (the full record reader is a later issue's test)."""
    from lightning.pytorch.loggers import WandbLogger

    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    logger = WandbLogger(project="normscope-test", save_dir=str(tmp_path))
    trainer = L.Trainer(
        max_steps=8,
        accelerator="cpu",
        logger=logger,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.warns(UserWarning, match="normscope alert"):
        trainer.fit(LitTiny(cancel_at_step=4, cancel_layer=1), train_dataloaders=token_loader())
    logger.experiment.finish()
    assert monitor.failure is None and not monitor.disabled
    assert monitor.alerts_fired
    # W&B's finish() can return before its core process has flushed the run file's last
    # 32 KiB block (seen here under load: a 32,768-byte file without the alert record)
    wait_for_summary(Path(tmp_path))
    run_files = list(Path(tmp_path).rglob("run-*.wandb"))
    assert len(run_files) == 1
    data = run_files[0].read_bytes()
    for needle in (
        b"dd/sigma_min_ratio_min",
        b"dd/model.ln_f/gamma_alignment",
        b"dd/sigma_min_profile",
        b"dd/spectrum_bottom",
    ):
        assert needle in data, needle
    # the alert record, read as a record (its bytes may straddle a 32 KiB block boundary)
    from normscope.runs import read_wandb_run

    titles = [a["title"] for a in read_wandb_run(tmp_path).alerts]
    assert any(t.startswith("normscope: sigma_min_collapse") for t in titles), titles


def test_failed_discovery_forward_keeps_the_norm_reads(tmp_path):
    """A batch the default discovery forward cannot run: the profile is off, with a warning
    saying how to fix it, and the norm reads still arrive."""
    torch.manual_seed(0)

    def broken_forward(pl_module, batch):
        raise TypeError("this module's forward takes something else")

    monitor = DeadDirectionMonitor(every_n_steps=2, example_forward=broken_forward, verbose=False)
    with pytest.warns(UserWarning, match="residual profile disabled.*example_forward"):
        trainer = fit(tmp_path, LitTiny(), monitor, steps=2)
    last = rows_with(read_csv(trainer), "dd/model.ln_f/gamma_alignment")[-1]
    assert float(last["dd/model.ln_f/gamma_alignment"]) >= 0.9999
    assert "dd/sigma_min_ratio_min" not in last or last["dd/sigma_min_ratio_min"] == ""
    assert not monitor.disabled


@pytest.mark.parametrize("monitor_cls", ["dd", "sm"])
def test_a_read_that_costs_more_than_overhead_warn_says_which_cadence_would_not(
    tmp_path, monitor_cls
):
    """The cost guard: after 20 plain steps, a read costing more than ``overhead_warn`` of
    training time at the cadence warns once with the every_n_steps that would not. The
    thresholds sit far from any real cost (1e-9: every read is over; 1e9: none is), so the test
    does not depend on this machine's speed."""
    import re

    from normscope import SignMagnitudeMonitor

    cls = DeadDirectionMonitor if monitor_cls == "dd" else SignMagnitudeMonitor
    torch.manual_seed(0)
    noisy = cls(every_n_steps=3, overhead_warn=1e-9, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "noisy", LitTiny(), noisy, steps=40)
    cost = [
        str(w.message) for w in caught if "of training time at every_n_steps=3" in str(w.message)
    ]
    assert len(cost) == 1, cost  # once, not once per read
    suggested = int(re.search(r"every_n_steps=(\d+) keeps it under", cost[0]).group(1))
    assert suggested > 3
    assert noisy.engine.cost.plain_steps >= 20 and not noisy.disabled
    quiet = cls(every_n_steps=3, overhead_warn=1e9, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "quiet", LitTiny(), quiet, steps=40)
    assert not [w for w in caught if "of training time" in str(w.message)]
    with pytest.raises(MisconfigurationException, match="overhead_warn"):
        cls(overhead_warn=0)
