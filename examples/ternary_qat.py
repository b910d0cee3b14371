"""Quantisation-aware training with ternary weights, watched by SignMagnitudeMonitor.

Two RMSNorm GPTs (``examples/nanogpt.py``) train side by side on the standard library's
source: a full-precision twin, and one whose block Linears run BitNet b1.58 ternary weights
(absmean scale, straight-through estimator: the forward sees ``s * Q(W)``, the gradient updates
the latent ``W``). SignMagnitudeMonitor reads both every ``--every`` steps; at the end the script
prints how ternary readiness and sign churn evolved:

* ``ternary_alignment`` -- ``cos^2(W, Q(W))`` of the latent weights (Gaussian: 0.787; QAT should
  pull it up as weights settle near the three levels);
* ``quant_transverse_rel`` -- the share of the signal that ternarising a layer would push across
  the next RMSNorm (smaller is readier);
* ``sign_churn`` -- the share of weight signs that changed since the previous read.

    python -m examples.ternary_qat                 # 300 steps each, a read every 50
"""

from __future__ import annotations

import argparse
import os
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from examples.data import make_dataloaders
from examples.lit_gpt import LitGPT
from examples.nanogpt import GPTConfig
from normscope import SignMagnitudeMonitor
from normscope.functional import ternary_quantize


class TernaryLinear(nn.Linear):
    """``nn.Linear`` whose forward uses the absmean ternary weights ``s * Q(W)`` (BitNet b1.58),
    with a straight-through estimator: ``W + (s Q(W) - W).detach()`` has the value of the
    quantised weight and the gradient of the latent one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = ternary_quantize(self.weight)
        w_q = (s * q).to(self.weight.dtype)
        return F.linear(x, self.weight + (w_q - self.weight).detach(), self.bias)


def ternarise(model: nn.Module) -> int:
    """Turn every ``nn.Linear`` inside the blocks into a :class:`TernaryLinear` (same
    parameters, new forward); returns how many were turned."""
    count = 0
    for block in model.transformer.h:
        for module in block.modules():
            if type(module) is nn.Linear:
                module.__class__ = TernaryLinear
                count += 1
    return count


def train(ternary: bool, args: argparse.Namespace) -> SignMagnitudeMonitor:
    L.seed_everything(args.seed, verbose=False)
    config = GPTConfig(norm="rmsnorm", n_layer=args.layers, n_embd=args.width)
    module = LitGPT(config, lr=args.lr)
    if ternary:
        ternarise(module.model)
    train_loader, _ = make_dataloaders(
        config.block_size, batch_size=args.batch_size, seed=args.seed
    )
    monitor = SignMagnitudeMonitor(every_n_steps=args.every, verbose=False)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        logger=False,
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=train_loader)
    monitor.final_loss = float(trainer.callback_metrics["train/loss"])
    return monitor


def main(argv: list[str] | None = None) -> dict[str, SignMagnitudeMonitor]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    runs = {"full precision": train(False, args), "ternary QAT": train(True, args)}
    keys = (
        "ternary_alignment_mean",
        "quant_transverse_rel_mean",
        "sign_churn_mean",
        "max_leverage_max",
    )
    print(f"\n{'step':>5} {'run':<15} " + " ".join(f"{k.replace('_mean', ''):>22}" for k in keys))
    for name, monitor in runs.items():
        for step, metrics in monitor.history:
            print(f"{step:>5} {name:<15} " + " ".join(f"{metrics[f'sm/{k}']:>22.4g}" for k in keys))
    for name, monitor in runs.items():
        print(
            f"{name}: final train/loss {monitor.final_loss:.3f}, {len(monitor.alerts_fired)} alert(s)"
        )
    return runs


if __name__ == "__main__":
    main()
