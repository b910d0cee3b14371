"""Training-step overhead of DeadDirectionMonitor against no monitor and against wandb.watch.

The demo model (``examples/nanogpt.py``) is trained for the same steps in each configuration:

* ``none``                       -- no monitor;
* ``dd every=N``                 -- DeadDirectionMonitor(every_n_steps=N), the default N = 50 among them;
* ``wandb.watch every=N``        -- ``wandb.watch(model, log="all", log_freq=N)`` (offline W&B run),
                                    the monitoring users already run;
* with ``--async-reads``: ``dd sync every=N`` and ``dd async every=N`` (``async_reads=False`` /
  ``True``) instead of the two above, and a second table: each read's critical-path cost,
  ``every x (mean - none mean)`` (the read step, the publish and the worker's contention with
  training all included), and the read step's own extra, sync and async side by side;

Each step is timed (forward + backward + optimiser, wall clock) inside a Lightning fit, from
the first callback's ``on_train_batch_start`` to the last callback's ``on_train_batch_end``, so a
sampled step includes the monitor's read (:class:`StepTimer`). Printed: the median step time,
the mean step time (what a run pays over all steps), the mean over the *non-sampled* steps only
(a hook that returns at once must cost nothing there), the mean over the *sampled* steps (rows
folded + the read), and the ratio of the mean to ``none``. Usage::

    python benchmarks/overhead.py                 # steps=200, cadences 50 and 10, 2 repeats
    python benchmarks/overhead.py --steps 400 --every 50 10 1 --width 128 256
    python benchmarks/overhead.py --async-reads --steps 160 --every 10 50 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: examples
from examples.data import make_dataloaders  # noqa: E402
from examples.lit_gpt import LitGPT  # noqa: E402
from examples.nanogpt import GPTConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, machine_line, markdown_table, write_outputs  # noqa: E402

from normscope import DeadDirectionMonitor  # noqa: E402


class StepTimer(L.Callback):
    """Wall time of each optimiser step, from the first callback's batch start to the last
    callback's batch end.

    Lightning runs callback hooks in list order, so a single timer placed anywhere misses the
    work of the callbacks on one side of it: timed from its own ``on_train_batch_end``, a timer
    listed before the monitor stops the clock *before* the monitor's read. So the timer is two
    callbacks: :attr:`start` goes first in the list, the timer itself last::

        timer = StepTimer()
        trainer = L.Trainer(callbacks=[timer.start, monitor, timer])

    On CUDA both ends synchronise the training thread's stream, so its queued kernels are
    counted in their step; an asynchronous read's solves on the monitor's side stream are not
    waited for (they show as the time they take from the training kernels they overlap).
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.steps: list[int] = []
        self._t0 = 0.0
        self.start = _StepStart(self)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _sync_module(pl_module)
        self.times.append(time.perf_counter() - self._t0)
        self.steps.append(trainer.global_step - 1)

    def check_order(self, trainer: L.Trainer, inner: list[L.Callback]) -> None:
        """Raise unless :attr:`start` comes before, and the timer after, every ``inner`` one."""
        cbs = list(trainer.callbacks)
        first, last = cbs.index(self.start), cbs.index(self)
        if any(not first < cbs.index(c) < last for c in inner):
            names = [type(c).__name__ for c in cbs]
            raise RuntimeError(f"StepTimer: start must come first and the timer last, got {names}")


class _StepStart(L.Callback):
    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync_module(pl_module)
        self.timer._t0 = time.perf_counter()


def _sync_module(pl_module) -> None:
    if pl_module.device.type == "cuda":
        torch.cuda.current_stream(pl_module.device).synchronize()


class TimedMonitor(DeadDirectionMonitor):
    """The monitor, keeping each read's critical-path seconds as its cost guard times them: the
    whole read when synchronous; the hand-off plus the publish when asynchronous."""

    def _judge_cost(self, read_seconds: float) -> None:
        self.__dict__.setdefault("read_costs", []).append(read_seconds)
        super()._judge_cost(read_seconds)


class WandbWatch(L.Callback):
    def __init__(self, every: int, run_dir: str) -> None:
        self.every = every
        self.run_dir = run_dir
        self.run = None

    def on_fit_start(self, trainer, pl_module):
        import wandb

        self.run = wandb.init(mode="offline", dir=self.run_dir, project="normscope-bench")
        wandb.watch(pl_module, log="all", log_freq=self.every)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # wandb.watch hooks log into the run on its own schedule; committing a row each step is
        # what a WandbLogger does too.
        self.run.log({"step": trainer.global_step})

    def on_fit_end(self, trainer, pl_module):
        import wandb

        wandb.unwatch(pl_module)
        self.run.finish()


