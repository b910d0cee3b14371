"""The engine: one trainer-agnostic :class:`Monitor` that owns the life of every read.

A monitor drives one *family* (:class:`~normscope.families.DeadDirectionFamily`,
:class:`~normscope.families.SignMagnitudeFamily`) through the small protocol of
:class:`Family`, and owns everything around the reads:

* the **schedule**: the baseline step and every ``every_n_steps``-th optimiser step are
  sampled; all gradient-accumulation micro-batches of a sampled step share its window; a window
  short of rows stays open (at most ``every_n_steps`` more steps);
* the **read**: synchronous, or handed to a worker thread (``async_reads``) and published at a
  later step end; under several processes the reduce, a round-robin split of the solves and the
  gather (every rank gets the same report);
* the **agreement** of ranks (torch.distributed's default group): one handshake per window end
  (global rows, "a rank failed"), one stop decision per read, so no collective ever hangs;
* **publishing**: every :class:`~normscope.engine.monitor.Target` (loggers, callables), the
  alert rules, the sinks, the read line, W&B summaries and charts;
* the **cost guard**, **fail-open** (a failure warns once, disables the monitor, and training
  goes on) and the **checkpoint state**.

It imports no trainer. An adapter (:mod:`normscope.adapters`) tells it three things: a step
begins (:meth:`Monitor.begin`), a step ended with this many optimiser steps done
(:meth:`Monitor.end`), training finished (:meth:`Monitor.finish`). A plain loop uses it
directly::

    monitor = Monitor.of(DeadDirectionConfig(), model, every_n_steps=50, log=wandb.log)
    for x, y in loader:
        with monitor.step(x) as result:
            loss = model(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad()
        if result.alerts: ...
    monitor.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from normscope._common import (
    ConfigurationError,
    disabled_message,
    logger,
    read_share,
    setup_logger,
)
from normscope.alerts import Alert, build_sinks
from normscope.engine.worker import ReadWorker
from normscope.families.sign_magnitude_family import SignMagnitudeFamily

__all__ = [
    "Family",
    "Monitor",
    "SUMMARIES",
    "StepResult",
    "Target",
    "canonical_metrics",
    "check_log_per_layer",
    "check_name",
    "family_names",
    "named_key",
    "named_metrics",
    "parse_family",
    "select_layers",
]


class Family(Protocol):
    """What the engine asks of a family (both families implement it; see their modules)."""

    prefix: str  # "dd" | "sm": the key family
    kind: str  # the monitor's name in messages: "DeadDirectionMonitor"
    supports_async: bool
    charts_every_n_reads: int
    rules: list[Any]  # its default rules; the engine appends the user's
    tracker: Any  # None until :meth:`build`

    def check_loop(self, precision: str) -> None: ...
    def build(self, model: nn.Module) -> None: ...
    @property
    def attached(self) -> bool: ...
    def first_batch(self, model: nn.Module, batch: Any) -> tuple[bool, bool]: ...
    def finish_discovery(self) -> None: ...
    def see(self, batch: Any) -> None: ...
    def share_rows(self, forwards: int) -> None: ...
    def open(self, batch: Any) -> None: ...
    def close(self) -> None: ...
    def rows(self) -> torch.Tensor: ...
    def rows_needed(self, rules: Sequence[Any]) -> int: ...
    def rejected(self) -> torch.Tensor: ...
    def read(self, step: int, *, distributed: bool) -> Any: ...
    # with ``supports_async``: the read in three parts, the middle one on the worker thread
    def take(self, step: int, *, distributed: bool, swap: bool) -> Any: ...
    def solve(self, window: Any, share: tuple[int, int]) -> Any: ...
    def gather(self, records: Any, error: str | None = None) -> list[Any]: ...
    def assemble(self, window: Any, parts: list[Any], solves: int) -> Any: ...
    def metrics(self, report: Any) -> dict[str, float]: ...
    def read_line(self, report: Any, fired: Sequence[Any]) -> str: ...
    def summary(self, report: Any, reads: int, alerts: Sequence[Any]) -> str | None: ...
    def worst_point(self, report: Any) -> tuple[float, str] | None: ...
    def charts(self, report: Any, step: int) -> dict[str, Any]: ...
    def detach(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class StepResult:
    """What one optimiser step's end gave: the report of the read published then (``None`` on
    a step without one), the alerts it fired, every key it logged (named:
    ``dd[name]/...``), and whether a ``stop_on_alert`` monitor asks the loop to stop."""

    report: Any = None
    alerts: list[Any] = field(default_factory=list)
    should_stop: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- collectives
def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    """Processes in torch.distributed's default group (1 without one)."""
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return tensor
    out = tensor.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def _any(decision: bool, device: torch.device) -> bool:
    """Whether any rank decided yes (one collective; no-op alone)."""
    if world_size() == 1:
        return bool(decision)
    votes = _sum(torch.tensor(float(bool(decision)), dtype=torch.float64, device=device))
    return bool(votes.item() > 0)


def _rank_zero() -> bool:
    dist = _dist()
    return dist is None or dist.get_rank() == 0


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


