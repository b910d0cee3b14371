"""Real distributed fits on 2 CPU processes (gloo), run as a script by ``tests/scaleout``:
Lightning re-runs this file for rank 1 (``LOCAL_RANK=1``), and every fit of the script runs in
the same two processes (one launch: the start-up is the slow part). Each rank writes what it saw
to ``<out>/<fit>_rank<r>.json``.

Fit ``exact``: learning rate 0, every rank fed a disjoint shard of a fixed dict dataset by
Lightning's ``DistributedSampler`` (``shuffle=False``), rows subsampling off; the data, the
modules and the read schedule are in ``shards.py``. Rank 1's batch of the first window is all
padding (``attention_mask`` zeros): that rank folds no row. Rank 0 saves the weights, so that
the test can compute the single-process reference (``expected.py``) on the same rows.

Fit ``stop`` (DDP): a cancelling MLP branch switched on at step 3 on rank 1 only,
``stop_on_alert``, a CSV and a W&B logger.

Fit ``tiers``: ``exact`` at ``spectral_every=2`` (the cheap read's window folds diagonals).

Fit ``fsdp``: FSDP2 through Lightning's ``ModelParallelStrategy``; the model is built *and*
sharded with ``fully_shard`` in ``configure_model`` (so the monitor finds its layers at
``on_fit_start``); learning rate 0 and the dict data of ``exact``. Rank 0 saves the full weights.

    python -m tests.support.distributed_fits OUT_DIR
"""

from __future__ import annotations

import json
import math
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.strategies import ModelParallelStrategy

from normscope import (
    DeadDirectionMonitor,
    DeadDirectionReport,
    DeadDirectionTracker,
    SignMagnitudeMonitor,
)
from normscope.alerts import CallableRule
from tests.support.shards import (
    EXACT_EVERY,
    EXACT_MAX_STEPS,
    EXACT_STOP,
    WORLD,
    LitDict,
    LitSources,
)
from tests.support.tiny_models import LitTiny, TinyLM, token_loader


def _discovery_forward(module: L.LightningModule, batch: Any) -> Any:
    """The separate discovery forward (the ``sources=`` label field is no model input)."""
    from normscope.taps.hooks import call_model

    return call_model(module, batch, ("source",))


# These fits' scenarios are built around step 0 (a padding-only shard at step 0, failures at
# the windows 0, 1, 3, ...): they keep the separate discovery forward, so step 0 is read as
# before. Discovery from the training forward under DDP (each rank on its own first batch) is
# tested with Fabric (tests/scaleout/test_fabric_ddp.py).
SEPARATE_DISCOVERY: dict[str, Any] = {"example_forward": _discovery_forward}


class CancelOnRank1(LitTiny):
    """From step 3, on rank 1 only, block 1 cancels 95% of its input stream: ``x + f(x) - 0.95 x``
    (``<x, f(x)> < 0``). A forward hook, not ``TinyLM.set_cancel``: that writes a buffer, and DDP
    broadcasts rank 0's buffers before every forward, which would undo a one-rank change."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            self.model.h[1].register_forward_hook(lambda m, args, out: out - 0.95 * args[0])


def recorder(reads: list[dict[str, Any]]) -> CallableRule:
    """A rule that fires nothing and keeps every read's metrics (rules see each read)."""

    def keep(metrics, step):
        reads.append({"step": step, "metrics": {k: _num(v) for k, v in metrics.items()}})

    return CallableRule("record", keep)


def rank_one_only(at_step: int) -> CallableRule:
    """A rule that fires on rank 1 alone: a stop decision only one rank takes."""

    def fire(metrics, step):
        if torch.distributed.get_rank() == 1 and step == at_step:
            return "rank 1 alone asks to stop"
        return None

    return CallableRule("rank_one_only", fire)


def _num(v: float) -> float | str:
    return v if math.isfinite(v) else repr(v)


def trainer(monitor: DeadDirectionMonitor, steps: int, loggers: list, **kw: Any) -> L.Trainer:
    return L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=WORLD,
        max_steps=steps,
        logger=loggers,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        **kw,
    )