def timed_trainer(timer: StepTimer, monitors: list, steps: int, **kw: Any) -> L.Trainer:
    """A quiet Trainer whose callbacks are ``timer.start``, the monitors, then ``timer``, so
    that a sampled step's time includes its read (the order is checked)."""
    settings = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    settings.update(kw)
    trainer = L.Trainer(max_steps=steps, callbacks=[timer.start, *monitors, timer], **settings)
    timer.check_order(trainer, monitors)
    return trainer


def run(
    config: str, every: int, steps: int, width: int, batch_size: int, async_reads: bool = False
) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=width)
    module = LitGPT(cfg)
    train, _ = make_dataloaders(cfg.block_size, batch_size=batch_size, seed=0)
    timer = StepTimer()
    inner: list[L.Callback] = []
    tmp = tempfile.mkdtemp(prefix="normscope-bench-")
    if config in ("dd", "dd-async"):
        inner.append(
            TimedMonitor(
                every_n_steps=every, verbose=False, alerts=(), async_reads=config == "dd-async"
            )
        )
    elif config == "watch":
        inner.append(WandbWatch(every, tmp))
    trainer = timed_trainer(timer, inner, steps)
    trainer.fit(module, train_dataloaders=train)
    out = summarise(timer, every, skip=5)
    costs = [c for m in inner for c in getattr(m, "read_costs", [])]
    out["read_critical"] = statistics.median(costs) if costs else float("nan")
    return out


def summarise(timer: StepTimer, every: int, skip: int = 5) -> dict:
    """Median and mean step time, and the means over sampled / non-sampled steps (the first
    ``skip`` steps, warm-up, left out for every configuration alike)."""
    times = timer.times[skip:]
    steps_ = timer.steps[skip:]
    sampled = {s for s in steps_ if s == 0 or (s + 1) % every == 0}
    quiet = [t for t, s in zip(times, steps_) if s not in sampled]
    hit = [t for t, s in zip(times, steps_) if s in sampled]
    return {
        "median": statistics.median(times),
        "mean": statistics.fmean(times),
        "quiet_mean": statistics.fmean(quiet) if quiet else float("nan"),
        "sampled_mean": statistics.fmean(hit) if hit else float("nan"),
        "steps": len(times),
    }


HEADERS = [
    "width",
    "configuration",
    "median ms",
    "mean ms",
    "non-sampled mean ms",
    "sampled mean ms",
    "mean / none",
    "median / none",
    "extra ms per read",
    "extra / (every x none median)",
]


def render(data: list[dict]) -> list[list[str]]:
    """Table rows of a run (the list ``main`` writes to JSON).

    ``extra ms per read`` is the sampled steps' mean minus the non-sampled steps' mean of the
    same run (rows folded + the read; with every=1, minus the ``none`` run's mean instead).
    It is given for the monitor only: ``wandb.watch`` histograms on its own counter, whose
    steps need not be the ones this schedule calls sampled. The last column is what that
    extra costs a run at its cadence, against the plain step's median.
    """
    rows = []
    for width in dict.fromkeys(r["width"] for r in data):
        block = [r for r in data if r["width"] == width]
        base = next(r for r in block if r["configuration"] == "none")
        for r in block:
            extra = math.nan
            if r["configuration"].startswith("dd"):
                quiet = r["quiet_mean"] if math.isfinite(r["quiet_mean"]) else base["mean"]
                extra = r["sampled_mean"] - quiet
            rows.append(
                [
                    str(width),
                    r["configuration"],
                    f"{1e3 * r['median']:.1f}",
                    f"{1e3 * r['mean']:.1f}",
                    f"{1e3 * r['quiet_mean']:.1f}" if math.isfinite(r["quiet_mean"]) else "-",
                    f"{1e3 * r['sampled_mean']:.1f}" if r["configuration"] != "none" else "-",
                    f"{r['mean'] / base['mean']:.3f}",
                    f"{r['median'] / base['median']:.3f}",
                    f"{1e3 * extra:.0f}" if math.isfinite(extra) else "-",
                    f"{100 * extra / (r['every'] * base['median']):.1f}%"
                    if math.isfinite(extra)
                    else "-",
                ]
            )
    return rows


