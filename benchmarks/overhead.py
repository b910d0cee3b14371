"""Training-step overhead of DeadDirectionMonitor against no monitor and against wandb.watch.

The demo model (``examples/nanogpt.py``) is trained for the same steps in each configuration:

* ``none``                       -- no monitor;
* ``dd every=N``                 -- DeadDirectionMonitor(every_n_steps=N), the default N = 50 among them;
* ``wandb.watch every=N``        -- ``wandb.watch(model, log="all", log_freq=N)`` (offline W&B run),
                                    the monitoring users already run;

Each step is timed (forward + backward + optimiser, wall clock) inside a Lightning fit. Printed:
the median step time, the mean step time (what a run pays over all steps), the mean over the
*non-sampled* steps only (a hook that returns at once must cost nothing there), and the ratio of
each to ``none``. Usage::

    python benchmarks/overhead.py                 # steps=200, cadences 50 and 10, 2 repeats
    python benchmarks/overhead.py --steps 400 --every 50 10 1 --width 128 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from nanogpt import GPTConfig, LitGPT, make_dataloaders  # noqa: E402

from normscope import DeadDirectionMonitor  # noqa: E402


class StepTimer(L.Callback):
    """Wall time of each optimiser step, from batch start to batch end."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.steps: list[int] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._t0)
        self.steps.append(trainer.global_step - 1)


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


def run(config: str, every: int, steps: int, width: int, batch_size: int) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=width)
    module = LitGPT(cfg)
    train, _ = make_dataloaders(cfg.block_size, batch_size=batch_size, seed=0)
    timer = StepTimer()
    callbacks: list[L.Callback] = [timer]
    tmp = tempfile.mkdtemp(prefix="normscope-bench-")
    if config == "dd":
        callbacks.append(DeadDirectionMonitor(every_n_steps=every, verbose=False, alerts=()))
    elif config == "watch":
        callbacks.append(WandbWatch(every, tmp))
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=train)
    times = timer.times[5:]  # warm-up steps left out for every configuration alike
    steps_ = timer.steps[5:]
    sampled = {s for s in steps_ if s == 0 or (s + 1) % every == 0}
    quiet = [t for t, s in zip(times, steps_) if s not in sampled]
    return {
        "median": statistics.median(times),
        "mean": statistics.fmean(times),
        "quiet_mean": statistics.fmean(quiet) if quiet else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, nargs="+", default=[50, 10])
    parser.add_argument("--width", type=int, nargs="+", default=[128])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, steps {args.steps}")
    print("| width | configuration | median ms | mean ms | non-sampled mean ms | mean / none |")
    print("|---:|---|---:|---:|---:|---:|")
    for width in args.width:
        configs = [("none", "none", max(args.every))]
        for every in args.every:
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
                if name not in best or r["mean"] < best[name]["mean"]:
                    best[name] = r
        base = best["none"]
        for name, _, _ in configs:
            r = best[name]
            print(
                f"| {width} | {name} | {1e3 * r['median']:.1f} | {1e3 * r['mean']:.1f} | "
                f"{1e3 * r['quiet_mean']:.1f} | {r['mean'] / base['mean']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
