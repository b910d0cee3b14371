"""normscope in a Hugging Face ``transformers.Trainer``: ``TrainerCallback`` s.

    from normscope.integrations.transformers import DeadDirectionCallback

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[DeadDirectionCallback(every_n_steps=50)])
    trainer.train()

Each callback takes the arguments of the Lightning monitor of the same family
(:class:`~normscope.DeadDirectionMonitor`, :class:`~normscope.SignMagnitudeMonitor`) and drives
that monitor's own hooks (:mod:`normscope.integrations.loop`), so the reads are those of a
Lightning run on the same model and rows. How the Trainer's loop maps onto them:

* the step starts at the model's first training forward after ``on_step_begin`` (a forward
  pre-hook: the batch -- its ``attention_mask`` -- is only visible there; the first step's
  forward is watched by residual discovery, so the first read is step 1's); every micro-batch of gradient accumulation is folded;
* the optimiser stepped at ``on_step_end`` (``state.global_step`` is the step count);
* a read is logged with ``trainer.log``: it lands in ``trainer.state.log_history`` and in every
  ``report_to`` integration (W&B, TensorBoard, ...), with ``<family>/alerts_fired`` (alerts
  fired by that read) and ``<family>/alert/<rule>`` (1.0 per rule that fired) beside the reads.
  HF's integrations prefix ``train/`` to the keys (``train/dd/sigma_min_ratio_min`` on W&B);
* ``stop_on_alert=True`` sets ``control.should_training_stop`` (decided across ranks).

The ``Trainer`` object itself is not passed to callbacks: the callback finds it on the call
stack at ``on_train_begin`` (or call :meth:`bind` yourself).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from torch import nn
from transformers import TrainerCallback

from normscope.integrations.loop import LoopView
from normscope.monitors.names import named_key

__all__ = ["DeadDirectionCallback", "SignMagnitudeCallback"]


class _TrainerLog:
    """The loop view's logger: reads wait here until the step's end, then go out in one
    ``trainer.log`` call with the alerts they fired."""

    def __init__(self) -> None:
        self.pending: dict[str, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.pending.update(metrics)


class _NormscopeCallback(TrainerCallback):
    _monitor_cls: type
    family: str

    def __init__(self, **monitor_kwargs: Any) -> None:
        monitor_kwargs.setdefault("verbose", False)
        self.monitor = self._monitor_cls(**monitor_kwargs)
        self.trainer: Any = None
        self._sink = _TrainerLog()
        self.loop = LoopView([self._sink])
        self.model: nn.Module | None = None
        self._handle: Any = None
        self._step_open = False
        self._in_hook = False
        self._batch_idx = 0
        self._set_up = False
        self.history: list[tuple[int, dict[str, float]]] = []  # every logged read, as logged

    # ------------------------------------------------------------ wiring
    def bind(self, trainer: Any) -> None:
        """The ``transformers.Trainer`` whose ``log`` the reads go through."""
        self.trainer = trainer

    def _find_trainer(self) -> Any:
        from transformers import Trainer

        frame = sys._getframe(1)
        for _ in range(12):
            if frame is None:
                break
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
        return None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        if self.trainer is None:
            self.trainer = self._find_trainer()
        if self.trainer is None:
            warnings.warn(
                f"normscope: {type(self).__name__} found no transformers.Trainer on the call "
                "stack; reads stay in callback.history (call callback.bind(trainer) to log them)",
                RuntimeWarning,
                stacklevel=2,
            )
        if model is None:
            return
        self.model = model
        self.loop = LoopView([self._sink], device=args.device, precision=_precision(args))
        self.loop.global_step = state.global_step
        if self.monitor.tracker is None:
            self.monitor._check_setup(self.loop)
            self.monitor.on_fit_start(self.loop, model)
        self._set_up = True
        self._handle = model.register_forward_pre_hook(self._at_forward, with_kwargs=True)

    def _at_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._step_open or self._in_hook or not module.training:
            return
        import torch

        if not torch.is_grad_enabled():
            return
        batch: Any = dict(kwargs) if kwargs else (args if len(args) != 1 else args[0])
        self._in_hook = True  # the discovery forward runs inside: not a training forward
        try:
            self.monitor.on_train_batch_start(self.loop, module, batch, self._batch_idx)
        finally:
            self._in_hook = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any):
        self.loop.global_step = state.global_step
        self._step_open = self._set_up

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any):
        if not self._step_open:
            return
        self._step_open = False
        monitor = self.monitor
        fired = len(monitor.alerts_fired)
        self.loop.global_step = state.global_step
        monitor.on_train_batch_end(self.loop, self.model, None, None, self._batch_idx)
        self._batch_idx += 1
        if self._sink.pending:
            logs = dict(self._sink.pending)
            self._sink.pending.clear()
            new = monitor.alerts_fired[fired:] if len(monitor.alerts_fired) > fired else []
            head = named_key(f"{self.family}/", getattr(monitor, "name", None))  # dd[name]/
            logs[f"{head}alerts_fired"] = float(len(new))
            for alert in new:
                logs[f"{head}alert/{alert.rule}"] = 1.0
            self.history.append((state.global_step, logs))
            del self.history[: max(0, len(self.history) - monitor.keep_last)]
            if self.trainer is not None:
                self.trainer.log(logs)
        if self.loop.should_stop:
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._set_up:
            self.monitor.on_fit_end(self.loop, self.model)
            self.monitor.teardown(self.loop, self.model, "fit")

    @property
    def alerts_fired(self) -> list[Any]:
        return self.monitor.alerts_fired

    @property
    def last_report(self) -> Any:
        return self.monitor.last_report


def _precision(args: Any) -> str:
    """``TrainingArguments``' precision in Lightning's spelling (``bf16``/``fp16`` autocast:
    "-mixed", which keeps LayerNorm in float32)."""
    if getattr(args, "bf16", False):
        return "bf16-mixed"
    return "16-mixed" if getattr(args, "fp16", False) else "32-true"


class DeadDirectionCallback(_NormscopeCallback):
    """:class:`~normscope.DeadDirectionMonitor` as a ``transformers.TrainerCallback``; takes the
    monitor's arguments (``every_n_steps``, ``alerts``, ``stop_on_alert``, ``log_per_layer`` ...;
    ``verbose`` defaults to False here).

    Example::

        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        from normscope.integrations.transformers import DeadDirectionCallback

        callback = DeadDirectionCallback(every_n_steps=50)
        trainer = Trainer(GPT2LMHeadModel(GPT2Config(n_layer=4)), TrainingArguments("out"),
                          train_dataset=ds, callbacks=[callback])
        trainer.train()
        [row["dd/sigma_min_ratio_min"] for row in trainer.state.log_history
         if "dd/sigma_min_ratio_min" in row]
    """

    family = "dd"

    @property
    def _monitor_cls(self) -> type:  # type: ignore[override]
        from normscope.callbacks.dead_direction import DeadDirectionMonitor

        return DeadDirectionMonitor


class SignMagnitudeCallback(_NormscopeCallback):
    """:class:`~normscope.SignMagnitudeMonitor` as a ``transformers.TrainerCallback`` (its
    arguments; the probe batch is the first training batch unless ``probe_batch=`` is given).

    Example::

        trainer = Trainer(model, args, train_dataset=ds,
                          callbacks=[SignMagnitudeCallback(every_n_steps=100)])
    """

    family = "sm"

    @property
    def _monitor_cls(self) -> type:  # type: ignore[override]
        from normscope.callbacks.sign_magnitude import SignMagnitudeMonitor

        return SignMagnitudeMonitor
