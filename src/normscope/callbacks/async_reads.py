"""Reads off the critical path (``DeadDirectionMonitor(async_reads=True)``), and the part of a
read every path shares: delivering its report.

At a read step the main thread does what must be collective or cheap: the cross-rank reduce
(under DDP), the window's hand-off (:func:`~normscope.monitors.read_window.take_window` with
``swap=True``: the read keeps the window's tensors, the taps get fresh ones). The eigensolves
run on a :class:`~normscope.monitors.read_worker.ReadWorker` thread; their report is published
-- loggers, rules, sinks, the read line, the stop decision, ``last_report``, ``reads`` -- at
the first optimiser step end after it is ready, logged under the step it belongs to. At most
one read is in flight: a read step waits for the previous read and publishes it first.

Under DDP the publish is at a step every rank agrees on: the end of the next optimiser step,
waiting for the worker there; the records of each rank's share are gathered and the stop is
decided there, on the main thread (no collective ever runs on the worker). A rank whose monitor
failed in between still takes part in that gather, with an error record: every rank then stops
reading together.
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from normscope.callbacks.wandb_extras import log_wandb_extras
from normscope.monitors.dead_direction_read import read_share, reduce_taps
from normscope.monitors.format import format_read_line
from normscope.monitors.read_window import (
    ReadRecords,
    ReadWindow,
    finish_report,
    gather_records,
    solve_window,
    take_window,
)
from normscope.monitors.read_worker import ReadWorker

__all__ = ["AsyncReads", "default_async"]


def default_async(trainer: Any) -> bool:
    """``async_reads=None``: asynchronous under a Lightning ``Trainer`` on a CUDA device (the
    solves on a side stream, off the step's critical path); synchronous on the CPU (measured:
    benchmarks/RESULTS.md, "Asynchronous reads") and in plain loops, Fabric and the Hugging Face
    ``Trainer`` (their step results carry the report of the same step). The same answer on every
    rank: it depends on the device type only."""
    if not isinstance(trainer, Trainer):
        return False
    return trainer.strategy.root_device.type == "cuda"


def _async_supported(trainer: Any) -> bool:
    """One device or DDP (FSDP2's sharded gammas and collectives: synchronous reads only)."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    if not isinstance(trainer, Trainer):
        return True  # a LoopView: a plain loop, Fabric, the HF Trainer over torch.distributed
    return isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy))


