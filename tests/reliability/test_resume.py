"""A fit killed inside a window and resumed with ``Trainer.fit(ckpt_path=...)``: no crash, the
resumed log's steps only go forward (no step logged twice), the previous read's signs come
back from the checkpoint, so ``sign_churn`` continues the
first run's curves. The kill is an exception raised by a callback at a chosen micro-batch; the
checkpoints are Lightning's own (``ModelCheckpoint(every_n_train_steps)``, and
``OnExceptionCheckpoint``, which saves inside the gradient-accumulation window)."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from normscope import DeadDirectionMonitor, SignMagnitudeMonitor
from tests.support.fits import fit, logged_steps, read_csv, rows_with
from tests.support.tiny_models import LitTiny, token_loader

ACCUMULATE = 3  # micro-batches per optimiser step
KILL_AT = 10  # micro-batch 10 = the 2nd of step 3's three: step 3 is a sampled window
STEPS = 6


class Killed(Exception):
    pass


class Killer(L.Callback):
    """Stands for a pre-empted node: raises at one micro-batch."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            raise Killed(f"killed at micro-batch {batch_idx}")


def kill_and_resume(tmp_path: Path, make_monitor, ckpt: str, norm: str = "layernorm"):
    """Run 1 (killed at KILL_AT) and run 2 (resumed from ``ckpt``); both monitors and trainers."""
    torch.manual_seed(0)
    first = make_monitor()
    periodic = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(Killed):
        fit(
            tmp_path, LitTiny(norm=norm), [first, Killer(KILL_AT), periodic,
            OnExceptionCheckpoint(tmp_path / "ckpt")], steps=STEPS, name="killed",
            accumulate_grad_batches=ACCUMULATE, enable_checkpointing=True,
        )  # fmt: skip
    path = (
        tmp_path / "ckpt" / ("on_exception.ckpt" if ckpt == "exception" else "epoch=0-step=2.ckpt")
    )
    saved = torch.load(path, weights_only=True)  # what the resumed fit loads, too
    second = make_monitor()
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=2, save_top_k=-1)
    trainer = fit(
        tmp_path, LitTiny(norm=norm), [second, again], steps=STEPS, name="resumed",
        ckpt_path=str(path), accumulate_grad_batches=ACCUMULATE, enable_checkpointing=True,
    )  # fmt: skip
    return first, second, saved, trainer


@pytest.mark.parametrize("ckpt", ["exception", "periodic"])
def test_dead_direction_monitor_resumes_a_run_killed_mid_window(tmp_path, ckpt):
    first, second, saved, trainer = kill_and_resume(
        tmp_path,
        lambda: DeadDirectionMonitor(every_n_steps=2, verbose=False, rows_per_read="all"),
        ckpt,
    )
    start = saved["global_step"]
    assert start == (3 if ckpt == "exception" else 2)
    assert trainer.global_step == STEPS
    killed_rows = read_csv(tmp_path / "killed" / "version_0")
    rows = read_csv(trainer)
    # killed run: read 2 (the baseline window is step 1: step 0's forward is residual
    # discovery's); resumed: discovery again on its first batch, so a resume at step 3 (a
    # sampled step) reads step 4 in its place (logged 5), one at step 2 reads step 3 (logged
    # 4); then 6 -- forward only, nothing logged twice
    assert logged_steps(killed_rows, "dd/sigma_min_ratio_min") == [2]
    steps = logged_steps(rows, "dd/sigma_min_ratio_min")
    assert steps == ([5, 6] if ckpt == "exception" else [4, 6])
    assert logged_steps(rows, "train/loss") == list(range(start, STEPS))
    state = saved["callbacks"][second.state_key]
    assert second.reads == state["reads"] + len(steps)
    # no baseline for Delta_gamma: it stands on each window with its own control, so the
    # first read after the restart already has it; the gain drift keeps the first run's gains
    # at its first batch (not the resumed run's), the RMS growth the last read's RMS
    saved = state["family"]["gain_baselines"]
    assert set(saved) == set(first.tracker.gain_baselines) == set(second.tracker.gain_baselines)
    for name, gains in saved.items():
        assert torch.equal(second.tracker.gain_baselines[name].cpu().double(), gains.double())
        assert torch.equal(first.tracker.gain_baselines[name].cpu().double(), gains.double())
    for r in rows_with(rows, "dd/sigma_min_ratio_min"):
        deltas = [k for k in r if k.endswith("/delta_gamma") and r[k] != ""]
        assert deltas
        for key in deltas:
            assert math.isfinite(float(r[key])), key
            assert math.isfinite(float(r[key.replace("/delta_gamma", "/delta_gamma_control")]))
    # the killed window's rows were not saved (8 d^2 bytes a tap); the resumed step 3's
    # micro-batches (Lightning resumes at micro-batch KILL_AT) are discovery's, and the whole
    # of step 4 is read in its place
    n_rows = [float(r["dd/model.ln_f/n_rows"]) for r in rows_with(rows, "dd/model.ln_f/n_rows")]
    assert n_rows[0] == 768.0
    reads = rows_with(rows, "dd/sigma_min_ratio_min")
    assert all(math.isfinite(float(r["dd/sigma_min_ratio_min"])) for r in reads)


