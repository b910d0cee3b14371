"""The runs of the alert sweep (benchmarks/alert_roc.py): the demo GPT trained with its monitors
attached, every read of every monitor kept as a record. ``Run`` says what one run is;
:func:`simulate` trains it."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.data import ByteDataset  # noqa: E402
from examples.nanogpt import GPT, GPTConfig, make_optimizer  # noqa: E402

from normscope import DeadDirectionConfig, Monitor  # noqa: E402


@dataclass
class Run:
    kind: str  # "healthy" | "step" | "ramp"
    width: int
    norm: str
    seed: int
    strength: float = 0.0
    switch_at: int | None = None
    steps: int = 100
    layers: int = 4
    batch: int = 32
    block: int = 64
    # (every, rows_per_read); rows None: the monitor's default (8 d per read)
    schedules: list[tuple[int, int | None]] = field(default_factory=list)
    cancel_block: int = 2

    @property
    def name(self) -> str:
        s = f"{self.kind} w{self.width} {self.norm} seed {self.seed}"
        return s + (f" s={self.strength} at {self.switch_at}" if self.kind != "healthy" else "")


def _profile_keys(metrics: dict[str, float]) -> dict[str, float]:
    keep = ("/sigma_min_ratio", "/sigma_min_step", "_lo", "_hi", "/rows_per_dim", "/depth")
    # the stream reads of the residual points (docs/metrics.md §1.6; no norm layer is read here)
    keep += ("/offset_share", "/offset_share_max", "/rms", "/rms_growth", "/rms_growth_max")
    keep += ("/final_offset_share", "/nonfinite_share", "/rows_rejected")
    # the attention-logit read (§1.7): no memory budget removes it
    keep += ("/max_logit", "/attn_logit_max", "/attn_modules_read")
    return {k: v for k, v in metrics.items() if k.startswith("dd/") and k.endswith(keep)}


def run_batches(data: torch.Tensor, run: Run, seed: int):
    ds = ByteDataset(data, run.block, samples=10**6, seed=seed)
    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(len(ds), (run.batch,), generator=g)
        xs, ys = zip(*(ds[int(i)] for i in idx))
        yield torch.stack(xs), torch.stack(ys)


def _monitor(model, every: int, rows: int | None, per_dim: float, width: int, layers: int):
    points = 2 * layers + 1
    config = DeadDirectionConfig(
        rows_per_read=rows,  # None: the monitor's default, 8 d per read
        kernel_residual_alert=None,
        max_memory=points * 8 * width * width,  # the profile, nothing else
    )
    monitor = Monitor.of(config, model, every_n_steps=every, alerts=(), verbose=False,
                         overhead_warn=None)  # fmt: skip
    monitor.family.sigma_rule.min_rows_per_dim = (
        per_dim  # the window stays open until N/d >= per_dim
    )
    return monitor


def simulate(run: Run, data: torch.Tensor) -> list[dict[str, Any]]:
    """Train one run with its monitors attached; every read of every monitor, as records."""
    torch.manual_seed(run.seed)
    config = GPTConfig(n_layer=run.layers, n_embd=run.width, n_head=4, norm=run.norm)
    model = GPT(config)
    opt = make_optimizer(model, lr=1e-3, weight_decay=0.1)
    mlp = model.transformer.h[min(run.cancel_block, run.layers - 1)].mlp
    watches = {}
    for every, rows in run.schedules:
        watches[(every, rows, 4.0)] = _monitor(model, every, rows, 4.0, run.width, run.layers)
        if rows is not None and rows < 4 * run.width:  # version 1 read at 2 d rows here
            watches[(every, rows, 2.0)] = _monitor(model, every, rows, 2.0, run.width, run.layers)
    records: list[dict[str, Any]] = []
    batches = run_batches(data, run, seed=run.seed)
    for step in range(run.steps + 1):
        if run.switch_at is not None and step >= run.switch_at:
            if run.kind == "ramp":
                mlp.set_cancel(min(0.95, 0.95 * (step - run.switch_at + 1) / 40))
            else:
                mlp.set_cancel(run.strength)
        x, y = next(batches)
        with contextlib.ExitStack() as stack:
            results = {k: stack.enter_context(w.step((x, y))) for k, w in watches.items()}
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for (every, rows, per_dim), result in results.items():
            if result.report is None:
                continue
            records.append(
                {
                    "run": run.name,
                    "kind": run.kind,
                    "width": run.width,
                    "norm": run.norm,
                    "seed": run.seed,
                    "strength": run.strength,
                    "switch_at": run.switch_at,
                    "every": every,
                    "max_rows": rows,
                    "per_dim": per_dim,
                    "step": step,
                    "cancel": mlp.cancel,
                    "block": run.cancel_block,
                    "layers": run.layers,
                    "metrics": _profile_keys(result.report.as_dict()),
                }
            )
    for w in watches.values():
        w.close()
    return records