class AsyncReads:
    """The read hand-off, the worker and the publish rule (a mixin of
    :class:`~normscope.DeadDirectionMonitor`)."""

    # Supplied by the monitor.
    tracker: Any
    async_reads: bool | None
    stop_on_alert: bool
    verbose: bool
    name: str | None
    charts_every_n_reads: int
    reads: int
    last_read_step: int
    last_report: Any
    _deferred: int
    _step_at_batch_start: int
    _stop_decided_step: int
    _owes_handshake: bool
    _publish: Any
    _local: Any
    _named: Any
    _disable: Any
    _judge_cost: Any
    _warn_once: Any

    def _init_async(self) -> None:
        self._async: bool | None = None  # resolved at the first read (async_reads or default)
        self._worker = ReadWorker()
        self._pending: tuple[ReadWindow, tuple[int, int] | None, int] | None = None
        self._gather_owed = False  # DDP: the peers gather the read in flight's records
        self._vote_owed = False  # DDP: the peers take the published read's stop decision
        self._handoff_seconds = 0.0
        self._waited: ReadRecords | None = None
        self._trainer: Any = None  # the trainer of the read in flight (a checkpoint publishes it)

    # ------------------------------------------------------------ the read step
    def _read(self, trainer: Trainer) -> None:
        """One read at the end of a sampled step: synchronous, or handed to the worker."""
        if self._async is None:
            wanted = default_async(trainer) if self.async_reads is None else self.async_reads
            self._async = wanted and _async_supported(trainer)
            if wanted and not self._async:
                self._warn_once(
                    "async", "normscope: async_reads is for one device or DDP; this strategy "
                    f"({type(trainer.strategy).__name__}) reads synchronously",
                )  # fmt: skip
        if not self._async:
            step = trainer.global_step
            report = self.tracker.read(step=step, reduce=trainer.world_size > 1)
            self._deferred = 0
            self._deliver(trainer, report)
            return
        self._publish_due(trainer, wait=True)  # at most one read in flight
        started = time.perf_counter()
        tracker = self.tracker
        distributed = trainer.world_size > 1
        if distributed:
            reduce_taps(tracker)
        window = take_window(tracker, trainer.global_step, swap=True)
        share = read_share() if distributed else None
        self._deferred = 0
        self._pending = (window, share, self._step_at_batch_start)
        self._trainer = trainer
        self._gather_owed = distributed
        self._worker.submit(
            lambda: solve_window(tracker, window, share),
            window.tensors(),
            trainer.strategy.root_device,
        )
        self._handoff_seconds = time.perf_counter() - started

    def _publish_due(self, trainer: Trainer, *, wait: bool = False) -> bool:
        """Publish the read in flight if its time has come: under DDP at the next optimiser
        step end (waiting for it), else once it is ready (``wait``: now). True if it did."""
        if self._pending is None:
            return False
        window, share, completed = self._pending
        distributed = share is not None
        if distributed and not wait and self._step_at_batch_start <= completed:
            return False
        if not (wait or distributed or self._worker.ready()):
            return False
        started = time.perf_counter()
        records = self._waited or self._worker.result()
        self._waited = None
        self._pending = None
        self._trainer = None
        parts = gather_records(records) if distributed else [records]
        self._gather_owed = False
        errors = [p.error for p in parts if p.error is not None]
        if errors:
            self._owes_handshake = False  # every rank stops reading here, together
            self._disable(f"the read failed: {errors[0]}", warn=records.error is not None)
            return True
        self.tracker.last_solves = records.solves
        self._deliver(trainer, finish_report(self.tracker, window, parts))
        self._judge_cost(self._handoff_seconds + time.perf_counter() - started)
        return True

    def _wait_in_flight(self) -> None:
        """A checkpoint while a read is in flight: one process publishes it now (the checkpoint
        holds it whole: baselines, counters, rule states); under DDP (the publish is a
        collective) its solves are waited for -- this rank's share of the baselines is in --
        and it is published at its usual step."""
        if self._pending is None:
            return
        if self._pending[1] is None and self._trainer is not None:
            self._publish_due(self._trainer, wait=True)
        elif self._waited is None and self._worker.pending:
            self._waited = self._worker.result()

    def _stop_worker(self) -> None:
        """Drop a read in flight and join the worker thread."""
        self._pending = None
        self._waited = None
        self._trainer = None
        self._worker.shutdown()

    # ------------------------------------------------------------ DDP: a failed rank
    def _owe_publish(self, trainer: Trainer) -> bool:
        """A disabled rank at an optimiser step end: take part in what its peers still run for
        the read in flight (the gather, with an error record: every rank then stops; or the
        stop decision, voting no). True when nothing more is owed at this step."""
        if self._gather_owed:
            self._gather_owed = False
            self._owes_handshake = False  # the peers stop reading at this gather
            self._stop_worker()
            gather_records(ReadRecords(error="the monitor on another rank failed"))
            return True
        if self._vote_owed:
            self._vote_owed = False
            self._stop_decided_step = self._step_at_batch_start  # this step's vote is cast
            trainer.strategy.reduce_boolean_decision(False, all=False)
        return False

    # ------------------------------------------------------------ delivering a report
    def _deliver(self, trainer: Trainer, report: Any) -> None:
        """Publish ``report`` (of the read at ``report.step``): counters, W&B charts, loggers,
        rules and sinks, the read line, the stop decision."""
        # Set first: a failure anywhere below still owes the peers this read's stop vote.
        self._vote_owed = self.stop_on_alert and trainer.world_size > 1
        step = report.step
        self.reads += 1
        self.last_read_step = step
        self.last_report = report
        metrics = report.as_dict()
        # Rank zero alone runs these two: a failure there must not skip the stop decision's
        # collective below, so each fails on its own (one warning) and the read goes on.
        if trainer.is_global_zero:
            self._local(
                lambda: log_wandb_extras(
                    trainer,
                    report,
                    step,
                    reads=self.reads,
                    every=self.charts_every_n_reads,
                    name=self.name,
                ),
                "W&B charts",
            )
        fired = self._publish(trainer, metrics, step)
        if self.verbose and trainer.is_global_zero:
            self._local(
                lambda: rank_zero_info(self._named(format_read_line(report, fired))), "read line"
            )
        if self.stop_on_alert:
            self._stop_decided_step = self._step_at_batch_start
            self._vote_owed = False
            stop = trainer.strategy.reduce_boolean_decision(bool(fired), all=False)
            if stop:
                trainer.should_stop = True
