"""What every normscope callback shares: the read schedule and the fail-open guards.

A monitor must never crash, stall or corrupt the run it watches. Every Lightning hook a
:class:`MonitorCallback` subclass defines is wrapped (:meth:`MonitorCallback.__init_subclass__`):

* a failure inside a hook or a read: one warning naming it, the hooks removed, the monitor
  disabled, the fit goes on (:func:`fail_open`); configuration errors raised in ``setup`` or
  ``on_fit_start`` (``MisconfigurationException``) still stop the fit before it starts;
* a failure in ``state_dict`` / ``load_state_dict``: one warning; the checkpoint is saved without
  the monitor's state, or the monitor starts afresh -- the checkpoint itself is never lost;
* in :meth:`MonitorCallback._publish`, a logger that raises is skipped for the monitor's metrics
  from then on (its other metrics and the other loggers are untouched), a rule that raises is
  disabled, a sink that raises is removed -- each with one warning, the monitor goes on.

Finer failures are handled below: a tap whose tensor it cannot read disables that layer only
(:mod:`normscope.taps.hooks`), and so does a read that fails for one layer (the trackers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import (
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    Strategy,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from normscope.callbacks.wandb_extras import define_summaries
from normscope.integrations.layers import select_layers
from normscope.monitors.names import check_name, named_key, named_metrics

__all__ = ["MonitorCallback", "check_strategy", "compiled", "eager_forwards", "fail_open"]


def fail_open(
    method: Callable[..., Any], *, reraise: tuple[type[BaseException], ...] = ()
) -> Callable[..., Any]:
    """A monitor must never crash or stall training: on its own failure it warns once,
    removes its hooks, disables itself, and the fit goes on. Exceptions of the ``reraise``
    types propagate (configuration errors at ``setup``)."""
    if getattr(method, "_normscope_guarded", False):
        return method

    @functools.wraps(method)
    def guarded(self: MonitorCallback, *args: Any, **kwargs: Any) -> Any:
        if args and type(args[0]).__name__ == "Fabric" and _is_fabric(args[0]):
            return _via_fabric(self, method.__name__, args, kwargs)  # Fabric(callbacks=[...])
        if self.disabled:
            self._keep_in_step(method.__name__, args)
            return None
        try:
            return method(self, *args, **kwargs)
        except reraise:
            raise
        except Exception as err:  # noqa: BLE001 - fail-open is the contract
            self._disable(f"{method.__name__}: {type(err).__name__}: {err}")
            self._keep_in_step(method.__name__, args)
            return None

    guarded._normscope_guarded = True  # type: ignore[attr-defined]
    return guarded


def _is_fabric(obj: Any) -> bool:
    from normscope.integrations.fabric import is_fabric

    return is_fabric(obj)


def _via_fabric(monitor: MonitorCallback, hook: str, args: tuple, kwargs: dict) -> Any:
    """A hook called by ``fabric.call`` with the ``Fabric`` as the trainer: routed through
    :mod:`normscope.integrations.fabric` (a loop view of the Fabric), fail-open like any hook."""
    from normscope.integrations.fabric import fabric_call

    try:
        return fabric_call(monitor, hook, args, kwargs)
    except MisconfigurationException:
        raise
    except Exception as err:  # noqa: BLE001 - fail-open is the contract
        if not monitor.disabled:
            monitor._disable(f"{hook} (Fabric): {type(err).__name__}: {err}")
        return None


def _guard_state(method: Callable[..., Any]) -> Callable[..., Any]:
    """``state_dict`` / ``load_state_dict`` that never break a checkpoint: on failure, one
    warning; no monitor state in the checkpoint, or a fresh monitor state on resume."""
    if getattr(method, "_normscope_guarded", False):
        return method
    saving = method.__name__ == "state_dict"

    @functools.wraps(method)
    def guarded(self: MonitorCallback, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as err:  # noqa: BLE001
            then = (
                "the checkpoint is saved without the monitor's state (a run resumed from it "
                "starts its baselines afresh)"
                if saving
                else "the monitor starts with a fresh state (baselines from the next read)"
            )
            self._warn_once(
                f"state:{method.__name__}",
                f"normscope: {self.label}.{method.__name__} failed; {then} "
                f"({type(err).__name__}: {err})",
            )
            return {} if saving else None

    guarded._normscope_guarded = True  # type: ignore[attr-defined]
    return guarded


#: constructor arguments left out of state_key (see MonitorCallback.state_key)
_UNKEYED = frozenset({"self", "every_n_steps", "layers", "verbose", "overhead_warn", "alerts"})
_PLAIN = (type(None), bool, int, float, str)


def stable_repr(value: Any) -> str:
    """A text of ``value`` that is the same in every process (no memory address): plain values
    by ``repr``; sequences and dicts item by item; functions, methods and classes by their
    qualified name; a tensor by shape and dtype; any other object by its class's qualified name
    and its public plain attributes (a rule's thresholds)."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(stable_repr(v) for v in value)
        return f"[{inner}]"  # a list and a tuple of the same items: one key
    if isinstance(value, dict):
        items = sorted((str(k), stable_repr(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}:{value.dtype}"
    qualname = getattr(value, "__qualname__", None)
    if isinstance(qualname, str):
        return f"{getattr(value, '__module__', None) or ''}.{qualname}".lstrip(".")
    cls = type(value)
    attrs = sorted(
        (k, v)
        for k, v in getattr(value, "__dict__", {}).items()
        if not k.startswith("_") and isinstance(v, _PLAIN)
    )
    inner = ", ".join(f"{k}={v!r}" for k, v in attrs)
    return f"{cls.__module__}.{cls.__qualname__}({inner})"


# Every Lightning hook a monitor may define; each is guarded by fail_open.
_HOOKS = frozenset(n for n in dir(Callback) if n.startswith("on_")) | {"setup", "teardown"}
_STATE_HOOKS = frozenset({"state_dict", "load_state_dict"})


def _sink_name(sink: Any) -> str:
    fn = getattr(sink, "fn", None)
    if fn is not None:
        return getattr(fn, "__qualname__", None) or repr(fn)
    return type(sink).__name__


class MonitorCallback(Callback):
    """Schedule: the first optimiser step (the baseline) and every ``every_n_steps``-th one are
    sampled; all gradient-accumulation micro-batches of a sampled step share its window.

    Every Lightning hook a subclass defines is guarded (module docstring); per-read lists
    (``alerts_fired``, ``history``) keep their last :attr:`keep_last` entries.
    """

    keep_last: int = 1000
    #: per-layer keys sent to the loggers: "all", "none" or the k worst layers (an int);
    #: see normscope.integrations.layers. Set by the subclasses' ``log_per_layer`` argument.
    log_per_layer: str | int = "all"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, fn in list(vars(cls).items()):
            if not callable(fn):
                continue
            if name in ("setup", "on_fit_start"):
                setattr(cls, name, fail_open(fn, reraise=(MisconfigurationException,)))
            elif name in _HOOKS:
                setattr(cls, name, fail_open(fn))
            elif name in _STATE_HOOKS:
                setattr(cls, name, _guard_state(fn))

    #: plain (not sampled) steps timed before a read's cost is judged against them
    min_timed_steps: int = 20

    def __init__(
        self, every_n_steps: int, overhead_warn: float | None = 0.05, name: str | None = None
    ) -> None:
        try:
            self.name = check_name(name, type(self).__name__)
        except ValueError as err:
            raise MisconfigurationException(str(err)) from err
        if (
            not isinstance(every_n_steps, int)
            or isinstance(every_n_steps, bool)
            or every_n_steps < 1
        ):
            raise MisconfigurationException(
                f"{type(self).__name__}: every_n_steps must be an int >= 1, got {every_n_steps!r}"
            )
        if overhead_warn is not None and not (
            isinstance(overhead_warn, (int, float)) and overhead_warn > 0
        ):
            raise MisconfigurationException(
                f"{type(self).__name__}: overhead_warn must be None or a fraction > 0, got "
                f"{overhead_warn!r}"
            )
        self.every_n_steps = every_n_steps
        self.overhead_warn = overhead_warn
        self._clock_last: float | None = None
        self._plain_seconds = 0.0
        self._plain_steps = 0
        self._read_seconds: float | None = None
        self.disabled = False
        self.failure: str | None = None
        self._deferred = 0
        self._step_at_batch_start = -1
        self._baseline_step = 0  # 1 on a compiled model: see compiled()
        self._warned: set[str] = set()
        # Ranks in step (see _handshake): a failed monitor owes its peers one handshake.
        self._owes_handshake = True
        self._handshake_step = -2
        self._stop_decided_step = -2
        self._skipped_loggers: set[int] = set()
        self._failed_rules: set[int] = set()

    @property
    def label(self) -> str:
        """``DeadDirectionMonitor``, or with a name ``DeadDirectionMonitor[fast]`` (messages,
        alerts)."""
        name = getattr(self, "name", None)
        return f"{type(self).__name__}[{name}]" if name else type(self).__name__

    # ------------------------------------------------------------ checkpoint key
    def _remember_arguments(self, init: Callable[..., Any], given: dict[str, Any]) -> None:
        """Keep, for :attr:`state_key`, every argument of ``init`` (the monitor's own
        ``__init__``) that differs from its default, as a stable text (:func:`stable_repr`).
        Called with ``locals()`` at the top of ``__init__``, before anything changes them."""
        keyed: dict[str, str] = {}
        for pname, param in inspect.signature(init).parameters.items():
            if pname in _UNKEYED or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            value = stable_repr(given.get(pname, param.default))
            if param.default is not param.empty and value == stable_repr(param.default):
                continue
            keyed[pname] = value
        self._keyed_arguments = dict(sorted(keyed.items()))

    @property
    def state_key(self) -> str:
        """The monitor's key in a checkpoint's callback states: its class, ``every_n_steps``,
        ``layers`` and every other constructor argument given a value other than its default
        (``verbose``, ``overhead_warn`` and ``alerts`` aside: they change how a read is shown or
        delivered, not what is read or kept). Two monitors that differ in any of them -- a
        ``name``, a ``tolerance`` -- coexist in one Trainer and each resumes its own state; a
        monitor with default arguments keeps the key of earlier versions,
        ``DeadDirectionMonitor{'every_n_steps': 50, 'layers': 'auto'}``."""
        return self._generate_state_key(
            every_n_steps=self.every_n_steps,
            layers=str(self.layers),  # type: ignore[attr-defined]
            **getattr(self, "_keyed_arguments", {}),
        )

    # ------------------------------------------------------------ lifecycle
    # Shared by every monitor; a subclass gives ``tracker`` (None until built),
    # ``_build_tracker(pl_module)`` and, optionally, ``_check_setup(trainer)``. Defined here, so
    # not wrapped by __init_subclass__: guarded explicitly, configuration errors stop the fit.
    @functools.partial(fail_open, reraise=(MisconfigurationException,))
    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.tracker is not None:
            return
        self._check_names(trainer)
        self._check_setup(trainer)
        if is_overridden("configure_model", pl_module):
            return  # its layers may be built (or sharded) there, after setup: see on_fit_start
        self._build_tracker(pl_module)

    @functools.partial(fail_open, reraise=(MisconfigurationException,))
    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        if self.tracker is None:
            self._build_tracker(pl_module)

    def _check_names(self, trainer: Trainer) -> None:
        """Warn (once, from the first of them) when another monitor of this class in the
        Trainer has the same name: both would log the same keys, their rows interleaved."""
        same = [
            cb
            for cb in getattr(trainer, "callbacks", [])
            if type(cb) is type(self) and getattr(cb, "name", None) == self.name
        ]
        if len(same) > 1 and same[0] is self:
            family = named_key(
                "dd/" if "DeadDirection" in type(self).__name__ else "sm/", self.name
            )
            rank_zero_warn(
                f"normscope: {len(same)} {self.label}s in this Trainer log the same keys "
                f"({family}...), their reads interleaved; give each its own "
                f"name=... (keys dd[name]/...)"
            )

    def _check_setup(self, trainer: Trainer) -> None:
        """Refuse, at setup, what the monitor cannot read (``MisconfigurationException``)."""
        return None

    # ------------------------------------------------------------ cost guard
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
        step = self._plain_seconds / self._plain_steps
        share = read_seconds / (self.every_n_steps * step) if step > 0 else math.inf
        if share <= self.overhead_warn:
            return
        suggest = math.ceil(read_seconds / (self.overhead_warn * step)) if step > 0 else None
        self._warn_once(
            "cost",
            f"normscope: a {self.label} read takes {read_seconds:.3g} s against a mean "
            f"training step of {step:.3g} s: about {share:.0%} of training time at "
            f"every_n_steps={self.every_n_steps}. every_n_steps={suggest} keeps it under "
            f"{self.overhead_warn:.0%} (or read fewer layers: layers=[...], max_memory=...); "
            "overhead_warn=None turns this warning off",
        )

    def _in_window(self, step: int) -> bool:
        return (
            step == self._baseline_step
            or (step + 1) % self.every_n_steps == 0
            or self._deferred > 0
        )

    def _publish(self, trainer: Trainer, metrics: dict[str, float], step: int) -> list[Any]:
        """Log a read to every logger and ``trainer.callback_metrics``, evaluate the rules,
        and deliver what fired to the sinks (rank zero). Returns the alerts that fired.

        A logger, rule or sink that raises is warned about once and left out from then on
        (loggers: for this monitor's metrics only); the others, and the monitor, go on."""
        monitor = self.label
        # Loggers and callback_metrics get the keys under the monitor's name (dd[name]/...);
        # the rules see the canonical dd/ keys. log_per_layer ranks the canonical keys.
        logged = named_metrics(select_layers(metrics, self.log_per_layer), self.name)
        for lg in trainer.loggers:
            if id(lg) in self._skipped_loggers:
                continue
            try:
                define_summaries(lg, logged)  # W&B: run-level minima summarise as minima
            except Exception as err:  # noqa: BLE001 - the summaries only
                self._warn_once("summaries", f"normscope: W&B define_metric failed ({err})")
            try:
                lg.log_metrics(logged, step=step)
            except Exception as err:  # noqa: BLE001 - that logger only
                self._skipped_loggers.add(id(lg))
                self._warn_once(
                    f"logger:{id(lg)}",
                    f"normscope: logger {type(lg).__name__} failed to log {monitor}'s metrics "
                    f"and is skipped for them from now on; its other metrics and the other "
                    f"loggers are not affected ({type(err).__name__}: {err})",
                )
        device = trainer.strategy.root_device
        trainer.callback_metrics.update(
            {
                k: torch.tensor(v, dtype=torch.float32, device=device)
                for k, v in named_metrics(metrics, self.name).items()
            }
        )
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
                    f"normscope: alert rule {getattr(rule, 'name', type(rule).__name__)!r} "
                    f"failed and is disabled; {monitor} and its other rules go on "
                    f"({type(err).__name__}: {err})",
                )
        fired = [self._own_alert(a) for a in fired]
        self.alerts_fired.extend(fired)
        self._keep_bounded()
        if trainer.is_global_zero:
            for alert in fired:
                for sink in list(self.sinks):
                    try:
                        sink(alert, trainer)
                    except Exception as err:  # noqa: BLE001 - that sink only
                        self.sinks.remove(sink)
                        self._warn_once(
                            f"sink:{id(sink)}",
                            f"normscope: alert sink {_sink_name(sink)} failed and is removed; "
                            f"{monitor} and its other sinks go on ({type(err).__name__}: {err})",
                        )
        return fired

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

    def _keep_bounded(self) -> None:
        """Per-read lists keep their last ``keep_last`` entries: a week-long run with a read
        every few steps must not grow the callback (or its checkpoints) without bound."""
        for attr in ("alerts_fired", "history"):
            items = getattr(self, attr, None)
            if isinstance(items, list) and len(items) > self.keep_last:
                del items[: len(items) - self.keep_last]

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        rank_zero_warn(message)

    def _detach(self) -> None:  # overridden: remove hooks
        return None

    # ------------------------------------------------------------ ranks in step
    def _handshake(
        self, trainer: Trainer, rows: torch.Tensor, *, failed: bool
    ) -> tuple[float, bool]:
        """The first collective of every window's end, on every rank: the global sum of
        ``rows`` (the dead-direction monitor's deferral decision) and whether any rank's monitor
        has failed. A rank whose monitor failed still makes this one call
        (:meth:`_keep_in_step`); then every rank stops reading together, and no rank waits for
        a collective that will not come."""
        device = trainer.strategy.root_device
        flags = torch.stack(
            [
                rows.to(device=device, dtype=torch.float64).reshape(()),
                torch.tensor(float(failed), dtype=torch.float64, device=device),
            ]
        )
        total, failures = trainer.strategy.reduce(flags, reduce_op="sum").tolist()
        self._handshake_step = self._step_at_batch_start
        return total, failures > 0

    def _keep_in_step(self, hook: str, args: tuple[Any, ...]) -> None:
        """Called for every hook while disabled (and right after a failure): take part in the
        one handshake the peers expect, then nothing more. Never raises."""
        if not self._owes_handshake or not args:
            return
        trainer = args[0]
        try:
            if trainer.world_size <= 1:
                self._owes_handshake = False
            elif hook == "on_train_batch_start":
                self._step_at_batch_start = trainer.global_step
            elif hook == "on_train_batch_end":
                completed = self._step_at_batch_start
                if trainer.global_step == completed or not self._in_window(completed):
                    return
                if self._handshake_step != completed:
                    self._owes_handshake = False
                    self._handshake(trainer, torch.zeros((), dtype=torch.float64), failed=True)
                elif getattr(self, "stop_on_alert", False) and self._stop_decided_step != completed:
                    # Failed after this window's handshake: the peers still take the read's
                    # stop decision; vote "no" in it, and owe them the next handshake.
                    self._stop_decided_step = completed
                    trainer.strategy.reduce_boolean_decision(False, all=False)
        except Exception:  # noqa: BLE001 - nothing more a failed monitor can do
            self._owes_handshake = False

    def _peers_failed(self, trainer: Trainer, rows: torch.Tensor) -> tuple[float, bool]:
        """The handshake of a healthy rank at a window's end: ``(global rows, stop)``; on
        ``stop`` (a peer's monitor failed) this monitor is disabled too, silently but on rank 0.
        One process: no collective, ``(rows, False)``."""
        if trainer.world_size <= 1:
            return float(rows), False
        total, peer_failed = self._handshake(trainer, rows, failed=False)
        if peer_failed:
            self._owes_handshake = False
            self._disable(
                "the monitor on another rank failed (its warning says why); every rank stops "
                "reading at the same step so that their collectives stay in step",
                warn=trainer.is_global_zero,
            )
        return total, peer_failed

    def _disable(self, reason: str, *, warn: bool = True) -> None:
        self.disabled = True
        self.failure = reason
        self._detach()
        if warn:
            # On the rank that failed, whichever it is (rank_zero_warn would hide rank 1's).
            warnings.warn(
                f"normscope: {self.label} disabled itself after an internal error; "
                f"training continues without it ({reason})",
                UserWarning,
                stacklevel=3,
            )


_SINGLE_AND_DDP = "a single device; DDP (DDPStrategy: strategy='ddp', 'ddp_spawn', 'ddp_fork')"
_FSDP2 = (
    "FSDP2 (ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1), with "
    "torch.distributed.fsdp.fully_shard applied in configure_model)"
)
_REFUSED: tuple[tuple[type[Strategy], str], ...] = (
    (
        DeepSpeedStrategy,
        "ZeRO stage 3 partitions every parameter, so a gamma is not whole where the monitor reads "
        "it, and no DeepSpeed stage has been tested with normscope",
    ),
    (
        FSDPStrategy,
        "FSDP1 (FullyShardedDataParallel) keeps each gamma in flat shards outside the forward, "
        "where the monitor reads it (Lightning also runs it on CUDA only, where it is untested)",
    ),
)


def check_strategy(strategy: Strategy, monitor: str, *, fsdp2: bool = True) -> None:
    """Refuse, at ``setup``, a strategy whose parameters the monitor cannot read whole.

    Args:
        strategy: ``trainer.strategy``.
        monitor: the monitor's name, for the message.
        fsdp2: whether the monitor reads FSDP2 (DTensor-sharded) parameters; if not,
            ``ModelParallelStrategy`` is refused too.

    Raises:
        MisconfigurationException: naming the strategy, why, and what is supported.

    Example::

        from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
        check_strategy(DDPStrategy(), "DeadDirectionMonitor")   # passes
        check_strategy(FSDPStrategy(), "DeadDirectionMonitor")  # MisconfigurationException:
        # "DeadDirectionMonitor: FSDPStrategy is not supported: FSDP1 ... Supported: ..."
    """
    refused = list(_REFUSED)
    if not fsdp2:
        refused.append(
            (
                ModelParallelStrategy,
                "its weight and probe reads take whole nn.Linear weights, and FSDP2 / tensor "
                "parallelism shard them as DTensors",
            )
        )
    elif isinstance(strategy, ModelParallelStrategy) and _tensor_parallel_size(strategy) > 1:
        refused.append(
            (
                ModelParallelStrategy,
                "tensor parallelism is untested: the reads reduce over every process, so rows "
                "that tensor-parallel peers share would be counted once per peer",
            )
        )
    supported = f"{_SINGLE_AND_DDP}; {_FSDP2}" if fsdp2 else _SINGLE_AND_DDP
    for cls, why in refused:
        if isinstance(strategy, cls):
            raise MisconfigurationException(
                f"{monitor}: {type(strategy).__name__} is not supported: {why}. Supported: "
                f"{supported}."
            )


def compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a submodule is ``torch.compile``d: Lightning's
    ``trainer.fit(torch.compile(model))``, ``self.model = torch.compile(...)`` (an
    ``OptimizedModule``) or ``module.compile()`` in place.

    Why it matters: dynamo caches the graph of the first compiled forward, and a forward traced
    with the gate open breaks its graph at every hooked module (the fold runs eagerly). Traced
    closed first, the model compiles whole and the open gate adds a second, cached graph for the
    sampled steps only; traced open first, the broken graph is what every step runs. So on a
    compiled model the baseline window is the second optimiser step, not the first."""
    if getattr(module, "_compiler_ctx", None) is not None:
        return True
    optimized = getattr(torch._dynamo, "OptimizedModule", ())
    return any(
        isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


def _tensor_parallel_size(strategy: ModelParallelStrategy) -> int:
    try:
        return int(strategy.device_mesh["tensor_parallel"].size())
    except (RuntimeError, KeyError):  # no mesh yet: the size asked for ("auto": devices per node)
        size = strategy._tensor_parallel_size
        return size if isinstance(size, int) else 2


@contextlib.contextmanager
def eager_forwards() -> Iterator[None]:
    """Run the forwards inside eagerly, even those of a ``torch.compile``d model: the monitor's
    own forwards (the residual discovery forward, whose temporary hooks compare tensor
    identities) must never be traced by dynamo, nor add graphs to the training cache."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    if set_stance is None:  # pragma: no cover - older torch
        with torch._dynamo.config.patch(disable=True):
            yield
        return
    with set_stance("force_eager"):
        yield
