"""normscope in a plain PyTorch training loop (nanoGPT style): no Lightning, no Trainer.

``monitor.step(batch)`` wraps one optimiser step: it opens the read window on sampled steps
(snapshotting the gammas the forward runs with), reads on schedule at the end, evaluates the
alert rules and logs to any callable (a print here; ``wandb.log`` works the same way).

    python -m examples.plain_loop                  # 60 steps, a read every 20
    python -m examples.plain_loop --cancel-at 30   # a cancelling MLP branch from step 30: alert
"""

from __future__ import annotations

import argparse

import torch

from examples.data import make_dataloaders
from examples.nanogpt import GPT, GPTConfig
from normscope import DeadDirectionConfig, Monitor


def main(argv: list[str] | None = None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--cancel-at", type=int, default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    # --- the loop: nanoGPT's model, data and optimiser, plus two normscope lines -------------
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train, _ = make_dataloaders(block_size=32, batch_size=16, max_bytes=300_000)

    def log(metrics: dict, step: int) -> None:  # or wandb.log
        print(f"step {step}: sigma_min_ratio_min {metrics['dd/sigma_min_ratio_min']:.3f}")

    monitor = Monitor.of(
        DeadDirectionConfig(), model, every_n_steps=args.every, log=log
    )  # normscope

    alerts = []
    for it, (x, y) in zip(range(args.steps), train):
        if it == args.cancel_at:
            model.transformer.h[1].mlp.set_cancel(0.95)
        with monitor.step((x, y)) as read:  # normscope
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        alerts += read.alerts
    monitor.close()  # normscope: the summary, the hooks removed
    # -------------------------------------------------------------------------------------------
    for alert in alerts:
        print(f"alert at step {alert.step}: {alert.message}")
    return alerts


if __name__ == "__main__":
    main()
