"""The sampled forward's fold against the matrix-multiply floor for the same rows (issue 35).

A GPT-2-shaped block (``examples/nanogpt.py``: one block, d = 1024, 16 heads; ``--width`` and
``--layers`` change it) runs the same batch of ``--rows`` tokens as a plain forward and as a
sampled forward (the :class:`~normscope.DeadDirectionTracker`'s gate open, its default
``rows_per_read``: ``8 d`` = 8,192 rows at d = 1024, so every row of a 4,096-row forward is
folded). Beside them, in the same loop, the floor: for every tap, the float64 ``X^T X`` of its
rows (``torch.mm``, the full GEMM, the rows already float64: no cast, no centring, no mask).
The three are timed in turn, ``--repeats`` times, and the medians compared: the fold's extra
(sampled forward minus plain forward) over the floor.

    python benchmarks/fold_floor.py                       # d = 1024, 4,096 rows, 1 block
    python benchmarks/fold_floor.py --width 128 --layers 4 --rows 2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: examples
from examples.nanogpt import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, machine_line  # noqa: E402

from normscope import DeadDirectionConfig, DeadDirectionTracker  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    d = args.width
    model = GPT(GPTConfig(n_embd=d, n_layer=args.layers, n_head=max(1, d // 64)))
    x = torch.randint(0, 256, (args.rows // 64, 64))
    tracker = DeadDirectionTracker(DeadDirectionConfig(), model)
    with torch.no_grad():
        tracker.attach(forward=lambda: model(x))
        taps = list(tracker.taps.taps.values())
        with tracker.gate.sampling():  # the taps' rows, for the floor
            model(x)
        counts = [t.accumulator.count for t in taps]
        floors = [torch.randn(n, t.dim, dtype=torch.float64) for n, t in zip(counts, taps)]
        times: dict[str, list[float]] = {"plain": [], "sampled": [], "floor": []}
        for _ in range(args.repeats):
            tracker.reset()
            t0 = time.perf_counter()
            model(x)
            times["plain"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with tracker.gate.sampling():
                model(x)
            times["sampled"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for f in floors:
                torch.mm(f.T, f)
            times["floor"].append(time.perf_counter() - t0)
    tracker.detach()
    med = {k: statistics.median(v) for k, v in times.items()}
    extra = med["sampled"] - med["plain"]
    print(machine_line(machine()))
    print(
        f"d = {d}, {args.layers} block(s), {args.rows} rows a forward, {len(taps)} taps folding "
        f"{sorted(set(counts))} rows each; medians of {args.repeats}"
    )
    print(
        f"plain forward {1e3 * med['plain']:.1f} ms | sampled forward {1e3 * med['sampled']:.1f} ms"
        f" | fold extra {1e3 * extra:.1f} ms | floor ({len(taps)} x float64 X^T X) "
        f"{1e3 * med['floor']:.1f} ms | extra / floor {extra / med['floor']:.2f}"
    )
    return {"median": med, "extra_over_floor": extra / med["floor"], "taps": len(taps)}


if __name__ == "__main__":
    main()
