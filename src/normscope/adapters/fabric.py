"""The Lightning Fabric adapter (LitGPT-style loops): plain calls into the engine.

Two ways, one engine:

1. **As a Fabric callback.** ``Fabric(callbacks=[DeadDirectionMonitor(...)])``, and the loop
   calls the monitor's hooks with the Fabric in the trainer's place::

       fabric.call("on_train_batch_start", fabric, model, batch, batch_idx)  # before the forward
       ...forward, fabric.backward(loss), optimizer.step()...
       fabric.call("on_train_batch_end", fabric, model, loss, batch, batch_idx)
       fabric.call("on_fit_end", fabric, model)                              # after the loop

   The optimiser steps are counted by a post-step hook on the optimisers that hold the model's
   parameters, so gradient accumulation works as under the ``Trainer`` (call both hooks for
   every micro-batch). ``on_fit_end`` publishes the last read, prints the summary and removes
   every hook; a model is never left hooked by a monitor that is gone, and a hooked model
   saves (``torch.save(model)``), copies and exports whole at any time.

2. **As an engine of your own** (:func:`watch_fabric`), when you would rather say when the
   step ends::

       monitor = watch_fabric(fabric, model, every_n_steps=50)          # dead-direction reads
       with monitor.step(batch):
           loss = ...; fabric.backward(loss); optimizer.step(); optimizer.zero_grad()
       monitor.close()

Both log every read to each of ``fabric.loggers`` (a ``WandbLogger`` also gets summaries,
charts and alerts) and work under DDP (every rank makes the same calls; the reads reduce over
the ranks).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from normscope._common import ConfigurationError
from normscope.engine import Monitor, StepResult, Target

__all__ = [
    "FabricLoop",
    "check_fabric_strategy",
    "is_fabric",
    "tensor_parallel_size",
    "watch_fabric",
]


def is_fabric(obj: Any) -> bool:
    """Whether ``obj`` is a ``lightning.fabric.Fabric`` (cheap: no import when it is not)."""
    if type(obj).__name__ != "Fabric":
        return False
    from lightning.fabric import Fabric

    return isinstance(obj, Fabric)


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside Fabric's ``_FabricModule`` (module paths as the user names
    them: the same metric keys as a plain loop over the same model)."""
    from lightning.fabric.wrappers import _FabricModule

    return model.module if isinstance(model, _FabricModule) else model


def _precision(fabric: Any) -> str:
    plugin = getattr(fabric.strategy, "precision", None)
    return str(getattr(plugin, "precision", "32-true"))


def _targets(fabric: Any) -> list[Target]:
    targets = []
    for lg in fabric.loggers:
        if type(lg).__name__ == "WandbLogger" and hasattr(lg, "experiment"):
            targets.append(
                Target(lg, wandb_run=lambda lg=lg: lg.experiment, step_key="trainer/global_step")
            )
        else:
            targets.append(Target(lg))
    return targets


def check_fabric_strategy(fabric: Any, kind: str, *, fsdp2: bool = True) -> None:
    """Refuse what :func:`~normscope.adapters.lightning.check_strategy` refuses under the
    Trainer, for Fabric's strategies: FSDP (1) and DeepSpeed always, ``ModelParallelStrategy``
    with tensor parallelism, and FSDP2 for a family that cannot read it (``fsdp2=False``).

    Raises:
        ConfigurationError: naming the strategy, why, and what is supported.
    """
    from lightning.fabric.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    strategy = fabric.strategy
    why = None
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
        why = "it keeps parameters sharded where the monitor reads them"
    elif isinstance(strategy, ModelParallelStrategy) and not fsdp2:
        why = (
            "its weight and probe reads take whole nn.Linear weights, and FSDP2 / tensor "
            "parallelism shard them as DTensors"
        )
    elif isinstance(strategy, ModelParallelStrategy) and tensor_parallel_size(strategy) > 1:
        why = (
            "tensor parallelism is untested: the reads reduce over every process, so rows that "
            "tensor-parallel peers share would be counted once per peer"
        )
    if why is not None:
        supported = "one device and DDP (strategy='ddp', 'ddp_spawn')"
        if fsdp2:
            supported += "; FSDP2 (ModelParallelStrategy(..., tensor_parallel_size=1))"
        raise ConfigurationError(
            f"{kind}: Fabric's {type(strategy).__name__} is not supported: {why}. Supported "
            f"under Fabric: {supported}."
        )


