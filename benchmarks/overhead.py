"""Training-step overhead of DeadDirectionMonitor against no monitor and against wandb.watch,
measured step-interleaved in one process.

The demo model (``examples/nanogpt.py``, 4 blocks, batch 32 x 64 byte tokens) is trained in one
process as several copies from the same initial weights, one per configuration, in a plain
PyTorch loop (forward, backward, AdamW step), **step by step** (``--block 1``, the default: one
step of each copy in turn, the order rotated each round; ``--block k`` runs ``k`` at a turn),
so that the load of a shared machine hits every configuration alike and cancels in paired
differences (separate runs, one after another, measured a
neighbour's load as monitor overhead or hid it). Each step is timed on its own (wall clock; on
CUDA the device is synchronised at both ends). Configurations, per width:

* ``none``: no monitor;
* ``dd every=N``: ``Monitor.of(DeadDirectionConfig(), model, every_n_steps=N)``, defaults
  (``rows_per_read=None``: ``8 d`` rows per read), synchronous reads, no logger;
  ``dd every=N spectral=k`` (``--spectral-every k``): the same with
  ``DeadDirectionConfig(spectral_every=k)``, the decompositions at every ``k``-th read only;
* ``wandb.watch every=N``: ``wandb.watch(model, log="all", log_freq=N)``, the monitoring users
  already run.

Every copy (``none`` included) commits one row a step to one offline W&B run, as the logger a
user already runs does, so the baseline carries it and ``wandb.watch`` is charged with its own
hooks only. Reported per width, against the ``none`` copy in the same run, from paired step
times (step ``i`` of a copy against step ``i`` of ``none``, run in the same round; ``diff_i``
their difference):

* **per-read extra, in plain steps**: ``N x mean(diff) / median(none)``, with its standard
  error: everything a read (or a ``wandb.watch`` histogram round) adds to a run, wherever it
  lands (the monitor's cost is its read steps; ``wandb.watch`` pays its gradient hooks at every
  step as well). The most precise at the smallest ``N`` (the error of a mean is multiplied by
  ``N``);
* **mean-step ratio**: ``1 + mean(diff) / mean(none)``, with its standard error;
* **read-step spike**: the median ``diff`` of the read steps (the sampled forward, its fold
  and the read; for ``wandb.watch`` the steps its hooks logged histograms in, counted; runs
  saved before that were counted fall back to the residue of the step modulo ``N`` with the
  highest median) minus that of the other steps, in plain steps; and
  **per-step overhead**, the median ``diff`` of the other steps.

Usage::

    python benchmarks/overhead.py                                  # width 128, N = 10 20 50
    python benchmarks/overhead.py --width 128 256 --steps 200 --out /tmp/overhead
    python benchmarks/overhead.py --width 512 --every 10 --steps 60  # the per-read extra only
    python benchmarks/overhead.py --width 256 --every 10 --spectral-every 1 5  # the cost tiers
    python benchmarks/overhead.py --render /tmp/overhead.json

``StepTimer``, ``timed_trainer`` and ``summarise`` (a Lightning fit's step times) serve
``benchmarks/gpu_training.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: examples
from examples.data import make_dataloaders  # noqa: E402
from examples.nanogpt import GPT, GPTConfig, make_optimizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, machine_line, markdown_table, write_outputs  # noqa: E402

from normscope import DeadDirectionConfig, Monitor  # noqa: E402


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


# --------------------------------------------------------------------- interleaved
@dataclass
class Copy:
    """One configuration's model, optimiser, batches, monitor and step times."""

    name: str
    kind: str  # "none" | "dd" | "watch"
    every: int
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    batches: Iterator
    monitor: Any = None
    times: list[float] = field(default_factory=list)
    read_steps: set[int] = field(default_factory=set)
    step: int = 0


def _batches(batch_size: int, device: torch.device, max_bytes: int, seed: int = 0) -> Iterator:
    train, _ = make_dataloaders(64, batch_size=batch_size, seed=seed, max_bytes=max_bytes)
    while True:
        for x, y in train:
            yield x.to(device), y.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_WATCH_LOGS = [0]  # tensors wandb.watch's hooks have logged (counted by _count_watch_logs)


def _count_watch_logs() -> Callable[[], None]:
    """Count wandb.watch's histogram calls, so that its logging steps are known exactly (as
    the monitor's read steps are); returns the undo."""
    from wandb.integration.torch import wandb_torch

    orig = wandb_torch.TorchHistory.log_tensor_stats

    def counted(self, tensor, name):
        _WATCH_LOGS[0] += 1
        return orig(self, tensor, name)

    wandb_torch.TorchHistory.log_tensor_stats = counted
    return lambda: setattr(wandb_torch.TorchHistory, "log_tensor_stats", orig)


