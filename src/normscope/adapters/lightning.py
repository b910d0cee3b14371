"""The Lightning adapter: :class:`DeadDirectionMonitor` and :class:`SignMagnitudeMonitor` as
``lightning.pytorch.Callback`` s.

Each holds one :class:`~normscope.engine.Monitor` (``monitor.engine``) and turns the Trainer's
hooks into its three calls -- a step begins (``on_train_batch_start``), a step ended with
``trainer.global_step`` optimiser steps done (``on_train_batch_end``), training finished
(``on_train_end``) -- plus set-up (the strategy checked, the model's layers found), the gate
closed for validation, the hooks removed at teardown, and the checkpoint state. What a read
publishes goes to every logger (a ``WandbLogger`` also gets summaries, charts and alerts) and to
``trainer.callback_metrics``; ``stop_on_alert`` sets ``trainer.should_stop``.

Called by ``fabric.call(...)`` with a ``Fabric`` in the trainer's place, the same callback
hands each hook to a :class:`~normscope.adapters.fabric.FabricLoop` instead (one check, in
``_path``); the Trainer's side is :class:`TrainerPath`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden

from normscope._common import ConfigurationError
from normscope.adapters.fabric import FabricLoop, is_fabric, tensor_parallel_size
from normscope.alerts import Alert, AlertRule, Pager
from normscope.engine import Monitor, StepResult, Target
from normscope.families import DeadDirectionConfig, SignMagnitudeConfig
from normscope.families.dead_direction.config import SPECTRAL_EVERY

__all__ = [
    "DeadDirectionMonitor",
    "SignMagnitudeMonitor",
    "TrainerPath",
    "check_strategy",
    "lightning_targets",
]

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

    Raises:
        MisconfigurationException: naming the strategy, why, and what is supported.

    Example::

        from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
        check_strategy(DDPStrategy(), "DeadDirectionMonitor")   # passes
        check_strategy(FSDPStrategy(), "DeadDirectionMonitor")  # MisconfigurationException
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
    elif isinstance(strategy, ModelParallelStrategy) and tensor_parallel_size(strategy) > 1:
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


def lightning_targets(loggers: Sequence[Any]) -> list[Target]:
    """Lightning (or Fabric) loggers as the engine's targets: a ``WandbLogger`` with its run
    and Lightning's step key ``trainer/global_step``."""
    out = []
    for lg in loggers:
        if isinstance(lg, WandbLogger):
            out.append(
                Target(lg, wandb_run=lambda lg=lg: lg.experiment, step_key="trainer/global_step")
            )
        else:
            out.append(Target(lg))
    return out


def _config(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ConfigurationError as err:
        raise MisconfigurationException(str(err)) from err


class TrainerPath:
    """The hooks as the Lightning ``Trainer`` calls them: set-up (the strategy checked, the
    model watched), the steps by ``trainer.global_step``, the last read at ``on_train_end``,
    what a read asks of the Trainer (``callback_metrics``, the stop). Its Fabric twin is
    :class:`~normscope.adapters.fabric.FabricLoop`."""

    def __init__(self, engine: Monitor, trainer: Trainer) -> None:
        self.engine = engine
        self.trainer = trainer

    def setup(self, pl_module: LightningModule, stage: str) -> None:
        engine = self.engine
        if stage != "fit" or engine.disabled:
            return
        check_strategy(self.trainer.strategy, engine.family.kind, fsdp2=engine.family.fsdp2)
        if is_overridden("configure_model", pl_module) and engine.tracker is None:
            return  # its layers may be built (or sharded) there, after setup: see fit_start
        self._watch(pl_module)  # a monitor kept for a second fit: this fit's loggers

    def fit_start(self, pl_module: LightningModule) -> None:
        if self.engine.tracker is None and not self.engine.disabled:
            self._watch(pl_module)

    def _watch(self, pl_module: LightningModule) -> None:
        trainer, strategy = self.trainer, self.trainer.strategy
        try:
            _config(
                lambda: self.engine.watch(
                    pl_module,
                    log=lightning_targets(trainer.loggers),
                    device=strategy.root_device,
                    precision=str(trainer.precision),
                    async_default=strategy.root_device.type == "cuda",
                    async_ok=isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)),
                )
            )
        except MisconfigurationException:
            raise
        except Exception as err:  # noqa: BLE001 - fail-open is the contract
            self.engine.disable(f"setup: {type(err).__name__}: {err}")

    def batch_start(self, pl_module: LightningModule, batch: Any) -> None:
        self.engine.begin(self.trainer.global_step, batch)

    def batch_end(self) -> None:
        self._apply(self.engine.end(self.trainer.global_step))

    def train_end(self) -> None:
        self._apply(self.engine.finish())  # the last read is never lost

    def fit_end(self) -> None:
        return None

    def teardown(self) -> None:
        self.engine.detach()

    def _apply(self, result: StepResult | None) -> None:
        """What a published read asks of the Trainer: ``callback_metrics`` and the stop."""
        if result is None:
            return
        trainer = self.trainer
        if result.metrics:
            device = trainer.strategy.root_device
            trainer.callback_metrics.update(
                {
                    k: torch.tensor(v, dtype=torch.float32, device=device)
                    for k, v in result.metrics.items()
                }
            )
        if result.should_stop:
            trainer.should_stop = True


