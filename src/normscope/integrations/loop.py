"""One engine for every training loop: a normscope monitor driven through a :class:`LoopView`.

The Lightning monitors (:class:`~normscope.DeadDirectionMonitor`,
:class:`~normscope.SignMagnitudeMonitor`) hold the whole schedule of a read: when a window opens
(the baseline step, every ``every_n_steps``-th step, deferrals), the gamma snapshot, the padding
mask, the cross-process handshake, the read itself, the alert rules and sinks, the fail-open
guards. What they ask of their loop is small: the optimiser step count, the process count and
rank, a device, a way to reduce a tensor, somewhere to log. :class:`LoopView` is that and no
more, so that any loop can drive the *same* monitor methods the Lightning ``Trainer`` calls:

* :class:`Watch` (plain PyTorch, Fabric): :meth:`Watch.start` before the forwards of an
  optimiser step, :meth:`Watch.stepped` after ``optimizer.step()``, or ``with watch.step(batch):``
  around both; the trackers' ``step()`` methods are a shortcut to it;
* :mod:`normscope.integrations.fabric`: ``Fabric(callbacks=[monitor])``, or :func:`watch_fabric`;
* :mod:`normscope.integrations.transformers`: a Hugging Face ``TrainerCallback``.

An adapter only says when a step starts, when the optimiser stepped, and where to log; the
reads are those of the Lightning run, key for key and bit for bit on the same rows.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["CallableLogger", "LoopView", "StepResult", "Watch", "as_logger"]


class CallableLogger:
    """A logging function as a logger: ``log_metrics(metrics, step)`` calls ``fn(metrics,
    step=step)`` when ``fn`` takes a ``step`` argument (``wandb.log``), else ``fn(metrics)``.

    Example::

        >>> seen = []
        >>> CallableLogger(lambda m, step: seen.append((step, m))).log_metrics({"dd/x": 1.0}, 3)
        >>> seen
        [(3, {'dd/x': 1.0})]
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        if not callable(fn):
            raise TypeError(f"normscope: log must be a callable or a logger, got {fn!r}")
        self.fn = fn
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # builtins without a signature
            params = {}
        self._takes_step = "step" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._takes_step:
            self.fn(dict(metrics), step=step)
        else:
            self.fn(dict(metrics))


def as_logger(target: Any) -> Any:
    """A logger object (anything with ``log_metrics(metrics, step)``: Lightning's and Fabric's
    loggers) as is; a callable wrapped in :class:`CallableLogger`."""
    if hasattr(target, "log_metrics"):
        return target
    return CallableLogger(target)


