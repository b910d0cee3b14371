"""Real Hugging Face ``Trainer`` runs with normscope's ``DeadDirectionCallback``, logged through
the Trainer's own W&B (offline) or TensorBoard integration, for the run-reading tests.

The model and data are ``tests/support/loops.py``'s: the tiny GPT-2 (built from a config)
whose block-1 MLP branch cancels part of the stream, so the callback alerts at its first read,
on one fixed batch. ``logging_steps=3`` puts the Trainer's own loss rows between the reads:
W&B's ``_step`` then counts rows (0, 1, 2, ...) and only ``train/global_step`` holds the
Trainer's step.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from normscope import DeadDirectionConfig
from normscope.adapters.transformers import DeadDirectionCallback
from normscope.runs import read_run
from tests.support import loops

STEPS, EVERY = 24, 4


@dataclass
class HFRun:
    """Where a run was written (``folder``: what ``normscope report`` is given) and what the
    callback read: ``{global step: logged keys}`` and the alerts it fired."""

    folder: Path
    reads: dict[int, dict[str, float]]
    alerts: list


def hf_run(tmp: Path, report_to: str) -> HFRun:
    """Train for ``STEPS`` steps with a read every ``EVERY``, logging to ``report_to``
    (``"wandb"``, offline, or ``"tensorboard"``) under ``tmp`` (a W&B run goes where the
    process's first W&B run went: ``HFRun.folder`` says where)."""
    callback = DeadDirectionCallback(
        DeadDirectionConfig(rows_per_read="all"), every_n_steps=EVERY, overhead_warn=None,
        alerts=("log",),
    )  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "hf"),
        max_steps=STEPS,
        per_device_train_batch_size=loops.BATCH,
        learning_rate=loops.LR,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=3,
        save_strategy="no",
        report_to=[report_to],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=loops.gpt2(), args=args, train_dataset=loops.Samples(), callbacks=[callback]
    )
    callback.bind(trainer)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")  # the alert's warning, HF's hints
        trainer.train()
    folder = tmp / "hf"  # TensorBoard: output_dir/runs/<date>/events...
    if report_to == "wandb":
        import wandb

        # W&B's settings (its dir) are fixed by the first run of the process: ask the run
        assert wandb.run is not None, "the Trainer's W&B integration left no run open"
        folder = Path(wandb.run.dir).parent
        wandb.finish()
        _wait_for_rows(folder, len(callback.history))
    return HFRun(
        folder, {step: logs for step, logs in callback.history}, callback.monitor.alerts_fired
    )


def _wait_for_rows(folder: Path, reads: int, timeout_s: float = 30.0) -> None:
    """W&B's ``finish()`` can return before its core process has flushed the last rows to the
    offline file (tests/test_runs.py says the same): wait until every read is there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = read_run(folder).history
        if sum("dd/sigma_min_ratio_min" in r for r in rows) >= reads:
            return
        time.sleep(0.25)
