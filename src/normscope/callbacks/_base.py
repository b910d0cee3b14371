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

import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from normscope.alerts import build_sinks

# Moved out by job; every name stays importable from here (the private ones re-exported).
from normscope.callbacks.arguments import _PLAIN, _UNKEYED, stable_repr  # noqa: F401
from normscope.callbacks.cost import CostGuard
from normscope.callbacks.guards import (  # noqa: F401
    _HOOKS,
    _STATE_HOOKS,
    _guard_state,
    _is_fabric,
    _via_fabric,
    fail_open,
)
from normscope.callbacks.handshake import Handshake
from normscope.callbacks.publishing import Publishing, _sink_name  # noqa: F401
from normscope.callbacks.strategy import (  # noqa: F401
    _FSDP2,
    _REFUSED,
    _SINGLE_AND_DDP,
    _tensor_parallel_size,
    check_strategy,
    compiled,
    eager_forwards,
)
from normscope.integrations.layers import check_log_per_layer
from normscope.monitors.names import check_name

__all__ = ["MonitorCallback", "check_strategy", "compiled", "eager_forwards", "fail_open"]


class MonitorCallback(Publishing, Handshake, CostGuard, Callback):
    """Schedule: the first optimiser step (the baseline) and every ``every_n_steps``-th one are
    sampled; all gradient-accumulation micro-batches of a sampled step share its window.

    Every Lightning hook a subclass defines is guarded (module docstring); per-read lists
    (``alerts_fired``, ``history``) keep their last :attr:`keep_last` entries.
    """

    keep_last: int = 1000
    #: per-layer keys sent to the loggers: "all", "none" or the k worst layers (an int);
    #: see normscope.integrations.layers. Set by the subclasses' ``log_per_layer`` argument.
    log_per_layer: str | int = "all"

    # Supplied by every subclass's __init__ (the shared code below and its mixins use them):
    tracker: Any  # the monitor's tracker; None until built (``_build_tracker(pl_module)``)
    layers: str | list[str]  # "auto" or module paths: part of state_key
    rules: list[Any]  # alert rules, evaluated on every read (_publish); checkpointed by name
    sinks: list[Any]  # alert sinks, called on rank zero with what fired
    alerts_fired: list[Any]  # every alert fired, last keep_last kept
    reads: int  # reads made

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

    def _keep_shared_arguments(
        self,
        layers: str | Iterable[str],
        alerts: Sequence[str | Callable[..., Any]],
        log_per_layer: str | int,
        example_forward: Callable[..., Any] | None,
        verbose: bool,
        seed: int,
    ) -> None:
        """Check and keep the arguments every monitor takes, the same way for each (a bad one is
        a ``MisconfigurationException`` naming the monitor), and start the per-read state."""
        owner = type(self).__name__
        try:
            self.log_per_layer = check_log_per_layer(log_per_layer, owner)
        except ValueError as err:
            raise MisconfigurationException(str(err)) from err
        paths = (
            None if isinstance(layers, str) or not isinstance(layers, Iterable) else list(layers)
        )
        if layers != "auto" and (paths is None or not all(isinstance(x, str) for x in paths)):
            raise MisconfigurationException(
                f"{owner}: layers must be 'auto' or a list of module paths, got {layers!r}"
            )
        try:
            self.sinks = build_sinks(alerts)
        except ValueError as err:
            raise MisconfigurationException(f"{owner}: {err}") from err
        self.layers = "auto" if paths is None else paths
        self.example_forward = example_forward
        self.verbose = verbose
        self.seed = seed
        self.reads = 0
        self.alerts_fired = []

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

    def _check_setup(self, trainer: Trainer) -> None:
        """Refuse, at setup, what the monitor cannot read (``MisconfigurationException``)."""
        return None

    def _in_window(self, step: int) -> bool:
        return (
            step == self._baseline_step
            or (step + 1) % self.every_n_steps == 0
            or self._deferred > 0
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        rank_zero_warn(message)

    def _local(self, fn: Callable[[], Any], what: str) -> None:
        """Run a part of a read that one rank runs alone (W&B charts, the read line): a failure
        there is warned about once and the reads go on without it."""
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - that part only
            self._warn_once(
                f"local:{what}",
                f"normscope: {self.label}'s {what} failed; the reads go on without it "
                f"({type(err).__name__}: {err})",
            )

    # Hooks every monitor shares. Defined here, so not wrapped by __init_subclass__: guarded.
    @fail_open
    def on_validation_start(self, trainer: Trainer, pl_module: Any) -> None:
        if self.tracker is not None:
            self.tracker.gate.open = False

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        self._detach()

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        self._detach()

    def _detach(self) -> None:
        """Close the gate and remove the tracker's hooks (at teardown, on an exception, and on
        a failure: see _disable)."""
        if self.tracker is not None:
            self.tracker.gate.open = False
            self.tracker.detach()

    # ------------------------------------------------------------ rule state
    def _rule_keys(self) -> list[str]:
        """Each rule's key in a checkpoint: its ``name`` (its class's without one); a second
        rule of the same name ``<name>#2``, a third ``<name>#3``, and so on."""
        keys: list[str] = []
        for rule in self.rules:
            name = str(getattr(rule, "name", type(rule).__name__))
            key, n = name, 1
            while key in keys:
                n += 1
                key = f"{name}#{n}"
            keys.append(key)
        return keys

    def _rule_states(self) -> dict[str, Any]:
        """The rules' states for a checkpoint, by rule key (:meth:`_rule_keys`)."""
        return {key: rule.state_dict() for key, rule in zip(self._rule_keys(), self.rules)}

    def _load_rule_states(self, saved: Any) -> None:
        """Restore the rules' states: a dict by rule key (a rule not in it keeps its state), or
        the list of earlier versions' checkpoints, by position."""
        if isinstance(saved, dict):
            pairs = [(r, saved[k]) for k, r in zip(self._rule_keys(), self.rules) if k in saved]
        else:
            pairs = list(zip(self.rules, saved))
        for rule, rule_state in pairs:
            rule.load_state_dict(rule_state)

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
