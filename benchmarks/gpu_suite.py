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

On CUDA every timing is bracketed by ``torch.cuda.synchronize`` and memory is read with
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. The tables go to stdout
and, with ``--out PATH``, to ``PATH.md`` and ``PATH.json`` (rewritten after every part, so a
killed run keeps what it measured).

Without CUDA the script says so and exits 0. ``--smoke-cpu`` runs the same code paths on the
CPU with tiny sizes (under 30 s) so that its logic can be tested anywhere. Exit status: 0, or 2
when an accuracy check failed (the files are written first).

Usage::

    python benchmarks/gpu_suite.py --out benchmarks/gpu_results      # on a CUDA machine
    python benchmarks/gpu_suite.py --smoke-cpu --out /tmp/gpu_smoke   # logic check on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: examples
from _common import machine, machine_line, markdown_table, median_time, sync, write_outputs  # noqa: E402
from read_cost import every_for, model_read_cost, test_matrix  # noqa: E402

from normscope.functional import (  # noqa: E402
    StreamingCovariance,
    kernel_read,
    schur_quotient,
    sigma_min,
    symmetric_eigh,
)

ACCURACY_TOL = 1e-12  # float64 on both sides, same float32 rows: only summation order differs
EIGEN_TOL = 1e-12  # |lambda_dev - lambda_cpu| / lambda_max; backward-stable solvers: ~d eps
PART_SHARES = {"accumulate": 0.15, "eigensolves": 0.25, "monitor read": 0.20, "training": 0.35}
RESERVE_S = 10.0  # kept back from the global deadline for writing the files


@dataclass
class Sizes:
    """What each part measures; ``cuda()`` for one data-centre GPU, ``smoke()`` for a CPU."""

    acc_dims: list[int]
    acc_rows: int
    check_rows: int
    eig_dims: list[int]
    eig_check_max_d: int
    read_models: list[tuple[int, int]]
    train_model: tuple[int, int, int]  # n_layer, n_embd, block_size
    train_batch: int
    train_steps: int
    train_every: int
    every1_steps: int
    skip_steps: int
    repeats: int
    precision: str
    max_bytes: int
    budget_s: float

    @staticmethod
    def cuda() -> Sizes:
        return Sizes(
            acc_dims=[1024, 2048, 4096, 8192],
            acc_rows=8192,
            check_rows=2048,
            eig_dims=[1024, 2048, 4096, 8192],
            eig_check_max_d=2048,
            read_models=[(12, 768), (24, 1024), (8, 2048), (4, 4096)],
            train_model=(12, 768, 256),
            train_batch=16,
            train_steps=60,
            train_every=10,
            every1_steps=20,
            skip_steps=5,
            repeats=3,
            precision="bf16-mixed",
            max_bytes=4_000_000,
            budget_s=390.0,
        )

    @staticmethod
    def smoke() -> Sizes:
        return Sizes(
            acc_dims=[64, 128],
            acc_rows=512,
            check_rows=256,
            eig_dims=[64, 128],
            eig_check_max_d=128,
            read_models=[(2, 64)],
            train_model=(2, 64, 32),
            train_batch=8,
            train_steps=10,
            train_every=3,
            every1_steps=6,
            skip_steps=2,
            repeats=2,
            precision="32-true",
            max_bytes=200_000,
            budget_s=60.0,
        )


@dataclass
class Clock:
    """The global deadline and the current part's."""

    budget_s: float
    t0: float = field(default_factory=time.perf_counter)
    part_deadline: float = math.inf

    @property
    def deadline(self) -> float:
        return self.t0 + self.budget_s - RESERVE_S

    def start_part(self, share: float) -> None:
        self.part_deadline = min(self.deadline, time.perf_counter() + share * self.budget_s)

    def why_not(self) -> str | None:
        """None if an item may start now, else why not."""
        now = time.perf_counter()
        if now >= self.deadline:
            return "skipped: global deadline"
        if now >= self.part_deadline:
            return "skipped: part budget spent"
        return None

    def part_left(self) -> float:
        return max(0.0, min(self.deadline, self.part_deadline) - time.perf_counter())

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