def fit_exact(out: Path, async_reads: bool = False) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    reads: list[dict[str, Any]] = []
    delivered: list[dict[str, Any]] = []
    solves: list[int] = []  # jobs this rank solved at each read (its share of a split read)
    monitor = DeadDirectionMonitor(
        **SEPARATE_DISCOVERY,
        every_n_steps=EXACT_EVERY,
        rows_per_read="all",
        rules=[
            recorder(reads),
            rank_one_only(at_step=EXACT_STOP),
            CallableRule("solves", lambda m, step: solves.append(monitor.tracker.last_solves)),
        ],
        alerts=(lambda a: delivered.append(a.as_dict()),),
        stop_on_alert=True,
        verbose=False,
        async_reads=async_reads,
    )
    module = LitDict(lr=0.0)
    t = trainer(
        monitor, EXACT_MAX_STEPS, [CSVLogger(out, name="exact")], use_distributed_sampler=False
    )
    t.fit(module)
    if t.is_global_zero:
        torch.save(module.state_dict(), out / f"exact{'_async' if async_reads else ''}_weights.pt")
    return {
        "global_step": t.global_step,
        "reads": reads,
        "solves": solves,
        "jobs": _jobs(monitor.tracker),
        "fired": [a.as_dict() for a in monitor.alerts_fired],
        "delivered": delivered,
        "log_dir": t.logger.log_dir,
        "failure": monitor.failure,
    }


def fit_tiers(out: Path) -> dict[str, Any]:
    """``exact``'s data and schedule at ``spectral_every=2``: the reads of steps 1 and 6 are
    spectral, step 3's cheap (its window folded the diagonals only); no stop."""
    L.seed_everything(0, verbose=False)
    reads: list[dict[str, Any]] = []

    def keep(metrics, step):
        full = monitor.tracker.fold_full  # the mode the read's window folded in, this rank
        metrics = {k: _num(v) for k, v in metrics.items()}
        reads.append({"step": step, "full": full, "metrics": metrics})

    monitor = DeadDirectionMonitor(
        **SEPARATE_DISCOVERY,
        every_n_steps=EXACT_EVERY,
        rows_per_read="all",
        spectral_every=2,
        rules=[CallableRule("record", keep, tier="cheap")],
        verbose=False,
    )
    module = LitDict(lr=0.0)
    t = trainer(monitor, EXACT_STOP, [], use_distributed_sampler=False)
    t.fit(module)
    if t.is_global_zero:
        torch.save(module.state_dict(), out / "tiers_weights.pt")
    return {"reads": reads, "failure": monitor.failure}


def _jobs(tracker: DeadDirectionTracker) -> int:
    """The jobs of one whole read: norm layers, the residual points no norm reads (a point a
    norm reads is read in that norm's job; no sources here), the one stream job and the one
    attention-logit job."""
    inputs = {tap_in.key for tap_in, _ in tracker.norm_taps.values()}
    alone = sum(1 for tap in tracker.point_taps if tap.key not in inputs)
    attention = 1 if tracker.attention_on else 0
    return len(tracker.norms) + alone + 1 + attention  # + the stream and attention jobs


def fit_exact_async(out: Path) -> dict[str, Any]:
    return fit_exact(out, async_reads=True)


def fit_stop(out: Path) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    reads: list[dict[str, Any]] = []
    delivered: list[dict[str, Any]] = []
    monitor = DeadDirectionMonitor(
        **SEPARATE_DISCOVERY,
        every_n_steps=2,
        rows_per_read="all",  # N/d = 32 below: every row of both ranks
        # Half the rows collapse: the pooled step ratio cannot fall under about 1/sqrt(2)
        # (S = (S_0 + S_1) / 2; read 0.70, interval top 0.88 from N/d = 32), above the
        # default floor 0.6; a floor of 0.9 catches it (healthy reads 0.93-0.95, tops >= 1.16).
        tolerance=0.1,
        stop_on_alert=True,
        rules=[recorder(reads)],
        alerts=("wandb", lambda a: delivered.append(a.as_dict())),
        verbose=False,
    )
    wandb_logger = WandbLogger(project="normscope-ddp", save_dir=str(out / "wandb_stop"))
    t = trainer(monitor, 12, [CSVLogger(out, name="stop"), wandb_logger])
    t.fit(CancelOnRank1(), train_dataloaders=token_loader(n=512))
    if t.is_global_zero:
        wandb_logger.experiment.finish()
    return {
        "global_step": t.global_step,
        "reads": reads,
        "fired": [a.as_dict() for a in monitor.alerts_fired],
        "delivered": delivered,
        "log_dir": t.loggers[0].log_dir,
        "failure": monitor.failure,
    }


