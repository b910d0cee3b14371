"""What a monitor costs on the steps it does not read: the demo GPT with a monitor that never
reads (``every_n_steps`` 10^6, after its first batch) against no monitor, step-interleaved.

Three copies of ``examples/nanogpt.py``'s GPT from the same weights train in turn on one fixed
batch (32 x 64 bytes): ``none``, ``idle`` (``Monitor.of(DeadDirectionConfig(), every_n_steps=
10**6)``) and a second ``none`` (the control: what the pairing itself reads as a difference).
Printed: the median and mean paired step difference of each against ``none``, in percent of a
plain step, with the mean's standard error.

    python benchmarks/idle_steps.py --width 128 --steps 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: examples
from _common import gpt_copy, gpt_step  # noqa: E402
from examples.nanogpt import GPT, GPTConfig  # noqa: E402


def run(width: int, steps: int, skip: int = 5) -> dict[str, tuple[float, float, float]]:
    """``{copy: (median %, mean %, s.e. of the mean %)}`` of the paired differences."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_embd=width, n_layer=4))
    x = torch.randint(0, 256, (32, 64))
    y = torch.randint(0, 256, (32, 64))
    copies = {}
    for name in ("none", "idle", "none (control)"):
        copies[name] = gpt_copy(base, {} if name == "idle" else None, every_n_steps=10**6)
    times: dict[str, list[float]] = {name: [] for name in copies}
    for it in range(steps):
        for name, (model, opt, mon) in copies.items():
            seconds = gpt_step(model, opt, mon, x, y)
            if it >= skip:  # the first batch (discovery, the first read) left out
                times[name].append(seconds)
    plain = statistics.median(times["none"])
    out = {}
    for name in ("idle", "none (control)"):
        diff = [a - b for a, b in zip(times[name], times["none"])]
        se = statistics.stdev(diff) / len(diff) ** 0.5
        out[name] = (
            100 * statistics.median(diff) / plain,
            100 * statistics.mean(diff) / plain,
            100 * se / plain,
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print(f"demo GPT width {args.width}, {args.steps} interleaved steps, {args.threads} thread(s)")
    print("| copy | median paired difference | mean (+- 1 s.e.) |")
    print("|---|---:|---:|")
    for name, (med, mean, se) in run(args.width, args.steps).items():
        print(f"| {name} | {med:+.2f}% | {mean:+.2f}% +- {se:.2f}% |")


if __name__ == "__main__":
    main()