def tensor_parallel_size(strategy: Any) -> int:
    """The tensor-parallel size of a (Fabric or Lightning) ``ModelParallelStrategy``: its
    mesh's, or before the mesh exists the size asked for (``"auto"``: devices per node)."""
    try:
        return int(strategy.device_mesh["tensor_parallel"].size())
    except (RuntimeError, KeyError):
        size = strategy._tensor_parallel_size
        return size if isinstance(size, int) else 2


def watch_fabric(fabric: Any, model: nn.Module, monitor: Monitor | None = None, **options: Any):
    """An engine :class:`~normscope.engine.Monitor` watching ``model`` (as ``fabric.setup``
    returned it, or the module itself), logging to ``fabric.loggers``: ``monitor`` as given, or
    ``Monitor.dead_direction(**options)``.

    Raises:
        ConfigurationError: under Fabric's FSDP or DeepSpeed strategies; bad options.

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", loggers=CSVLogger("logs"))
        model, optimizer = fabric.setup(model, optimizer)
        monitor = watch_fabric(fabric, model, every_n_steps=50)
        for batch in loader:
            with monitor.step(batch) as result:
                ...
        monitor.close()
    """
    engine = monitor if monitor is not None else Monitor.dead_direction(**options)
    check_fabric_strategy(fabric, engine.family.kind, fsdp2=engine.family.fsdp2)
    engine.watch(
        _unwrap(model), log=_targets(fabric), device=fabric.device, precision=_precision(fabric)
    )
    return engine


class _OptimizerSteps:
    """Counts ``optimizer.step()`` calls of the optimisers holding ``model``'s parameters. The
    global post-step hook holds this counter weakly and goes when the counter does."""

    def __init__(self, model: nn.Module) -> None:
        self._params = {id(p) for p in model.parameters()}
        self._ours: dict[int, bool] = {}
        self.count = 0
        ref = weakref.ref(self)

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            counter = ref()
            if counter is not None:
                counter.stepped(optimizer)

        self._handle = register_optimizer_step_post_hook(hook)
        weakref.finalize(self, self._handle.remove)

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        ours = self._ours.get(id(optimizer))
        if ours is None:
            ours = any(
                id(p) in self._params for group in optimizer.param_groups for p in group["params"]
            )
            self._ours[id(optimizer)] = ours
        if ours:
            self.count += 1

    def remove(self) -> None:
        self._handle.remove()


class FabricLoop:
    """The callback path under Fabric: the monitor's hooks, called by ``fabric.call`` with the
    Fabric in the trainer's place, drive its engine through this object (the monitor makes one
    at the first such call; the engine watches the model at the first batch)."""

    def __init__(self, fabric: Any, engine: Monitor) -> None:
        self.fabric = fabric
        self.engine = engine
        self.steps: _OptimizerSteps | None = None
        self._open = False
        self._closed = False

    def setup(self, model: Any, stage: str) -> None:
        return None  # the monitor sets itself up at the first batch

    def fit_start(self, model: Any) -> None:
        return None

    def batch_start(self, model: Any, batch: Any) -> None:
        steps = self.steps if self.steps is not None else self._start(model)
        self._open = True
        self.engine.begin(steps.count, batch)

    def batch_end(self) -> StepResult | None:
        if not self._open or self.steps is None:
            return None
        self._open = False
        return self.engine.end(self.steps.count)

    def train_end(self) -> None:
        return None  # on_fit_end publishes the last read

    def fit_end(self) -> None:
        self.close()

    def teardown(self) -> None:
        if self.steps is not None:
            self.close()

    def close(self) -> None:
        """``on_fit_end`` / ``teardown``: the last read published, the summary, every hook
        removed (the optimiser-step hook too)."""
        if self._closed:
            return
        self._closed = True
        if self.steps is not None:
            self.steps.remove()
        self.engine.close()

    def _start(self, model: Any) -> _OptimizerSteps:
        engine = self.engine
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"normscope: {engine.label} under Fabric needs the model: call "
                "fabric.call('on_train_batch_start', fabric, model, batch, batch_idx) as "
                "Lightning's hook signature says"
            )
        module = _unwrap(model)
        if engine.tracker is None and not engine.disabled:
            try:
                watch_fabric(self.fabric, module, engine)
            except ConfigurationError as err:
                from lightning.pytorch.utilities.exceptions import MisconfigurationException

                raise MisconfigurationException(str(err)) from err
        self.steps = _OptimizerSteps(module)
        return self.steps
