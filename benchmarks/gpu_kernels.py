"""Parts 1 to 3 of benchmarks/gpu_suite.py: accumulate, eigensolves, monitor read (what each
measures is in that script's docstring)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch
from _common import markdown_table, median_time
from gpu_common import ACCURACY_TOL, EIGEN_TOL, Clock, Sizes, fmt_mib, peak_since, reset_peak
from read_cost import PRIMITIVES, every_for, model_read_cost, test_matrix

from normscope.functional import (
    StreamingCovariance,
    input_reads,
    kernel_read,
    schur_quotient,
    sigma_min,
    symmetric_eigh,
)


# ------------------------------------------------------------------------ part 1
def part_accumulate(dev: torch.device, sz: Sizes, clock: Clock) -> list[dict[str, Any]]:
    out = []
    for d in sz.acc_dims:
        why = clock.why_not()
        if why:
            out.append({"d": d, "status": why})
            continue
        row = accumulate_speed(dev, d, sz.acc_rows, sz.repeats)
        if clock.why_not() is None:
            row.update(accumulate_accuracy(dev, d, sz.check_rows))
        out.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def accumulate_speed(dev: torch.device, d: int, rows: int, repeats: int) -> dict[str, Any]:
    """The folds against the bare float64 matmul at one width, and the update's peak memory."""
    gen = torch.Generator(device=dev).manual_seed(d)
    x = torch.randn(rows, d, device=dev, generator=gen)
    acc = StreamingCovariance(d, device=dev)
    acc.update(x)  # warm-up, and the state exists before the memory baseline
    base = reset_peak(dev)
    acc.update(x)
    update_peak = peak_since(dev, base)
    _, ts_u = median_time(lambda: acc.update(x), dev, repeats, warmup=0)
    times = {"auto": statistics.median(ts_u)}
    for mode in ("gemm", "panels"):
        other = StreamingCovariance(d, device=dev, fold=mode)
        times[mode] = statistics.median(median_time(lambda o=other: o.update(x), dev, repeats)[1])
    x64 = x.to(torch.float64)
    _, ts_m = median_time(lambda: x64.T @ x64, dev, repeats, warmup=1)
    t_m = statistics.median(ts_m)
    rate = 2.0 * rows * d * d / t_m  # the GEMM's flop rate
    useful = float(rows) * d * (d + 1)  # the flops of the symmetric result
    kind, panel = acc._plan
    return {
        "d": d,
        "rows": rows,
        "fold": f"panels of {panel}" if kind == "panels" else kind,
        "update_ms": 1e3 * times["auto"],
        "gemm_fold_ms": 1e3 * times["gemm"],
        "panel_fold_ms": 1e3 * times["panels"],
        "update_gflops": useful / times["auto"] / 1e9,
        "matmul_gflops": rate / 1e9,
        "fraction": useful / times["auto"] / rate,
        "gemm_fold_fraction": useful / times["gemm"] / rate,
        "panel_fold_fraction": useful / times["panels"] / rate,
        "update_peak_extra_bytes": update_peak,
        "state_bytes": 8 * d * d,
        "status": "ok",
    }


def accumulate_accuracy(dev: torch.device, d: int, rows: int) -> dict[str, Any]:
    """The same float32 rows (mean offset 3, so centring matters) into device accumulators
    (default fold and forced panels) and a CPU float64 one, in two updates (the Chan merge is
    exercised); the worst relative errors."""
    gen = torch.Generator(device=dev).manual_seed(10_000 + d)
    x = torch.randn(rows, d, device=dev, generator=gen) + 3.0
    ref = StreamingCovariance(d)
    on_dev = [StreamingCovariance(d, device=dev), StreamingCovariance(d, device=dev, fold="panels")]
    half = rows // 2
    for part in (x[:half], x[half:]):
        ref.update(part.cpu())
        for acc in on_dev:
            acc.update(part)
    com = mean = 0.0
    for acc in on_dev:
        m_dev, m_ref = acc.comoment.cpu(), ref.comoment
        com = max(
            com, float(torch.linalg.matrix_norm(m_dev - m_ref) / torch.linalg.matrix_norm(m_ref))
        )
        mean = max(
            mean,
            float(
                torch.linalg.vector_norm(acc.mean.cpu() - ref.mean)
                / torch.linalg.vector_norm(ref.mean)
            ),
        )
    return {
        "comoment_rel_err": com,
        "mean_rel_err": mean,
        "accuracy_ok": bool(max(com, mean) <= ACCURACY_TOL),
    }


