"""Scaling on paper: memory and time per read for 1B-, 7B- and 70B-class widths.

A projection, not a measurement. It combines

* constants **measured on this machine** when the script runs (CPU, float64): a power-law fit
  ``t_eigh = a d^b`` of ``symmetric_eigh`` over a few widths, the costs of ``kernel_read``,
  ``schur_quotient``, ``sigma_min`` and ``eigvalsh`` relative to ``symmetric_eigh``, the rate of
  ``StreamingCovariance.update``, and the transient memory of an update and a kernel read
  (peak RSS above the baseline, in units of one ``8 d^2`` state), all at d = 1024;
* **assumed** constants for one data-centre GPU (an H200 SXM unless ``--gpu-json`` gives the
  ``gpu_suite.py`` output of a real one): float64 dense peak 67 TFLOP/s, ``update`` at 60% of
  it (a GEMM), eigensolves at an effective 3 TFLOP/s of ``9 d^3`` flops (cuSOLVER's ``syevd``
  is bound by the memory-bound tridiagonal reduction, not the tensor cores; about 5% of peak)
  with a 10 ms floor, the same relative costs of the reads as measured on the CPU; training at
  40% MFU of 989 TFLOP/s bf16 with 32768 tokens per GPU per step (``6 P T`` flops);
* the monitor's own layer selection: ``_plan_budget`` of ``normscope.families.budget``
  is called on stand-in layers, so a stride is exactly what ``max_memory`` would pick.

Layout: a pre-norm decoder (LLaMA-like) with ``2 L + 1`` norms (two per block and a final
one), ``P = 12 L d^2`` parameters. The residual points ``p_0 .. p_2L`` are the norms' inputs
and share their taps: every layer read is ``2 (2 L + 1)`` taps. Under ``max_memory`` the
tracker's ``_plan_budget`` keeps the profile first (at a stride when it alone is over) and
reads norm layers at a stride with what is left; the table shows each budget with and
without ``residual``.

Usage::

    python benchmarks/scaling_projection.py
    python benchmarks/scaling_projection.py --gpu-json benchmarks/gpu_results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    machine,
    machine_line,
    markdown_table,
    median_time,
    peak_rss_bytes,
    peak_rss_reset,
    rss_bytes,
    write_outputs,
)
from read_cost import fit_power, primitive_costs, test_matrix  # noqa: E402

from normscope.families.budget import plan_budget as _plan_budget  # noqa: E402
from normscope.families.budget import tap_cost as _tap_cost
from normscope.functional import (  # noqa: E402
    StreamingCovariance,
    kernel_read,
    symmetric_eigh,
)
from normscope.taps.residual import ResidualPoint  # noqa: E402

CPU = torch.device("cpu")
GIB = 2**30
SHAPES = [("1B-class", 2048, 24), ("7B-class", 4096, 32), ("70B-class", 8192, 80)]
# max_memory chosen per class: everything where it fits in a few GiB, else a stride.
BUDGETS = {"1B-class": [], "7B-class": [4 * GIB], "70B-class": [8 * GIB, 24 * GIB]}
ASSUMED_GPU = {
    "name": "H200 SXM (assumed)",
    "fp64_dense_tflops": 67.0,
    "update_efficiency": 0.6,
    "eigh_eff_tflops": 3.0,
    "eigh_floor_s": 0.010,
    "bf16_dense_tflops": 989.0,
    "mfu": 0.4,
    "tokens_per_gpu_step": 32768,
    "memory_gib": 141.0,
}
MAX_ROWS = 4096  # rows per forward measured (the old default; now 8 d per read)


def _eigh_s(d: int, repeats: int) -> float:
    c = test_matrix(d)
    return median_time(lambda: symmetric_eigh(c), CPU, repeats)[0]


def measure_cpu(dims: list[int], repeats: int, ratio_dim: int = 2048) -> dict[str, Any]:
    """The constants measured on this machine (see the module docstring): the read primitives
    relative to ``symmetric_eigh`` at ``ratio_dim`` on both test spectra (the fast solvers'
    cost depends on the bottom gaps), and the default fold against the full float64 GEMM."""
    eigh = {d: _eigh_s(d, repeats) for d in dims}
    a, b = fit_power(list(eigh), list(eigh.values()))
    d = ratio_dim
    ratios: dict[str, dict[str, float]] = {}
    times: dict[str, dict[str, float]] = {}
    for spectrum in ("test", "power-law"):
        t = primitive_costs(d, repeats, 1, spectrum=spectrum)
        times[spectrum] = t
        ratios[spectrum] = {k: v / t["symmetric_eigh"] for k, v in t.items()}
    x = torch.randn(MAX_ROWS, d)
    acc = StreamingCovariance(d)
    t_up = median_time(lambda: acc.update(x), CPU, repeats)[0]
    x64 = x.double()
    t_gemm = median_time(lambda: x64.T @ x64, CPU, repeats)[0]
    return {
        "eigh_points_s": eigh,
        "eigh_fit": {"a": a, "b": b},
        "ratio_dim": d,
        "times_s": times,
        "ratios_by_spectrum": ratios,
        # the projection's read ratios: the harder spectrum, so the figures are upper bounds
        "ratios": ratios["power-law"],
        "update_gflops": 2 * MAX_ROWS * d * d / t_up / 1e9,
        "update_over_gemm": t_up / t_gemm,
        **measure_transient(1024),
    }


def measure_transient(d: int) -> dict[str, float]:
    """Peak memory above the live state of one ``update`` (of ``MAX_ROWS`` float32 rows) and
    of one ``kernel_read``, in units of one ``8 d^2`` state, from a fresh process.

    The process runs with ``MALLOC_MMAP_THRESHOLD_=65536``: every buffer over 64 KiB is its
    own mapping, returned to the kernel when freed, so the peak RSS (``VmHWM`` after a reset)
    counts every transient buffer; with glibc's default dynamic threshold a freed 8 MiB
    buffer could be reused from the heap without showing in the RSS.
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--transient-worker", str(d)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return {"update_transient_states": math.nan, "kernel_read_transient_states": math.nan}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def transient_worker(d: int) -> dict[str, float]:
    c = test_matrix(d)
    gamma = 1.0 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(1), dtype=c.dtype)
    x = torch.randn(MAX_ROWS, d)
    acc = StreamingCovariance(d)
    state = 8 * d * d
    rows_bytes = 8 * MAX_ROWS * d  # the float64 copy of the rows every update makes

    def peak_of(fn) -> float:
        gc.collect()
        if not peak_rss_reset():
            return math.nan
        base = rss_bytes()
        fn()
        return float(peak_rss_bytes() - base)

    symmetric_eigh(torch.eye(8, dtype=torch.float64))  # load LAPACK before measuring
    up = peak_of(lambda: acc.update(x))
    kr = peak_of(lambda: kernel_read(c, gamma, 2 * d, declared_kind="layernorm"))
    return {
        "update_transient_states": max(0.0, up - rows_bytes) / state,
        "update_transient_bytes_at_1024": up,
        "kernel_read_transient_states": kr / state,
    }


