"""Throughput of StreamingCovariance.update, old fold against new, and the float64 roofline.

For each width d, a batch of N rows (float32, as a model produces them) is folded into an
accumulator repeatedly. Side by side:

* ``old``  -- the fold as it was before issue 14 (``OldFold`` below, kept verbatim): a float64
              copy, row-sum NaN/Inf test, ``masked_fill_``, mean, centre, weight multiply, one
              full ``addmm_`` (2 N d^2 flops), Chan merge;
* ``new``  -- ``StreamingCovariance(fold="auto")``: the passes of ``functional/fold.py`` and
              the symmetric product as upper-triangle panel GEMMs (``(1 + p/d)/2`` of the
              GEMM's flops; the full GEMM where d < 2 panels);
* ``syrk`` -- ``fold="syrk"`` (opt-in, CPU): the same passes, numpy's BLAS dsyrk for the
              product (N d (d + 1) flops); this script pins numpy's BLAS to ``--threads``;
* ``x.T @ x`` -- the bare float64 torch matmul of the same rows: the machine's GEMM rate R;
* ``collect+np.cov`` -- what a script does without an accumulator: keep every row, np.cov.

Two kinds of figure (both in the table):

* **useful GFLOP/s** = N d (d + 1) / t: the flops of the symmetric result (one triangle plus the
  diagonal), whatever the kernel does, so old and new are on one scale;
* **fraction of the syrk roofline** = useful GFLOP/s / R, i.e. t_roof / t with
  t_roof = t_matmul * (d + 1) / (2 d): the time of a symmetric update that ran at the GEMM's
  flop rate. 1.0 means "as fast as the matmul on the flops that are needed". The old fold's
  ``update / matmul`` ratio of earlier tables is ``2 d / (d + 1)`` times its figure here.

N is scaled with d so that the whole run finishes in a few minutes on a 2-core CPU:
N = clamp(2^24 / d, 1024, 8192) unless ``--rows`` fixes it. Usage::

    python benchmarks/covariance_throughput.py            # d in {256, ..., 8192}, N scaled
    python benchmarks/covariance_throughput.py --dims 1024 --rows 8192 --repeats 5
    python benchmarks/covariance_throughput.py --device cuda --out /tmp/cov_gpu
    python benchmarks/covariance_throughput.py --overhead      # the Python around a small fold

``--overhead`` times what a hook pays per call at small widths, where the arithmetic is
cheap and the Python around it shows: ``update(x)`` as a hook calls it (through the
``torchmetrics.Metric`` wrapper: ``_update_count``, ``_computed``, grad mode), the same method
without the wrapper (``type(acc).update(acc, x)``: argument checks, flattening) and the bare
fold of the same, already flat rows (``_fold``: the kernel and the Chan merge); ``--against
<checkout>/src/normscope/functional/covariance.py`` adds that file's ``update``, timed in the
same loops (a before/after on one loaded machine)::

    python benchmarks/covariance_throughput.py --overhead \
        --against /work/main/src/normscope/functional/covariance.py
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import random
import sys
import time
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
    "new product",
    "old ms",
    "new ms",
    "syrk ms",
    "new / old speed",
    "old rows/s",
    "new rows/s",
    "old useful GFLOP/s",
    "new useful GFLOP/s",
    "float64 x.T@x GFLOP/s",
    "old / syrk roofline",
    "new / syrk roofline",
    "syrk / syrk roofline",
    "collect + np.cov rows/s",
]


class OldFold(StreamingCovariance):
    """The fold before issue 14, verbatim: the baseline of the ``old`` columns."""

    def _fold(self, rows: torch.Tensor, keep: torch.Tensor | None) -> None:
        rows = rows.to(device=self.device, dtype=torch.float64, copy=True)
        finite = torch.isfinite(rows.sum(dim=1))
        if keep is None:
            weight = finite
        else:
            keep = keep.to(self.device)
            weight = keep & finite
            finite = finite | ~keep
        self._rejected += (~finite).sum()
        rows.masked_fill_(~weight[:, None], 0.0)
        w = weight.to(torch.float64)
        n_b = w.sum()
        mean_b = rows.sum(dim=0) / n_b.clamp_min(1)
        rows.sub_(mean_b).mul_(w[:, None])
        self._comoment.addmm_(rows.mT, rows)
        self._merge_moments(n_b, mean_b, None)


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
) -> dict[str, float | str]:
    """Fastest times of the old and new ``update``, the bare matmul, collect + ``np.cov``."""
    gen = torch.Generator(device=device).manual_seed(d)
    x = torch.randn(rows, d, device=device, generator=gen)  # float32 activations
    old, new = OldFold(d, device=device), StreamingCovariance(d, device=device)
    syrk = StreamingCovariance(d, device=device, fold="syrk") if device.type == "cpu" else None
    x64 = x.to(torch.float64)
    # Interleaved, so that a neighbour's burst of load hits all alike.
    ts: dict[str, list[float]] = {"old": [], "new": [], "syrk": [], "matmul": []}
    for _ in range(repeats):
        ts["old"] += median_time(lambda: old.update(x), device, 1)[1]
        ts["new"] += median_time(lambda: new.update(x), device, 1)[1]
        if syrk is not None:
            ts["syrk"] += median_time(lambda: syrk.update(x), device, 1)[1]
        ts["matmul"] += median_time(lambda: x64.T @ x64, device, 1)[1]
    # The fastest repeat is the table's figure: on a shared machine a neighbour's load only
    # ever slows a run down (the medians are kept in the JSON).
    t_old, t_new, t_mm = (min(ts[k]) for k in ("old", "new", "matmul"))
    t_syrk = min(ts["syrk"]) if ts["syrk"] else math.nan
    useful = float(rows) * d * (d + 1)
    rate = 2.0 * rows * d * d / t_mm  # the GEMM's flop rate R

    # The direct route: stack B batches of rows on the host, then one np.cov; per-batch cost.
    host = x.cpu().numpy()

    def collect_then_cov() -> None:
        stacked = np.concatenate([host] * batches_for_np).astype(np.float64)
        np.cov(stacked, rowvar=False, bias=True)

    _, ts_np = median_time(collect_then_cov, torch.device("cpu"), max(1, repeats // 2))
    t_np = min(ts_np) / batches_for_np
    kind, panel = new._plan
    return {
        "d": d,
        "rows": rows,
        "new_product": f"panels of {panel}" if kind == "panels" else kind,
        "old_ms": 1e3 * t_old,
        "new_ms": 1e3 * t_new,
        "syrk_ms": 1e3 * t_syrk,
        "speedup": t_old / t_new,
        "old_rows_s": rows / t_old,
        "new_rows_s": rows / t_new,
        "old_useful_gflops": useful / t_old / 1e9,
        "new_useful_gflops": useful / t_new / 1e9,
        "matmul_gflops": rate / 1e9,
        "old_roofline_fraction": useful / t_old / rate,
        "new_roofline_fraction": useful / t_new / rate,
        "syrk_roofline_fraction": useful / t_syrk / rate,
        "old_over_matmul": t_mm / t_old,
        "np_cov_rows_s": rows / t_np,
        "times_s": ts,
    }


def row_cells(r: dict) -> list[str]:
    return [
        str(r["d"]),
        str(r["rows"]),
        str(r["new_product"]),
        f"{r['old_ms']:.1f}",
        f"{r['new_ms']:.1f}",
        f"{r['syrk_ms']:.1f}",
        f"{r['speedup']:.2f}x",
        f"{r['old_rows_s']:.3g}",
        f"{r['new_rows_s']:.3g}",
        f"{r['old_useful_gflops']:.1f}",
        f"{r['new_useful_gflops']:.1f}",
        f"{r['matmul_gflops']:.1f}",
        f"{r['old_roofline_fraction']:.2f}",
        f"{r['new_roofline_fraction']:.2f}",
        f"{r['syrk_roofline_fraction']:.2f}",
        f"{r['np_cov_rows_s']:.3g}",
    ]


OVERHEAD_HEADERS = ["d", "rows", "update us", "unwrapped us", "bare fold us", "wrapper us"]


def load_other(path: str) -> type:
    """``StreamingCovariance`` of another checkout's ``functional/covariance.py`` (it imports
    this checkout's ``fold`` and ``_rows``)."""
    spec = importlib.util.spec_from_file_location("other_covariance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StreamingCovariance


def update_overhead(
    d: int, rows: int, calls: int = 500, repeats: int = 9, other: type | None = None
) -> dict[str, float | int]:
    """Per-call microseconds of ``update``, of the same method unwrapped, of the bare ``_fold``
    of the same rows and of ``other``'s ``update`` (CPU, float32 rows, fastest of ``repeats``
    loops of ``calls`` calls each, the kinds shuffled in each round)."""
    gen = torch.Generator().manual_seed(d + rows)
    x = torch.randn(rows, d, generator=gen)
    acc, plain, bare = (StreamingCovariance(d) for _ in range(3))
    method = type(plain).update
    calls_of = {
        "update": lambda: acc.update(x),
        "unwrapped": lambda: method(plain, x),
        "fold": lambda: bare._fold(x, None) if rows else None,  # 0 rows: update returns first
    }
    if other is not None:
        then = other(d)
        calls_of["other"] = lambda: then.update(x)
    ts: dict[str, list[float]] = {key: [] for key in calls_of}
    shuffle = random.Random(d + rows)
    for _ in range(repeats):
        for key, fn in shuffle.sample(list(calls_of.items()), len(calls_of)):
            fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            ts[key].append((time.perf_counter() - t0) / calls)
    t_update, t_plain, t_fold = (min(ts[k]) for k in ("update", "unwrapped", "fold"))
    out: dict[str, float | int] = {
        "d": d,
        "rows": rows,
        "update_us": 1e6 * t_update,
        "unwrapped_us": 1e6 * t_plain,
        "fold_us": 1e6 * t_fold,
        "wrapper_us": 1e6 * (t_update - t_plain),
    }
    if other is not None:
        out["other_update_us"] = 1e6 * min(ts["other"])
    return out


def overhead_main(args: argparse.Namespace) -> None:
    info = machine(torch.device("cpu"))
    note = "per call, fastest of 9 shuffled rounds of 500 calls each; 0 rows: the Python alone"
    print(machine_line(info) + f"; {note}", flush=True)
    other = load_other(args.against) if args.against else None
    headers = OVERHEAD_HEADERS + (["--against update us"] if other is not None else [])
    keys = ["update_us", "unwrapped_us", "fold_us", "wrapper_us"]
    keys += ["other_update_us"] if other is not None else []
    results, cells = [], []
    for d in (32, 128):
        for rows in (0, 8, 64):
            r = update_overhead(d, rows, calls=500, other=other)
            results.append(r)
            cells.append([d, rows] + [f"{r[k]:.1f}" for k in keys])
            print("| " + " | ".join(str(c) for c in cells[-1]) + " |", flush=True)
    text = machine_line(info) + f"; {note}\n\n" + markdown_table(headers, cells)
    print("\n" + text)
    write_outputs(args.out, text, {"machine": info, "results": results})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--overhead", action="store_true", help="time the Python around small updates instead"
    )
    parser.add_argument(
        "--against", default=None, help="with --overhead: another checkout's covariance.py"
    )
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
    if args.overhead:
        overhead_main(args)
        return
    device = torch.device(args.device)
    info = machine(device)
    print(machine_line(info), flush=True)
    note = f"fastest of {args.repeats} interleaved timed calls, each after 1 warm-up"
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