class LitSharded(LitDict):
    """``LitDict`` built in ``configure_model`` and sharded there with FSDP2, per block and at
    the root, as Lightning's ``ModelParallelStrategy`` expects."""

    def __init__(self, lr: float = 0.0) -> None:
        super().__init__(lr=lr)
        self.model = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.model is not None:
            return
        torch.manual_seed(0)
        self.model = TinyLM()
        with torch.no_grad():  # distinct gammas: a read of one shard would not pass for the whole
            for m in self.model.modules():
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.copy_(0.5 + torch.rand(m.weight.shape))
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr)


def fit_fsdp(out: Path) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    reads: list[dict[str, Any]] = []
    monitor = DeadDirectionMonitor(
        **SEPARATE_DISCOVERY,
        every_n_steps=EXACT_EVERY,
        rows_per_read="all",
        rules=[recorder(reads)],
        verbose=False,
    )
    module = LitSharded()
    t = L.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        accelerator="cpu",
        devices=WORLD,
        max_steps=EXACT_EVERY * 2,
        logger=False,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    t.fit(module)
    ln_f = module.model.ln_f.weight
    full = {  # full_tensor() is a collective: every rank gathers
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in module.model.state_dict().items()
    }
    if t.is_global_zero:
        torch.save(full, out / "fsdp_weights.pt")
    return {
        "global_step": t.global_step,
        "reads": reads,
        "ln_f_weight_type": type(ln_f).__name__,
        "ln_f_local_shape": list(ln_f.to_local().shape),
        "failure": monitor.failure,
    }


class FailOnRank1(LitTiny):
    """Breaks the monitor on rank 1 alone, from step ``at``: ``what`` names the method that
    raises there (``snapshot_gammas``: at the window's first batch, before any collective;
    ``min_rows``: at the window's end, before the handshake; ``as_dict``: the report's, after
    the handshake and the reduce, before the stop decision). Each rank is its own process, so
    patching a class on rank 1 changes nothing on rank 0."""

    def __init__(self, monitor: DeadDirectionMonitor, what: str, at: int) -> None:
        super().__init__()
        self.monitor, self.what, self.at = monitor, what, at

    def on_train_batch_start(self, batch, batch_idx):
        # The module's hook runs after the callbacks': the failure hits from step `at` + 1.
        if self.global_rank == 1 and self.global_step == self.at - 1:

            def broken(*args, **kwargs):
                raise RuntimeError(f"injected on rank 1: {self.what}")

            if self.what == "as_dict":
                DeadDirectionReport.as_dict = broken
            elif self.what == "result":  # async_reads: the worker's result, before the gather
                self.monitor.in_flight.worker.result = broken
            else:
                setattr(self.monitor.tracker, self.what, broken)


FAIL_CASES = ("snapshot_gammas", "min_rows", "as_dict")
FAIL_STEPS = 8


def _fail_fits(out: Path, cases: tuple[str, ...], name: str, **monitor_kw: Any) -> dict[str, Any]:
    """One fit per case, rank 1 failing as the case says; what each rank ended with."""
    results = {}
    for what in cases:
        L.seed_everything(0, verbose=False)
        monitor = DeadDirectionMonitor(
            every_n_steps=2, stop_on_alert=True, verbose=False, **SEPARATE_DISCOVERY, **monitor_kw
        )
        t = trainer(monitor, FAIL_STEPS, [CSVLogger(out, name=f"{name}_{what}")])
        original = DeadDirectionReport.as_dict
        try:
            t.fit(FailOnRank1(monitor, what, at=3), train_dataloaders=token_loader(n=512))
        finally:
            DeadDirectionReport.as_dict = original
        results[what] = {
            "global_step": t.global_step,
            "reads": monitor.reads,
            "last_read_step": monitor.last_read_step,
            "disabled": monitor.disabled,
            "failure": monitor.failure,
            "threads": [th.name for th in threading.enumerate() if th.name.startswith("normscope")],
        }
    return results