# ------------------------------------------------------------------------ memory
def reset_peak(device: torch.device) -> int:
    """Reset the device's peak-memory mark; return the bytes allocated now (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_since(device: torch.device, base: int) -> float:
    """Peak bytes allocated above ``base`` since :func:`reset_peak`; NaN on the CPU."""
    if device.type != "cuda":
        return math.nan
    sync(device)
    return float(torch.cuda.max_memory_allocated(device) - base)


def _ms(r: dict[str, Any], key: str) -> str:
    return f"{1e3 * r[key]:.1f}" if math.isfinite(r[key]) else "-"


def _mib(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x / 2**20:.0f}"


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
                f"{_mib(r['state_bytes'])} / {_mib(r['update_peak_extra_bytes'])}",
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
PRIMS = (
    "symmetric_eigh",
    "eigvalsh",
    "kernel_read",
    "kernel_read_fast",
    "schur_quotient",
    "sigma_min",
    "sigma_min_fast",
)
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
        peak = _mib(r.get("kernel_read_peak_extra_bytes", math.nan))
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
                _mib(r["peak_bytes"]),
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


# ------------------------------------------------------------------------ part 4
def _fit(
    dev: torch.device, sz: Sizes, monitors: list[Any], steps: int, every: int, clock: Clock
) -> dict[str, Any]:
    from examples.data import make_dataloaders
    from examples.lit_gpt import LitGPT
    from examples.nanogpt import GPTConfig
    from overhead import StepTimer, summarise, timed_trainer

    n_layer, width, block = sz.train_model
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=n_layer, n_embd=width, n_head=max(1, width // 64), block_size=block)
    module = LitGPT(cfg)
    train, _ = make_dataloaders(block, batch_size=sz.train_batch, seed=0, max_bytes=sz.max_bytes)
    timer = StepTimer()
    left = max(1.0, clock.part_left())
    trainer = timed_trainer(
        timer,
        monitors,
        steps,
        max_time=datetime.timedelta(seconds=left),
        accelerator="gpu" if dev.type == "cuda" else "cpu",
        devices=1,
        precision=sz.precision,
    )
    base = reset_peak(dev)
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=train)
    wall = time.perf_counter() - t0
    if len(timer.times) <= sz.skip_steps:
        return {"status": f"stopped after {len(timer.times)} steps (time budget)", "wall_s": wall}
    r = summarise(timer, every, skip=sz.skip_steps)
    r.update(
        status="ok" if len(timer.times) == steps else f"{len(timer.times)}/{steps} steps (budget)",
        wall_s=wall,
        peak_bytes=peak_since(dev, base),
        failures=[m.failure for m in monitors if getattr(m, "failure", None)],
        reads=[getattr(m, "reads", 0) for m in monitors],
    )
    return r


def part_training(dev: torch.device, sz: Sizes, clock: Clock) -> list[dict[str, Any]]:
    from normscope import DeadDirectionMonitor, SignMagnitudeMonitor

    e = sz.train_every
    null_tol = 1e-4 if "bf16" in sz.precision else 1e-10

    def dd(every: int, async_reads: bool | None = None) -> Any:
        return DeadDirectionMonitor(
            every_n_steps=every,
            verbose=False,
            alerts=(),
            null_tol=null_tol,
            async_reads=async_reads,
        )

    def sm(every: int) -> Any:
        return SignMagnitudeMonitor(every_n_steps=every, verbose=False, alerts=())

    configs: list[tuple[str, Callable[[], list[Any]], int, int]] = [
        ("none", lambda: [], sz.train_steps, e),
        (f"DeadDirectionMonitor every={e} (default)", lambda: [dd(e)], sz.train_steps, e),
        (f"DeadDirectionMonitor every={e} sync", lambda: [dd(e, False)], sz.train_steps, e),
        (f"DeadDirectionMonitor every={e} async", lambda: [dd(e, True)], sz.train_steps, e),
        (f"SignMagnitudeMonitor every={e}", lambda: [sm(e)], sz.train_steps, e),
        (f"both every={e}", lambda: [dd(e), sm(e)], sz.train_steps, e),
        ("DeadDirectionMonitor every=1", lambda: [dd(1)], sz.every1_steps, 1),
    ]
    out = []
    base_mean = math.nan
    for name, make, steps, every in configs:
        why = clock.why_not()
        if why:
            out.append({"configuration": name, "status": why})
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = _fit(dev, sz, make(), steps, every, clock)
        r["configuration"] = name
        if name == "none" and "mean" in r:
            base_mean = r["mean"]
        if "mean" in r:
            r["mean_over_none"] = r["mean"] / base_mean
        out.append(r)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def table_training(rows: list[dict[str, Any]]) -> str:
    cells = []
    for r in rows:
        if "mean" not in r:
            cells.append([r["configuration"], r["status"], *[""] * 6])
            continue

        note = r["status"] if r["status"] != "ok" else ""
        if r.get("failures"):
            note += " FAILED: " + "; ".join(r["failures"])
        cells.append(
            [
                r["configuration"],
                _ms(r, "median"),
                _ms(r, "mean"),
                _ms(r, "quiet_mean"),
                _ms(r, "sampled_mean") if r["configuration"] != "none" else "-",
                f"{r['mean_over_none']:.3f}",
                _mib(r.get("peak_bytes", math.nan)),
                note or "ok",
            ]
        )
    return markdown_table(
        [
            "configuration",
            "median ms",
            "mean ms",
            "non-sampled mean ms",
            "sampled mean ms",
            "mean / none",
            "peak MiB",
            "status",
        ],
        cells,
    )


# ------------------------------------------------------------------------ driver
PARTS: list[tuple[str, Callable[..., list[dict[str, Any]]], Callable[..., str]]] = [
    ("accumulate", part_accumulate, table_accumulate),
    ("eigensolves", part_eigensolves, table_eigensolves),
    ("monitor read", part_read, table_read),
    ("training", part_training, table_training),
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