class _DistStrategy:
    """The two collectives a monitor makes, over ``torch.distributed``'s default group (no-ops
    on one process): what ``trainer.strategy`` gives a monitor under Lightning."""

    def __init__(self, device: torch.device) -> None:
        self.root_device = device

    @staticmethod
    def _world() -> int:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return 1

    def reduce(self, tensor: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
        if self._world() == 1:
            return tensor
        import torch.distributed as dist

        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out / self._world() if reduce_op in ("mean", "avg") else out

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
        world = self._world()
        if world == 1:
            return bool(decision)
        votes = self.reduce(
            torch.tensor(float(bool(decision)), dtype=torch.float64, device=self.root_device)
        )
        return bool(votes.item() == world) if all else bool(votes.item() > 0)


class LoopView:
    """The part of a Lightning ``Trainer`` a normscope monitor uses, for any other loop.

    Args:
        loggers: where reads go: logger objects (``log_metrics(metrics, step)``) or callables.
        device: the device of the model's parameters (the collectives' tensors live there).
        precision: the loop's precision, in Lightning's spelling (``"bf16-true"`` makes the
            dead-direction monitor suggest a looser ``null_tol``).

    ``global_step`` is the number of optimiser steps completed; the adapter advances it.
    ``should_stop`` is set by a monitor with ``stop_on_alert=True`` (decided across ranks).
    """

    def __init__(
        self,
        loggers: Sequence[Any] = (),
        *,
        device: torch.device | str = "cpu",
        precision: str = "32-true",
    ) -> None:
        self.global_step = 0
        self.loggers = [as_logger(lg) for lg in loggers]
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.should_stop = False
        self.precision = precision
        self.strategy = _DistStrategy(torch.device(device))

    @property
    def world_size(self) -> int:
        return _DistStrategy._world()

    @property
    def global_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if self.world_size > 1 else 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0


@dataclass
class StepResult:
    """What one optimiser step under :meth:`Watch.step` gave: the report of a read taken at its
    end (else ``None``), the alerts that read fired, and whether a ``stop_on_alert`` monitor asks
    the loop to stop."""

    report: Any = None
    alerts: list[Any] = field(default_factory=list)
    should_stop: bool = False


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class Watch:
    """Drive a normscope monitor from a loop you wrote (plain PyTorch, Fabric, anything).

    Args:
        monitor: a :class:`~normscope.DeadDirectionMonitor` or
            :class:`~normscope.SignMagnitudeMonitor` (its arguments: schedule, rules, sinks...).
        model: the model it watches (the module whose forward the loop calls; wrappers such
            as DDP's are fine, the hooks sit on the modules inside).
        log: where reads go: a callable (``wandb.log``, ``print``...) or a logger object, or a
            list of them.
        precision: the loop's precision in Lightning's spelling (only ``"bf16-true"`` /
            ``"16-true"`` change anything: a warning about ``null_tol``).

    Every process of a distributed run must make the same calls at the same steps (the reads
    reduce over ``torch.distributed``'s default group).

    Example::

        from normscope import DeadDirectionMonitor
        from normscope.integrations import Watch

        watch = Watch(DeadDirectionMonitor(every_n_steps=50), model, log=wandb.log)
        for x, y in loader:
            with watch.step((x, y)) as result:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            if result.alerts: ...
        watch.close()
    """

    def __init__(
        self,
        monitor: Any,
        model: nn.Module,
        *,
        log: Any = None,
        precision: str = "32-true",
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"normscope.Watch: model must be an nn.Module, got {type(model)}")
        loggers = [] if log is None else list(log) if isinstance(log, (list, tuple)) else [log]
        self.monitor = monitor
        self.model = model
        self.loop = LoopView(loggers, device=device or _model_device(model), precision=precision)
        self._set_up = False
        self._batch_idx = 0
        self._batch: Any = None
        self._open = False

    @property
    def global_step(self) -> int:
        """Optimiser steps completed under this watch."""
        return self.loop.global_step

    def _setup(self) -> None:
        self._set_up = True
        monitor = self.monitor
        if monitor.tracker is None:
            # What Lightning's setup does, without its LightningModule-only checks.
            monitor._check_setup(self.loop)
            monitor.on_fit_start(self.loop, self.model)

    def start(self, batch: Any = None) -> None:
        """Before the forwards of an optimiser step (of each micro-batch, with gradient
        accumulation). ``batch``: what the forward gets; its ``attention_mask`` (a dict batch)
        excludes padding. At the first call the residual discovery hooks are armed: they watch
        this step's own forwards, and the taps are registered at :meth:`stepped` (so the first
        read is step 1's; a monitor with ``example_forward=`` instead runs its own discovery
        forward here)."""
        if not self._set_up:
            self._setup()
        self._batch = batch
        self._open = True
        self.monitor.on_train_batch_start(self.loop, self.model, batch, self._batch_idx)

    def stepped(self) -> StepResult:
        """After ``optimizer.step()``: closes the window and reads when one is due. Returns what
        the read gave (``report`` None on a step without a read)."""
        if not self._open:
            raise RuntimeError("normscope.Watch.stepped(): call start() before the step's forwards")
        self._open = False
        monitor = self.monitor
        reads, fired = monitor.reads, len(monitor.alerts_fired)
        self.loop.global_step += 1
        monitor.on_train_batch_end(self.loop, self.model, None, self._batch, self._batch_idx)
        self._batch_idx += 1
        self._batch = None
        if monitor.reads == reads:
            return StepResult(should_stop=self.loop.should_stop)
        alerts = list(monitor.alerts_fired[fired:]) if len(monitor.alerts_fired) > fired else []
        return StepResult(monitor.last_report, alerts, self.loop.should_stop)

    @contextlib.contextmanager
    def step(self, batch: Any = None) -> Iterator[StepResult]:
        """Around one optimiser step (forwards, backward, ``optimizer.step()``): :meth:`start`
        on entry, :meth:`stepped` on exit; the yielded :class:`StepResult` is filled at exit.
        A step that raises is not counted (the window stays shut)."""
        result = StepResult()
        self.start(batch)
        try:
            yield result
        except BaseException:
            self._open = False
            if self.monitor.tracker is not None:
                self.monitor.tracker.gate.open = False
            raise
        got = self.stepped()
        result.report, result.alerts, result.should_stop = got.report, got.alerts, got.should_stop

    def close(self) -> None:
        """The end of training: the summary line (``verbose``) and the hooks removed."""
        if self._set_up:
            self.monitor.on_fit_end(self.loop, self.model)
            self.monitor.teardown(self.loop, self.model, "fit")


def adopt(monitor: Any, tracker: Any) -> Any:
    """Give ``monitor`` an already built ``tracker`` (what its own setup would build)."""
    monitor.tracker = tracker
    kernel_rule = getattr(monitor, "kernel_rule", None)
    if kernel_rule is not None:
        from normscope.monitors.dead_direction import key_path

        kernel_rule.kinds = {key_path(n.name): n.kind for n in tracker.norms}
    baselines = getattr(monitor, "_baselines", None)
    if baselines:
        tracker.baselines.update(baselines)
    return monitor


def tracker_step(tracker: Any, monitor_cls: type, batch: Any, options: dict[str, Any]) -> Any:
    """The trackers' ``step()``: one :class:`Watch` per tracker, built at the first call from
    that call's ``options`` (the monitor's arguments plus ``log``) and reused after."""
    watch = getattr(tracker, "_normscope_watch", None)
    if watch is None:
        opts = dict(options)
        log = opts.pop("log", None)
        opts.setdefault("verbose", False)
        opts.setdefault("alerts", ("log",))
        if getattr(tracker, "sources", None) is not None:
            opts.setdefault("sources", tracker.sources)  # the monitor's SourceCollapseRule
        monitor = adopt(monitor_cls(**opts), tracker)
        if getattr(monitor, "source_rule", None) is not None:
            tracker.source_rule = monitor.sigma_rule
        watch = Watch(monitor, tracker.model, log=log)
        watch._set_up = True  # the tracker is the monitor's: nothing more to build
        tracker._normscope_watch = watch
    return watch.step(batch)
