"""Real fits and what they logged: the one ``fit`` of the suite, the CSV reader, the in-memory
logger, warning capture, and the wait for an offline W&B run's summary.

A test builds its monitor, fits the tiny LM of ``tiny_models.py`` and reads the log back::

    trainer = fit(tmp_path, LitTiny(), DeadDirectionMonitor(every_n_steps=4), steps=8)
    reads = rows_with(read_csv(trainer), "dd/sigma_min_ratio_min")
"""

from __future__ import annotations

import csv
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger, Logger
from torch import nn
from torch.utils.data import DataLoader

from normscope.runs import read_wandb_run
from tests.support.tiny_models import cpu_trainer, token_loader


def fit(
    root: Path | None,
    module: L.LightningModule,
    callbacks: L.Callback | Sequence[L.Callback] = (),
    *,
    steps: int = 8,
    loader: DataLoader | None = None,
    logger: Any = None,
    name: str = "run",
    ckpt_path: str | None = None,
    **trainer_kw: Any,
) -> L.Trainer:
    """Fit ``module`` on the CPU for ``steps`` optimiser steps and return the trainer.

    Args:
        root: where the default ``CSVLogger(root, name=name)`` writes (every step); ``None``
            with ``logger=False`` for a fit that logs nothing.
        callbacks: a callback (the monitor) or several.
        loader: the training batches; ``token_loader()`` by default.
        logger: any Lightning logger (or a list of them) instead of the CSV one; ``False``: none.
        ckpt_path: resume from this checkpoint (``Trainer.fit(ckpt_path=...)``).
        trainer_kw: any other ``L.Trainer`` argument (``precision=``,
            ``accumulate_grad_batches=``, ``enable_checkpointing=True``, ...).

    No progress bar, model summary, checkpointing or sanity check unless ``trainer_kw`` asks.
    """
    settings: dict[str, Any] = {
        "logger": logger if logger is not None else CSVLogger(root, name=name),
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        **trainer_kw,
    }
    listed = [callbacks] if isinstance(callbacks, L.Callback) else list(callbacks)
    trainer = cpu_trainer(steps, listed, **settings)
    extra = {"ckpt_path": ckpt_path} if ckpt_path is not None else {}
    trainer.fit(module, train_dataloaders=loader or token_loader(), **extra)
    return trainer


def read_csv(where: L.Trainer | str | Path) -> list[dict[str, str]]:
    """The rows of a ``CSVLogger``'s ``metrics.csv``: the trainer's logger's, or the one file in
    or under the folder ``where``."""
    folder = Path(where.logger.log_dir if isinstance(where, L.Trainer) else where)
    if (folder / "metrics.csv").exists():
        path = folder / "metrics.csv"
    else:
        (path,) = folder.rglob("metrics.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def rows_with(rows: list[dict[str, str]], key: str) -> list[dict[str, str]]:
    """The CSV rows in which ``key`` was logged."""
    return [r for r in rows if r.get(key) not in (None, "")]


def logged_steps(rows: list[dict[str, str]], key: str) -> list[int]:
    """The steps at which ``key`` was logged."""
    return [int(r["step"]) for r in rows_with(rows, key)]


def assert_loss_logged_every_step(trainer: L.Trainer, first: int = 0) -> None:
    """The run's own metrics are complete: ``train/loss`` for every optimiser step."""
    steps = logged_steps(read_csv(trainer), "train/loss")
    assert steps == list(range(first, trainer.global_step)), steps


class MemoryLogger(Logger):
    """A Lightning logger that keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.calls.append((int(step or 0), {k: float(v) for k, v in metrics.items()}))

    def calls_with(self, key: str) -> list[tuple[int, dict[str, float]]]:
        """The calls that logged ``key`` (a read's run-level key picks out the reads)."""
        return [(s, m) for s, m in self.calls if key in m]


@contextmanager
def recorded_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning raised inside the block, repeats included."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        yield records


def normscope_failures(records: list[warnings.WarningMessage]) -> list[str]:
    """normscope's own failure warnings (every one starts with ``normscope:``; alerts start with
    ``normscope alert:`` and are not failures)."""
    return [str(r.message) for r in records if str(r.message).startswith("normscope:")]


def normscope_hooks(model: nn.Module) -> int:
    """How many of the model's forward and forward-pre hooks are normscope's."""
    return sum(
        "normscope" in getattr(h, "__module__", "")
        for m in model.modules()
        for hooks in (m._forward_hooks, m._forward_pre_hooks)
        for h in hooks.values()
    )


def wait_for_summary(folder: Path, timeout_s: float = 30.0) -> None:
    """W&B 0.31's ``finish()`` can return before its core process has written the last
    history rows and the summary to the offline file (seen under load): wait for the summary."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if read_wandb_run(folder).summary.get("dd/sigma_min_ratio_min") is not None:
            time.sleep(0.5)  # and whatever follows it in the same flush
            return
        time.sleep(0.25)
