"""Snapshots of the demo GPT's norm and residual-stream moments for the issue-33 measurements.

Trains the example GPT (``examples/nanogpt.py``) with a plain AdamW loop, one thread, and at
chosen steps folds a fixed set of validation rows through it, saving in float64 per residual
point ``p_k`` (the input of every norm, in forward order): the uncentred second moment ``S_k``,
the mean, the cross-moment ``X_{k-1}^T X_k / N`` with the previous point, the norm's gain and
the centred covariance of the norm's output. ``benchmarks/meaning.py`` reads these files.

    python -m benchmarks.meaning_collect --width 128 --norm layernorm --seed 0 --out DIR
    python -m benchmarks.meaning_collect --cancel-at 100 ...     # the collapse example's branch
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from examples.data import make_dataloaders
from examples.lit_gpt import lr_lambda
from examples.nanogpt import GPT, GPTConfig, make_optimizer


def norms_in_order(model: GPT) -> list[tuple[str, torch.nn.Module]]:
    """ln_1, ln_2 of every block, then ln_f: their inputs are the residual points p_0 .. p_2L."""
    out = []
    for b, block in enumerate(model.transformer.h):
        out += [(f"h.{b}.ln_1", block.ln_1), (f"h.{b}.ln_2", block.ln_2)]
    return out + [("ln_f", model.transformer.ln_f)]


@torch.no_grad()
def snapshot(model: GPT, batches: list[torch.Tensor]) -> dict[str, np.ndarray]:
    norms = norms_in_order(model)
    seen: dict[str, list[torch.Tensor]] = {name: [] for name, _ in norms}
    outs: dict[str, list[torch.Tensor]] = {name: [] for name, _ in norms}
    hooks = []
    for name, mod in norms:

        def hook(m, args, out, name=name):
            seen[name].append(args[0].detach().reshape(-1, args[0].shape[-1]).double())
            outs[name].append(out.detach().reshape(-1, out.shape[-1]).double())

        hooks.append(mod.register_forward_hook(hook))
    was = model.training
    model.eval()
    for x in batches:
        model(x)
    model.train(was)
    for h in hooks:
        h.remove()
    res: dict[str, np.ndarray] = {}
    prev = None
    for k, (name, mod) in enumerate(norms):
        x = torch.cat(seen[name])
        y = torch.cat(outs[name])
        n = x.shape[0]
        res[f"S{k}"] = (x.T @ x / n).numpy()
        res[f"mu{k}"] = x.mean(0).numpy()
        yc = y - y.mean(0)
        res[f"Cout{k}"] = (yc.T @ yc / n).numpy()
        res[f"gamma{k}"] = mod.weight.detach().double().numpy()
        if prev is not None:
            res[f"X{k}"] = (prev.T @ x / n).numpy()  # X_{k-1}^T X_k / N
        prev = x
    res["n_rows"] = np.array(n)
    res["names"] = np.array([name for name, _ in norms])
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--norm", default="layernorm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--snap", default="0,50,100,125,150,200")
    p.add_argument("--cancel-at", type=int, default=None)
    p.add_argument("--cancel-layer", type=int, default=2)
    p.add_argument("--eval-batches", type=int, default=2, help="x 32 x 64 rows")
    p.add_argument("--out", default="/tmp/meaning_runs")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    n_head = max(1, args.width // 32)
    config = GPTConfig(norm=args.norm, n_embd=args.width, n_head=n_head)
    model = GPT(config)
    train, val = make_dataloaders(config.block_size, args.batch_size, seed=args.seed)
    _, val32 = make_dataloaders(config.block_size, 32, seed=args.seed)
    vi = iter(val32)
    eval_batches = [next(vi)[0] for _ in range(args.eval_batches)]
    opt = make_optimizer(model, 3e-3, 0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, 20, None))
    snaps = {int(s) for s in args.snap.split(",")}
    tag = f"{args.norm}_w{args.width}_s{args.seed}" + (
        f"_cancel{args.cancel_at}" if args.cancel_at is not None else ""
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches, t0 = iter(train), time.perf_counter()
    for step in range(args.steps + 1):
        if args.cancel_at is not None and step == args.cancel_at:
            model.transformer.h[args.cancel_layer].mlp.set_cancel(0.95)
        if step in snaps:
            np.savez(out / f"{tag}_step{step}.npz", **snapshot(model, eval_batches))
        if step == args.steps:
            break
        x, y = next(batches)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    print(f"{tag}: loss {loss.item():.3f}, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
