"""normscope in a Lightning Fabric loop (LitGPT-style): two ways, one engine.

1. **As a Fabric callback.** ``Fabric(callbacks=[DeadDirectionMonitor(...)])``, and the loop calls
   the monitor's Lightning hooks with the Fabric object in the trainer's place::

       fabric.call("on_train_batch_start", fabric, model, batch, batch_idx)  # before the forward
       ...forward, fabric.backward(loss), optimizer.step()...
       fabric.call("on_train_batch_end", fabric, model, loss, batch, batch_idx)
       fabric.call("on_fit_end", fabric, model)                             # after the loop

   The monitor counts the optimiser steps of the optimisers that hold the model's parameters
   (a post-step hook), so gradient accumulation works as under the ``Trainer``: call both hooks
   for every micro-batch; the window spans the optimiser step's micro-batches.

2. **As a helper**, when you would rather say when the step ends: :func:`watch_fabric` gives a
   :class:`~normscope.integrations.Watch` logging through the Fabric's loggers (what
   ``fabric.log_dict`` writes to)::

       watch = watch_fabric(fabric, model, DeadDirectionMonitor(every_n_steps=50))
       with watch.step(batch):
           loss = ...; fabric.backward(loss); optimizer.step(); optimizer.zero_grad()

Both log every read with ``logger.log_metrics(metrics, step)`` on each of ``fabric.loggers`` (a
Lightning ``WandbLogger`` there also gets the W&B charts, summaries and alerts), and work under
DDP (every rank runs the same calls; the reads reduce over the ranks). Why a bare Fabric used to
fail: the monitor read ``trainer.precision`` and ``trainer.global_step``, which a ``Fabric`` does
not have; the adapter gives the monitor a :class:`~normscope.integrations.LoopView` instead.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from normscope.integrations.loop import LoopView, Watch

__all__ = ["fabric_view", "watch_fabric"]


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside Fabric's ``_FabricModule`` (module paths as the user names
    them: the same metric keys as a plain loop over the same model)."""
    from lightning.fabric.wrappers import _FabricModule

    return model.module if isinstance(model, _FabricModule) else model


def _precision(fabric: Any) -> str:
    plugin = getattr(fabric.strategy, "precision", None)
    return str(getattr(plugin, "precision", "32-true"))


def _check_fabric_strategy(fabric: Any, monitor: Any) -> None:
    from lightning.fabric.strategies import DeepSpeedStrategy, FSDPStrategy

    strategy = fabric.strategy
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
        raise MisconfigurationException(
            f"{type(monitor).__name__}: Fabric's {type(strategy).__name__} is not supported: it "
            "keeps parameters sharded where the monitor reads them. Supported under Fabric: one "
            "device and DDP (strategy='ddp', 'ddp_spawn')."
        )


def fabric_view(fabric: Any) -> LoopView:
    """A :class:`LoopView` of a ``Fabric``: its loggers, device and precision."""
    return LoopView(list(fabric.loggers), device=fabric.device, precision=_precision(fabric))


def watch_fabric(fabric: Any, model: nn.Module, monitor: Any) -> Watch:
    """A :class:`~normscope.integrations.Watch` of ``model`` (as ``fabric.setup`` returned it, or
    the module itself) logging to ``fabric.loggers``.

    Raises:
        MisconfigurationException: under Fabric's FSDP or DeepSpeed strategies.

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", loggers=CSVLogger("logs"))
        model, optimizer = fabric.setup(model, optimizer)
        watch = watch_fabric(fabric, model, DeadDirectionMonitor(every_n_steps=50))
        for batch in loader:
            with watch.step(batch) as result:
                ...
    """
    _check_fabric_strategy(fabric, monitor)
    watch = Watch(monitor, _unwrap(model), device=fabric.device, precision=_precision(fabric))
    watch.loop = fabric_view(fabric)
    return watch


class _OptimizerSteps:
    """Counts ``optimizer.step()`` calls of the optimisers holding ``model``'s parameters."""

    def __init__(self, model: nn.Module) -> None:
        self._params = {id(p) for p in model.parameters()}
        self._ours: dict[int, bool] = {}
        self.count = 0
        self._handle = register_optimizer_step_post_hook(self._hook)

    def _hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
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


class _FabricHooks:
    """The callback path: Lightning hook calls made with a ``Fabric`` as the trainer."""

    def __init__(self, fabric: Any, model: nn.Module, monitor: Any) -> None:
        self.watch = watch_fabric(fabric, model, monitor)
        self.steps = _OptimizerSteps(self.watch.model)

    def call(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        watch, monitor = self.watch, self.watch.monitor
        if hook == "on_train_batch_start":
            batch = args[2] if len(args) > 2 else kwargs.get("batch")
            watch.start(batch)
            return None
        if hook == "on_train_batch_end":
            if not watch._open:
                return None
            if self.steps.count == watch.loop.global_step:
                # mid gradient accumulation: the gate closes until the next micro-batch
                watch._open = False
                monitor.on_train_batch_end(watch.loop, watch.model, None, None, 0)
                return None
            watch.loop.global_step = self.steps.count - 1  # stepped() advances it by one
            watch.stepped()
            return None
        if hook in ("on_fit_end", "teardown"):
            self.steps.remove()
            watch.close()
            return None
        if hook in ("setup", "on_fit_start"):
            return None  # the monitor sets itself up at the first batch
        method = getattr(monitor, hook)
        return method(watch.loop, watch.model, *args[2:], **kwargs)


def fabric_call(monitor: Any, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A monitor hook called with a ``Fabric`` in the trainer's place (``fabric.call(...)``):
    routed through the monitor's :class:`_FabricHooks` (built at the first call)."""
    hooks = monitor.__dict__.get("_normscope_fabric")
    if hooks is None:
        model = args[1] if len(args) > 1 else kwargs.get("pl_module")
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"normscope: {type(monitor).__name__}.{hook} under Fabric needs the model: call "
                f"fabric.call({hook!r}, fabric, model, ...) as Lightning's hook signature says"
            )
        hooks = _FabricHooks(args[0], model, monitor)
        monitor._normscope_fabric = hooks
    return hooks.call(hook, args, kwargs)


def is_fabric(obj: Any) -> bool:
    """Whether ``obj`` is a ``lightning.fabric.Fabric`` (cheap: no import when it is not)."""
    if type(obj).__name__ != "Fabric":
        return False
    from lightning.fabric import Fabric

    return isinstance(obj, Fabric)