class _LightningMonitor(Callback):
    """What both Lightning monitors share: the engine, and the hooks that hand each call to the
    path of its caller (the Trainer's, or Fabric's under ``fabric.call``)."""

    engine: Monitor

    def __getattr__(self, name: str) -> Any:
        # reads of the engine (reads, last_report, alerts_fired, disabled, tracker...) and of
        # the family (sigma_rule, layers...) through the monitor; only called for what the
        # adapter itself does not have
        if name.startswith("__") or name in ("engine", "_fabric"):
            raise AttributeError(name)
        engine = self.__dict__.get("engine")
        if engine is None:
            raise AttributeError(name)
        if hasattr(engine, name):
            return getattr(engine, name)
        return getattr(engine.family, name)

    @property
    def state_key(self) -> str:
        return self.engine.state_key

    def _path(self, trainer: Any) -> TrainerPath | FabricLoop:
        """The path of this call: ``fabric.call`` passes a Fabric in the trainer's place."""
        if not is_fabric(trainer):
            return TrainerPath(self.engine, trainer)
        loop = self.__dict__.get("_fabric")
        if loop is None:
            loop = self._fabric = FabricLoop(trainer, self.engine)
        return loop

    # ------------------------------------------------------------ the hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._path(trainer).setup(pl_module, stage)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._path(trainer).fit_start(pl_module)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._path(trainer).batch_start(pl_module, batch)

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._path(trainer).batch_end()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.engine.pause()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._path(trainer).train_end()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._path(trainer).fit_end()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._path(trainer).teardown()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self.engine.detach()

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict)


class DeadDirectionMonitor(_LightningMonitor):
    r"""Log the dead-direction geometry of every norm layer and the residual stream's
    ``sigma_min`` depth profile while a model trains, and alert when the stream collapses.

    Every ``every_n_steps`` optimiser steps (and once at the first read step) the hooks fold
    that step's training rows into float64 accumulators; at the step's end the monitor reduces
    them across processes, runs the reads of docs/metrics.md §1 and logs them to every logger
    and ``trainer.callback_metrics`` as ``dd/<module path>/<metric>`` and ``dd/<metric>``.

    Args:
        every_n_steps, rules, alerts, stop_on_alert, verbose, overhead_warn, log_per_layer,
            name, async_reads, paging: the engine's (:class:`~normscope.engine.Monitor`).
        layers, residual, rows_per_read, alert_below, tolerance, patience, warmup_reads,
            kernel_residual_alert, null_tol, max_memory, example_forward, seed, sources,
            max_sources, attention, spectral_every, objective: the family's
            (:class:`~normscope.families.DeadDirectionConfig`).

    Each argument, its default and its figures: docs/monitors.md.

    Raises:
        MisconfigurationException: a bad argument, or at setup no norm layer / an unknown layer
            name / a strategy it cannot read (FSDP1, DeepSpeed).

    Example::

        from lightning import Trainer
        from normscope import DeadDirectionMonitor

        monitor = DeadDirectionMonitor(every_n_steps=50)
        trainer = Trainer(callbacks=[monitor], max_steps=1000)
        trainer.fit(model, datamodule)
        trainer.callback_metrics["dd/sigma_min_ratio_min"]
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        layers: str | Sequence[str] = "auto",
        residual: bool = True,
        rows_per_read: int | str | None = None,
        alert_below: float = 1.0,
        tolerance: float = 0.4,
        patience: int = 1,
        warmup_reads: int = 0,
        kernel_residual_alert: float | None = 1e-4,
        rules: Sequence[AlertRule] = (),
        alerts: Sequence[str | Callable[[Alert], Any]] = ("log", "wandb"),
        stop_on_alert: bool = False,
        null_tol: float = 1e-10,
        max_memory: int | None = None,
        example_forward: Callable[[LightningModule, Any], Any] | None = None,
        verbose: bool = True,
        seed: int = 0,
        overhead_warn: float | None = 0.05,
        log_per_layer: str | int = "all",
        sources: Callable[[Any], Any] | str | None = None,
        max_sources: int = 8,
        name: str | None = None,
        async_reads: bool | None = None,
        attention: str | Sequence[str] | None = "auto",
        spectral_every: int | str = SPECTRAL_EVERY,
        paging: Pager | None = None,
        objective: str = "tokens",
    ) -> None:
        config = _config(
            lambda: DeadDirectionConfig(
                layers=layers,
                residual=residual,
                rows_per_read=rows_per_read,
                alert_below=alert_below,
                tolerance=tolerance,
                patience=patience,
                warmup_reads=warmup_reads,
                kernel_residual_alert=kernel_residual_alert,
                null_tol=null_tol,
                max_memory=max_memory,
                example_forward=example_forward,
                seed=seed,
                sources=sources,
                max_sources=max_sources,
                attention=attention,
                spectral_every=spectral_every,
                objective=objective,
            )
        )
        self.engine = _config(
            lambda: Monitor(
                config.build(),
                every_n_steps=every_n_steps,
                rules=rules,
                alerts=alerts,
                stop_on_alert=stop_on_alert,
                log_per_layer=log_per_layer,
                verbose=verbose,
                overhead_warn=overhead_warn,
                name=name,
                async_reads=async_reads,
                paging=paging,
            )
        )

    @property
    def charts_every_n_reads(self) -> int:
        """W&B: the profile chart and the spectrum table at the first read and every this many
        reads (10)."""
        return self.engine.family.charts_every_n_reads

    @charts_every_n_reads.setter
    def charts_every_n_reads(self, every: int) -> None:
        self.engine.family.charts_every_n_reads = every

    @property
    def sigma_min_ratio_min(self) -> float:
        """The last read's smallest cumulative ratio (NaN before the first read)."""
        report = self.engine.last_report
        return report.sigma_min_ratio_min if report is not None else float("nan")