def table_accumulate(rows: list[dict[str, Any]]) -> str:
    cells = []
    for r in rows:
        if r.get("status") != "ok":
            cells.append([r["d"], "-", r["status"]] + [""] * 10)
            continue
        acc = "PASS" if r.get("accuracy_ok") else "FAIL" if "accuracy_ok" in r else "not checked"
        cells.append(
            [
                r["d"],
                r["rows"],
                r["fold"],
                f"{r['update_ms']:.2f}",
                f"{r['gemm_fold_ms']:.2f}",
                f"{r['panel_fold_ms']:.2f}",
                f"{r['update_gflops']:.3g}",
                f"{r['matmul_gflops']:.3g}",
                f"{r['fraction']:.2f}",
                f"{r['gemm_fold_fraction']:.2f} / {r['panel_fold_fraction']:.2f}",
                f"{fmt_mib(r['state_bytes'])} / {fmt_mib(r['update_peak_extra_bytes'])}",
                f"{r.get('comoment_rel_err', math.nan):.1e} / {r.get('mean_rel_err', math.nan):.1e}",
                acc,
            ]
        )
    return markdown_table(
        [
            "d",
            "N rows",
            "default fold",
            "update ms (median)",
            "gemm fold ms",
            "panel fold ms",
            "update useful GFLOP/s",
            "float64 x.T@x GFLOP/s",
            "update / syrk roofline",
            "gemm / panel fold vs roofline",
            "state / update peak extra MiB",
            "vs CPU float64: co-moment / mean rel. err",
            f"<= {ACCURACY_TOL:g}",
        ],
        cells,
    )


# ------------------------------------------------------------------------ part 2
PRIMS = PRIMITIVES  # the solves read_cost.py times on the CPU, in its order
FAST_TOL = 1e-10  # the fast solvers against the dense route, as tests/functional/test_solvers.py


MEASURED_EIGH_S: dict[int, float] = {}  # filled by part 2, used by part 3 to skip what won't fit


def part_eigensolves(dev: torch.device, sz: Sizes, clock: Clock) -> list[dict[str, Any]]:
    out = []
    for d in sz.eig_dims:
        why = clock.why_not()
        if why:
            out.append({"d": d, "status": why})
            continue
        row = eigen_costs(dev, d, sz.repeats if d <= 4096 else 1, sz.eig_check_max_d, clock)
        if math.isfinite(row.get("symmetric_eigh", math.nan)):
            MEASURED_EIGH_S[d] = row["symmetric_eigh"]
        out.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def eigen_costs(
    dev: torch.device, d: int, reps: int, check_max_d: int, clock: Clock
) -> dict[str, Any]:
    """Median time and peak extra memory of each read primitive at width ``d``; eigenvalues
    against the CPU float64 solver when ``d <= check_max_d``."""
    c = test_matrix(d, device=dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    gamma = 1.0 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64, device=dev)
    calls: dict[str, Callable[[], Any]] = {
        "symmetric_eigh": lambda: symmetric_eigh(c),
        "eigvalsh": lambda: torch.linalg.eigvalsh(c),
        "kernel_read": lambda: kernel_read(
            c, gamma, 2 * d, declared_kind="layernorm", solver="dense"
        ),
        "kernel_read_fast": lambda: kernel_read(c, gamma, 2 * d, declared_kind="layernorm"),
        "schur_quotient": lambda: schur_quotient(c, gamma, 2 * d),
        "sigma_min": lambda: sigma_min(c, 2 * d, solver="dense"),
        "sigma_min_fast": lambda: sigma_min(c, 2 * d),
        "input_reads": lambda: input_reads(c, gamma, 2 * d),
    }
    row: dict[str, Any] = {"d": d, "status": "ok"}
    for name in PRIMS:
        if clock.why_not():
            row[name] = math.nan
            row["status"] = "partly skipped: budget"
            continue
        base = reset_peak(dev)
        row[name] = median_time(calls[name], dev, reps, warmup=1)[0]
        row[f"{name}_peak_extra_bytes"] = peak_since(dev, base)
    if d <= check_max_d and clock.why_not() is None:
        ev_dev = torch.linalg.eigvalsh(c).cpu()
        ev_cpu = torch.linalg.eigvalsh(c.cpu())
        err = float((ev_dev - ev_cpu).abs().max() / ev_cpu.abs().max())
        row["eig_rel_err"] = err
        row["eig_ok"] = bool(err <= EIGEN_TOL)
    if clock.why_not() is None:
        row.update(fast_against_dense(c, gamma, d))
    return row


