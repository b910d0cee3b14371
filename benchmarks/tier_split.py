"""Where a read goes: the demo GPT read at every step, full reads against cheap reads.

Three copies of ``examples/nanogpt.py``'s GPT from the same weights, trained step-interleaved
in one process on one fixed batch (32 x 64 bytes): ``none`` (no monitor), ``spectral``
(``Monitor.of(DeadDirectionConfig(spectral_every=1), every_n_steps=1)``: every step a full
read) and ``cheap`` (``spectral_every`` 10^6: every read after the first cheap, its window
folded to the diagonals). The median step of each against ``none``'s, in plain steps, is what
a full and a cheap read add; their difference is the spectral tier with the ``d^2`` fold only
a spectral window pays (docs/costs.md, "Tiers").

    python benchmarks/tier_split.py --width 128 256 --steps 12
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: examples
from examples.nanogpt import GPT, GPTConfig, make_optimizer  # noqa: E402

from normscope import DeadDirectionConfig, Monitor  # noqa: E402


def split(width: int, steps: int, layers: int = 4) -> dict[str, float]:
    """Median step seconds of ``none``, ``spectral`` and ``cheap`` (the first 2 steps left
    out: discovery and the first, always spectral, read)."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_embd=width, n_layer=layers))
    x = torch.randint(0, 256, (32, 64))
    y = torch.randint(0, 256, (32, 64))
    copies = {}
    for name, every in (("none", None), ("spectral", 1), ("cheap", 10**6)):
        model = copy.deepcopy(base)
        opt = make_optimizer(model, 1e-3, 0.1)
        monitor = None
        if every is not None:
            config = DeadDirectionConfig(spectral_every=every)
            monitor = Monitor.of(
                config, model, every_n_steps=1, alerts=(), verbose=False, overhead_warn=None
            )  # fmt: skip
        copies[name] = (model, opt, monitor, [])

    def one(model, opt, monitor) -> None:
        def body() -> None:
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if monitor is None:
            body()
            return
        with monitor.step((x, y)):
            body()

    for _ in range(steps + 2):
        for model, opt, monitor, times in copies.values():
            t0 = time.perf_counter()
            one(model, opt, monitor)
            times.append(time.perf_counter() - t0)
    for _, _, monitor, _ in copies.values():
        if monitor is not None:
            monitor.close()
    return {name: statistics.median(c[3][2:]) for name, c in copies.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print("| width | plain step ms | full read | cheap read | spectral part |")
    print("|---:|---:|---:|---:|---:|")
    for width in args.width:
        t = split(width, args.steps)
        full = (t["spectral"] - t["none"]) / t["none"]
        cheap = (t["cheap"] - t["none"]) / t["none"]
        print(
            f"| {width} | {1e3 * t['none']:.1f} | {full:.2f} | {cheap:.2f} | {full - cheap:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