class SignMagnitudeMonitor(_LightningMonitor):
    r"""Log the sign–magnitude geometry of a model's Linear layers while it trains: sign and
    ternary alignment, sign churn, outlier leverage, and probe-measured asymmetry and ternary
    readiness (docs/metrics.md §2), under ``sm/<module path>/<metric>`` and ``sm/<metric>``.

    Every ``every_n_steps`` optimiser steps (and at the first step): parameter reads on every
    monitored Linear, outlier reads from hooks on their inputs, and probe reads on
    ``probe_layers`` on a fixed probe batch, each weight restored bit-exactly
    (docs/monitors.md, ``SignMagnitudeMonitor``).

    Args:
        every_n_steps, rules, alerts, verbose, overhead_warn, log_per_layer, name, paging: the engine's,
            as for :class:`DeadDirectionMonitor` (``name``: keys ``sm[name]/...``).
        layers, probe_layers, probe_batch, probe_samples, flip_rate, max_leverage_alert,
            churn_spike_factor, min_churn, example_forward, seed: the family's, as
            :class:`~normscope.families.SignMagnitudeConfig` takes and checks them.

    Raises:
        MisconfigurationException: a bad argument (naming it); at ``setup``, a strategy whose
            weights it cannot read whole (FSDP, DeepSpeed, FSDP2, tensor parallelism).

    Example::

        from normscope import SignMagnitudeMonitor
        trainer = Trainer(callbacks=[SignMagnitudeMonitor(every_n_steps=100)])
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        layers: str | Sequence[str] = "auto",
        probe_layers: Sequence[str] | None = None,
        probe_batch: Any = None,
        probe_samples: int = 8,
        flip_rate: float = 0.01,
        max_leverage_alert: float | None = 100.0,
        churn_spike_factor: float | None = 5.0,
        min_churn: float = 0.01,
        rules: Sequence[AlertRule] = (),
        alerts: Sequence[str | Callable[[Alert], Any]] = ("log", "wandb"),
        example_forward: Callable[[LightningModule, Any], Any] | None = None,
        verbose: bool = True,
        seed: int = 0,
        overhead_warn: float | None = 0.05,
        log_per_layer: str | int = "all",
        name: str | None = None,
        paging: Pager | None = None,
    ) -> None:
        config = _config(
            lambda: SignMagnitudeConfig(
                layers=layers,
                probe_layers=probe_layers,
                probe_batch=probe_batch,
                probe_samples=probe_samples,
                flip_rate=flip_rate,
                max_leverage_alert=max_leverage_alert,
                churn_spike_factor=churn_spike_factor,
                min_churn=min_churn,
                example_forward=example_forward,
                seed=seed,
            )
        )
        self.engine = _config(
            lambda: Monitor.of(
                config,
                every_n_steps=every_n_steps,
                rules=rules,
                alerts=alerts,
                log_per_layer=log_per_layer,
                verbose=verbose,
                overhead_warn=overhead_warn,
                name=name,
                paging=paging,
            )
        )
