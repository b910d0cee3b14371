"""The read lifecycle: one trainer-agnostic :class:`Monitor` drives one *family* through
:class:`~normscope.engine.family.Family`: the schedule (sampled steps, micro-batches sharing a
window, a window short of rows kept open), the read (synchronous or on the worker thread; under
several processes the reduce, a split of the solves, the gather), fail-open and the checkpoint
state. Publishing (:mod:`~normscope.engine.publish`), the agreement of ranks
(:mod:`~normscope.engine.ranks`) and the cost guard (:mod:`~normscope.engine.cost`) are its
parts. It imports no trainer: an adapter says when a step begins (:meth:`Monitor.begin`), ends
(:meth:`Monitor.end`) and training finishes (:meth:`Monitor.finish`). A plain loop::

    monitor = Monitor.of(DeadDirectionConfig(), model, every_n_steps=50, log=wandb.log)
    for x, y in loader:
        with monitor.step(x) as result:
            loss = model(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad()
    monitor.close()
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from normscope._common import ConfigurationError, logger, say, setup_logger
from normscope._distributed import rank_zero, read_share, world_size
from normscope.alerts import Alert, Pager, build_sinks, format_alerts, rule_tier
from normscope.engine.cost import CostGuard
from normscope.engine.failopen import fail_open
from normscope.engine.family import Family, StepResult
from normscope.engine.keys import check_name
from normscope.engine.publish import Publisher, as_targets, check_log_per_layer
from normscope.engine.ranks import RankAgreement
from normscope.engine.state import load_rules_state, rules_state
from normscope.engine.worker import InFlight

__all__ = ["Monitor"]


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class Monitor:
    """One family's reads on a schedule, for any loop (see the module docstring).

    Args:
        family: what is read (:class:`~normscope.families.DeadDirectionFamily`, ...).
        every_n_steps: optimiser steps between reads (>= 1).
        rules: extra :mod:`normscope.alerts` rules, after the family's own.
        alerts: sinks: ``"log"``, ``"wandb"``, or callables ``fn(alert)``.
        paging: which alerts page the sinks (default ``Pager()``: per event the first alert
            and one follow-up; the rest counted, in ``alerts_fired`` and the summary).
        stop_on_alert: ask the loop to stop when an alert fires (decided across ranks).
        log_per_layer: ``"all"``, ``"none"``, or the ``k`` worst layers of each ranking.
        verbose: a line per read and a summary at :meth:`finish` (rank zero).
        overhead_warn: warn once when a read costs more than this fraction of training time.
        name: tell this monitor from others in one run: keys ``dd[name]/...``.
        async_reads: solve on a worker thread; ``None``: the adapter's default.
        log: a logger, a callable (``wandb.log``), a :class:`~normscope.engine.Target`, or a list.
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
        paging: Pager | None = None,
    ) -> None:
        owner = family.kind
        try:
            self.name = check_name(name, owner)
            log_per_layer = check_log_per_layer(log_per_layer, owner)
            sinks = build_sinks(alerts)
            self.cost = CostGuard(overhead_warn)
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
        if verbose:
            setup_logger()  # the read lines print unless the application set up logging
        self.family = family
        family.rules.extend(rules)
        self.rules = family.rules  # one list: the family drops rules that do not apply
        self.every_n_steps = every_n_steps
        self.stop_on_alert = stop_on_alert
        self.verbose = verbose
        self.async_reads = async_reads
        self._warned: set[str] = set()
        self.publisher = Publisher(
            label=self.label,
            name=self.name,
            log_per_layer=log_per_layer,
            sinks=sinks,
            targets=as_targets(log),
            warn_once=self._warn_once,
            pager=paging,
        )
        # per read
        self.reads = 0
        self.last_read_step = -1
        self.last_report: Any = None
        self.should_stop = False
        self.disabled = False
        self.failure: str | None = None
        self.model: nn.Module | None = None
        self.device = torch.device("cpu")
        self.steps = 0  # optimiser steps done, for plain loops (:meth:`step`)
        self._result = StepResult()
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
        self.ranks = RankAgreement()
        # asynchronous reads
        self._async: bool | None = None
        self._async_default = False
        self._async_ok = True
        self.in_flight = InFlight()
        if model is not None:
            self.watch(model)

    # ------------------------------------------------------------------ plain loops
    @classmethod
    def of(cls, config: Any, model: nn.Module | None = None, **engine: Any) -> Monitor:
        """A monitor of the family ``config`` describes (``config.build()``: a
        :class:`~normscope.families.DeadDirectionConfig`, ...), ``engine`` the options of
        :class:`Monitor` (``every_n_steps``, ``log``, ...)."""
        return cls(config.build(), model=model, **engine)

    @contextlib.contextmanager
    def step(self, batch: Any = None) -> Iterator[StepResult]:
        """Around one optimiser step of your loop: :meth:`begin`, then :meth:`end` filling the
        yielded :class:`StepResult`; a step that raises is not counted."""
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
    def alerts_fired(self) -> list[Any]:
        """Every alert fired so far (the last ``keep_last``)."""
        return self.publisher.alerts_fired

    @alerts_fired.setter
    def alerts_fired(self, alerts: list[Any]) -> None:
        self.publisher.alerts_fired = alerts

    @property
    def history(self) -> list[tuple[int, dict[str, float]]]:
        """``(step, run-level keys)`` of every read so far (the last ``keep_last``)."""
        return self.publisher.history

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
            self.publisher.targets = as_targets(log)
        self.model = model
        self.device = torch.device(device) if device is not None else _model_device(model)
        self._async_default = async_default
        self._async_ok = async_ok
        if self.family.tracker is None:
            self.family.check_loop(precision)
            self.family.build(model)

    @fail_open("begin")
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
                self._discovery_step = family.discovery_step = step
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

    @fail_open("end")
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

    @fail_open("finish")
    def finish(self) -> StepResult:
        """The end of training: the read in flight published (never lost), the worker joined,
        the open event's count line, the summary (``verbose``: the family's; then every alert
        with its step and remedy, also without ``verbose`` when the alerts went to sinks)."""
        self._result = StepResult(should_stop=self.should_stop)
        self._publish_due(wait=True)
        self._stop_worker()
        closed = self.publisher.pager.close()
        if rank_zero():
            self.publisher.count_line(closed)
        if (self.verbose or self.publisher.sinks) and self.last_report is not None and rank_zero():
            report, fired = self.last_report, self.alerts_fired  # the list: also when they paged
            text = self.verbose and self.family.summary(report, self.reads, fired)
            if text := "\n".join(t for t in (text, format_alerts(fired)) if t):
                say(self._named(text))  # printed unless the application set up logging
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
        self.ranks.gather_owed = distributed
        self.in_flight.submit(
            lambda: family.solve(window, share),
            window,
            distributed=distributed,
            step=self._step_at_begin,
            device=self.device,
        )
        self.in_flight.handoff_seconds = time.perf_counter() - started

    def _publish_due(self, *, wait: bool = False) -> bool:
        """Publish the read in flight if its time has come (:meth:`InFlight.due`). True if it
        did."""
        started = time.perf_counter()
        due = self.in_flight.due(self._step_at_begin, wait=wait)
        if due is None:
            return False
        window, distributed, records = due
        parts = self.family.gather(records) if distributed else [records]
        self.ranks.gather_owed = False
        errors = [p.error for p in parts if p.error is not None]
        if errors:
            self.ranks.owes_handshake = False  # every rank stops reading here, together
            self._disable(f"the read failed: {errors[0]}", warn=records.error is not None)
            return True
        self._deliver(self.family.assemble(window, parts, records.solves))
        self._judge_cost(self.in_flight.handoff_seconds + time.perf_counter() - started)
        return True

    def _stop_worker(self) -> None:
        self.in_flight.stop()

    # ------------------------------------------------------------------ publishing
    def _deliver(self, report: Any) -> None:
        """Publish ``report``: counters, targets, rules, sinks, W&B extras, read line, stop."""
        # set first: a failure anywhere below still owes the peers this read's stop vote
        self.ranks.vote_owed = self.stop_on_alert and world_size() > 1
        family = self.family
        step = report.step
        self.reads += 1
        self.last_read_step = step
        self.last_report = report
        metrics = family.metrics(report)
        tier = family.tier_of(report) if hasattr(family, "tier_of") else "spectral"  # cost tiers
        rules = [r for r in self.rules if tier == "spectral" or rule_tier(r) == "cheap"]
        held = getattr(family, "held_key", None) if tier != "spectral" else None
        fired, named = self.publisher.publish(metrics, step, rules, self.keep_last, held=held)
        self._result.metrics.update(named)
        if rank_zero():
            # each fails on its own (one warning): a failure must not skip the stop decision
            extras = lambda: self.publisher.wandb_extras(family, report, step, self.reads)  # noqa: E731
            self._local(extras, "W&B charts")
            if self.verbose:
                line = family.read_line(report, fired)
                self._local(lambda: logger.info(self._named(line)), "read line")
        if self.stop_on_alert and self.ranks.stop_vote(
            bool(fired), self.device, self._step_at_begin
        ):
            self.should_stop = True
        result = self._result
        result.report, result.should_stop = report, self.should_stop
        result.alerts.extend(fired)

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
        if rank_zero():
            warnings.warn(message, UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ cost guard
    def _clock(self, *, plain: bool) -> None:
        self.cost.clock(plain=plain)

    def _judge_cost(self, read_seconds: float) -> None:
        warning = self.cost.judge(read_seconds, every_n_steps=self.every_n_steps, label=self.label)
        if warning is not None:
            self._warn_once("cost", warning)

    # ------------------------------------------------------------------ ranks in step
    def _peers_failed(
        self, rows: torch.Tensor, rejected: torch.Tensor
    ) -> tuple[float, float, bool]:
        """The handshake of a healthy rank at a window's end; a failed peer disables this
        monitor too, so that every rank stops reading at the same step."""
        total, bad, peer_failed = self.ranks.window_end(
            rows, rejected, device=self.device, step=self._step_at_begin
        )
        if peer_failed:
            self._disable(
                "the monitor on another rank failed (its warning says why); every rank stops "
                "reading at the same step so that their collectives stay in step",
                warn=rank_zero(),
            )
        return total, bad, peer_failed

    def _keep_in_step(self, phase: str, *args: Any) -> None:
        """While disabled: what the peers still expect (:meth:`RankAgreement.keep_in_step`)."""
        if phase == "begin":
            if args and self.ranks.owes_handshake and world_size() > 1:
                self._step_at_begin = int(args[0])
            elif world_size() <= 1:
                self.ranks.owes_handshake = False
            return
        self.ranks.keep_in_step(
            phase,
            int(args[0]) if args else None,
            completed=self._step_at_begin,
            in_window=self._in_window,
            stop_on_alert=self.stop_on_alert,
            device=self.device,
            settle=self._owe_publish,
        )

    def _owe_publish(self) -> bool:
        return self.ranks.settle(
            step=self._step_at_begin,
            device=self.device,
            drop_read=self._stop_worker,
            gather_error=lambda: self.family.gather(
                None, error="the monitor on another rank failed"
            ),
        )

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
    def state_dict(self) -> dict[str, Any]:
        """Counters, rule states, the alerts fired and the family's state (the dead-direction
        stream reads' gain baselines and last RMS, the sign family's previous signs): plain
        types and tensors, loadable with ``weights_only=True``. Never the open window's
        accumulators (``8 d^2`` bytes per tap): a resumed run starts its window again.
        A read in flight is published first (DDP: waited for, published at its usual step)."""
        try:
            if self.in_flight.hold():
                self._publish_due(wait=True)
            return {
                "reads": self.reads,
                "last_read_step": self.last_read_step,
                "rules": rules_state(self.rules),
                "alerts_fired": [a.as_dict() for a in self.alerts_fired],
                "pager": self.publisher.pager.state_dict(),
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
            load_rules_state(self.rules, state.get("rules", {}))
            self.alerts_fired = [Alert(**a) for a in state.get("alerts_fired", [])]
            self.publisher.pager.load_state_dict(state.get("pager", {}))
            self.family.load_state_dict(state.get("family", {}))
        except Exception as err:  # noqa: BLE001
            self._warn_once(
                "state:load_state_dict",
                f"normscope: {self.label}.load_state_dict failed; the monitor starts with a "
                f"fresh state (counters and rules from zero) ({type(err).__name__}: {err})",
            )