def gpu_constants(path: str | None, cpu: dict[str, Any]) -> dict[str, Any]:
    """Assumed H200 constants, or ones measured by ``gpu_suite.py`` (``--gpu-json``)."""
    g: dict[str, Any] = dict(ASSUMED_GPU, ratios=dict(cpu["ratios"]), source="assumed")
    if path is None:
        return g
    data = json.loads(Path(path).read_text())
    parts = data["parts"]
    g["name"] = data["machine"].get("gpu", "measured GPU") + " (measured by gpu_suite.py)"
    g["source"] = "measured"
    acc = [r for r in parts.get("accumulate", {}).get("rows", []) if r.get("status") == "ok"]
    if acc:
        top = max(acc, key=lambda r: r["d"])
        g["update_tflops"] = top["update_gflops"] / 1e3
    eig = [r for r in parts.get("eigensolves", {}).get("rows", []) if "symmetric_eigh" in r]
    eig = [r for r in eig if math.isfinite(r["symmetric_eigh"])]
    if len(eig) >= 2:
        big = (
            [r for r in eig if r["d"] >= 2048]
            if len([r for r in eig if r["d"] >= 2048]) >= 2
            else eig
        )
        a, b = fit_power([r["d"] for r in big], [r["symmetric_eigh"] for r in big])
        g["eigh_fit"] = {"a": a, "b": b}
        top = max(eig, key=lambda r: r["d"])
        g["ratios"] = {
            k: top[k] / top["symmetric_eigh"]
            for k in ("kernel_read", "schur_quotient", "sigma_min", "eigvalsh")
            if math.isfinite(top.get(k, math.nan))
        }
    return g


def t_eigh_gpu(d: int, g: dict[str, Any]) -> float:
    if "eigh_fit" in g:
        return g["eigh_fit"]["a"] * d ** g["eigh_fit"]["b"]
    return max(g["eigh_floor_s"], 9 * d**3 / (g["eigh_eff_tflops"] * 1e12))


