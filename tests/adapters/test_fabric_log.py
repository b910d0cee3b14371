"""``watch_fabric(fabric, model, log=fn)``: ``log=`` adds to the Fabric's loggers (it used to be
dropped), and with neither one warning says the reads stay in ``monitor.history``."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch

from normscope.adapters.fabric import watch_fabric
from tests.support import loops

STEPS = 6


def _train(fabric, model, optimizer, monitor) -> None:
    batch = next(iter(loops.loader()))  # one fixed batch, every step
    for _ in range(STEPS):
        with monitor.step(batch):
            loss = model(**batch).loss
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    monitor.close()


def _setup(loggers=()):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, loggers=list(loggers))
    bare = loops.gpt2(cancel=False)
    model, optimizer = fabric.setup(bare, torch.optim.SGD(bare.parameters(), lr=loops.LR))
    return fabric, model, optimizer


@pytest.mark.filterwarnings("ignore:.*LeafSpec")
def test_log_adds_to_the_fabric_loggers(tmp_path):
    """A CSVLogger on the Fabric and ``log=fn``: both get every read, at the same steps."""
    from lightning.fabric.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="fabric")
    fabric, model, optimizer = _setup([logger])
    seen: list[tuple[int, dict[str, float]]] = []
    options = loops.ENGINE_ARGS | {"every_n_steps": 2, "config": loops.dd_config()}
    monitor = watch_fabric(fabric, model, log=lambda m, step: seen.append((step, m)), **options)
    _train(fabric, model, optimizer, monitor)
    logger.finalize("success")
    steps = [s for s, m in seen if "dd/sigma_min_ratio_min" in m]
    assert steps and steps == [s for s, _ in monitor.history]
    with open(tmp_path / "fabric" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("dd/sigma_min_ratio_min")]
    assert [int(r["step"]) for r in rows] == steps


@pytest.mark.filterwarnings("ignore:.*LeafSpec")
def test_log_alone_is_kept_without_fabric_loggers():
    fabric, model, optimizer = _setup()
    seen: list[int] = []
    options = loops.ENGINE_ARGS | {"every_n_steps": 2, "config": loops.dd_config()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "logs nowhere" warning
        warnings.filterwarnings("ignore", message=".*LeafSpec")
        monitor = watch_fabric(fabric, model, log=lambda m, step: seen.append(step), **options)
    _train(fabric, model, optimizer, monitor)
    assert seen and seen == [s for s, _ in monitor.history]


@pytest.mark.filterwarnings("ignore:.*LeafSpec")
def test_no_logger_and_no_log_warns_once_that_reads_stay_in_history():
    fabric, model, optimizer = _setup()
    options = loops.ENGINE_ARGS | {"every_n_steps": 2, "config": loops.dd_config()}
    with pytest.warns(UserWarning, match=r"logs nowhere.*monitor\.history") as record:
        monitor = watch_fabric(fabric, model, **options)
        _train(fabric, model, optimizer, monitor)
    assert sum("logs nowhere" in str(w.message) for w in record) == 1
    assert monitor.history  # the reads are still kept
