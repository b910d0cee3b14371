"""Part 4 of benchmarks/gpu_suite.py: a Lightning fit of the example GPT on the device, with and
without the monitors (what it measures is in that script's docstring)."""

from __future__ import annotations

import datetime
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _common import markdown_table
from gpu_common import Clock, Sizes, fmt_mib, fmt_ms, peak_since, reset_peak


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


# ------------------------------------------------------------------------ part 5
def part_overhead(dev: torch.device, sz: Sizes, clock: Clock) -> list[dict[str, Any]]:
    """``benchmarks/overhead.py``'s step-interleaved run on the device: per width, the
    per-read extra of the monitor and of ``wandb.watch`` in plain steps, and the mean-step
    ratio at each cadence (the CPU figures' counterpart; same code)."""
    from overhead import interleaved, summarise_interleaved

    out: list[dict[str, Any]] = []
    for width in sz.overhead_widths:
        why = clock.why_not()
        if why:
            out.append({"width": width, "configuration": "all", "status": why})
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = interleaved(
                width,
                sz.overhead_every,
                sz.overhead_steps,
                device=dev,
                block=sz.overhead_block,
                batch_size=sz.overhead_batch,
                layers=sz.overhead_layers,
                stop=lambda: clock.why_not() is not None,
                max_bytes=sz.max_bytes,
            )
        skip = min(5, max(1, sz.overhead_steps // 3))
        rows = summarise_interleaved(width, got, skip=skip)
        done = min(len(r["times"]) for r in got)
        status = "ok" if done >= sz.overhead_steps else f"ok: {done} steps (deadline)"
        out += [dict(r, status=status) for r in rows]
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def table_overhead(rows: list[dict[str, Any]]) -> str:
    from overhead import HEADERS, render

    done = [r for r in rows if "ratio" in r]
    skipped = [f"width {r['width']}: {r['status']}" for r in rows if "ratio" not in r]
    text = markdown_table(HEADERS, render(done)) if done else ""
    return text + ("\n\n" + "; ".join(skipped) if skipped else "")


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
                fmt_ms(r, "median"),
                fmt_ms(r, "mean"),
                fmt_ms(r, "quiet_mean"),
                fmt_ms(r, "sampled_mean") if r["configuration"] != "none" else "-",
                f"{r['mean_over_none']:.3f}",
                fmt_mib(r.get("peak_bytes", math.nan)),
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
