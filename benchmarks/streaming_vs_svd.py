"""Streaming accumulation against the paper's route: stack every row, then one SVD.

The paper reads ``sigma_min`` of a residual point from the singular values of the whole
``N x d`` matrix of its rows. normscope folds the rows into a ``d x d`` float64 second moment as
they arrive (:class:`~normscope.functional.StreamingCovariance`) and takes one eigensolve at
read time: ``s_i = sqrt(N * lambda_i(S))``. Routes, each on the same seeded rows:

* ``streaming``  -- ``update`` per batch of 4096 float32 rows (the monitor's default
                    ``rows_per_read``), then ``symmetric_eigh`` of ``second_moment()``;
* ``torch svd``  -- the rows copied into one preallocated ``N x d`` tensor, then
                    ``torch.linalg.svdvals``;
* ``numpy svd``  -- the same into a numpy array, then ``np.linalg.svd(compute_uv=False)``.

Preallocating the stack is the kindest form of the direct route (a list of batches plus one
``concatenate`` would hold the rows twice). Rows: ``x = z * s + m`` with ``z ~ N(0, 1)``,
``s`` log-spaced from 1 down to 1e-3 and ``m`` a linear ramp in [-1, 1] (a non-zero mean, as
residual streams have), float32 as a model produces them.

Method:

* **Time** is the route's own work (``update`` calls + eigensolve, or copies + SVD); drawing
  the rows is timed apart ("gen s") and left out, as it is the same for every route.
* **Peak memory**: each (route, N) runs in a fresh subprocess. After imports and a tiny
  warm-up of every library (so code pages and thread pools are resident), the kernel's
  peak-RSS mark is reset (``/proc/self/clear_refs`` = 5) and the baseline RSS read; at the
  end the peak (``VmHWM``) minus that baseline is the route's peak extra memory. It counts
  what the process really touched, whichever allocator (torch, numpy, LAPACK workspace).
* **What fits**: the direct route needs the stack plus LAPACK's copy of it (``2 N d`` items;
  numpy casts a float32 stack to float64 first, see :func:`_need_bytes`). If that is over
  ``--mem-fraction`` of ``MemAvailable`` (read just before the run) in float64, the stack is
  float32 (marked in the table); if float32 does not fit either, the row says so and nothing
  runs. A run is also stopped if ``MemAvailable`` falls under ``--min-free-gib`` (the machine
  is shared).
* **Agreement**: every route's singular values are compared with the float64 direct route at
  the same N (max error over ``s_max``, and the relative error of ``s_min``).

Usage::

    python benchmarks/streaming_vs_svd.py                    # N in {1e4, 1e5, 1e6}, d = 1024
    python benchmarks/streaming_vs_svd.py --rows 10000 --dim 256 --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    machine,
    machine_line,
    markdown_table,
    meminfo_available,
    peak_rss_bytes,
    peak_rss_reset,
    rss_bytes,
    write_outputs,
)

from normscope.functional import StreamingCovariance, symmetric_eigh  # noqa: E402

ROUTES = ("streaming", "torch svd", "numpy svd")
BATCH = 4096
MIB = 2**20


# ------------------------------------------------------------------------ the worker
def _rows(gen: torch.Generator, b: int, scales: torch.Tensor, offset: torch.Tensor):
    return torch.randn(b, scales.numel(), generator=gen).mul_(scales).add_(offset)


def worker(route: str, n: int, d: int, dtype: str, seed: int, sv_path: str) -> dict[str, Any]:
    """One route at one N, in this (fresh) process; returns times and peak extra bytes."""
    # Warm every library up first so that the baseline holds their code and pools.
    StreamingCovariance(8).update(torch.randn(16, 8))
    symmetric_eigh(torch.eye(8, dtype=torch.float64))
    torch.linalg.svdvals(torch.randn(16, 8))
    np.linalg.svd(np.random.default_rng(0).random((16, 8)), compute_uv=False)
    gc.collect()
    reset_ok = peak_rss_reset()
    base = rss_bytes()
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -3, d)
    offset = torch.linspace(-1, 1, d)
    t_gen = t_work = 0.0
    if route == "streaming":
        acc = StreamingCovariance(d)
        for start in range(0, n, BATCH):
            t0 = time.perf_counter()
            x = _rows(gen, min(BATCH, n - start), scales, offset)
            t1 = time.perf_counter()
            acc.update(x)
            t_work += time.perf_counter() - t1
            t_gen += t1 - t0
            del x
        t0 = time.perf_counter()
        evals = symmetric_eigh(acc.second_moment())[0]
        sv = torch.sqrt(evals.clamp_min(0) * n).flip(0).numpy()
        t_work += time.perf_counter() - t0
    else:
        np_dtype = np.float64 if dtype == "float64" else np.float32
        t0 = time.perf_counter()
        if route == "torch svd":
            stack: Any = torch.empty(n, d, dtype=getattr(torch, dtype))
        else:
            stack = np.empty((n, d), dtype=np_dtype)
        t_work += time.perf_counter() - t0
        for start in range(0, n, BATCH):
            b = min(BATCH, n - start)
            t0 = time.perf_counter()
            x = _rows(gen, b, scales, offset)
            t1 = time.perf_counter()
            if route == "torch svd":
                stack[start : start + b].copy_(x)
            else:
                stack[start : start + b] = x.numpy()
            t_work += time.perf_counter() - t1
            t_gen += t1 - t0
            del x
        t0 = time.perf_counter()
        if route == "torch svd":
            sv = torch.linalg.svdvals(stack).to(torch.float64).numpy()
        else:
            sv = np.linalg.svd(stack, compute_uv=False).astype(np.float64)
        t_work += time.perf_counter() - t0
    peak = peak_rss_bytes()
    np.save(sv_path, np.asarray(sv, dtype=np.float64))
    return {
        "route": route,
        "n": n,
        "d": d,
        "dtype": dtype,
        "time_s": t_work,
        "gen_s": t_gen,
        "peak_extra_bytes": (peak - base) if (peak is not None and base is not None) else None,
        "peak_reset": reset_ok,
        "threads": torch.get_num_threads(),
    }


# ------------------------------------------------------------------------ the parent
def _need_bytes(route: str, n: int, d: int, itemsize: int) -> int:
    """Peak bytes a direct route needs: the stack plus what the SVD copies (+ 512 MiB).

    torch keeps the stack's dtype and LAPACK works on one copy: 2 stacks (measured: 1692 MiB
    for a 781 MiB float64 stack, 7942 MiB for a 3906 MiB float32 one). numpy does the same
    in float64, but casts a float32 stack to float64 first: the stack plus two float64
    copies is assumed (a 4 GB float32 stack had reached 16 GB of RSS when it was stopped)."""
    stack = n * d * itemsize
    if route == "numpy svd" and itemsize != 8:
        return stack + 2 * n * d * 8 + 512 * MIB
    return 2 * stack + 512 * MIB


def _direct_dtype(route: str, n: int, d: int, fraction: float) -> tuple[str | None, str]:
    """The stack dtype that fits in ``fraction`` of MemAvailable now (float64, else float32)."""
    avail = meminfo_available()
    if avail is None:
        return "float64", "MemAvailable unknown"
    for dtype, size in (("float64", 8), ("float32", 4)):
        need = _need_bytes(route, n, d, size)
        if need <= fraction * avail:
            return dtype, f"needs ~{need / 2**30:.1f} GiB of {avail / 2**30:.1f} GiB available"
    need = _need_bytes(route, n, d, 4)
    return None, (
        f"does not fit: float32 stack needs ~{need / 2**30:.1f} GiB, {fraction:.0%} of "
        f"{avail / 2**30:.1f} GiB available is allowed"
    )


def run_one(
    route: str, n: int, d: int, dtype: str, seed: int, timeout: float, tmp: str, floor: int
) -> dict:
    """One worker process; killed if it outlives ``timeout`` or MemAvailable drops below
    ``floor`` bytes (the machine is shared: another job must never be pushed out of memory)."""
    sv_path = os.path.join(tmp, f"{route.replace(' ', '_')}_{n}_{dtype}.npy")
    spec = json.dumps({"route": route, "n": n, "d": d, "dtype": dtype, "seed": seed})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", spec, "--sv-path", sv_path]
    fail = {"route": route, "n": n, "dtype": dtype}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.perf_counter()
    killed = None
    while proc.poll() is None:
        time.sleep(0.25)
        avail = meminfo_available()
        if avail is not None and avail < floor:
            killed = f"stopped: machine memory low ({avail / 2**30:.1f} GiB available)"
        elif time.perf_counter() - t0 > timeout:
            killed = f"timed out after {timeout:.0f} s"
        if killed:
            proc.kill()
            proc.wait()
            return {**fail, "status": killed}
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        tail = (stderr or stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {**fail, "status": f"failed: {tail[0]}"}
    out = json.loads(stdout.strip().splitlines()[-1])
    out["status"] = "ok"
    out["sv"] = np.load(sv_path)
    return out


def _agreement(sv: np.ndarray, ref: np.ndarray | None) -> tuple[float, float]:
    if ref is None:
        return math.nan, math.nan
    s, r = np.sort(sv)[::-1], np.sort(ref)[::-1]
    return float(np.max(np.abs(s - r)) / r[0]), float(abs(s[-1] - r[-1]) / r[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="fresh runs per (route, N)")
    parser.add_argument(
        "--repeats-above", type=int, default=100_000, help="N above this runs once per route"
    )
    parser.add_argument("--mem-fraction", type=float, default=0.6, help="of MemAvailable")
    parser.add_argument(
        "--min-free-gib", type=float, default=2.0, help="stop a run when MemAvailable drops below"
    )
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: reproducible on a shared machine)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write <out>.md and <out>.json")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sv-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        torch.set_num_threads(args.threads)
        spec = json.loads(args.worker)
        print(json.dumps(worker(**spec, sv_path=args.sv_path)))
        return

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)  # the workers' numpy/LAPACK use the same cores
    torch.set_num_threads(args.threads)
    info = machine()
    print(machine_line(info), flush=True)
    d = args.dim
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="normscope-svd-") as tmp:
        for n in args.rows:
            reps = args.repeats if n <= args.repeats_above else 1
            by_route: dict[str, dict] = {}
            for route in ROUTES:
                if route not in args.routes:
                    by_route[route] = {"route": route, "n": n, "dtype": "-", "status": "not asked"}
                    continue
                dtype, why = "float64", "d x d state"
                if route != "streaming":
                    dtype, why = _direct_dtype(route, n, d, args.mem_fraction)
                print(f"N = {n}, {route}: {dtype or 'not run'} ({why})", flush=True)
                if dtype is None:
                    by_route[route] = {"route": route, "n": n, "dtype": "-", "status": why}
                    continue
                floor = int(args.min_free_gib * 2**30)
                runs = [
                    run_one(route, n, d, dtype, args.seed, args.timeout, tmp, floor)
                    for _ in range(reps)
                ]
                ok = [r for r in runs if r["status"] == "ok"]
                if not ok:
                    by_route[route] = runs[0]
                    continue
                best = dict(ok[0])
                best["time_s"] = statistics.median(r["time_s"] for r in ok)
                best["time_all_s"] = [r["time_s"] for r in ok]
                best["gen_s"] = statistics.median(r["gen_s"] for r in ok)
                best["peak_extra_bytes"] = statistics.median(r["peak_extra_bytes"] for r in ok)
                best["runs"] = len(ok)
                by_route[route] = best
                print(f"  {route}: {best['time_s']:.2f} s, "
                      f"{best['peak_extra_bytes'] / MIB:.0f} MiB", flush=True)  # fmt: skip
            ref = None
            for route in ("torch svd", "numpy svd"):
                r = by_route.get(route, {})
                if r.get("status") == "ok" and r["dtype"] == "float64":
                    ref = r["sv"]
                    break
            stream = by_route["streaming"]
            direct_mem = [
                by_route[r]["peak_extra_bytes"]
                for r in ("torch svd", "numpy svd")
                if by_route[r].get("status") == "ok"
            ]
            for route in ROUTES:
                r = by_route[route]
                if r.get("status") == "ok":
                    r["sv_err_over_smax"], r["smin_rel_err"] = _agreement(r["sv"], ref)
                    if stream.get("status") == "ok":
                        r["time_over_streaming"] = r["time_s"] / stream["time_s"]
                        r["mem_over_streaming"] = r["peak_extra_bytes"] / max(
                            1, stream["peak_extra_bytes"]
                        )
                    r.pop("sv", None)
                results.append(r)
            if stream.get("status") == "ok" and direct_mem:
                stream["mem_over_smallest_direct"] = stream["peak_extra_bytes"] / min(direct_mem)

    headers = [
        "N rows",
        "route",
        "stack dtype",
        "runs",
        "time s (median)",
        "gen s (excluded)",
        "peak extra MiB",
        "time / streaming",
        "memory / streaming",
        "max abs(s - s_ref) / s_max",
        "s_min rel. err",
    ]
    cells = []
    for r in results:
        if r.get("status") == "not asked":
            continue
        if r.get("status") != "ok":
            cells.append([f"{r['n']:,}", r["route"], r.get("dtype", "-"), 0, "not run: "
                          + r["status"], "", "", "", "", "", ""])  # fmt: skip
            continue
        cells.append(
            [
                f"{r['n']:,}",
                r["route"],
                r["dtype"] + ("" if r["route"] == "streaming" else " stack"),
                r["runs"],
                f"{r['time_s']:.2f}",
                f"{r['gen_s']:.2f}",
                f"{r['peak_extra_bytes'] / MIB:.0f}",
                f"{r.get('time_over_streaming', math.nan):.2f}x",
                f"{r.get('mem_over_streaming', math.nan):.1f}x",
                f"{r.get('sv_err_over_smax', math.nan):.1e}",
                f"{r.get('smin_rel_err', math.nan):.1e}",
            ]
        )
    text = (
        machine_line(info)
        + f"\n\nd = {d}, rows drawn in batches of {BATCH} float32; peak extra = VmHWM after a "
        "peak reset minus the baseline RSS, fresh process per run\n\n"
        + markdown_table(headers, cells)
    )
    print("\n" + text)
    write_outputs(args.out, text, {"machine": info, "dim": d, "batch": BATCH, "results": results})


if __name__ == "__main__":
    main()