def plan(label: str, d: int, n_layer: int, budget: int | None, residual: bool) -> dict[str, Any]:
    """Which norms and residual points the monitor would tap for this shape and budget: the
    tracker's own ``_plan_budget`` on stand-in layers of a pre-norm decoder."""
    norms = [
        SimpleNamespace(name=f"layers.{i // 2}.norm{i % 2}", dim=d) for i in range(2 * n_layer)
    ]
    norms.append(SimpleNamespace(name="norm", dim=d))
    # Pre-norm: every point p_0 .. p_2L is a norm's input (attn, mlp alternating after p_0).
    points = [
        ResidualPoint(n.name, n.name, "input", None if i == 0 else ("attn", "mlp")[(i - 1) % 2], i)
        for i, n in enumerate(norms)
    ]
    if not residual:
        points = []
    chosen, kept = list(norms), list(points)
    if budget is not None:
        chosen, kept, *_ = _plan_budget(list(norms), points, d, budget)
    index = [norms.index(n) for n in chosen]
    if len(chosen) == len(norms):
        stride = "all"
    elif len(index) > 1:
        stride = f"stride {index[1] - index[0]}"
    else:
        stride = "final only" if index else "none"
    return {
        "class": label,
        "d": d,
        "L": n_layer,
        "max_memory": budget,
        "residual": residual,
        "norms": len(norms),
        "norms_read": len(chosen),
        "stride": stride,
        "points": len(kept),
        "points_all": len(points),
        "taps": _tap_cost(chosen, kept, d) // (8 * d * d),
    }


