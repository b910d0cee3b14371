"""The normscope demo: a small pre-norm GPT trained on this machine's Python sources, watched by
DeadDirectionMonitor.

    python -m examples.demo                    # LayerNorm GPT, 400 steps, a read every 50
    python -m examples.demo --norm rmsnorm     # the same with RMSNorm: no gamma kernel
    python -m examples.demo --cancel-at 200    # a cancelling MLP branch from step 200: the alert

Logs go to ``normscope_runs/`` as CSV and as a W&B run (offline unless you are logged in:
``wandb sync normscope_runs/wandb/offline-run-*`` uploads it later). What to look at: each read
prints one line; ``dd/sigma_min_ratio_min`` should stay near or above 1 and every LayerNorm's
``gamma_alignment`` at 1.000000; the end of the run prints the last read as a table.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from examples.data import make_dataloaders
from examples.lit_gpt import LitGPT
from examples.nanogpt import GPTConfig
from normscope import DeadDirectionMonitor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small GPT with DeadDirectionMonitor.")
    p.add_argument("--norm", choices=["layernorm", "rmsnorm"], default="layernorm")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=50, help="optimiser steps between reads")
    p.add_argument(
        "--spectral-every",
        type=int,
        default=None,
        help="reads between spectral reads (default: the monitor's, docs/costs.md)",
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--cancel-at", type=int, default=None, help="switch on a cancelling branch")
    p.add_argument("--cancel-layer", type=int, default=2)
    p.add_argument("--stop-on-alert", action="store_true")
    p.add_argument("--out", default="normscope_runs")
    p.add_argument("--no-wandb", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> DeadDirectionMonitor:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*smaller than the logging interval.*")
    L.seed_everything(args.seed, verbose=False)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    config = GPTConfig(norm=args.norm, n_layer=args.layers, n_embd=args.width)
    module = LitGPT(config, cancel_at_step=args.cancel_at, cancel_layer=args.cancel_layer)
    train, val = make_dataloaders(config.block_size, batch_size=args.batch_size, seed=args.seed)
    out = Path(args.out)
    loggers: list = [CSVLogger(out, name="csv")]
    if not args.no_wandb:
        os.environ.setdefault("WANDB_SILENT", "true")
        if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
            os.environ["WANDB_MODE"] = "offline"
        loggers.append(WandbLogger(project="normscope-demo", save_dir=str(out)))
    tiers = {} if args.spectral_every is None else {"spectral_every": args.spectral_every}
    monitor = DeadDirectionMonitor(
        every_n_steps=args.every, stop_on_alert=args.stop_on_alert, **tiers
    )
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        logger=loggers,
        callbacks=[monitor],
        val_check_interval=min(100, args.steps),
        limit_val_batches=4,
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    print(
        f"normscope demo: {args.norm} GPT, {config.n_layer} layers x {config.n_embd} wide, "
        f"{args.steps} steps on {len(train.dataset.data) / 1e6:.1f} MB of stdlib source; "
        f"a read every {args.every} steps"
    )
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    took = time.perf_counter() - t0
    loss = trainer.callback_metrics.get("train/loss")
    print(
        f"trained {trainer.global_step} steps in {took:.0f} s; final train/loss "
        f"{float(loss):.3f}; {monitor.reads} reads, {len(monitor.alerts_fired)} alert(s); "
        f"logs in {out}/"
    )
    return monitor


if __name__ == "__main__":
    main()