def fast_against_dense(c: torch.Tensor, gamma: torch.Tensor, d: int) -> dict[str, Any]:
    """The default (fast, from d = 1024) reads against the dense route on the same device:
    the largest relative difference of the logged numbers (``bottom_eigenvalues`` and
    ``kernel_residual`` absolute, their rounding floor) and the dense fallbacks taken."""
    fast = kernel_read(c, gamma, 2 * d, declared_kind="layernorm")
    dense = kernel_read(c, gamma, 2 * d, declared_kind="layernorm", solver="dense")
    err = 0.0
    for key in ("gamma_alignment", "subspace_alignment", "live_floor"):
        a, b = getattr(fast, key), getattr(dense, key)
        err = max(err, abs(a - b) / max(abs(b), 1e-300))
    err = max(err, abs(fast.kernel_residual - dense.kernel_residual))
    err = max(err, *(abs(a - b) for a, b in zip(fast.bottom_eigenvalues, dense.bottom_eigenvalues)))
    s_fast, s_dense = sigma_min(c, 2 * d), sigma_min(c, 2 * d, solver="dense")
    err = max(err, abs(s_fast - s_dense) / max(abs(s_dense), 1e-300))
    same = fast.null_dim == dense.null_dim and fast.norm_class == dense.norm_class
    return {
        "fast_rel_err": err,
        "fast_solver": fast.solver,
        "fast_ok": bool(err <= FAST_TOL and same),
    }


def table_eigensolves(rows: list[dict[str, Any]]) -> str:
    cells = []
    for r in rows:
        if "symmetric_eigh" not in r:
            cells.append([r["d"], r["status"], *[""] * (len(PRIMS) + 2)])
            continue
        times = [f"{1e3 * r[k]:.1f}" if math.isfinite(r[k]) else "skipped" for k in PRIMS]
        peak = fmt_mib(r.get("kernel_read_peak_extra_bytes", math.nan))
        err = r.get("eig_rel_err")
        check = "not checked" if err is None else f"{err:.1e} {'PASS' if r['eig_ok'] else 'FAIL'}"
        fast = r.get("fast_rel_err")
        fast_check = (
            "not checked"
            if fast is None
            else f"{fast:.1e} {'PASS' if r['fast_ok'] else 'FAIL'} ({r['fast_solver']})"
        )
        cells.append([r["d"], *times, peak, check, fast_check])
    return markdown_table(
        [
            "d",
            *[f"{k} ms" for k in PRIMS],
            "kernel_read peak extra MiB",
            "eigvalsh vs CPU",
            "fast vs dense (route)",
        ],
        cells,
    )


# ------------------------------------------------------------------------ part 3
def part_read(dev: torch.device, sz: Sizes, clock: Clock) -> list[dict[str, Any]]:
    out = []
    reads = 2  # timed reads; model_read_cost runs one more for the report
    for n_layer, width in sz.read_models:
        why = clock.why_not()
        # About three eigensolves per norm layer (kernel read ~2, sigma_min 1) per read.
        est = (reads + 1) * 3 * (2 * n_layer + 1) * MEASURED_EIGH_S.get(width, 0.0)
        if why is None and est > clock.part_left():
            why = f"skipped: ~{est:.0f} s of reads, {clock.part_left():.0f} s left in the part"
        if why:
            out.append({"model": f"{n_layer}x{width}", "status": why})
            continue
        base = reset_peak(dev)
        r = model_read_cost(n_layer, width, reads, 2, device=dev)
        r["peak_bytes"] = peak_since(dev, base)
        cost = r["read_s"] + r["sampled_extra_s"]
        r["every_1pct"] = every_for(cost, r["step_s"], 0.01)
        r["status"] = "ok"
        out.append(r)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def table_read(rows: list[dict[str, Any]]) -> str:
    cells = []
    for r in rows:
        if r.get("status") != "ok":
            cells.append([r["model"], r["status"], *[""] * 8])
            continue
        cells.append(
            [
                r["model"],
                f"{r['params'] / 1e6:.3g}M",
                r["taps"],
                f"{r['acc_mib']:.0f}",
                fmt_mib(r["peak_bytes"]),
                f"{1e3 * r['step_s']:.1f}",
                f"{1e3 * r['sampled_extra_s']:.1f}",
                f"{1e3 * r['read_s']:.0f}",
                r["every_1pct"],
                "yes" if r["read_finite"] else "NO",
            ]
        )
    return markdown_table(
        [
            "model (L x d)",
            "params",
            "taps",
            "accumulators MiB",
            "peak MiB (model + optimiser + taps)",
            "fp32 train step ms",
            "sampled-step extra ms",
            "read ms",
            "every_n_steps for <= 1%",
            "read finite",
        ],
        cells,
    )
