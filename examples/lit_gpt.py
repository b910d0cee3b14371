"""The example GPT as a LightningModule: AdamW with warm-up, the loss logged, nothing else."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import lightning as L
import torch

from examples.nanogpt import GPT, GPTConfig, make_optimizer


def lr_lambda(step: int, warmup_steps: int, decay_steps: int | None) -> float:
    """Linear warm-up to 1, then constant, or cosine down to 0.1 by ``decay_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_steps is None or decay_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (decay_steps - warmup_steps))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


class LitGPT(L.LightningModule):
    """The GPT as a LightningModule; module paths inside are ``model.transformer.h.0.ln_1`` etc.

    Args:
        config: the GPT's shape (a :class:`GPTConfig`, or its dict as saved in a checkpoint).
        lr: AdamW's peak learning rate.
        warmup_steps: optimiser steps of linear warm-up.
        lr_decay_steps: if set, cosine decay to 10% of ``lr`` by this step; else constant.
        weight_decay: applied to matrices only. Norm gammas and biases are not decayed: decay
            would shrink the gammas for a reason outside the model, and the gamma reads watch them.
        cancel_at_step: from this optimiser step on, the MLP of block ``cancel_layer`` cancels
            part of the stream with strength ``cancel_strength`` (see :class:`MLP`).

    Example::

        >>> module = LitGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2), lr=1e-3)
        >>> module.hparams.lr, type(module.get_submodule("model.transformer.h.0.ln_1")).__name__
        (0.001, 'LayerNorm')
    """

    def __init__(
        self,
        config: GPTConfig | dict[str, Any] | None = None,
        lr: float = 3e-3,
        warmup_steps: int = 20,
        lr_decay_steps: int | None = None,
        weight_decay: float = 0.01,
        cancel_at_step: int | None = None,
        cancel_layer: int = 2,
        cancel_strength: float = 0.95,
    ) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = GPTConfig(**config)
        config = config or GPTConfig()
        if cancel_at_step is not None and not 0 <= cancel_layer < config.n_layer:
            raise ValueError(f"cancel_layer must be in [0, {config.n_layer}), got {cancel_layer}")
        self.save_hyperparameters(
            {
                "config": asdict(config),
                "lr": lr,
                "warmup_steps": warmup_steps,
                "lr_decay_steps": lr_decay_steps,
                "weight_decay": weight_decay,
                "cancel_at_step": cancel_at_step,
                "cancel_layer": cancel_layer,
                "cancel_strength": cancel_strength,
            }
        )
        self.model = GPT(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        hp = self.hparams
        if hp.cancel_at_step is not None and self.global_step >= hp.cancel_at_step:
            mlp = self.model.transformer.h[hp.cancel_layer].mlp
            if mlp.cancel != hp.cancel_strength:  # also right after a resume past the step
                mlp.set_cancel(hp.cancel_strength)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val/loss", loss, prog_bar=True)

    def configure_optimizers(self):
        hp = self.hparams
        opt = make_optimizer(self.model, hp.lr, hp.weight_decay)
        warm, decay = max(1, hp.warmup_steps), hp.lr_decay_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warm, decay))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