def test_sign_magnitude_monitor_resumes_a_run_killed_mid_window(tmp_path):
    """The previous read's signs come back: the first resumed read has a finite sign churn
    (a fresh monitor has none), measured against the checkpoint's signs."""
    first, second, saved, trainer = kill_and_resume(
        tmp_path,
        lambda: SignMagnitudeMonitor(
            every_n_steps=2, probe_layers=["model.h.1.mlp.2"], verbose=False, alerts=()
        ),
        "exception",
        norm="rmsnorm",
    )
    state = saved["callbacks"][second.state_key]
    signs = state["family"]["prev_signs"]
    assert signs and all(t.dtype == torch.int8 for t in signs.values())
    rows = read_csv(trainer)
    steps = logged_steps(rows, "sm/sign_churn_mean")
    assert steps == [4, 6]
    churn = float(rows_with(rows, "sm/sign_churn_mean")[0]["sm/sign_churn_mean"])
    assert 0 < churn < 0.5
    assert second.reads == state["reads"] + 2
    # the churn rule's history continues too (first run: reads 1 and 2; resumed: 2 more)
    spike = next(r for r in second.rules if type(r).__name__ == "SignChurnSpikeRule")
    assert len(spike.history) == len(state["rules"]["sign_churn_spike"]["history"]) + 2


def test_resume_from_a_checkpoint_inside_a_deferred_window(tmp_path):
    """8 rows a step (< 2 d): windows stay open over several steps. A checkpoint saved inside
    one (after step 1: the window opened there, step 0 being residual discovery's) and a kill
    at step 6, inside the window opened at step 5: the resumed run opens its next window afresh, reads
    forward only, NaN with a reason, and never alerts."""
    torch.manual_seed(0)
    loader = token_loader(n=64, t=8, batch_size=1)
    make = lambda: DeadDirectionMonitor(every_n_steps=2, alerts=(), verbose=False)  # noqa: E731
    first = make()
    ckpts = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    with pytest.raises(Killed):
        fit(
            tmp_path, LitTiny(), [first, Killer(6), ckpts], steps=8, loader=loader,
            name="killed", enable_checkpointing=True,
        )  # fmt: skip
    assert first._deferred == 1 and first.reads == 1  # killed inside the window opened at step 5
    second = make()
    trainer = fit(
        tmp_path, LitTiny(), [second], steps=8, loader=loader, name="resumed",
        ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"),
    )  # fmt: skip
    rows = read_csv(trainer)
    steps = logged_steps(rows, "dd/model.ln_f/n_rows")
    assert steps == sorted(set(steps)) and steps and min(steps) > 2
    assert trainer.global_step == 8 and second.alerts_fired == []
    assert {n.kernel.reason for n in second.last_report.norms.values()} == {"insufficient_rows"}
