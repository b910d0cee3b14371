"""Trace one sampled read through the package: which normscope files it touches, how far it hops.

A 2-block pre-norm GPT (``examples/nanogpt.py``) trains under a Lightning ``Trainer`` with
``DeadDirectionMonitor(every_n_steps=10)`` (synchronous reads, a CSV logger). At the sampled
step that is read, a profiler records every call made in a normscope source file from the
monitor's ``on_train_batch_start`` (the training forward and its hooks included) to the end of
its ``on_train_batch_end``, where the logger's ``log_metrics`` has run. Printed:

* the calls and the files they ran in (outside ``functional/``: the upper floors), and the
  packages those files belong to (a family's package counts once: ``families/dead_direction``);
* the longest chain of cross-file hops: along one call stack, a call from a normscope frame in
  file A into one in file B != A is a hop (frames of other packages in between are skipped);
* hops back: a call into a file already on its stack, left before (``A -> B -> A``).

    python benchmarks/trace_read.py            # the figures
    python benchmarks/trace_read.py --calls    # and every chain of the longest length
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from examples.nanogpt import GPT, GPTConfig  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

import normscope  # noqa: E402
from normscope import DeadDirectionMonitor  # noqa: E402

PACKAGE = Path(normscope.__file__).resolve().parent


class Trace:
    """``sys.setprofile`` over normscope's files: per call, its file and its chain of files."""

    def __init__(self) -> None:
        self.calls = 0
        self.files: Counter[str] = Counter()
        self.longest: tuple[str, ...] = ()
        self.chains: set[tuple[str, ...]] = set()
        self.back: set[tuple[str, ...]] = set()
        self._chain: dict[int, tuple[str, ...]] = {}

    def _file(self, frame: FrameType) -> str | None:
        name = frame.f_code.co_filename
        if not name.startswith(str(PACKAGE)):
            return None
        return os.path.relpath(name, PACKAGE)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        here = self._file(frame)
        if here is None:
            return
        parent = frame.f_back
        while parent is not None and self._file(parent) is None:
            parent = parent.f_back
        chain = self._chain.get(id(parent), ()) if parent is not None else ()
        if not chain or chain[-1] != here:
            if here in chain:
                self.back.add((*chain, here))
            chain = (*chain, here)
        self._chain[id(frame)] = chain
        self.calls += 1
        self.files[here] += 1
        if len(chain) > len(self.longest):
            self.longest = chain
        self.chains.add(chain)


class Start(L.Callback):
    def __init__(self, trace: Trace, step: int) -> None:
        self.trace, self.step = trace, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            sys.setprofile(self.trace)


class Stop(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sys.setprofile(None)


class LitGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32, vocab_size=64))

    def training_step(self, batch, batch_idx):
        _, loss = self.model(*batch)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trace_read(tmp: Path, every: int = 10) -> Trace:
    """Fit ``every + 1`` steps and trace the sampled step ``every - 1`` (read at its end)."""
    torch.manual_seed(0)
    x = torch.randint(0, 64, (64 * (every + 1), 32))
    data = torch.utils.data.DataLoader(list(zip(x, x.roll(-1, 1))), batch_size=64)
    trace = Trace()
    monitor = DeadDirectionMonitor(every_n_steps=every, async_reads=False)  # else the defaults
    trainer = L.Trainer(
        max_steps=every,
        accelerator="cpu",
        callbacks=[Start(trace, every - 1), monitor, Stop()],
        logger=CSVLogger(tmp, name="trace"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LitGPT(), data)
    sys.setprofile(None)
    assert monitor.reads >= 2, "the traced step was not read"
    return trace


def package_of(path: str) -> str:
    """The package a file of normscope belongs to: its folder (``families/dead_direction``,
    ``engine``), ``normscope`` for the top-level modules."""
    folder = os.path.dirname(path)
    return folder if folder else "normscope"


def summary(trace: Trace) -> dict[str, Any]:
    upper = {f: n for f, n in trace.files.items() if not f.startswith("functional/")}
    return {
        "calls": trace.calls,
        "files": len(trace.files),
        "files_outside_functional": sorted(upper),
        "packages_outside_functional": sorted({package_of(f) for f in upper}),
        "longest_hops": max(len(trace.longest) - 1, 0),
        "longest_chain": list(trace.longest),
        "hops_back": sorted(" -> ".join(c) for c in trace.back),
    }


def main(argv: list[str] | None = None) -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", action="store_true", help="print every chain of the longest length")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        trace = trace_read(Path(tmp))
    s = summary(trace)
    print(f"one sampled read: {s['calls']} normscope calls in {s['files']} files")
    packages = s["packages_outside_functional"]
    print(f"packages outside functional/ ({len(packages)}): {', '.join(packages)}")
    print(f"files outside functional/ ({len(s['files_outside_functional'])}):")
    for f in s["files_outside_functional"]:
        print(f"  {f:40s} {trace.files[f]:5d} calls")
    print(f"longest chain of cross-file hops: {s['longest_hops']}")
    print("  " + " -> ".join(s["longest_chain"]))
    print(f"hops back into a file already left: {len(s['hops_back'])}")
    for c in s["hops_back"]:
        print("  " + c)
    if args.calls:
        top = max(len(c) for c in trace.chains)
        for c in sorted(c for c in trace.chains if len(c) == top):
            print("  " + " -> ".join(c))


if __name__ == "__main__":
    main()