# --------------------------------------------------------------------------- fail-open
def _fail_open(phase: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A monitor must never crash or stall training: a failure in ``phase`` warns once,
    disables the monitor (hooks removed) and training goes on; a disabled monitor only takes
    part in what its peers still expect of it (:meth:`Monitor._keep_in_step`)."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def guarded(self: Monitor, *args: Any, **kwargs: Any) -> Any:
            if self.disabled:
                self._keep_in_step(phase, *args)
                return self._result if phase == "end" else None
            try:
                return method(self, *args, **kwargs)
            except ConfigurationError:
                raise
            except Exception as err:  # noqa: BLE001 - fail-open is the contract
                self._disable(f"{method.__name__}: {type(err).__name__}: {err}")
                self._keep_in_step(phase, *args)
                return self._result if phase == "end" else None

        return guarded

    return wrap


class Monitor:
    """One family's reads on a schedule, for any loop (see the module docstring).

    Args:
        family: what is read (:class:`~normscope.families.DeadDirectionFamily`, ...).
        every_n_steps: optimiser steps between reads (>= 1).
        rules: extra :mod:`normscope.alerts` rules (``evaluate(metrics, step)``), after the
            family's own.
        alerts: sinks: ``"log"``, ``"wandb"``, or callables ``fn(alert)``.
        stop_on_alert: ask the loop to stop when an alert fires (decided across ranks).
        log_per_layer: per-layer keys sent to the targets: ``"all"``, ``"none"``, or the ``k``
            worst layers of each ranking (rules always see every key).
        verbose: a line per read and a summary at :meth:`finish` (rank zero, logger
            ``normscope``).
        overhead_warn: warn once when a read costs more than this fraction of training time.
        name: tell this monitor from others in one run: keys ``dd[name]/...``.
        async_reads: solve on a worker thread (families that support it); ``None``: what the
            adapter says (on under a Lightning ``Trainer`` on CUDA, off elsewhere).
        log: where reads go: a logger object, a callable (``wandb.log``), a
            :class:`~normscope.engine.monitor.Target`, or a list of them.
        model: watch this model at once (:meth:`watch`).

    Raises:
        ConfigurationError: a bad argument.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from normscope.engine import Monitor
        >>> from normscope.families import DeadDirectionConfig
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
        >>> monitor = Monitor.of(DeadDirectionConfig(residual=False), model, every_n_steps=2,
        ...                      verbose=False, alerts=())
        >>> for _ in range(2):
        ...     with monitor.step() as result:
        ...         _ = model(torch.randn(64, 16))
        >>> round(result.metrics["dd/gamma_alignment_min"], 6)
        1.0
        >>> monitor.close()
    """

    keep_last: int = 1000  # per-read lists keep this many entries
    min_timed_steps: int = 20  # plain steps timed before a read's cost is judged

    def __init__(
        self,
        family: Family,
        *,
        every_n_steps: int = 50,
        rules: Sequence[Any] = (),
        alerts: Sequence[str | Callable[[Alert], Any]] | str | None = ("log",),
        stop_on_alert: bool = False,
        log_per_layer: str | int = "all",
        verbose: bool = True,
        overhead_warn: float | None = 0.05,
        name: str | None = None,
        async_reads: bool | None = None,
        log: Any = None,
        model: nn.Module | None = None,
    ) -> None:
        owner = family.kind
        try:
            self.name = check_name(name, owner)
            self.log_per_layer = check_log_per_layer(log_per_layer, owner)
            self.sinks = build_sinks(alerts)
        except ValueError as err:
            text = str(err) if owner in str(err) else f"{owner}: {err}"
            raise ConfigurationError(text) from err
        if (
            not isinstance(every_n_steps, int)
            or isinstance(every_n_steps, bool)
            or every_n_steps < 1
        ):
            raise ConfigurationError(
                f"{owner}: every_n_steps must be an int >= 1, got {every_n_steps!r}"
            )
        if overhead_warn is not None and not (
            isinstance(overhead_warn, (int, float)) and overhead_warn > 0
        ):
            raise ConfigurationError(
                f"{owner}: overhead_warn must be None or a fraction > 0, got {overhead_warn!r}"
            )
        if verbose:
            setup_logger()  # the read lines print unless the application set up logging
        self.family = family
        family.rules.extend(rules)
        self.rules = family.rules  # one list: the family drops rules that do not apply
        self.every_n_steps = every_n_steps
        self.stop_on_alert = stop_on_alert
        self.verbose = verbose
        self.overhead_warn = overhead_warn
        self.async_reads = async_reads
        self.targets: list[Target] = as_targets(log)
        # per read
        self.reads = 0
        self.last_read_step = -1
        self.last_report: Any = None
        self.alerts_fired: list[Any] = []
        self.history: list[tuple[int, dict[str, float]]] = []  # run-level keys per read
        self.should_stop = False
        self.disabled = False
        self.failure: str | None = None
        self.model: nn.Module | None = None
        self.device = torch.device("cpu")
        self.steps = 0  # optimiser steps done, for plain loops (:meth:`step`)
        self._result = StepResult()
        self._warned: set[str] = set()
        self._skipped: set[int] = set()  # targets that failed
        self._failed_rules: set[int] = set()
        self._published: set[str] = set()  # every key a read has published
        # schedule
        self._baseline_step = 0  # 1 on a compiled model: see taps.hooks.compiled
        self._deferred = 0
        self._step_at_begin = -1
        # micro-batches of the current optimiser step, and the most seen in one step so far:
        # a window's row budget is shared by that many forwards on each rank
        self._micro = 0
        self._micro_per_step = 1
        self._discovering = False
        self._discovery_step: int | None = None
        self._late_window: int | None = None
        # cost guard
        self._clock_last: float | None = None
        self._plain_seconds = 0.0
        self._plain_steps = 0
        self._read_seconds: float | None = None
        # ranks in step: a failed monitor owes its peers one handshake
        self._owes_handshake = True
        self._handshake_step = -2
        self._stop_decided_step = -2
        # asynchronous reads
        self._async: bool | None = None
        self._async_default = False
        self._async_ok = True
        self._worker = ReadWorker()
        self._pending: tuple[Any, bool, int] | None = None  # window, distributed, its step
        self._waited: Any = None
        self._gather_owed = False
        self._vote_owed = False
        self._handoff_seconds = 0.0
        if model is not None:
            self.watch(model)

    # ------------------------------------------------------------------ plain loops
    @classmethod
    def of(cls, config: Any, model: nn.Module | None = None, **engine: Any) -> Monitor:
        """A monitor of the family ``config`` describes (``config.build()``: a
        :class:`~normscope.families.DeadDirectionConfig`, ...), ``engine`` the options of
        :class:`Monitor` (``every_n_steps``, ``log``, ...)."""
        return cls(config.build(), model=model, **engine)

    @classmethod
    def sign_magnitude(cls, model: nn.Module | None = None, **options: Any) -> Monitor:
        """A sign–magnitude monitor: ``options`` are :class:`~normscope.SignMagnitudeMonitor`'s
        plus ``log=``."""
        return cls._of(SignMagnitudeFamily, model, options)

    @contextlib.contextmanager
    def step(self, batch: Any = None) -> Iterator[StepResult]:
        """Around one optimiser step of a loop you wrote (forwards, backward,
        ``optimizer.step()``): :meth:`begin` on entry, :meth:`end` on exit, the yielded
        :class:`StepResult` filled at exit. A step that raises is not counted (the window
        stays shut)."""
        if self.model is None:
            raise RuntimeError("normscope: Monitor.step() needs a model: Monitor(..., model=m)")
        result = StepResult()
        self.begin(self.steps, batch)
        try:
            yield result
        except BaseException:
            self.family.close()
            raise
        self.steps += 1
        got = self.end(self.steps)
        result.report, result.alerts = got.report, got.alerts
        result.should_stop, result.metrics = got.should_stop, got.metrics

    def close(self) -> None:
        """The end of training in a plain loop: :meth:`finish`, then the hooks removed."""
        self.finish()
        self.detach()

    # ------------------------------------------------------------------ lifecycle
    @property
    def tracker(self) -> Any:
        """The family's tracker (None until :meth:`watch`)."""
        return self.family.tracker

    @property
    def label(self) -> str:
        """``DeadDirectionMonitor``, or with a name ``DeadDirectionMonitor[fast]``."""
        kind = self.family.kind
        return f"{kind}[{self.name}]" if self.name else kind

    @property
    def state_key(self) -> str:
        """The monitor's key in a checkpoint: its family and name (two monitors of one family
        in one run need different names: Lightning refuses two callbacks with one key)."""
        return self.label

    def watch(
        self,
        model: nn.Module,
        *,
        log: Any = None,
        device: torch.device | str | None = None,
        precision: str = "32-true",
        async_default: bool = False,
        async_ok: bool = True,
    ) -> None:
        """Set up on ``model`` (its layers found now; the hooks at the first batch). ``log``
        replaces the targets; ``async_default``: the adapter's default for ``async_reads=None``;
        ``async_ok``: whether the loop allows asynchronous reads at all.

        Raises:
            ConfigurationError: no norm layer, an unknown layer name, ...
        """
        if log is not None:
            self.targets = as_targets(log)
        self.model = model
        self.device = torch.device(device) if device is not None else _model_device(model)
        self._async_default = async_default
        self._async_ok = async_ok
        if self.family.tracker is None:
            self.family.check_loop(precision)
            self.family.build(model)

    @_fail_open("begin")
    def begin(self, step: int, batch: Any = None) -> None:
        """Before the forwards of an optimiser step (of each micro-batch): ``step`` optimiser
        steps are done. The first call registers the hooks (or arms residual discovery on this
        step's own forward); a sampled step opens the gate."""
        family = self.family
        if family.tracker is None:
            return
        family.see(batch)
        if not family.attached and not self._discovering:
            in_window = self._in_window(step)
            discovering, is_compiled = family.first_batch(self.model, batch)
            if discovering:
                # this step's forwards run untapped; a sampled one is read at the next step
                self._late_window = step + 1 if in_window else self._late_window
                self._discovering = True
                self._discovery_step = step
            elif step == 0 and is_compiled:
                self._baseline_step = 1  # the first compiled forward must see the gate closed
        self._micro = self._micro + 1 if step == self._step_at_begin else 1
        self._micro_per_step = max(self._micro_per_step, self._micro)
        self._step_at_begin = step
        if family.attached and self._in_window(step):
            # the read's row budget, shared by its micro-batches on every rank (learned from
            # the steps before: gradient accumulation runs the same count every step)
            family.share_rows(self._micro_per_step * world_size())
            family.open(batch)

    def pause(self) -> None:
        """Close the gate (validation, a forward of the user's own)."""
        self.family.close()

    @_fail_open("end")
    def end(self, step: int) -> StepResult:
        """After a micro-batch: ``step`` optimiser steps are done now (the same number as at
        :meth:`begin`: mid gradient accumulation). Closes the window and reads when one is
        due; returns what was published."""
        family = self.family
        self._result = result = StepResult(should_stop=self.should_stop)
        if family.tracker is None:
            return result
        if self._discovering:  # the forward discovery watched has run: decide, then tap
            self._discovering = False
            family.finish_discovery()
        family.close()
        completed = self._step_at_begin  # the optimiser step these micro-batches belong to
        if step == completed:
            return result  # mid accumulation
        published = self._publish_due()  # async_reads: a read that is ready (DDP: due)
        if self.disabled:
            return result  # the published read failed: every rank stopped reading, together
        if completed == self._discovery_step:
            self._clock(plain=False)
            return result  # discovery's step: its forwards ran before the taps existed
        if not self._in_window(completed):
            self._clock(plain=not published)
            return result
        have, rejected, peers_failed = self._peers_failed(family.rows(), family.rejected())
        if peers_failed:
            return result
        if not rejected and not self._enough_rows(have):
            self._deferred += 1
            self._clock(plain=False)
            return result  # keep the window open one more optimiser step
        started = time.perf_counter()
        self._read(step)
        if not self._async:  # an asynchronous read is judged at its publish
            self._judge_cost(time.perf_counter() - started)
        self._clock(plain=False)
        result.should_stop = self.should_stop
        return result

    @_fail_open("finish")
    def finish(self) -> StepResult:
        """The end of training: the read in flight published (never lost), the worker joined,
        the summary (``verbose``)."""
        self._result = StepResult(should_stop=self.should_stop)
        self._publish_due(wait=True)
        self._stop_worker()
        if self.verbose and self.last_report is not None and _rank_zero():
            text = self.family.summary(self.last_report, self.reads, self.alerts_fired)
            if text:
                logger.info(self._named(text))
        return self._result

    def detach(self) -> None:
        """Remove every hook (teardown, an exception, a failure); the worker joined."""
        self._stop_worker()
        self.family.detach()

    # ------------------------------------------------------------------ schedule
    def _in_window(self, step: int) -> bool:
        if step == self._discovery_step:
            return False
        return (
            step == self._late_window
            or step == self._baseline_step
            or (step + 1) % self.every_n_steps == 0
            or self._deferred > 0
        )

    def _enough_rows(self, have: float) -> bool:
        need = self.family.rows_needed(self.rules)
        # defer at most every_n_steps optimiser steps, then read whatever there is (NaN + reason)
        return have >= need or self._deferred >= self.every_n_steps

    # ------------------------------------------------------------------ the read
    def _read(self, step: int) -> None:
        """One read at the end of a sampled step: synchronous, or handed to the worker."""
        family = self.family
        distributed = world_size() > 1
        if self._async is None:
            wanted = self._async_default if self.async_reads is None else self.async_reads
            wanted = bool(wanted) and family.supports_async
            self._async = wanted and self._async_ok
            if wanted and not self._async:
                self._warn_once(
                    "async",
                    "normscope: async_reads is for one device or DDP; this loop reads "
                    "synchronously",
                )
        if not self._async:
            report = family.read(step, distributed=distributed)
            self._deferred = 0
            self._deliver(report)
            return
        self._publish_due(wait=True)  # at most one read in flight
        started = time.perf_counter()
        window = family.take(step, distributed=distributed, swap=True)
        share = read_share()
        self._deferred = 0
        self._pending = (window, distributed, self._step_at_begin)
        self._gather_owed = distributed
        self._worker.submit(lambda: family.solve(window, share), window.tensors(), self.device)
        self._handoff_seconds = time.perf_counter() - started

    def _publish_due(self, *, wait: bool = False) -> bool:
        """Publish the read in flight if its time has come: under DDP at the next optimiser
        step end (waiting for it), else once it is ready (``wait``: now). True if it did."""
        if self._pending is None:
            return False
        window, distributed, completed = self._pending
        if distributed and not wait and self._step_at_begin <= completed:
            return False
        if not (wait or distributed or self._worker.ready()):
            return False
        started = time.perf_counter()
        records = self._waited or self._worker.result()
        self._waited = None
        self._pending = None
        parts = self.family.gather(records) if distributed else [records]
        self._gather_owed = False
        errors = [p.error for p in parts if p.error is not None]
        if errors:
            self._owes_handshake = False  # every rank stops reading here, together
            self._disable(f"the read failed: {errors[0]}", warn=records.error is not None)
            return True
        self._deliver(self.family.assemble(window, parts, records.solves))
        self._judge_cost(self._handoff_seconds + time.perf_counter() - started)
        return True

    def _wait_in_flight(self) -> None:
        """A checkpoint while a read is in flight: one process publishes it now (the checkpoint
        holds it whole); under DDP (the publish is a collective) its solves are waited for and
        it is published at its usual step."""
        if self._pending is None:
            return
        if not self._pending[1]:
            self._publish_due(wait=True)
        elif self._waited is None and self._worker.pending:
            self._waited = self._worker.result()

    def _stop_worker(self) -> None:
        """Drop a read in flight and join the worker thread."""
        self._pending = None
        self._waited = None
        self._worker.shutdown()

    # ------------------------------------------------------------------ publishing
    def _deliver(self, report: Any) -> None:
        """Publish ``report``: counters, W&B extras, targets, rules and sinks, the read line,
        the stop decision."""
        # set first: a failure anywhere below still owes the peers this read's stop vote
        self._vote_owed = self.stop_on_alert and world_size() > 1
        family = self.family
        step = report.step
        self.reads += 1
        self.last_read_step = step
        self.last_report = report
        metrics = family.metrics(report)
        head = named_key(f"{family.prefix}/", self.name)
        self.history.append((step, {k: v for k, v in metrics.items() if k.count("/") == 1}))
        fired = self._publish(metrics, step)
        if _rank_zero():
            # each fails on its own (one warning): a failure must not skip the stop decision
            self._local(lambda: self._wandb_extras(report, step, head[:-1]), "W&B charts")
            if self.verbose:
                line = family.read_line(report, fired)
                self._local(lambda: logger.info(self._named(line)), "read line")
        if self.stop_on_alert:
            self._stop_decided_step = self._step_at_begin
            self._vote_owed = False
            if _any(bool(fired), self.device):
                self.should_stop = True
        result = self._result
        result.report, result.should_stop = report, self.should_stop
        result.alerts.extend(fired)

    def _publish(self, metrics: dict[str, float], step: int) -> list[Any]:
        """Log a read to every target, evaluate the rules, deliver what fired to the sinks
        (rank zero). A target, rule or sink that raises is warned about once and left out from
        then on; the others, and the monitor, go on."""
        logged = named_metrics(select_layers(metrics, self.log_per_layer), self.name)
        for target in self.targets:
            if id(target) in self._skipped:
                continue
            try:
                run = target.wandb_run()
                if run is not None:
                    define_summaries(run, target.step_key, logged)
            except Exception as err:  # noqa: BLE001 - the summaries only
                self._warn_once("summaries", f"normscope: W&B define_metric failed ({err})")
            try:
                target.log(logged, step)
            except Exception as err:  # noqa: BLE001 - that target only
                self._skipped.add(id(target))
                self._warn_once(
                    f"logger:{id(target)}",
                    f"normscope: logger {type(target.sink).__name__} failed to log "
                    f"{self.label}'s metrics and is skipped for them from now on; its other "
                    f"metrics and the other loggers are not affected ({type(err).__name__}: "
                    f"{err})",
                )
        named = named_metrics(metrics, self.name)
        # a key an earlier read published and this one lacks is NaN, never a stale value (a
        # Trainer's callback_metrics keep every key: EarlyStopping and ModelCheckpoint read them)
        for key in self._published - named.keys():
            named[key] = math.nan
        self._published |= named.keys()
        self._result.metrics.update(named)
        fired: list[Any] = []
        for rule in self.rules:
            if id(rule) in self._failed_rules:
                continue
            try:
                fired.extend(rule.evaluate(metrics, step))
            except Exception as err:  # noqa: BLE001 - that rule only
                self._failed_rules.add(id(rule))
                self._warn_once(
                    f"rule:{id(rule)}",
                    disabled_message(
                        f"alert rule {getattr(rule, 'name', type(rule).__name__)!r}",
                        f"{type(err).__name__}: {err}",
                        goes_on=f"{self.label} and its other rules go on",
                    ),
                )
        fired = [self._own_alert(a) for a in fired]
        self.alerts_fired.extend(fired)
        for items in (self.alerts_fired, self.history):
            del items[: max(0, len(items) - self.keep_last)]
        if _rank_zero() and fired:
            runs = self._wandb_runs()
            for alert in fired:
                for sink in list(self.sinks):
                    try:
                        sink(alert, runs)
                    except Exception as err:  # noqa: BLE001 - that sink only
                        self.sinks.remove(sink)
                        fn = getattr(sink, "fn", None)
                        what = getattr(fn, "__qualname__", None) or type(sink).__name__
                        self._warn_once(
                            f"sink:{id(sink)}",
                            f"normscope: alert sink {what} failed and is removed; {self.label} "
                            f"and its other sinks go on ({type(err).__name__}: {err})",
                        )
        return fired

    def _wandb_runs(self) -> list[Any]:
        runs = []
        for target in self.targets:
            try:
                run = target.wandb_run()
            except Exception:  # noqa: BLE001 - no run to alert on
                run = None
            if run is not None:
                runs.append(run)
        return runs

    def _wandb_extras(self, report: Any, step: int, head: str) -> None:
        """On every W&B run a target writes to (Lightning's ``WandbLogger``, a plain loop's
        ``wandb.log``): the run's worst point in its summary, and at the first read and every
        ``charts_every_n_reads``-th the family's charts."""
        family = self.family
        every = family.charts_every_n_reads
        for target in self.targets:
            if target.step_key is None:
                continue
            run = target.wandb_run()
            if run is None:
                continue
            note_worst(run, head, family.worst_point(report), step)
            if every and (every <= 1 or (self.reads - 1) % every == 0):
                payload = {
                    named_key(k, self.name): v for k, v in family.charts(report, step).items()
                }
                if payload:
                    run.log({**payload, target.step_key: step})

    def _own_alert(self, alert: Any) -> Any:
        """An alert as this monitor reports it: ``monitor`` set; with a name, its key is the
        logged one (``dd[name]/...``) and its message starts with ``DeadDirectionMonitor[name]:``."""
        if not dataclasses.is_dataclass(alert) or not hasattr(alert, "monitor"):
            return alert
        if self.name is None:
            return dataclasses.replace(alert, monitor=alert.monitor or self.label)
        if alert.monitor is not None:
            return alert  # already named (a restored or re-raised alert)
        return dataclasses.replace(
            alert,
            key=named_key(alert.key, self.name),
            monitor=self.label,
            message=f"{self.label}: {alert.message}",
        )

    def _named(self, text: str) -> str:
        """A read line or summary under this monitor's name: ``normscope[fast] step 50 | ...``."""
        return text.replace("normscope", f"normscope[{self.name}]", 1) if self.name else text

    def _local(self, fn: Callable[[], Any], what: str) -> None:
        """A part of a read one rank runs alone (charts, the read line): a failure there is
        warned about once and the reads go on without it."""
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - that part only
            self._warn_once(
                f"local:{what}",
                f"normscope: {self.label}'s {what} failed; the reads go on without it "
                f"({type(err).__name__}: {err})",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        if _rank_zero():
            warnings.warn(message, UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ cost guard
    def _clock(self, *, plain: bool) -> None:
        """At the end of every optimiser step: time the plain ones (a wall clock, no device
        sync: over many steps it follows the device's pace)."""
        now = time.perf_counter()
        if plain and self._clock_last is not None:
            self._plain_seconds += now - self._clock_last
            self._plain_steps += 1
        self._clock_last = now

    def _judge_cost(self, read_seconds: float) -> None:
        """Warn once when reads cost more than ``overhead_warn`` of training time at this
        cadence, with the ``every_n_steps`` that would not (rank zero)."""
        self._read_seconds = read_seconds
        if self.overhead_warn is None or self._plain_steps < self.min_timed_steps:
            return
        mean = self._plain_seconds / self._plain_steps
        share = read_seconds / (self.every_n_steps * mean) if mean > 0 else math.inf
        if share <= self.overhead_warn:
            return
        suggest = math.ceil(read_seconds / (self.overhead_warn * mean)) if mean > 0 else None
        self._warn_once(
            "cost",
            f"normscope: a {self.label} read takes {read_seconds:.3g} s against a mean "
            f"training step of {mean:.3g} s: about {share:.0%} of training time at "
            f"every_n_steps={self.every_n_steps}. every_n_steps={suggest} keeps it under "
            f"{self.overhead_warn:.0%} (or read fewer layers: layers=[...], max_memory=...); "
            "overhead_warn=None turns this warning off",
        )

    # ------------------------------------------------------------------ ranks in step
    def _handshake(
        self, rows: torch.Tensor, rejected: torch.Tensor, *, failed: bool
    ) -> tuple[float, float, bool]:
        """The first collective of every window's end, on every rank: the global sums of
        ``rows`` and of the non-finite ``rejected`` rows, and whether any rank's monitor has
        failed."""
        flags = torch.stack(
            [
                rows.to(device=self.device, dtype=torch.float64).reshape(()),
                rejected.to(device=self.device, dtype=torch.float64).reshape(()),
                torch.tensor(float(failed), dtype=torch.float64, device=self.device),
            ]
        )
        total, bad, failures = _sum(flags).tolist()
        self._handshake_step = self._step_at_begin
        return total, bad, failures > 0

    def _peers_failed(
        self, rows: torch.Tensor, rejected: torch.Tensor
    ) -> tuple[float, float, bool]:
        """The handshake of a healthy rank at a window's end: ``(global rows, global
        non-finite rows, stop)``; on ``stop`` (a peer failed) this monitor is disabled too. One
        process: no collective (one host sync, the window's end)."""
        if world_size() <= 1:
            pair = torch.stack([rows.to(torch.float64), rejected.to(rows.device, torch.float64)])
            total, bad = pair.tolist()
            return total, bad, False
        total, bad, peer_failed = self._handshake(rows, rejected, failed=False)
        if peer_failed:
            self._owes_handshake = False
            self._disable(
                "the monitor on another rank failed (its warning says why); every rank stops "
                "reading at the same step so that their collectives stay in step",
                warn=_rank_zero(),
            )
        return total, bad, peer_failed

    def _keep_in_step(self, phase: str, *args: Any) -> None:
        """While disabled (and right after a failure): take part in the one handshake or vote
        the peers still expect, then nothing more. Never raises."""
        if not self._owes_handshake:
            return
        try:
            if world_size() <= 1:
                self._owes_handshake = False
            elif phase == "finish":
                self._owe_publish()
            elif phase == "begin" and args:
                self._step_at_begin = int(args[0])
            elif phase == "end" and args:
                completed = self._step_at_begin
                if int(args[0]) == completed or self._owe_publish():
                    return
                if not self._in_window(completed):
                    return
                if self._handshake_step != completed:
                    self._owes_handshake = False
                    zero = torch.zeros((), dtype=torch.float64)
                    self._handshake(zero, zero, failed=True)
                elif self.stop_on_alert and self._stop_decided_step != completed:
                    # failed after this window's handshake: vote "no" in the read's stop
                    self._stop_decided_step = completed
                    _any(False, self.device)
        except Exception:  # noqa: BLE001 - nothing more a failed monitor can do
            self._owes_handshake = False

    def _owe_publish(self) -> bool:
        """A disabled rank at a step end: take part in what its peers still run for the read in
        flight (the gather, with an error record, or the stop vote). True when nothing more is
        owed at this step."""
        if self._gather_owed:
            self._gather_owed = False
            self._owes_handshake = False  # the peers stop reading at this gather
            self._stop_worker()
            self.family.gather(None, error="the monitor on another rank failed")
            return True
        if self._vote_owed:
            self._vote_owed = False
            self._stop_decided_step = self._step_at_begin
            _any(False, self.device)
        return False

    def disable(self, reason: str) -> None:
        """Switch the monitor off (hooks removed), warning once with ``reason``: what an
        adapter does when its own part fails."""
        self._disable(reason)

    def _disable(self, reason: str, *, warn: bool = True) -> None:
        self.disabled = True
        self.failure = reason
        self.detach()
        if warn:
            # on the rank that failed, whichever it is
            warnings.warn(
                f"normscope: {self.label} disabled itself after an internal error; "
                f"training continues without it ({reason})",
                UserWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------------ checkpoint
    def _rule_keys(self) -> list[str]:
        """Each rule's key in a checkpoint: its ``name`` (its class's without one); a second
        rule of the same name ``<name>#2``, and so on."""
        keys: list[str] = []
        for rule in self.rules:
            base = str(getattr(rule, "name", type(rule).__name__))
            key, n = base, 1
            while key in keys:
                n += 1
                key = f"{base}#{n}"
            keys.append(key)
        return keys

    def state_dict(self) -> dict[str, Any]:
        """Counters, rule states, the alerts fired and the family's state (the dead-direction
        stream reads' gain baselines and last RMS, the sign family's previous signs): plain
        types and tensors, loadable with ``weights_only=True``. Never the open window's
        accumulators (``8 d^2`` bytes per tap): a resumed run starts its window again.
        A read in flight is published first (DDP: waited for, published at its usual step)."""
        try:
            self._wait_in_flight()
            return {
                "reads": self.reads,
                "last_read_step": self.last_read_step,
                "rules": {k: r.state_dict() for k, r in zip(self._rule_keys(), self.rules)},
                "alerts_fired": [a.as_dict() for a in self.alerts_fired],
                "family": self.family.state_dict(),
            }
        except Exception as err:  # noqa: BLE001 - a checkpoint is never lost over us
            self._warn_once(
                "state:state_dict",
                f"normscope: {self.label}.state_dict failed; the checkpoint is saved without "
                f"the monitor's state (a run resumed from it starts its counters and rules afresh) "
                f"({type(err).__name__}: {err})",
            )
            return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (a rule not in it keeps its state)."""
        try:
            self.reads = int(state.get("reads", 0))
            self.last_read_step = int(state.get("last_read_step", -1))
            saved = state.get("rules", {})
            for key, rule in zip(self._rule_keys(), self.rules):
                if key in saved:
                    rule.load_state_dict(saved[key])
            self.alerts_fired = [Alert(**a) for a in state.get("alerts_fired", [])]
            self.family.load_state_dict(state.get("family", {}))
        except Exception as err:  # noqa: BLE001
            self._warn_once(
                "state:load_state_dict",
                f"normscope: {self.label}.load_state_dict failed; the monitor starts with a "
                f"fresh state (counters and rules from zero) ({type(err).__name__}: {err})",
            )


# ============================================================================
# Where a read goes: the loggers (:class:`Target`), which per-layer keys they get
# (``log_per_layer``), and what a W&B run gets beyond scalars.
#
# **log_per_layer**.
# A 32-layer model logs about 1,200 ``dd/<layer>/<metric>`` keys a read. ``log_per_layer`` keeps
# every run-level key (``dd/<metric>``, ``sm/<metric>``) and, of the per-layer keys, all of them
# (``"all"``, the default), none (``"none"``), or those of the ``k`` worst layers (an int): for
# each ranking below, the ``k`` layers that rank worst, their union kept whole (every metric of a
# kept layer). The alert rules and ``trainer.callback_metrics`` always see every key: a layer
# left out of the log still alerts.
#
# Rankings (worst first; NaN never ranks):
#
# * ``dd``: smallest ``sigma_min_step`` (the sublayer that shrank the stream most), largest
#   ``kernel_residual`` (a LayerNorm's kernel lost), largest ``delta_gamma``, largest
#   ``max_logit`` (the attention module nearest one-hot softmax rows);
# * ``sm``: largest ``max_leverage``, largest ``sign_churn``, largest ``asymmetry_ratio``.
# ============================================================================


LogPerLayer = str | int

# family -> [(metric, worst is larger)]
RANKINGS: dict[str, tuple[tuple[str, bool], ...]] = {
    "dd": (
        ("sigma_min_step", False),
        ("kernel_residual", True),
        ("delta_gamma", True),
        ("max_logit", True),
    ),
    "sm": (("max_leverage", True), ("sign_churn", True), ("asymmetry_ratio", True)),
}


def check_log_per_layer(value: object, owner: str) -> LogPerLayer:
    """``value`` if it is ``"all"``, ``"none"`` or an int >= 0, else ``ValueError`` naming
    ``owner``."""
    if value in ("all", "none"):
        return value  # type: ignore[return-value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(
        f"{owner}: log_per_layer must be 'all', 'none' or an int >= 0 (the worst layers kept), "
        f"got {value!r}"
    )


def select_layers(metrics: Mapping[str, float], keep: LogPerLayer) -> dict[str, float]:
    """The keys of ``metrics`` to log under ``log_per_layer=keep``.

    Example::

        >>> m = {"dd/sigma_min_ratio_min": 0.5, "dd/a/sigma_min_step": 0.9,
        ...      "dd/b/sigma_min_step": 0.4, "dd/b/depth": 1.0}
        >>> sorted(select_layers(m, 1))
        ['dd/b/depth', 'dd/b/sigma_min_step', 'dd/sigma_min_ratio_min']
        >>> sorted(select_layers(m, "none"))
        ['dd/sigma_min_ratio_min']
    """
    if keep == "all":
        return dict(metrics)
    by_layer: dict[tuple[str, str], dict[str, float]] = {}
    out: dict[str, float] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) < 3:
            out[key] = value  # run-level (and anything not <family>/<layer>/<metric>)
            continue
        family, layer = parts[0], "/".join(parts[1:-1])
        by_layer.setdefault((family, layer), {})[parts[-1]] = value
    if keep == "none" or keep == 0:
        return out
    kept: set[tuple[str, str]] = set()
    for family in {f for f, _ in by_layer}:
        layers = {name: m for (f, name), m in by_layer.items() if f == family}
        # a per-source family (dd.<source>) ranks as its own family (dd)
        for metric, larger_is_worse in RANKINGS.get(family.split(".", 1)[0], ()):
            ranked = [
                (v, name)
                for name, m in layers.items()
                if (v := m.get(metric)) is not None and math.isfinite(v)
            ]
            ranked.sort(key=lambda t: -t[0] if larger_is_worse else t[0])
            kept.update((family, name) for _, name in ranked[: int(keep)])
    for family, layer in kept:
        for metric, value in by_layer[(family, layer)].items():
            out[f"{family}/{layer}/{metric}"] = value
    return out


# ------------------------------------------------------------------------------ targets
class Target:
    """One place reads are logged to: a logger object (anything with ``log_metrics(metrics,
    step)``: Lightning's and Fabric's loggers) or a callable (``wandb.log``, ``print``...:
    called ``fn(metrics, step=step)`` when it takes a ``step``, else ``fn(metrics)``).

    ``wandb_run`` (a zero-argument callable returning a W&B run, or None) gives the run the
    W&B extras go to; ``step_key`` the run's step metric (Lightning's ``trainer/global_step``).
    Without them a ``wandb.log`` / ``run.log`` callable is recognised by itself.

    Example::

        >>> seen = []
        >>> Target(lambda m, step: seen.append((step, m))).log({"dd/x": 1.0}, 3)
        >>> seen
        [(3, {'dd/x': 1.0})]
    """

    def __init__(
        self,
        sink: Any,
        *,
        wandb_run: Callable[[], Any] | None = None,
        step_key: str | None = None,
    ) -> None:
        self.sink = sink
        if hasattr(sink, "log_metrics"):
            self._log: Callable[[dict[str, float], int], None] = sink.log_metrics
        elif callable(sink):
            try:
                params = inspect.signature(sink).parameters
            except (TypeError, ValueError):  # builtins without a signature
                params = {}
            takes_step = "step" in params or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
            )
            self._log = (
                (lambda m, step: sink(dict(m), step=step))
                if takes_step
                else (lambda m, step: sink(dict(m)))
            )
        else:
            raise TypeError(f"normscope: log must be a callable or a logger, got {sink!r}")
        self.step_key = step_key
        self._wandb_run = wandb_run if wandb_run is not None else _wandb_callable_run(sink)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._log(metrics, step)

    def wandb_run(self) -> Any:
        """The W&B run this target writes to, or None."""
        return self._wandb_run() if self._wandb_run is not None else None


def _wandb_callable_run(fn: Any) -> Callable[[], Any] | None:
    """A plain-loop ``log=wandb.log`` or ``log=run.log``: its run (W&B's own step)."""
    if not (getattr(fn, "__module__", "") or "").startswith("wandb"):
        return None
    owner = getattr(fn, "__self__", None)
    if owner is not None and hasattr(owner, "define_metric"):
        return lambda: owner
    return lambda: getattr(sys.modules.get("wandb"), "run", None)


def as_targets(log: Any) -> list[Target]:
    """``log=`` of a monitor: None, a target, a logger or a callable, or a list of them."""
    if log is None:
        return []
    items = list(log) if isinstance(log, (list, tuple)) else [log]
    return [x if isinstance(x, Target) else Target(x) for x in items]


# ------------------------------------------------------------------------------ W&B
#: run-level key -> W&B summary ("min" / "max" over the run): the run table and the sweep view
#: show the worst read of the run, not the last one
SUMMARIES: dict[str, str] = {
    "dd/sigma_min_ratio_min": "min",
    "dd/sigma_min_step_min": "min",
    "dd/gamma_alignment_min": "min",
    "dd/rows_rejected": "max",
    "dd/reads_disabled": "max",
    "sm/max_leverage_max": "max",
    "sm/sign_churn_mean": "max",
    "sm/reads_disabled": "max",
}

# (run id, family head) pairs whose summaries are defined: per family, so that a second monitor
# in the same run (an sm next to a dd, a dd[fast] next to a dd) gets its own
_DEFINED: set[tuple[str, str]] = set()
# (run id, family head) -> that family's smallest worst-point value so far
_RUN_MIN: dict[tuple[str, str], float] = {}


def _run_key(run: Any) -> str:
    return str(getattr(run, "id", None) or id(run))


def define_summaries(run: Any, step_key: str | None, metrics: Mapping[str, float]) -> None:
    """``define_metric`` for the run-level keys of :data:`SUMMARIES`, once per W&B run and
    family (``dd``, ``sm``, a named monitor's ``dd[fast]``)."""
    key = _run_key(run)
    for head in sorted({k.split("/", 1)[0] for k in metrics}):
        family, name, source = parse_family(head)
        if family is None or source is not None or (key, head) in _DEFINED:
            continue
        for metric, summary in SUMMARIES.items():
            if metric.split("/", 1)[0] != family:
                continue
            metric = named_key(metric, name)
            if step_key is None:
                run.define_metric(metric, summary=summary)
            else:
                run.define_metric(metric, step_metric=step_key, summary=summary)
        _DEFINED.add((key, head))


def note_worst(run: Any, head: str, worst: tuple[float, str] | None, step: int) -> None:
    """``<head>/worst_point`` and ``<head>/worst_point_step`` in the run's summary when this
    read's ``worst = (value, point)`` is the run's smallest so far."""
    if worst is None:
        return
    key = (_run_key(run), head)
    if worst[0] < _RUN_MIN.get(key, float("inf")):
        _RUN_MIN[key] = worst[0]
        run.summary[f"{head}/worst_point"] = worst[1]
        run.summary[f"{head}/worst_point_step"] = step


# ============================================================================
# Several monitors in one fit: a monitor's ``name`` and the key family it logs under.
#
# An unnamed monitor logs ``dd/<...>`` (``sm/<...>``; per source ``dd.<source>/<...>``). A named
# one logs the same keys with the name in the family: ``dd[fast]/<...>``, ``dd[fast].<source>/<...>``,
# ``sm[probe]/<...>``. W&B and TensorBoard group keys by the text before the first ``/``, so each
# monitor gets its own section. The alert rules always see the canonical ``dd/`` keys
# (:func:`named_metrics` renames only what is logged); :func:`canonical_metrics` undoes it for a
# reader of a saved run.
#
# Example::
#
#     >>> named_metrics({"dd/sigma_min_ratio_min": 1.0, "dd.code/n_rows": 8.0}, "fast")
#     {'dd[fast]/sigma_min_ratio_min': 1.0, 'dd[fast].code/n_rows': 8.0}
#     >>> canonical_metrics({"dd[fast]/a": 1.0, "dd/a": 2.0}, "fast")
#     {'dd/a': 1.0}
#     >>> parse_family("dd[fast].code")
#     ('dd', 'fast', 'code')
# ============================================================================


FAMILIES = ("dd", "sm")
_HEAD = re.compile(r"^(dd|sm)(?:\[([^\[\]/\s]+)\])?(?:\.(.+))?$", re.DOTALL)


def check_name(name: object, owner: str) -> str | None:
    """``name`` if it is None or a valid monitor name (a non-empty string without ``/``,
    brackets or whitespace), else ``ValueError`` naming ``owner``."""
    if name is None:
        return None
    if not isinstance(name, str) or not name or re.search(r"[/\[\]\s]", name):
        raise ValueError(
            f"{owner}: name must be None or a non-empty string without '/', '[', ']' or "
            f"whitespace (it goes into every logged key: dd[name]/...), got {name!r}"
        )
    return name


def parse_family(head: str) -> tuple[str | None, str | None, str | None]:
    """The text before a key's first ``/`` as ``(family, name, source)``: ``"dd"`` ->
    ``("dd", None, None)``, ``"dd[fast].code"`` -> ``("dd", "fast", "code")``; not a normscope
    family: ``(None, None, None)``."""
    m = _HEAD.match(head)
    if m is None:
        return None, None, None
    return m.group(1), m.group(2), m.group(3)


def named_key(key: str, name: str | None) -> str:
    """``key`` (a canonical ``dd/...``, ``dd.<source>/...`` or ``sm/...`` key) as monitor
    ``name`` logs it; unchanged for ``name=None`` or a key of no normscope family."""
    if name is None:
        return key
    head, sep, rest = key.partition("/")
    family, old, source = parse_family(head)
    if family is None or old is not None:
        return key
    return f"{family}[{name}]{'.' + source if source is not None else ''}{sep}{rest}"


def named_metrics(metrics: Mapping[str, float], name: str | None) -> dict[str, float]:
    """Every key of ``metrics`` renamed by :func:`named_key` (a new dict; the same for None)."""
    if name is None:
        return dict(metrics)
    return {named_key(k, name): v for k, v in metrics.items()}


def canonical_metrics(metrics: Mapping[str, float], name: str | None) -> dict[str, float]:
    """The keys of monitor ``name`` (``None``: the unnamed monitor) in ``metrics``, renamed
    back to their canonical ``dd/`` / ``dd.<source>/`` / ``sm/`` form; other keys dropped."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        head, sep, rest = key.partition("/")
        family, found, source = parse_family(head)
        if family is None or found != name or not sep:
            continue
        out[f"{family}{'.' + source if source is not None else ''}/{rest}"] = value
    return out


def family_names(keys: Iterable[str], family: str = "dd") -> list[str]:
    """The monitor names of ``family`` found in ``keys`` (sorted; the unnamed one left out)."""
    found = set()
    for key in keys:
        fam, name, _ = parse_family(key.partition("/")[0])
        if fam == family and name is not None:
            found.add(name)
    return sorted(found)
