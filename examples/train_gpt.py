"""Train the example GPT with a plain loop (no Lightning, no monitor) and print the loss and the
step time: the baseline the monitored runs are compared with.

    python -m examples.train_gpt                  # 300 plain AdamW steps
    python -m examples.train_gpt --norm rmsnorm

Measured on a shared 2-core CPU, default config, batch 32 x 64 bytes, forward + backward +
AdamW: 0.20-0.33 s a step with one thread (300 steps in 100 s while other jobs ran), 1.0-1.1 s
with two threads when another process held a core. The loss goes from 5.34 at step 0 to about 2.4
after 300 steps (lr 3e-3, 20 warm-up steps).
"""

from __future__ import annotations

import argparse
import time

import torch

from examples.data import make_dataloaders
from examples.lit_gpt import lr_lambda
from examples.nanogpt import GPT, NORMS, GPTConfig, make_optimizer


def main(argv: list[str] | None = None) -> list[float]:
    """Train with a plain loop (no Lightning) and print the loss and the step time."""
    p = argparse.ArgumentParser(description="Train the example GPT on stdlib source, plainly.")
    p.add_argument("--norm", choices=NORMS, default="layernorm")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    # One thread: on a shared 2-core machine two threads ran 5x slower (1.1 s vs 0.2 s a step)
    # whenever another process held a core, as OpenMP threads wait on each other.
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPTConfig(norm=args.norm)
    model = GPT(config)
    train, _ = make_dataloaders(config.block_size, args.batch_size, seed=0)
    opt = make_optimizer(model, args.lr, 0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, 20, None))
    losses, batches, t0 = [], iter(train), time.perf_counter()
    for step in range(args.steps):
        x, y = next(batches)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.3f}")
    took = time.perf_counter() - t0
    print(f"{args.steps} steps in {took:.1f} s ({1e3 * took / args.steps:.0f} ms/step)")
    return losses


if __name__ == "__main__":
    main()
