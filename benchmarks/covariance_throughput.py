"""Throughput of StreamingCovariance.update against the float64 matmul roofline.

For each width d, a batch of N rows (float32, as a model produces them) is folded into the
accumulator repeatedly. Side by side:

* ``update``        -- StreamingCovariance.update (cast to float64, mask/NaN weights, centring,
                       in-place rank-N update, Chan merge);
* ``x.T @ x``       -- the bare float64 matmul of the same shape: the physical limit of this work;
* ``collect+np.cov``-- what a script does without an accumulator: keep every row, then np.cov.

GFLOP/s counts 2 N d^2 per update (the rank-N product). Usage::

    python benchmarks/covariance_throughput.py            # d in {256, 1024, 4096}, N = 8192
    python benchmarks/covariance_throughput.py --dims 256 1024 2048 4096 8192 --device cuda
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch

from normscope.functional import StreamingCovariance


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(d: int, rows: int, device: torch.device, repeats: int, batches_for_np: int) -> dict:
    x = torch.randn(rows, d, device=device)  # float32 activations
    acc = StreamingCovariance(d, device=device)
    t_update = _time(lambda: acc.update(x), device, repeats)
    x64 = x.to(torch.float64)
    t_matmul = _time(lambda: x64.T @ x64, device, repeats)
    flops = 2.0 * rows * d * d

    # The direct route: stack B batches of rows on the host, then one np.cov; per-batch cost.
    host = x.cpu().numpy()

    def collect_then_cov() -> None:
        stacked = np.concatenate([host] * batches_for_np).astype(np.float64)
        np.cov(stacked, rowvar=False, bias=True)

    t_np = _time(collect_then_cov, torch.device("cpu"), max(1, repeats // 2)) / batches_for_np
    return {
        "d": d,
        "rows": rows,
        "update_ms": 1e3 * t_update,
        "update_rows_s": rows / t_update,
        "update_gflops": flops / t_update / 1e9,
        "matmul_gflops": flops / t_matmul / 1e9,
        "ratio": t_matmul / t_update,
        "np_cov_rows_s": rows / t_np,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--np-batches", type=int, default=4, help="batches stacked for np.cov")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    lines = [
        f"device: {device} ({name or platform.machine()}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, N = {args.rows} rows per update",
        "",
        "| d | update ms | update rows/s | update GFLOP/s | float64 x.T@x GFLOP/s "
        "| update / matmul | collect + np.cov rows/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in args.dims:
        r = measure(d, args.rows, device, args.repeats, args.np_batches)
        lines.append(
            f"| {r['d']} | {r['update_ms']:.1f} | {r['update_rows_s']:.3g} | "
            f"{r['update_gflops']:.1f} | {r['matmul_gflops']:.1f} | {r['ratio']:.2f}x | "
            f"{r['np_cov_rows_s']:.3g} |"
        )
        print(lines[-1] if len(lines) > 4 else "\n".join(lines), flush=True)
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