ASYNC_HEADERS = [
    "width",
    "every",
    "sync read, critical path ms",
    "async read, critical path ms",
    "async / sync (critical)",
    "sync ms per read",
    "async ms per read",
    "async / sync",
    "sync read-step extra ms",
    "async read-step extra ms",
    "async / sync (read step)",
]


def render_async(data: list[dict]) -> list[list[str]]:
    """Sync against async reads, from one run: the monitor's own critical-path time per read
    (median; as its cost guard times it: sync the whole read, async the hand-off plus the
    publish), per read ``every x (mean - none mean)`` (all
    the critical-path time a read adds, wherever it lands: the read step, the publish, the
    worker competing with training), and the read step's own extra (sampled minus non-sampled
    mean)."""
    rows = []
    for width in dict.fromkeys(r["width"] for r in data):
        block = {r["configuration"]: r for r in data if r["width"] == width}
        base = block["none"]["mean"]
        for every in sorted({r["every"] for r in data if r["configuration"] != "none"}):
            sync, asyn = block[f"dd sync every={every}"], block[f"dd async every={every}"]
            per = [every * (r["mean"] - base) for r in (sync, asyn)]
            own = [r["sampled_mean"] - r["quiet_mean"] for r in (sync, asyn)]
            crit = [r.get("read_critical", math.nan) for r in (sync, asyn)]
            rows.append(
                [
                    str(width),
                    str(every),
                    f"{1e3 * crit[0]:.1f}",
                    f"{1e3 * crit[1]:.1f}",
                    f"{crit[1] / crit[0]:.2f}" if crit[0] > 0 else "-",
                    f"{1e3 * per[0]:.1f}",
                    f"{1e3 * per[1]:.1f}",
                    f"{per[1] / per[0]:.2f}" if per[0] > 0 else "-",
                    f"{1e3 * own[0]:.1f}",
                    f"{1e3 * own[1]:.1f}",
                    f"{own[1] / own[0]:.2f}" if own[0] > 0 else "-",
                ]
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, nargs="+", default=[50, 10])
    parser.add_argument("--width", type=int, nargs="+", default=[128])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: reproducible on a shared machine)"
    )
    parser.add_argument(
        "--async-reads",
        action="store_true",
        help="compare DeadDirectionMonitor(async_reads=False) with async_reads=True",
    )
    parser.add_argument("--out", default=None, help="also write <out>.md and <out>.json")
    parser.add_argument("--render", default=None, help="print the table of a saved <out>.json")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        print(saved.get("head", machine_line(saved["machine"])) + "\n")
        print(markdown_table(HEADERS, render(saved["results"])))
        if saved.get("async_reads"):
            print("\n" + markdown_table(ASYNC_HEADERS, render_async(saved["results"])))
        return
    os.environ.setdefault("WANDB_SILENT", "true")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    info = machine()
    head = f"{machine_line(info)}; steps {args.steps}, batch {args.batch_size} x 64 bytes"
    print(head, flush=True)
    data = []
    for width in args.width:
        configs = [("none", "none", max(args.every))]
        for every in args.every:
            if args.async_reads:
                configs += [
                    (f"dd sync every={every}", "dd", every),
                    (f"dd async every={every}", "dd-async", every),
                ]
                continue
            configs += [
                (f"dd every={every}", "dd", every),
                (f"wandb.watch every={every}", "watch", every),
            ]
        # Repeats in rotated order, keeping each configuration's fastest repeat: a neighbour's
        # load on a shared machine only ever slows a run down.
        best: dict[str, dict] = {}
        for rep in range(args.repeats):
            order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
            for name, kind, every in order:
                r = run(kind, every, args.steps, width, args.batch_size)
                print(f"  {name} (repeat {rep + 1}): mean {1e3 * r['mean']:.1f} ms", flush=True)
                if name not in best or r["mean"] < best[name]["mean"]:
                    best[name] = r
        for name, _, every in configs:
            data.append({"width": width, "configuration": name, "every": every, **best[name]})
    text = head + "\n\n" + markdown_table(HEADERS, render(data))
    if args.async_reads:
        text += "\n\n" + markdown_table(ASYNC_HEADERS, render_async(data))
    print("\n" + text, flush=True)
    saved = {"machine": info, "head": head, "results": data, "async_reads": args.async_reads}
    write_outputs(args.out, text, saved)


if __name__ == "__main__":
    main()
