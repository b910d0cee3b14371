"""A Fabric DDP loop on 2 CPU processes (gloo), run as a script by ``test_fabric_ddp.py``:
Fabric's launcher re-runs this module for rank 1. The monitor is a Fabric callback
(``Fabric(callbacks=[monitor])``), the hooks called with the Lightning signatures; gradient
accumulation of 2 micro-batches per optimiser step (the optimiser-step hook must count steps,
not batches). Learning rate 0 (the weights stay those of the seed), rows subsampling off, each
rank fed its own half of the samples: every read must equal one process's read of both halves.
Each rank writes its reads to ``<out>/rank<r>.json``.

    python -m tests.support.fabric_ddp OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.support.loops import MONITOR_ARGS, Samples, gpt2

WORLD = 2
ACCUMULATE = 2
STEPS = 4  # reads after steps 2 and 4 (every_n_steps=2; step 0 is residual discovery's)


def micro_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s ``ACCUMULATE`` micro-batches (2 samples each) of every step: the
    samples ``rank, rank + 2, ...`` of :class:`Samples` (the last two have padding)."""
    data = Samples()
    idx = list(range(rank, len(data), WORLD))
    out = []
    for k in range(ACCUMULATE):
        part = idx[2 * k : 2 * k + 2]
        out.append({key: torch.stack([data[i][key] for i in part]) for key in data[0]})
    return out


def main(out: Path) -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import CSVLogger

    from normscope import DeadDirectionMonitor

    monitor = DeadDirectionMonitor(**MONITOR_ARGS)
    fabric = Fabric(
        accelerator="cpu",
        devices=WORLD,
        strategy="ddp",
        callbacks=[monitor],
        loggers=CSVLogger(out, name="fabric_ddp"),
    )
    fabric.launch()
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    batches = micro_batches(fabric.global_rank)
    i = 0
    for _ in range(STEPS):
        for k, batch in enumerate(batches):
            fabric.call("on_train_batch_start", fabric, model, batch, i)
            with fabric.no_backward_sync(model, enabled=k < ACCUMULATE - 1):
                fabric.backward(model(**batch).loss / ACCUMULATE)
            if k == ACCUMULATE - 1:
                optimizer.step()
                optimizer.zero_grad()
            fabric.call("on_train_batch_end", fabric, model, None, batch, i)
            i += 1
    fabric.call("on_fit_end", fabric, model)
    fabric.logger.finalize("success")
    loop = monitor._fabric
    result = {
        "disabled": monitor.disabled,
        "failure": monitor.failure,
        "reads": monitor.reads,
        "global_step": loop.steps.count,
        "last": {k: repr(v) for k, v in monitor.last_report.as_dict().items()},
        "first": {k: repr(v) for k, v in monitor.history[0][1].items()},  # run-level keys
        "alerts": [a.step for a in monitor.alerts_fired],
    }
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
