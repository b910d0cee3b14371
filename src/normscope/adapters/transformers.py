"""The Hugging Face ``transformers.Trainer`` adapter: ``TrainerCallback`` s.

    from normscope.adapters.transformers import DeadDirectionCallback

    callback = DeadDirectionCallback(every_n_steps=50)
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[callback])
    callback.bind(trainer)          # the reads go out through trainer.log
    trainer.train()

Each callback takes the options of the Lightning monitor of the same family
(:class:`~normscope.DeadDirectionMonitor`; :class:`SignMagnitudeCallback` its family's as a
:class:`~normscope.families.SignMagnitudeConfig`) and drives its own
:class:`~normscope.engine.Monitor` (``callback.engine``). How the Trainer's loop maps onto it:

* a step begins at the model's first training forward after ``on_step_begin`` (a forward
  pre-hook: the batch -- its ``attention_mask`` -- is only visible there; the first step's forward
  is watched by residual discovery, so the first read is step 1's); every micro-batch of
  gradient accumulation is folded;
* the step ended at ``on_step_end`` (``state.global_step`` optimiser steps done);
* a read is logged with ``trainer.log``: it lands in ``trainer.state.log_history`` and in every
  ``report_to`` integration (W&B, TensorBoard, ...), with ``<family>/alerts_fired`` and
  ``<family>/alert/<rule>`` beside the reads; HF's integrations prefix ``train/`` to the keys;
* ``stop_on_alert=True`` sets ``control.should_training_stop`` (decided across ranks);
* checkpoints: at every save the engine's state (counters, rule states, previous signs) is written
  beside the checkpoint (``normscope-<monitor>.pt`` in ``checkpoint-<step>/``), and a run
  resumed from that checkpoint (``trainer.train(resume_from_checkpoint=...)``) reads it back at
  ``on_train_begin``: the resumed run reads what the uninterrupted one reads.

The ``Trainer`` is bound explicitly (:meth:`bind`); without it the reads stay in
``callback.history``, with one warning.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from normscope.engine import Monitor, Target
from normscope.engine.keys import named_key
from normscope.families import SignMagnitudeConfig

__all__ = ["DeadDirectionCallback", "SignMagnitudeCallback"]


class _Pending:
    """The engine's target: reads wait here until the step's end, then go out in one
    ``trainer.log`` call with the alerts they fired."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)


def _precision(args: Any) -> str:
    """``TrainingArguments``' precision in Lightning's spelling (``bf16``/``fp16`` autocast:
    "-mixed", which keeps LayerNorm in float32)."""
    if getattr(args, "bf16", False):
        return "bf16-mixed"
    return "16-mixed" if getattr(args, "fp16", False) else "32-true"