def project(p: dict[str, Any], cpu: dict[str, Any], g: dict[str, Any]) -> dict[str, Any]:
    d = p["d"]
    state = 8 * d * d
    p["acc_gib"] = p["taps"] * state / GIB
    p["update_transient_mib"] = (8 * MAX_ROWS * d + cpu["update_transient_states"] * state) / 2**20
    p["read_transient_gib"] = cpu["kernel_read_transient_states"] * state / GIB
    r = g["ratios"]
    te = t_eigh_gpu(d, g)
    fit = cpu["eigh_fit"]
    tc = fit["a"] * d ** fit["b"]
    cr = cpu["ratios"]

    def read_s(ratios: dict[str, float], t_eigh: float, fast: bool) -> float:
        kr, sm = ("kernel_read_fast", "sigma_min_fast") if fast else ("kernel_read", "sigma_min")
        layer = ratios[kr] + ratios["schur_quotient"]
        return (p["norms_read"] * layer + p["points"] * ratios[sm]) * t_eigh

    p["read_gpu_dense_s"] = read_s(r, te, fast=False)
    p["read_gpu_s"] = read_s(r, te, fast=True)
    p["read_cpu_s"] = read_s(cr, tc, fast=True)
    # The default fold on CUDA from d = 1024: upper-triangle panels of max(256, d / 16) columns,
    # (1 + panel / d) / 2 of the full product's 2 N d^2 flops, at the update efficiency.
    panel = max(256, d // 16)
    flops = p["taps"] * 2 * MAX_ROWS * d * d * (1 + panel / d) / 2
    update_tflops = g.get("update_tflops", g["fp64_dense_tflops"] * g["update_efficiency"])
    p["accumulate_gpu_s"] = flops / (update_tflops * 1e12)
    params = 12 * p["L"] * d * d
    p["params"] = params
    p["step_s"] = 6 * params * g["tokens_per_gpu_step"] / (g["mfu"] * g["bf16_dense_tflops"] * 1e12)

    def every(cost: float) -> int:
        return max(1, math.ceil(cost / (0.01 * p["step_s"])))

    acc = p["accumulate_gpu_s"]
    p["every_1pct_dense"] = every(p["read_gpu_dense_s"] + acc)
    p["every_1pct"] = every(p["read_gpu_s"] + acc)
    # Asynchronous reads: the solves run on a side stream while training goes on, so the
    # critical path is the accumulation alone -- if the read overlaps fully (an assumption the
    # GPU suite's sync/async fit checks) and is done before the next read is due.
    p["every_1pct_async"] = max(every(acc), math.ceil(p["read_gpu_s"] / p["step_s"]))
    p["every_1pct_ddp8"] = every(p["read_gpu_s"] / 8 + acc)
    return p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratio-dim", type=int, default=2048, help="d of the read ratios")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gpu-json", default=None, help="gpu_suite.py output to use instead")
    parser.add_argument("--out", default=None, help="also write <out>.md and <out>.json")
    parser.add_argument("--transient-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.transient_worker is not None:
        print(json.dumps(transient_worker(args.transient_worker)))
        return
    info = machine()
    print(machine_line(info), flush=True)
    cpu = measure_cpu(args.dims, args.repeats, args.ratio_dim)
    g = gpu_constants(args.gpu_json, cpu)
    rows = []
    for label, d, n_layer in SHAPES:
        rows.append(project(plan(label, d, n_layer, None, True), cpu, g))
        for budget in BUDGETS[label]:
            rows.append(project(plan(label, d, n_layer, budget, True), cpu, g))
            rows.append(project(plan(label, d, n_layer, budget, False), cpu, g))

    def mm(b: int | None) -> str:
        return "None" if b is None else f"{b / GIB:.0f} GiB"

    table = markdown_table(
        [
            "class (d, L)",
            "max_memory, residual",
            "norms read",
            "profile points",
            "taps",
            "accumulators GiB",
            "update transient MiB",
            "read transient GiB",
            "accumulate s / sampled step (GPU)",
            "read s, dense solvers (GPU)",
            "read s, fast solvers (GPU)",
            "read s (this CPU, fit)",
            "assumed step s",
            "every_n_steps <= 1%: dense, sync",
            "fast, sync",
            "fast, async",
            "fast, sync, split over 8 ranks",
        ],
        [
            [
                f"{p['class']} ({p['d']}, {p['L']})",
                f"{mm(p['max_memory'])}, {p['residual']}",
                f"{p['norms_read']}/{p['norms']} ({p['stride']})",
                f"{p['points']}/{p['points_all']}",
                p["taps"],
                f"{p['acc_gib']:.1f}",
                f"{p['update_transient_mib']:.0f}",
                f"{p['read_transient_gib']:.2f}",
                f"{p['accumulate_gpu_s']:.2f}",
                f"{p['read_gpu_dense_s']:.1f}",
                f"{p['read_gpu_s']:.1f}",
                f"{p['read_cpu_s']:.0f}",
                f"{p['step_s']:.2f}",
                p["every_1pct_dense"],
                p["every_1pct"],
                p["every_1pct_async"],
                p["every_1pct_ddp8"],
            ]
            for p in rows
        ],
    )
    fit = cpu["eigh_fit"]
    consts = [
        f"Measured here (CPU, {args.threads} thread(s)): symmetric_eigh ~ {fit['a']:.3g} d^{fit['b']:.2f} s "
        f"over d in {args.dims}; at d = {cpu['ratio_dim']} relative to symmetric_eigh, "
        "test spectrum / power-law spectrum (the projection uses the power law's): "
        + ", ".join(
            f"{k} {v:.2f} / {cpu['ratios_by_spectrum']['power-law'][k]:.2f}"
            for k, v in cpu["ratios_by_spectrum"]["test"].items()
            if k != "symmetric_eigh"
        )
        + f"; update {cpu['update_gflops']:.1f} GFLOP/s ({MAX_ROWS} rows, "
        f"{cpu['update_over_gemm']:.2f}x the time of the full float64 GEMM); transient memory "
        f"of an update {cpu['update_transient_states']:.2f} states + the float64 rows, of a "
        f"kernel_read {cpu['kernel_read_transient_states']:.2f} states (one state = 8 d^2 bytes, "
        "at d = 1024).",
        f"GPU constants ({g['source']}): {g['name']}"
        + (
            f", fp64 dense {g['fp64_dense_tflops']} TFLOP/s, update at "
            f"{g['update_efficiency']:.0%} of it, eigh at {g['eigh_eff_tflops']} TFLOP/s "
            f"effective of 9 d^3 flops (floor {1e3 * g['eigh_floor_s']:.0f} ms), read ratios as on "
            "the CPU"
            if g["source"] == "assumed"
            else f", eigh fit {g['eigh_fit']['a']:.3g} d^{g['eigh_fit']['b']:.2f} s"
        )
        + f"; training step = 6 P T / ({g['mfu']:.0%} MFU x {g['bf16_dense_tflops']} TFLOP/s bf16), "
        f"T = {g['tokens_per_gpu_step']} tokens per GPU per step, P = 12 L d^2.",
    ]
    text = machine_line(info) + "\n\n" + "\n\n".join(consts) + "\n\n" + table
    print("\n" + text)
    write_outputs(args.out, text, {"machine": info, "cpu": cpu, "gpu": g, "rows": rows})


if __name__ == "__main__":
    main()
