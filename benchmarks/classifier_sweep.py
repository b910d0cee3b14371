"""The norm-type classifier over widths, gain spreads and inputs (docs/metrics.md §1.2.1).

Rows go through ``torch.nn.functional.layer_norm`` / ``rms_norm`` in float32 (as a model's
forward would), fold into a ``StreamingCovariance``, and ``kernel_read`` classifies the output
(no declared kind). Widths 32-1024; gains all ones ("init") or log-normal with sigma 0.05 (early training), 0.5, 1, 2
(LayerNorms also get a random bias); inputs isotropic or anisotropic (eigenvalues log-uniform
over 6 decades in a random basis), each with a random channel offset; N = 8 d rows; seeds 0-1.
Prints every read that is not right and the counts: indeterminate and wrong, per norm.

    python -m benchmarks.classifier_sweep            # the full sweep (about 3 min, one core)
    python -m benchmarks.classifier_sweep --quick    # widths up to 256
    python -m benchmarks.classifier_sweep --runs /tmp/meaning_runs   # also the demo GPT's norms

``--runs`` adds every norm of every ``benchmarks/meaning_collect.py`` snapshot (the demo GPT at
widths 64-256, LayerNorm and RMSNorm, init and trained, float32 forwards).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from normscope.functional import StreamingCovariance, kernel_read

WIDTHS = (32, 64, 128, 256, 512, 1024)
SPREADS = (0.0, 0.05, 0.5, 1.0, 2.0)  # 0: gamma = 1 (init); 0.05: early in training
INPUTS = ("isotropic", "anisotropic")


def make_rows(d: int, n: int, kind: str, g: torch.Generator) -> torch.Tensor:
    z = torch.randn(n, d, generator=g, dtype=torch.float64)
    if kind == "anisotropic":
        q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
        lam = 10.0 ** (-6.0 * torch.rand(d, generator=g, dtype=torch.float64))
        z = (z * lam.sqrt()) @ q.T
    return (z + torch.randn(d, generator=g, dtype=torch.float64)).float()


def one_read(norm: str, d: int, spread: float, inputs: str, seed: int):
    g = torch.Generator().manual_seed(seed * 7919 + d)
    n = 8 * d
    x = make_rows(d, n, inputs, g)
    gamma = torch.ones(d) if spread == 0 else torch.exp(spread * torch.randn(d, generator=g))
    if norm == "layernorm":
        beta = 0.1 * torch.randn(d, generator=g) if spread else torch.zeros(d)
        y = F.layer_norm(x, (d,), gamma.float(), beta.float(), eps=1e-5)
    else:
        y = F.rms_norm(x, (d,), gamma.float(), eps=1e-6)
    acc = StreamingCovariance(d)
    for chunk in y.chunk(4):
        acc.update(chunk)
    return kernel_read(acc.covariance(), gamma.double(), acc.count)


def main(argv: list[str] | None = None) -> Counter:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--runs", default=None, help="also classify meaning_collect snapshots")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    widths = [w for w in WIDTHS if w <= 256] if args.quick else WIDTHS
    counts: Counter = Counter()
    t0 = time.perf_counter()
    for norm in ("layernorm", "rmsnorm"):
        want = "layernorm-like" if norm == "layernorm" else "rmsnorm-like"
        for d in widths:
            for spread in SPREADS:
                for inputs in INPUTS:
                    for seed in range(args.seeds):
                        r = one_read(norm, d, spread, inputs, seed)
                        got = r.norm_class
                        verdict = "right" if got == want else got
                        verdict = "wrong" if got not in (want, "indeterminate") else verdict
                        counts[norm, verdict] += 1
                        if verdict != "right":
                            print(
                                f"{norm:9s} d={d:4d} sigma={spread:3.1f} {inputs:11s} s{seed}: "
                                f"{got:14s} residual {r.kernel_residual:.1e} "
                                f"align {r.gamma_alignment:.4f} subspace {r.subspace_alignment:.4f}"
                                f" null_dim {r.null_dim}"
                            )
    if args.runs:
        for f in sorted(Path(args.runs).glob("*.npz")):
            z = np.load(f)
            norm = "layernorm" if f.name.startswith("layernorm") else "rmsnorm"
            want = "layernorm-like" if norm == "layernorm" else "rmsnorm-like"
            for k in range(len(z["names"])):
                c, gamma = torch.from_numpy(z[f"Cout{k}"]), torch.from_numpy(z[f"gamma{k}"])
                r = kernel_read(c, gamma, int(z["n_rows"]))
                got = r.norm_class
                verdict = "right" if got == want else got
                verdict = "wrong" if got not in (want, "indeterminate") else verdict
                counts["demo " + norm, verdict] += 1
                if verdict != "right":
                    print(
                        f"demo {f.name} {z['names'][k]}: {got} residual "
                        f"{r.kernel_residual:.1e} align {r.gamma_alignment:.4f}"
                    )
    total = sum(counts.values())
    for norm in sorted({nm for nm, _ in counts}):
        n = sum(v for (nm, _), v in counts.items() if nm == norm)
        print(
            f"{norm}: {n} reads, {counts[norm, 'right']} right, "
            f"{counts[norm, 'indeterminate']} indeterminate, {counts[norm, 'wrong']} wrong"
        )
    ind = sum(v for (_, k), v in counts.items() if k == "indeterminate")
    wrong = sum(v for (_, k), v in counts.items() if k == "wrong")
    print(
        f"all: {total} reads, {ind} indeterminate ({100 * ind / total:.1f}%), {wrong} wrong; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    return counts


if __name__ == "__main__":
    main()
