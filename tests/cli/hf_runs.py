"""Real Hugging Face ``Trainer`` runs with normscope's ``DeadDirectionCallback``, logged through
the Trainer's own W&B (offline) or TensorBoard integration, for the run-reading tests.

The model and data are ``tests/integrations/loops.py``'s: the tiny GPT-2 (built from a config)
whose block-1 MLP branch cancels part of the stream, so the callback alerts at its first read,
on one fixed batch. ``logging_steps=3`` puts the Trainer's own loss rows between the reads:
W&B's ``_step`` then counts rows (0, 1, 2, ...) and only ``train/global_step`` holds the
Trainer's step.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from normscope.integrations.transformers import DeadDirectionCallback
from tests.integrations import loops

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
    (``"wandb"``, offline, or ``"tensorboard"``) under ``tmp``."""
    callback = DeadDirectionCallback(
        every_n_steps=EVERY, max_rows_per_step=None, overhead_warn=None, alerts=("log",)
    )
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
    old = os.environ.get("WANDB_DIR")
    os.environ["WANDB_DIR"] = str(tmp)  # the W&B integration's run folder: tmp/wandb/
    try:
        trainer = transformers.Trainer(
            model=loops.gpt2(), args=args, train_dataset=loops.Samples(), callbacks=[callback]
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")  # the alert's warning, HF's hints
            trainer.train()
        if report_to == "wandb":
            import wandb

            wandb.finish()
    finally:
        if old is None:
            os.environ.pop("WANDB_DIR", None)
        else:
            os.environ["WANDB_DIR"] = old
    folder = tmp / "wandb" if report_to == "wandb" else tmp / "hf"
    return HFRun(
        folder, {step: logs for step, logs in callback.history}, callback.monitor.alerts_fired
    )
