"""Fail-open, in real Lightning fits: a failure inside a hook, a read, an alert sink, an alert
rule, a logger call or the checkpoint state costs one warning naming it and that part of the
monitor only; the fit reaches ``max_steps``, its checkpoints load the way Lightning loads them
(``torch.load(weights_only=True)``, torch >= 2.6's default) and its own CSV metrics are complete.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from normscope import DeadDirectionMonitor, SignMagnitudeMonitor
from normscope.alerts import CallableRule
from normscope.families.dead_direction import read as read_path
from normscope.families.dead_direction.render import format_read_line
from normscope.families.sign_magnitude import SignMagnitudeConfig, SignMagnitudeTracker
from tests.support.fits import (
    assert_loss_logged_every_step,
    fit,
    logged_steps,
    normscope_failures,
    read_csv,
    recorded_warnings,
)
from tests.support.reliability_models import (
    DDFailingCSVLogger,
    LitSparse,
    NarrowingLM,
    sparse_loader,
)
from tests.support.tiny_models import LitTiny, TinyLM


def checkpointing(tmp_path: Path, every: int = 2) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1)


def assert_run_intact(trainer: L.Trainer, tmp_path: Path, monitor: L.Callback) -> dict:
    """max_steps reached; the last checkpoint exists, loads with weights_only=True (what
    ``Trainer.fit(ckpt_path=...)`` does on torch >= 2.6) into a fresh module, and holds the
    monitor's state; ``train/loss`` was logged at every step."""
    assert trainer.global_step == trainer.max_steps
    path = tmp_path / "ckpt" / f"epoch=0-step={trainer.max_steps}.ckpt"
    assert path.is_file(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["global_step"] == trainer.max_steps
    module = trainer.lightning_module
    type(module)(**module.hparams).load_state_dict(ckpt["state_dict"])  # a fresh twin
    assert monitor.state_key in ckpt["callbacks"]
    assert_loss_logged_every_step(trainer)
    return ckpt["callbacks"][monitor.state_key]


def test_failing_sink_and_rule_cost_only_themselves(tmp_path):
    """A pager that raises is removed after its first alert, a rule that raises is disabled;
    the other sink still gets every page and the monitor reads to the end."""
    torch.manual_seed(0)
    pager_calls, delivered = [], []

    def pager(alert):
        pager_calls.append(alert)
        raise ConnectionError("pager service unreachable")

    def broken_rule(metrics, step):
        raise KeyError("dd/metric-that-does-not-exist")

    heartbeat = CallableRule("heartbeat", lambda m, step: f"read at step {step}")
    monitor = DeadDirectionMonitor(
        every_n_steps=2,
        rules=[CallableRule("broken", broken_rule), heartbeat],
        alerts=(pager, delivered.append),
        verbose=False,
    )
    with recorded_warnings() as records:
        trainer = fit(
            tmp_path, LitTiny(), [monitor, checkpointing(tmp_path)], steps=6,
            enable_checkpointing=True,
        )  # fmt: skip
    failures = normscope_failures(records)
    assert len(failures) == 2, failures
    assert sum("sink" in f and "pager" in f and "unreachable" in f for f in failures) == 1
    assert sum("rule 'broken'" in f and "KeyError" in f for f in failures) == 1
    assert len(pager_calls) == 1  # removed after its first failure
    # the other sink still gets the page; the heartbeat's later reads are the same rule in the
    # same event: counted, not paged (issue 43), and every read's heartbeat is in the record
    # (baseline window 1: step 0 is discovery's)
    assert [a.step for a in delivered] == [2]
    assert [(a.step, a.paged) for a in monitor.alerts_fired] == [(2, True), (4, False), (6, False)]
    assert not monitor.disabled and monitor.reads == 3
    state = assert_run_intact(trainer, tmp_path, monitor)
    assert len(state["alerts_fired"]) == 3


@pytest.mark.parametrize("family", ["dd", "sm"])
def test_failing_logger_is_skipped_for_normscope_metrics_only(tmp_path, family):
    """A logger whose backend refuses normscope's keys: one warning, that logger skipped for
    normscope from then on; its own metrics (the loss) and the other logger are complete."""
    torch.manual_seed(0)
    monitor = (
        DeadDirectionMonitor(every_n_steps=2, verbose=False)
        if family == "dd"
        else SignMagnitudeMonitor(every_n_steps=2, probe_layers=(), verbose=False, alerts=())
    )
    bad = DDFailingCSVLogger(tmp_path, name="bad", prefix=f"{family}/")
    good = CSVLogger(tmp_path, name="good")
    with recorded_warnings() as records:
        trainer = fit(
            tmp_path, LitTiny(norm="rmsnorm"), [monitor, checkpointing(tmp_path)], steps=6,
            logger=[bad, good], enable_checkpointing=True,
        )  # fmt: skip
    failures = normscope_failures(records)
    assert len(failures) == 1 and "DDFailingCSVLogger" in failures[0], failures
    assert "backend refused" in failures[0]
    assert bad.refused == 1  # never asked again
    # dd finds the stream from step 0's training forward: its baseline window is step 1
    steps = [2, 4, 6] if family == "dd" else [1, 2, 4, 6]
    assert not monitor.disabled and monitor.reads == len(steps)
    bad_rows = read_csv(trainer)  # trainer.logger is the first one: the failing logger
    assert not any(k.startswith(f"{family}/") for k in bad_rows[0])
    good_rows = read_csv(L.Trainer(logger=good, accelerator="cpu"))
    key = f"{family}/sigma_min_ratio_min" if family == "dd" else "sm/sign_alignment_mean"
    assert logged_steps(good_rows, key) == steps
    assert key in trainer.callback_metrics
    assert_run_intact(trainer, tmp_path, monitor)


def test_failing_read_of_one_layer_disables_that_layer_only(tmp_path, monkeypatch):
    torch.manual_seed(0)
    module = LitTiny()
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    real_read_norm = read_path.read_norm

    def read_norm(norm, *taps_gamma_and_options):
        if norm.name == "model.h.0.ln_2":
            raise FloatingPointError("injected failure in one layer's read")
        return real_read_norm(norm, *taps_gamma_and_options)

    monkeypatch.setattr(read_path, "read_norm", read_norm)
    with recorded_warnings() as records:
        trainer = fit(tmp_path, module, [monitor], steps=4)
    failures = normscope_failures(records)
    assert len(failures) == 1 and "'model.h.0.ln_2'" in failures[0], failures
    assert "injected failure" in failures[0]
    rows = read_csv(trainer)
    for metric in ("gamma_alignment", "kernel_residual", "schur_quotient", "gamma_min"):
        assert f"dd/model.h.0.ln_2/{metric}" not in rows[0], metric
    # its input is still a residual point: the profile, a separate read, goes on there
    # (reads after windows 1 and 3: step 0's forward is residual discovery's)
    assert logged_steps(rows, "dd/model.h.0.ln_2/sigma_min") == [2, 4]
    for layer in ("model.h.0.ln_1", "model.h.1.ln_2", "model.ln_f"):
        assert logged_steps(rows, f"dd/{layer}/gamma_alignment") == [2, 4]
    assert [float(r["dd/reads_disabled"]) for r in rows if r.get("dd/reads_disabled")] == [1.0] * 2
    assert not monitor.disabled
    assert_loss_logged_every_step(trainer)


@pytest.mark.parametrize("family", ["dd", "sm"])
def test_failing_read_disables_the_monitor_and_leaves_the_run_intact(tmp_path, family):
    torch.manual_seed(0)
    module = LitTiny(norm="rmsnorm")
    monitor = (
        DeadDirectionMonitor(every_n_steps=2, verbose=False)
        if family == "dd"
        else SignMagnitudeMonitor(every_n_steps=2, probe_layers=(), verbose=False, alerts=())
    )
    monitor.setup(L.Trainer(logger=False, accelerator="cpu"), module, "fit")

    def broken_read(*args, **kwargs):
        raise RuntimeError("injected read failure")

    monitor.tracker.read = broken_read
    with recorded_warnings() as records:
        trainer = fit(
            tmp_path, module, [monitor, checkpointing(tmp_path)], steps=6,
            enable_checkpointing=True,
        )  # fmt: skip
    failures = normscope_failures(records)
    assert len(failures) == 1, failures
    assert "disabled itself" in failures[0] and "injected read failure" in failures[0]
    assert monitor.disabled
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
    assert not any(k.startswith(f"{family}/") for k in read_csv(trainer)[0])
    assert_run_intact(trainer, tmp_path, monitor)


def test_a_layer_whose_width_changes_disables_that_layer_only(tmp_path):
    """From step 3 the parameter-free final norm is also run on half the stream: its taps see
    a width they cannot fold. One warning; the other norms are read to the end."""
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    with recorded_warnings() as records:
        trainer = fit(
            tmp_path, NarrowingLM(narrow_at=3), [monitor, checkpointing(tmp_path)], steps=8,
            enable_checkpointing=True,
        )  # fmt: skip
    failures = normscope_failures(records)
    assert len(failures) == 1, failures
    assert "'model.ln_f'" in failures[0] and "width 16" in failures[0]
    rows = read_csv(trainer)
    # windows 1, 3, 5, 7 (step 0's forward is residual discovery's)
    assert logged_steps(rows, "dd/model.h.1.ln_2/gamma_alignment") == [2, 4, 6, 8]
    assert logged_steps(rows, "dd/model.ln_f/gamma_alignment") == [2]  # before the change
    disabled = {
        int(r["step"]): float(r["dd/reads_disabled"]) for r in rows if r.get("dd/reads_disabled")
    }
    assert disabled == {2: 0.0, 4: 1.0, 6: 1.0, 8: 1.0}
    assert "disabled after a failure: model.ln_f" in format_read_line(monitor.last_report)
    assert not monitor.disabled
    assert_run_intact(trainer, tmp_path, monitor)


def test_sparse_input_disables_only_that_layers_outlier_tap(tmp_path):
    """A Linear fed a sparse COO tensor: its input cannot be folded, so its outlier read is
    off (one warning); its weight read and every other layer go on."""
    torch.manual_seed(0)
    layers = ["model.encoder", "model.h.0.fc", "model.h.0.proj", "model.h.1.fc", "model.h.1.proj"]
    monitor = SignMagnitudeMonitor(every_n_steps=2, layers=layers, verbose=False, alerts=())
    with recorded_warnings() as records:
        trainer = fit(
            tmp_path, LitSparse(), [monitor, checkpointing(tmp_path)], steps=4,
            loader=sparse_loader(), enable_checkpointing=True,
        )  # fmt: skip
    failures = normscope_failures(records)
    assert len(failures) == 1 and "'model.encoder'" in failures[0], failures
    assert "outlier tap" in failures[0]
    rows = read_csv(trainer)
    assert logged_steps(rows, "sm/model.encoder/max_leverage") == []
    assert logged_steps(rows, "sm/model.encoder/sign_alignment") == [1, 2, 4]
    assert logged_steps(rows, "sm/model.h.0.fc/max_leverage") == [1, 2, 4]
    assert {r["sm/reads_disabled"] for r in rows if r.get("sm/reads_disabled")} == {"1.0"}
    assert not monitor.disabled
    assert_run_intact(trainer, tmp_path, monitor)


def test_a_probe_failing_mid_perturbation_restores_the_weight_and_costs_that_layer_only():
    """The probe forward raises while a perturbed weight is in place: that weight is restored
    bit-exactly, that layer's probe is off (one warning), the other probe is read."""
    torch.manual_seed(0)
    model = TinyLM(norm="rmsnorm")
    x = torch.randint(0, 32, (4, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tracker = SignMagnitudeTracker(
        model, SignMagnitudeConfig(probe_layers=["h.0.mlp.2", "h.1.mlp.2"])
    )
    tracker.attach()
    calls = []

    def forward():
        calls.append(1)
        if len(calls) == 3:  # clean pass, flip, then inside h.0.mlp.2's magnitude run
            raise RuntimeError("injected probe failure")
        return model(x)

    with recorded_warnings() as records:
        report = tracker.read(0, probe=forward)
    failures = normscope_failures(records)
    assert len(failures) == 1 and "'h.0.mlp.2'" in failures[0], failures
    assert set(report.probes) == {"h.1.mlp.2"}
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert report.as_dict()["sm/reads_disabled"] == 1.0
    again = tracker.read(1, probe=lambda: model(x))  # the failed layer stays off
    assert set(again.probes) == {"h.1.mlp.2"}
    tracker.detach()


class StatefulRule:
    """A user rule whose state cannot be saved (its backend is gone)."""

    name = "stateful"

    def evaluate(self, metrics, step):
        return []

    def state_dict(self):
        raise RuntimeError("rule state store unavailable")

    def load_state_dict(self, state):
        return None


def test_failing_state_dict_keeps_the_checkpoint(tmp_path):
    """The monitor's state cannot be built: the checkpoint is still written (without it),
    with one warning, and loads with weights_only=True; the monitor keeps reading."""
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, rules=[StatefulRule()], verbose=False)
    with recorded_warnings() as records:
        trainer = fit(
            tmp_path, LitTiny(), [monitor, checkpointing(tmp_path)], steps=4,
            enable_checkpointing=True,
        )  # fmt: skip
    failures = normscope_failures(records)
    assert len(failures) == 1 and "state_dict failed" in failures[0], failures
    assert not monitor.disabled and monitor.reads == 2  # windows 1 and 3
    assert trainer.global_step == 4
    for step in (2, 4):
        ckpt = torch.load(tmp_path / "ckpt" / f"epoch=0-step={step}.ckpt", weights_only=True)
        assert ckpt["global_step"] == step and monitor.state_key not in ckpt["callbacks"]
    assert_loss_logged_every_step(trainer)
