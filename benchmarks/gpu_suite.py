"""Every GPU-relevant normscope cost in one run that finishes in under 8 minutes on one GPU.

Parts (each with a share of ``--budget`` seconds and a global deadline; an item that would
start past its part's or the global deadline is recorded as skipped, never run):

1. **accumulate** -- ``StreamingCovariance.update`` of float32 rows on the device, the default
   fold (``fold="auto"``: on CUDA upper-triangle panels from d = 1024, the full GEMM below),
   the full-GEMM fold (``fold="gemm"``) and forced panels (``fold="panels"``), against the bare
   float64 ``x.T @ x``: useful GFLOP/s (``N d (d + 1)`` flops, the symmetric result) and the
   fraction of the syrk roofline (useful GFLOP/s / the matmul's ``2 N d^2`` rate), the update's
   peak extra device memory, and the float64 accumulator on the device (default and panel
   folds) against a CPU float64 reference of the same rows (relative Frobenius error of the
   co-moment and of the mean; must be <= 1e-12).
2. **eigensolves** -- ``symmetric_eigh``, ``eigvalsh``, ``kernel_read``, ``schur_quotient``,
   ``sigma_min`` on the device against d; device eigenvalues against CPU float64 ``eigvalsh``.
3. **monitor read** -- a whole ``DeadDirectionTracker.read`` on the example GPT at several
   depths/widths (read time, accumulator and peak read memory, the model's train step, and
   the ``every_n_steps`` that keeps the monitor under 1%).
4. **training** -- a Lightning fit of the example GPT (``examples/nanogpt.py``) on the device,
   with no monitor, ``DeadDirectionMonitor`` (default, synchronous and asynchronous reads),
   ``SignMagnitudeMonitor`` and both; step times from the first callback's batch start to the
   last one's batch end, the training stream synchronised (an asynchronous read's side stream
   is not waited for: its cost shows as what it takes from the training kernels).
5. **overhead** -- ``benchmarks/overhead.py``'s step-interleaved run on the device (the demo
   GPT at widths 128, 256, 512; no monitor, ``DeadDirectionMonitor`` and ``wandb.watch`` at
   ``every_n_steps`` 10, 20, 50, one process, block by block): the per-read extra of the
   monitor and of ``wandb.watch`` in plain steps and the mean-step ratios, the figures the CPU
   run records in ``benchmarks/RESULTS.md``.

On CUDA every timing is bracketed by ``torch.cuda.synchronize`` and memory is read with
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. The tables go to stdout
and, with ``--out PATH``, to ``PATH.md`` and ``PATH.json`` (rewritten after every part, so a
killed run keeps what it measured).

Without CUDA the script says so and exits 0. ``--smoke-cpu`` runs the same code paths on the
CPU with tiny sizes (under 30 s) so that its logic can be tested anywhere. Exit status: 0, or 2
when an accuracy check failed (the files are written first).

The parts live in ``gpu_kernels.py`` (1 to 3) and ``gpu_training.py`` (4); the sizes and the
deadlines in ``gpu_common.py``. This file is the driver.

Usage::

    python benchmarks/gpu_suite.py --out benchmarks/gpu_results      # on a CUDA machine
    python benchmarks/gpu_suite.py --smoke-cpu --out /tmp/gpu_smoke   # logic check on a CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: examples
from _common import machine, machine_line, write_outputs  # noqa: E402
from gpu_common import ACCURACY_TOL, Clock, Sizes  # noqa: E402
from gpu_kernels import (  # noqa: E402
    part_accumulate,
    part_eigensolves,
    part_read,
    table_accumulate,
    table_eigensolves,
    table_read,
)
from gpu_training import (  # noqa: E402
    part_overhead,
    part_training,
    table_overhead,
    table_training,
)

PART_SHARES = {
    "accumulate": 0.12,
    "eigensolves": 0.2,
    "monitor read": 0.16,
    "training": 0.27,
    "overhead": 0.2,
}


# ------------------------------------------------------------------------ driver
PARTS: list[tuple[str, Callable[..., list[dict[str, Any]]], Callable[..., str]]] = [
    ("accumulate", part_accumulate, table_accumulate),
    ("eigensolves", part_eigensolves, table_eigensolves),
    ("monitor read", part_read, table_read),
    ("training", part_training, table_training),
    ("overhead", part_overhead, table_overhead),
]


def render(head: str, results: dict[str, Any]) -> str:
    out = [head]
    for name, _, table in PARTS:
        if name not in results:
            continue
        r = results[name]
        out.append(f"\n### {name} ({r['elapsed_s']:.0f} s)\n")
        out.append(r["error"] if "error" in r else table(r["rows"]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write <out>.md and <out>.json")
    parser.add_argument("--smoke-cpu", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all parts")
    parser.add_argument("--parts", nargs="*", default=[p[0] for p in PARTS], help="run only these")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    if not args.smoke_cpu and not torch.cuda.is_available():
        print(
            f"gpu_suite: no CUDA device available (torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda}); nothing measured. Use --smoke-cpu to run the same code "
            "paths on the CPU with tiny sizes."
        )
        return 0
    dev = torch.device("cpu") if args.smoke_cpu else torch.device("cuda", 0)
    sz = Sizes.smoke() if args.smoke_cpu else Sizes.cuda()
    if args.budget is not None:
        sz.budget_s = args.budget
    if dev.type == "cpu":
        # One thread: on a shared CPU, OpenMP threads that wait on a busy core make tiny ops
        # orders of magnitude slower (a 128 x 128 eigh took 1.8 s with two threads under load).
        torch.set_num_threads(1)
    clock = Clock(sz.budget_s)
    info = machine(dev)
    mode = "smoke run on the CPU (tiny sizes: logic check, not figures)" if args.smoke_cpu else ""
    head = f"{machine_line(info)}\n\nnormscope gpu_suite on {dev}{': ' + mode if mode else ''}; "
    head += f"budget {sz.budget_s:.0f} s"
    print(head, flush=True)
    results: dict[str, Any] = {}
    failed_checks = []
    for name, fn, table in PARTS:
        if name not in args.parts:
            continue
        clock.start_part(PART_SHARES[name])
        t0 = time.perf_counter()
        try:
            rows = fn(dev, sz, clock)
            results[name] = {"rows": rows}
        except Exception as err:  # noqa: BLE001 - one part failing must not lose the others
            results[name] = {"error": f"error: {type(err).__name__}: {err}", "rows": []}
            traceback.print_exc()
        results[name]["elapsed_s"] = time.perf_counter() - t0
        for r in results[name]["rows"]:
            if (
                r.get("accuracy_ok") is False
                or r.get("eig_ok") is False
                or r.get("fast_ok") is False
            ):
                failed_checks.append(f"{name} d={r.get('d')}")
        text = render(head, results)
        print(f"\n### {name} ({results[name]['elapsed_s']:.0f} s)\n", flush=True)
        print(results[name].get("error") or table(results[name]["rows"]), flush=True)
        write_outputs(
            args.out,
            text + f"\n\n(total {clock.elapsed():.0f} s)",
            {
                "machine": info,
                "device": str(dev),
                "smoke_cpu": args.smoke_cpu,
                "budget_s": sz.budget_s,
                "elapsed_s": clock.elapsed(),
                "accuracy_tol": ACCURACY_TOL,
                "parts": results,
            },
        )
    print(f"\ngpu_suite: done in {clock.elapsed():.0f} s", flush=True)
    if args.out:
        print(f"gpu_suite: wrote {args.out}.md/.json (suffix dropped if given)")
    if failed_checks:
        print("gpu_suite: ACCURACY CHECK FAILED: " + ", ".join(failed_checks))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
