"""Throughput of StreamingCovariance.update against the float64 matmul roofline.

For each width d, a batch of N rows (float32, as a model produces them) is folded into the
accumulator repeatedly. Side by side:

* ``update``        -- StreamingCovariance.update (cast to float64, mask/NaN weights, centring,
                       in-place rank-N update, Chan merge);
* ``x.T @ x``       -- the bare float64 matmul of the same shape: the physical limit of this work
                       (the roofline); ``update / matmul`` is the fraction of it reached;
* ``collect+np.cov``-- what a script does without an accumulator: keep every row, then np.cov.

GFLOP/s counts 2 N d^2 per update (the rank-N product). N is scaled with d so that the whole
run (d = 256 ... 8192) finishes in a few minutes on a 2-core CPU: N = clamp(2^24 / d, 1024,
8192) unless ``--rows`` fixes it. Usage::

    python benchmarks/covariance_throughput.py            # d in {256, ..., 8192}, N scaled
    python benchmarks/covariance_throughput.py --dims 1024 --rows 8192 --repeats 5
    python benchmarks/covariance_throughput.py --device cuda --out /tmp/cov_gpu
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _blas_threads_from_argv() -> None:
    # numpy's OpenBLAS fixes its thread count when it is loaded: set it before numpy and torch
    # are imported, to the --threads the torch side gets (two threads of each on two cores,
    # with a neighbour's load, made np.cov 17x slower).
    n = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv[:-1] else "1"
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, n)


_blas_threads_from_argv()

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, machine_line, markdown_table, median_time, write_outputs  # noqa: E402

from normscope.functional import StreamingCovariance  # noqa: E402

HEADERS = [
    "d",
    "N rows",
    "update ms",
    "update rows/s",
    "update GFLOP/s",
    "float64 x.T@x GFLOP/s",
    "update / matmul",
    "collect + np.cov rows/s",
]


def rows_for(d: int, rows: int | None = None) -> int:
    """Rows per update: ``rows`` if given, else ``clamp(2^24 / d, 1024, 8192)``.

    Example::

        >>> rows_for(256), rows_for(4096), rows_for(8192), rows_for(8192, 512)
        (8192, 4096, 2048, 512)
    """
    if rows is not None:
        return rows
    return max(1024, min(8192, 2**24 // d))


def measure(
    d: int, rows: int, device: torch.device, repeats: int, batches_for_np: int
) -> dict[str, float]:
    """Median times of ``update``, the bare matmul and collect + ``np.cov`` at one width."""
    gen = torch.Generator(device=device).manual_seed(d)
    x = torch.randn(rows, d, device=device, generator=gen)  # float32 activations
    acc = StreamingCovariance(d, device=device)
    med_update, ts_update = median_time(lambda: acc.update(x), device, repeats)
    x64 = x.to(torch.float64)
    med_matmul, ts_matmul = median_time(lambda: x64.T @ x64, device, repeats)
    # The fastest repeat is the table's figure: on a shared machine a neighbour's load only
    # ever slows a run down (the medians are kept in the JSON).
    t_update, t_matmul = min(ts_update), min(ts_matmul)
    flops = 2.0 * rows * d * d

    # The direct route: stack B batches of rows on the host, then one np.cov; per-batch cost.
    host = x.cpu().numpy()

    def collect_then_cov() -> None:
        stacked = np.concatenate([host] * batches_for_np).astype(np.float64)
        np.cov(stacked, rowvar=False, bias=True)

    _, ts_np = median_time(collect_then_cov, torch.device("cpu"), max(1, repeats // 2))
    t_np = min(ts_np) / batches_for_np
    return {
        "d": d,
        "rows": rows,
        "update_ms": 1e3 * t_update,
        "update_rows_s": rows / t_update,
        "update_gflops": flops / t_update / 1e9,
        "matmul_gflops": flops / t_matmul / 1e9,
        "ratio": t_matmul / t_update,
        "np_cov_rows_s": rows / t_np,
        "update_ms_median": 1e3 * med_update,
        "matmul_ratio_median": med_matmul / med_update,
    }


def row_cells(r: dict[str, float]) -> list[str]:
    return [
        str(r["d"]),
        str(r["rows"]),
        f"{r['update_ms']:.1f}",
        f"{r['update_rows_s']:.3g}",
        f"{r['update_gflops']:.1f}",
        f"{r['matmul_gflops']:.1f}",
        f"{r['ratio']:.2f}x",
        f"{r['np_cov_rows_s']:.3g}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--rows", type=int, default=None, help="fix N (default: scaled with d)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--np-batches", type=int, default=4, help="batches stacked for np.cov")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: reproducible on a shared machine)"
    )
    parser.add_argument("--out", default=None, help="also write <out>.md and <out>.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = machine(device)
    print(machine_line(info), flush=True)
    note = f"fastest of {args.repeats} timed calls after 1 warm-up"
    print(note, flush=True)
    results, cells = [], []
    for d in args.dims:
        r = measure(d, rows_for(d, args.rows), device, args.repeats, args.np_batches)
        results.append(r)
        cells.append(row_cells(r))
        print("| " + " | ".join(cells[-1]) + " |", flush=True)
    text = machine_line(info) + f"; {note}\n\n" + markdown_table(HEADERS, cells)
    print("\n" + text)
    write_outputs(args.out, text, {"machine": info, "results": results})


if __name__ == "__main__":
    main()