def _one_step(c: Copy, device: torch.device, run: Any) -> None:
    x, y = next(c.batches)
    logged = _WATCH_LOGS[0]
    _sync(device)
    t0 = time.perf_counter()
    if c.kind == "dd":
        with c.monitor.step((x, y)) as result:
            _, loss = c.model(x, y)
            loss.backward()
            c.opt.step()
            c.opt.zero_grad(set_to_none=True)
        if result.report is not None:
            c.read_steps.add(c.step)
    else:
        _, loss = c.model(x, y)
        loss.backward()
        c.opt.step()
        c.opt.zero_grad(set_to_none=True)
        if c.kind == "watch" and _WATCH_LOGS[0] > logged:
            c.read_steps.add(c.step)  # wandb.watch's histograms ran in this step
    if run is not None:
        # every copy commits one row a step, as the W&B logger users already run does: the
        # baseline includes it, so the comparison charges wandb.watch with its hooks only
        run.log({f"loss/{c.name}": loss.detach()})
    _sync(device)
    c.times.append(time.perf_counter() - t0)
    c.step += 1


def interleaved(
    width: int,
    everys: Sequence[int],
    steps: int,
    *,
    device: torch.device | str = "cpu",
    block: int = 1,
    batch_size: int = 32,
    layers: int = 4,
    watch: bool = True,
    run_dir: str | None = None,
    stop: Callable[[], bool] | None = None,
    max_bytes: int = 4_000_000,
    spectral: Sequence[int | str] = ("auto",),
) -> list[dict[str, Any]]:
    """Train every configuration ``steps`` steps, interleaved block by block; one dict per
    configuration (step times and read steps), ``none`` first. ``stop()`` is asked before
    each round (a deadline): True ends the run with the rounds done, every copy alike.
    ``spectral``: one monitored copy per ``spectral_every`` value (and ``every``); the
    default is the monitor's own (``"auto"``)."""
    device = torch.device(device)
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_embd=width, n_layer=layers)).to(device)
    configs = [("none", "none", max(everys), 1)]
    configs += [
        (f"dd every={e}" + (f" spectral={k}" if k != "auto" else ""), "dd", e, k)
        for e in everys
        for k in spectral
    ]
    configs += [(f"wandb.watch every={e}", "watch", e, 1) for e in everys] if watch else []
    run = None
    if watch:
        import wandb

        run = wandb.init(
            mode="offline", dir=run_dir or tempfile.mkdtemp(prefix="normscope-bench-"),
            project="normscope-bench",
        )  # fmt: skip
        undo = _count_watch_logs()
    copies = []
    for name, kind, every, spectral_every in configs:
        model = copy.deepcopy(base)
        c = Copy(name, kind, every, model, make_optimizer(model, 1e-3, 0.1), _batches(
            batch_size, device, max_bytes))  # fmt: skip
        if kind == "dd":
            c.monitor = Monitor.of(
                DeadDirectionConfig(spectral_every=spectral_every), model, every_n_steps=every,
                alerts=(), verbose=False,
                overhead_warn=None,
            )  # fmt: skip
        elif kind == "watch":
            wandb.watch(model, log="all", log_freq=every, idx=len(copies))
        copies.append(c)
    try:
        rounds = -(-steps // block)
        for r in range(rounds):
            if stop is not None and r > 0 and stop():
                break
            order = copies[r % len(copies) :] + copies[: r % len(copies)]
            for c in order:
                for _ in range(min(block, steps - c.step)):
                    _one_step(c, device, run)
    finally:
        for c in copies:
            if c.monitor is not None:
                c.monitor.close()
        if run is not None:
            run.finish()
            undo()
    return [
        {"name": c.name, "kind": c.kind, "every": c.every, "times": c.times,
         "read_steps": sorted(c.read_steps)}
        for c in copies
    ]  # fmt: skip


def summarise_interleaved(
    width: int, results: list[dict[str, Any]], skip: int = 5
) -> list[dict[str, Any]]:
    """Per configuration, against the ``none`` copy of the same run, from **paired** step
    times: step ``i`` of a copy and step ``i`` of ``none`` ran in the same round (one step of
    each copy in turn), so a neighbour's load hits both and cancels in their difference
    ``diff_i``. The first ``skip`` steps of every copy (warm-up, the monitor's discovery step)
    are left out alike.

    * per-read extra, in plain steps: ``every x mean(diff) / median(none)``, with its
      standard error (from the spread of ``diff``);
    * mean-step ratio: ``1 + mean(diff) / mean(none)``;
    * read-step spike: ``median(diff at read steps) - median(diff at the others)``, over
      ``median(none)``; per-step overhead: ``median(diff at the others) / median(none)``.
    """
    none = next(r for r in results if r["kind"] == "none")
    base = none["times"]
    out = []
    for r in results:
        times = r["times"]
        n = min(len(times), len(base))
        idx = range(skip, n)
        every = r["every"]
        plain = statistics.median(base[i] for i in idx)
        plain_mean = statistics.fmean(base[i] for i in idx)
        diff = {i: times[i] - base[i] for i in idx}
        if r["kind"] == "dd":
            hit = [i for i in idx if i in set(r["read_steps"])]
        elif r["kind"] == "watch" and r["read_steps"]:  # its logging steps, counted
            hit = [i for i in idx if i in set(r["read_steps"])]
        elif r["kind"] == "watch":  # runs saved before they were counted: the slowest residue
            by_residue = {
                k: statistics.median([diff[i] for i in idx if i % every == k] or [0.0])
                for k in range(every)
            }
            top = max(by_residue, key=by_residue.get)
            hit = [i for i in idx if i % every == top]
        else:
            hit = []
        quiet = [diff[i] for i in idx if i not in set(hit)]
        mean_diff = statistics.fmean(diff.values())
        se = statistics.stdev(diff.values()) / math.sqrt(len(diff)) if len(diff) > 1 else 0.0
        quiet_med = statistics.median(quiet) if quiet else math.nan
        spike = (
            (statistics.median([diff[i] for i in hit]) - quiet_med) / plain
            if hit and quiet
            else math.nan
        )
        out.append(
            {
                "width": width,
                "configuration": r["name"],
                "kind": r["kind"],
                "every": every,
                "steps": len(diff),
                "reads": len(hit),
                "plain_ms": 1e3 * plain,
                "mean_ms": 1e3 * statistics.fmean(times[i] for i in idx),
                "per_step": quiet_med / plain if r["kind"] != "none" else 0.0,
                "extra_steps": spike,
                "per_read_steps": every * mean_diff / plain,
                "per_read_se": every * se / plain,
                "ratio": 1 + mean_diff / plain_mean,
                "ratio_se": se / plain_mean,
            }
        )
    return out


HEADERS = [
    "width",
    "configuration",
    "steps (reads)",
    "plain step ms (median)",
    "per-step overhead",
    "read-step spike, plain steps",
    "per-read extra, plain steps (+- 1 s.e.)",
    "mean-step ratio (+- 1 s.e.)",
]


def render(rows: list[dict[str, Any]]) -> list[list[str]]:
    def num(v: float, f: str) -> str:
        return format(v, f) if math.isfinite(v) else "-"

    return [
        [
            str(r["width"]),
            r["configuration"],
            f"{r['steps']} ({r['reads']})",
            f"{r['plain_ms']:.1f}",
            f"{100 * r['per_step']:+.1f}%" if r["kind"] != "none" else "-",
            num(r["extra_steps"], ".2f"),
            f"{r['per_read_steps']:.2f} +- {r['per_read_se']:.2f}" if r["kind"] != "none" else "-",
            f"{r['ratio']:.4f} +- {r['ratio_se']:.4f}",
        ]
        for r in rows
    ]


def _tier(text: str) -> int | str:
    """``--spectral-every``: ``auto`` or an int."""
    return "auto" if text == "auto" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per configuration")
    parser.add_argument("--every", type=int, nargs="+", default=[10, 20, 50])
    parser.add_argument("--width", type=int, nargs="+", default=[128])
    parser.add_argument("--block", type=int, default=1, help="steps per turn of a copy")
    parser.add_argument(
        "--spectral-every", type=_tier, nargs="+", default=["auto"],
        help="one monitored copy per value of DeadDirectionConfig(spectral_every=): an int or "
        "auto (the default, the monitor's own)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--no-watch", action="store_true", help="leave wandb.watch out")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: reproducible on a shared machine)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="also write <out>.md and <out>.json")
    parser.add_argument("--render", default=None, help="print the table of a saved <out>.json")
    args = parser.parse_args()
    if args.render:  # summarised again from the saved step times
        saved = json.loads(Path(args.render).read_text())
        rows = [
            row for w in saved["raw"] for row in summarise_interleaved(w["width"], w["results"])
        ]
        print(saved["head"] + "\n")
        print(markdown_table(HEADERS, render(rows)))
        return
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_MODE", "offline")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = machine(device)
    head = (
        f"{machine_line(info)}; step-interleaved in one process, blocks of {args.block} steps, "
        f"{args.steps} steps per configuration, batch {args.batch_size} x 64 bytes"
    )
    print(head, flush=True)
    rows: list[dict[str, Any]] = []
    raw = []
    for width in args.width:
        t0 = time.perf_counter()
        got = interleaved(
            width, args.every, args.steps, device=device, block=args.block,
            batch_size=args.batch_size, watch=not args.no_watch, spectral=args.spectral_every,
        )  # fmt: skip
        raw.append({"width": width, "results": got})
        rows += summarise_interleaved(width, got)
        print(f"  width {width}: {time.perf_counter() - t0:.0f} s", flush=True)
        print(markdown_table(HEADERS, render([r for r in rows if r["width"] == width])), flush=True)
    text = head + "\n\n" + markdown_table(HEADERS, render(rows))
    print("\n" + text, flush=True)
    write_outputs(args.out, text, {"machine": info, "head": head, "rows": rows, "raw": raw})


if __name__ == "__main__":
    main()