def fit_fail(out: Path) -> dict[str, Any]:
    """A monitor failing on one rank only: every rank must finish the fit (no collective left
    waiting), the failed rank with its own reason, the others stopping their reads with it."""
    return _fail_fits(out, FAIL_CASES, "fail")


ASYNC_FAIL_CASES = ("min_rows", "as_dict", "result")


def fit_fail_async(out: Path) -> dict[str, Any]:
    """``fit_fail`` with ``async_reads=True``: a read in flight when rank 1 fails (``result``:
    at its publish, before the gather; ``as_dict``: after the gather, before the stop vote)."""
    return _fail_fits(out, ASYNC_FAIL_CASES, "fail_async", async_reads=True)


SM_EVERY = 3  # windows 0, 2, 5: the last read's outlier moments are step 5's rows
SM_STEPS = 6


class FailAttachOnRank1(LitTiny):
    """Rank 1's SignMagnitudeMonitor fails at the first batch of step 3 (before any collective)."""

    def __init__(self, monitor: SignMagnitudeMonitor) -> None:
        super().__init__()
        self.monitor = monitor

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 2:

            def broken() -> None:
                raise RuntimeError("injected on rank 1: attach")

            self.monitor.tracker.attached = False
            self.monitor.tracker.attach = broken


def fit_sm(out: Path) -> dict[str, Any]:
    """SignMagnitudeMonitor under DDP: outlier moments summed over the ranks; then a failure on
    rank 1 alone."""
    L.seed_everything(0, verbose=False)
    monitor = SignMagnitudeMonitor(every_n_steps=SM_EVERY, verbose=False)
    module = LitDict(lr=0.0)
    t = trainer(monitor, SM_STEPS, [CSVLogger(out, name="sm")], use_distributed_sampler=False)
    t.fit(module)
    if t.is_global_zero:
        torch.save(module.state_dict(), out / "sm_weights.pt")
    result: dict[str, Any] = {
        "reads": monitor.reads,
        "last": {k: _num(v) for k, v in monitor.last_report.as_dict().items()},
        "failure": monitor.failure,
    }
    L.seed_everything(0, verbose=False)
    failing = SignMagnitudeMonitor(every_n_steps=2, verbose=False)
    t = trainer(failing, FAIL_STEPS, [CSVLogger(out, name="sm_fail")])
    t.fit(FailAttachOnRank1(failing), train_dataloaders=token_loader(n=512))
    result["fail"] = {
        "global_step": t.global_step,
        "reads": failing.reads,
        "disabled": failing.disabled,
        "failure": failing.failure,
    }
    return result


def fit_sources(out: Path) -> dict[str, Any]:
    """Per-source reads under DDP: a source seen by one rank only, and a window where rank 1
    holds no row: the source names are agreed across ranks before the exact reduce."""
    L.seed_everything(0, verbose=False)
    reads: list[dict[str, Any]] = []
    monitor = DeadDirectionMonitor(
        **SEPARATE_DISCOVERY,
        every_n_steps=EXACT_EVERY,
        rows_per_read="all",
        rules=[recorder(reads)],
        sources="source",
        alerts=(),
        verbose=False,
    )
    module = LitSources(lr=0.0)
    t = trainer(monitor, EXACT_EVERY * 2, [], use_distributed_sampler=False)
    t.fit(module)
    if t.is_global_zero:
        torch.save(module.state_dict(), out / "sources_weights.pt")
    return {
        "global_step": t.global_step,
        "reads": reads,
        "names": sorted(monitor.tracker.split.accs),
        "failure": monitor.failure,
    }


FITS = {
    "exact": fit_exact,
    "exact_async": fit_exact_async,
    "stop": fit_stop,
    "fsdp": fit_fsdp,
    "fail": fit_fail,
    "fail_async": fit_fail_async,
    "sm": fit_sm,
    "sources": fit_sources,
    "tiers": fit_tiers,
}


def main(out: Path, names: list[str]) -> None:
    for name in names:
        result = FITS[name](out)
        result["rank"] = rank = torch.distributed.get_rank()
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or list(FITS))
