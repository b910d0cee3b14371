"""Fidelity figures of issue 18: Delta_gamma over training, the ``sigma_min`` step on a
healthy and a cancelling run, the LN/RMS classifier's separation by width, and how the Schur
complement moves with the row count.

    python benchmarks/fidelity.py                 # about 2-4 min on one CPU thread

1. The demo GPT (examples/nanogpt.py, data from examples/data.py, 4 x 128, LayerNorm, batch 32 x 64 = 2048 rows a read)
   trained with DeadDirectionMonitor, reads at steps 1, 10, 20, 30, 50: Delta_gamma and its
   random-direction control per layer (issue 33's definition) and 1 - R_q (version 1's).
2. The same run with the cancelling MLP branch of block 2 switched on at step 25: the
   ``sigma_min`` step at every point, at the read of step 50, against the healthy run's (the
   no-cancellation margin this table printed first was removed: negative at every point).
3. torch's LayerNorm / RMSNorm at d = 32 .. 1024 with uneven gammas: the largest LayerNorm
   kernel_residual, the smallest RMSNorm one, and the largest RMSNorm alignment x sqrt(d).
4. The Schur complement of the trained model's deep layers read on 2k, 8k and 32k rows.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.data import make_dataloaders  # noqa: E402
from examples.lit_gpt import LitGPT  # noqa: E402
from examples.nanogpt import GPTConfig  # noqa: E402
from tests.support.tiny_models import cpu_trainer  # noqa: E402

from normscope import DeadDirectionMonitor, scan_model  # noqa: E402
from normscope.alerts import CallableRule  # noqa: E402
from normscope.functional import StreamingCovariance, kernel_read  # noqa: E402

DEEP = ["h.2.ln_1", "h.2.ln_2", "h.3.ln_1", "h.3.ln_2", "ln_f"]
PREFIX = "dd/model.transformer."


def fit(steps: int, every: int, cancel_at: int | None) -> tuple[list, LitGPT]:
    torch.manual_seed(0)
    seen: list[tuple[int, dict[str, float]]] = []
    rule = CallableRule("record", lambda m, s: seen.append((s, dict(m))) and None)
    monitor = DeadDirectionMonitor(every_n_steps=every, rules=[rule], alerts=(), verbose=False)
    module = LitGPT(GPTConfig(), cancel_at_step=cancel_at, cancel_layer=2)
    train, _ = make_dataloaders(64, batch_size=32, seed=0, max_bytes=1_000_000)
    cpu_trainer(steps, [monitor]).fit(module, train_dataloaders=train)
    return seen, module


def delta_gamma_table(seen: list) -> None:
    print("\n## 1. Delta_gamma / its random-direction control / 1 - R_q on the deep layers")
    print("| step | Delta_gamma min-max | control min-max | 1 - R_q min-max |")
    print("|---:|---|---|---|")
    for step, m in seen:
        dg = [m[f"{PREFIX}{k}/delta_gamma"] for k in DEEP]
        dp = [m[f"{PREFIX}{k}/delta_gamma_control"] for k in DEEP]
        old = [1 - m[f"{PREFIX}{k}/schur_quotient"] for k in DEEP]
        print(
            f"| {step} | {min(dg):.4f}-{max(dg):.4f} | {min(dp):.3g}-{max(dp):.3g} | "
            f"{min(old):.3f}-{max(old):.3f} |"
        )


def steps(m: dict[str, float]) -> dict[str, float]:
    suffix = "/sigma_min_step"
    return {k[len(PREFIX) : -len(suffix)]: v for k, v in m.items() if k.endswith(suffix)}


def classifier() -> None:
    print("\n## 3. classifier separation (uneven gammas; 3 seeds x 2 gamma laws)")
    print("| d | LN kernel_residual max | RMS kernel_residual min | RMS alignment max x sqrt(d) |")
    print("|---:|---:|---:|---:|")
    for d in (32, 64, 128, 256, 512, 1024):
        ln_res, rms_res, rms_al = [], [], []
        n = 4 * d if d >= 512 else 8 * d
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            a = torch.randn(d, d, generator=g) / math.sqrt(d) * torch.logspace(0, -1.5, d)
            x = torch.randn(n, d, generator=g) @ a + 0.5 * torch.randn(d, generator=g)
            for gamma in (
                0.1 + 1.9 * torch.rand(d, generator=g),
                torch.exp(0.5 * torch.randn(d, generator=g)),
            ):
                for kind in ("layernorm", "rmsnorm"):
                    f = torch.nn.functional
                    y = (
                        f.layer_norm(x, (d,), gamma)
                        if kind == "layernorm"
                        else f.rms_norm(x, (d,), gamma)
                    )
                    acc = StreamingCovariance(d)
                    acc.update(y)
                    r = kernel_read(acc.covariance(), gamma, acc.count, declared_kind=kind)
                    if kind == "layernorm":
                        ln_res.append(r.kernel_residual)
                    else:
                        rms_res.append(r.kernel_residual)
                        rms_al.append(r.gamma_alignment * math.sqrt(d))
        print(f"| {d} | {max(ln_res):.1e} | {min(rms_res):.1e} | {max(rms_al):.2f} |")


def rows_sensitivity(module: LitGPT) -> None:
    print("\n## 4. Schur complement s of the trained (step 50) model by rows read")
    data, _ = make_dataloaders(64, batch_size=32, seed=7, max_bytes=1_000_000)
    batches = []
    for x, _ in data:
        batches.append(x)
        if len(batches) == 16:
            break
    model = module.model
    out = {}
    for n_batches in (1, 4, 16):
        report = scan_model(model, batches[:n_batches], residual=False)
        out[n_batches * 2048] = {
            k: report.norms[f"transformer.{k}"].schur.schur_complement for k in DEEP
        }
    print("| layer | s at 2k | s at 8k | s at 32k | 32k / 2k |")
    print("|---|---:|---:|---:|---:|")
    for k in DEEP:
        a, b, c = out[2048][k], out[8192][k], out[32768][k]
        print(f"| {k} | {a:.3g} | {b:.3g} | {c:.3g} | {c / a:.2f} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    healthy, trained = fit(51, 10, None)
    delta_gamma_table(healthy)
    cancel, _ = fit(51, 25, cancel_at=25)
    print("\n## 2. sigma_min step at the step-50 read (block 2's MLP cancels from step 25)")
    h = steps([m for s, m in healthy if s == 50][0])
    c = steps([m for s, m in cancel if s == 50][0])
    print("| point | healthy step | cancelling step |")
    print("|---|---:|---:|")
    for k in h:
        print(f"| {k} | {h[k]:.3f} | {c.get(k, math.nan):.3f} |")
    classifier()
    rows_sensitivity(trained)


if __name__ == "__main__":
    main()
