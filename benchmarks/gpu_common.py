"""What every part of benchmarks/gpu_suite.py shares: the sizes, the deadlines, peak memory and
the table cells. Imported by that script, which puts this folder and the repository root on
``sys.path`` (as gpu_kernels.py and gpu_training.py are)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from _common import sync

ACCURACY_TOL = 1e-12  # float64 on both sides, same float32 rows: only summation order differs
EIGEN_TOL = 1e-12  # |lambda_dev - lambda_cpu| / lambda_max; backward-stable solvers: ~d eps
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
    # part 5, benchmarks/overhead.py's step-interleaved run: widths, cadences, steps, block
    overhead_widths: list[int] = field(default_factory=lambda: [128, 256, 512])
    overhead_every: list[int] = field(default_factory=lambda: [10, 20, 50])
    overhead_steps: int = 150
    overhead_block: int = 10
    overhead_batch: int = 32  # the demo's batch (of 64 byte tokens) and depth
    overhead_layers: int = 4

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
            overhead_widths=[32],
            overhead_every=[2],
            overhead_steps=6,
            overhead_block=2,
            overhead_batch=4,
            overhead_layers=2,
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


def fmt_ms(r: dict[str, Any], key: str) -> str:
    return f"{1e3 * r[key]:.1f}" if math.isfinite(r[key]) else "-"


def fmt_mib(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x / 2**20:.0f}"