class _NormscopeCallback(TrainerCallback):
    _factory: Any  # Monitor.dead_direction / Monitor.of

    def __init__(self, **monitor_kwargs: Any) -> None:
        monitor_kwargs.setdefault("verbose", False)
        monitor_kwargs.setdefault("alerts", ("log", "wandb"))
        self.engine: Monitor = type(self)._factory(**monitor_kwargs)
        self.trainer: Any = None
        self._pending = _Pending()
        self.model: nn.Module | None = None
        self._handle: Any = None
        self._step_open = False
        self._in_hook = False
        self._steps = 0
        self.history: list[tuple[int, dict[str, float]]] = []  # every logged read, as logged

    def bind(self, trainer: Any) -> _NormscopeCallback:
        """The ``transformers.Trainer`` whose ``log`` the reads go through (returns self)."""
        self.trainer = trainer
        return self

    @property
    def alerts_fired(self) -> list[Any]:
        return self.engine.alerts_fired

    @property
    def last_report(self) -> Any:
        return self.engine.last_report

    @property
    def monitor(self) -> Monitor:
        return self.engine

    # ------------------------------------------------------------ the loop
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        if self.trainer is None:
            warnings.warn(
                f"normscope: {type(self).__name__} is not bound to a transformers.Trainer; the "
                "reads stay in callback.history (call callback.bind(trainer) to log them)",
                RuntimeWarning,
                stacklevel=2,
            )
        if model is None:
            return
        self.model = model
        self._steps = state.global_step
        self.engine.watch(
            model, log=[Target(self._pending)], device=args.device, precision=_precision(args)
        )
        self._resume(args, state)
        if self._handle is None:
            self._handle = model.register_forward_pre_hook(self._at_forward, with_kwargs=True)

    def _at_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._step_open or self._in_hook or not module.training:
            return
        if not torch.is_grad_enabled():
            return
        batch: Any = dict(kwargs) if kwargs else (args if len(args) != 1 else args[0])
        self._in_hook = True  # the discovery forward runs inside: not a training forward
        try:
            self.engine.begin(self._steps, batch)
        finally:
            self._in_hook = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any):
        self._steps = state.global_step
        self._step_open = self.model is not None

    def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any):
        if self._step_open:  # a micro-batch of gradient accumulation: the gate closes
            self.engine.end(self._steps)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any):
        if not self._step_open:
            return
        self._step_open = False
        result = self.engine.end(state.global_step)
        self._steps = state.global_step
        if self._pending.metrics:
            logs = dict(self._pending.metrics)
            self._pending.metrics.clear()
            head = named_key(f"{self.engine.family.prefix}/", self.engine.name)
            logs[f"{head}alerts_fired"] = float(len(result.alerts))
            for alert in result.alerts:
                logs[f"{head}alert/{alert.rule}"] = 1.0
            self.history.append((state.global_step, logs))
            del self.history[: max(0, len(self.history) - self.engine.keep_last)]
            if self.trainer is not None:
                self.trainer.log(logs)
        if result.should_stop:
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.model is not None:
            self.engine.close()

    # ------------------------------------------------------------ checkpoints
    def _state_file(self, folder: str | os.PathLike) -> Path:
        return Path(folder) / f"normscope-{self.engine.state_key}.pt"

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any):
        """Write the engine's state beside the checkpoint the Trainer just saved."""
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            torch.save(self.engine.state_dict(), self._state_file(folder))

    def _resume(self, args: Any, state: Any) -> None:
        """A run resumed from a checkpoint: read back the engine's state saved with it."""
        if state.global_step <= 0:
            return
        candidates = []
        resume = getattr(args, "resume_from_checkpoint", None)
        if isinstance(resume, str):
            candidates.append(Path(resume))
        candidates.append(Path(args.output_dir) / f"checkpoint-{state.global_step}")
        for folder in candidates:
            path = self._state_file(folder)
            if path.is_file():
                self.engine.load_state_dict(torch.load(path, weights_only=True))
                return


class DeadDirectionCallback(_NormscopeCallback):
    """:class:`~normscope.DeadDirectionMonitor` as a ``transformers.TrainerCallback``; takes the
    monitor's arguments (``every_n_steps``, ``alerts``, ``stop_on_alert``, ``log_per_layer`` ...;
    ``verbose`` defaults to False here).

    Example::

        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        from normscope.adapters.transformers import DeadDirectionCallback

        callback = DeadDirectionCallback(every_n_steps=50)
        trainer = Trainer(GPT2LMHeadModel(GPT2Config(n_layer=4)), TrainingArguments("out"),
                          train_dataset=ds, callbacks=[callback])
        callback.bind(trainer)
        trainer.train()
        [row["dd/sigma_min_ratio_min"] for row in trainer.state.log_history
         if "dd/sigma_min_ratio_min" in row]
    """

    _factory = Monitor.dead_direction


class SignMagnitudeCallback(_NormscopeCallback):
    """:class:`~normscope.SignMagnitudeMonitor` as a ``transformers.TrainerCallback``: the
    family's options in ``config`` (a :class:`~normscope.families.SignMagnitudeConfig`;
    default: its defaults; the probe batch is the first training batch unless it gives
    ``probe_batch``), the engine's as keywords (``every_n_steps``, ``alerts``, ...).

    Example::

        config = SignMagnitudeConfig(probe_samples=4)
        callback = SignMagnitudeCallback(config, every_n_steps=100)
        trainer = Trainer(model, args, train_dataset=ds, callbacks=[callback])
        callback.bind(trainer)
    """

    _factory = Monitor.of

    def __init__(self, config: SignMagnitudeConfig | None = None, **engine: Any) -> None:
        super().__init__(config=SignMagnitudeConfig() if config is None else config, **engine)
