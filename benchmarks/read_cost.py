"""What a read costs: the eigensolves against d, and a whole monitor read against model size.

Part 1, per width d (float64 ``d x d`` matrices built as ``X^T X / m`` from ``m = 2d`` rows with
a log-spread column scale, so that the spectrum spans six decades as a trained model's does):

* ``symmetric_eigh``   -- values and vectors (what every read calls);
* ``eigvalsh``         -- values only, for reference (what ``sigma_min`` and the restricted
                          floor would need);
* ``kernel_read``      -- one norm's output read, ``solver="dense"``: an eigh of ``C``, a 1x1
                          eigh, the complete QR of ``v*`` and an eigvalsh of ``Q^T C Q``;
* ``kernel_read_fast`` -- the same read, ``solver="fast"`` (the default): Lanczos for
                          ``lambda_d``, one Cholesky of ``C + sI``, block shift-invert Lanczos for
                          the bottom pairs and the live floor (functional/solvers.py);
* ``schur_quotient``   -- one norm's input read: a Cholesky factor and a triangular solve;
* ``sigma_min``        -- one residual point, ``solver="dense"``: an eigvalsh of the second moment;
* ``sigma_min_fast``   -- the same, ``solver="fast"``: one Cholesky and shift-invert Lanczos;
* ``input_reads``      -- one norm's input read as the monitor takes it since issue 33.

"layer + point" is ``kernel_read + schur_quotient + sigma_min`` (one norm layer and its residual
point), dense and fast, in units of the same run's ``symmetric_eigh``; "now" is what the monitor
runs since issue 33: ``kernel_read`` (fast) + ``input_reads`` (one ``eigh`` of the input
covariance for ``delta_gamma``, its control and the Schur quotient; the point's ``sigma_min``
from the same eigenpairs by the secular equation, O(d)).

Part 2, a whole :meth:`DeadDirectionTracker.read` on the example GPT (``examples/nanogpt.py``)
at several depths and widths, the accumulators filled by one sampled forward of ``2d`` tokens
per tap or more. Beside it, the model's own training step (forward + backward + AdamW on the
same batch) and the extra cost of a *sampled* step (hooks folding rows) over a plain one. From
those: the smallest ``every_n_steps`` that keeps the monitor under 1% (and 3%) of training
time, ``every >= (read + sampled extra) / (budget * step)``.

Usage::

    python benchmarks/read_cost.py                       # d in 256 .. 2048 (+ eigh at 4096)
    python benchmarks/read_cost.py --dims 256 512 --models 2x128 --out /tmp/read_cost
    python benchmarks/read_cost.py --dims 1024 2048 --eigh-only-dims --models --spectrum power-law
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: examples
from _common import machine, machine_line, markdown_table, median_time, write_outputs  # noqa: E402
from examples.nanogpt import GPT, GPTConfig, make_optimizer  # noqa: E402

from normscope.families.dead_direction import DeadDirectionConfig, DeadDirectionTracker  # noqa: E402
from normscope.functional import (  # noqa: E402
    input_reads,
    kernel_read,
    schur_quotient,
    sigma_min,
    symmetric_eigh,
)

CPU = torch.device("cpu")
PRIMITIVES = (
    "symmetric_eigh",
    "eigvalsh",
    "kernel_read",
    "kernel_read_fast",
    "schur_quotient",
    "sigma_min",
    "sigma_min_fast",
    "input_reads",
)


def test_matrix(
    d: int, seed: int = 0, device: torch.device = CPU, spectrum: str = "test"
) -> torch.Tensor:
    """A float64 SPD ``d x d`` matrix ``X^T X / 2d``, column scales log-spaced over 3 decades;
    ``spectrum="power-law"``: ``Q diag(i^-2) Q^T`` instead (a trained model's heavy tail, the
    bottom eigenvalues 0.5% apart: the fast solvers' hard case).

    Example::

        >>> c = test_matrix(8)
        >>> c.shape, bool((torch.linalg.eigvalsh(c) > 0).all())
        (torch.Size([8, 8]), True)
        >>> round(float(torch.linalg.eigvalsh(test_matrix(8, spectrum="power-law"))[0]), 6)
        0.015625
    """
    g = torch.Generator(device=device).manual_seed(seed)
    if spectrum == "power-law":
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64, device=device))
        c = (q * torch.arange(1, d + 1, dtype=torch.float64, device=device) ** -2.0) @ q.T
        return (c + c.T) / 2
    x = torch.randn(2 * d, d, generator=g, dtype=torch.float64, device=device)
    x *= torch.logspace(0, -3, d, dtype=torch.float64, device=device)
    return x.T @ x / (2 * d)


def primitive_costs(
    d: int,
    repeats: int,
    warmup: int,
    only: tuple[str, ...] = PRIMITIVES,
    device=CPU,
    spectrum: str = "test",
) -> dict[str, float]:
    """Median seconds of each read primitive at width ``d``."""
    c = test_matrix(d, device=device, spectrum=spectrum)
    g = torch.Generator(device=device).manual_seed(1)
    gamma = 1.0 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64, device=device)
    n = 2 * d
    calls = {
        "symmetric_eigh": lambda: symmetric_eigh(c),
        "eigvalsh": lambda: torch.linalg.eigvalsh(c),
        "kernel_read": lambda: kernel_read(c, gamma, n, declared_kind="layernorm", solver="dense"),
        "kernel_read_fast": lambda: kernel_read(c, gamma, n, declared_kind="layernorm"),
        "schur_quotient": lambda: schur_quotient(c, gamma, n),
        "sigma_min": lambda: sigma_min(c, n, solver="dense"),
        "sigma_min_fast": lambda: sigma_min(c, n),
        "input_reads": lambda: input_reads(c, gamma, n),
    }
    return {k: median_time(calls[k], device, repeats, warmup)[0] for k in only}


def fit_power(ds: list[int], ts: list[float]) -> tuple[float, float]:
    """Least-squares ``t = a d^b`` through the points (log-log); returns ``(a, b)``.

    Example::

        >>> a, b = fit_power([100, 200, 400], [1e-3, 8e-3, 64e-3])
        >>> round(b, 6), round(a * 1e6, 6)
        (3.0, 0.001)
    """
    xs, ys = [math.log(d) for d in ds], [math.log(t) for t in ts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 3.0
    return math.exp(my - b * mx), b


# --------------------------------------------------------------------------- part 2
def parse_model(spec: str) -> tuple[int, int]:
    """``"4x256"`` -> ``(n_layer, n_embd)``."""
    layers, width = spec.lower().split("x")
    return int(layers), int(width)


def model_read_cost(
    n_layer: int, width: int, repeats: int, train_steps: int, device: torch.device = CPU
) -> dict[str, Any]:
    """Train-step time, sampled-step extra and whole-read time of one GPT shape."""
    torch.manual_seed(0)
    heads = max(1, width // 64)
    cfg = GPTConfig(n_layer=n_layer, n_embd=width, n_head=heads, block_size=64)
    model = GPT(cfg).to(device)
    params = sum(p.numel() for p in model.parameters())
    # Enough rows for every tap (2d), at least one default batch (32 x 64 tokens).
    batch = max(32, math.ceil(2 * width / cfg.block_size))
    g = torch.Generator(device=device).manual_seed(0)
    x, y = torch.randint(0, 256, (2, batch, cfg.block_size), generator=g, device=device)
    opt = make_optimizer(model, 1e-4, 0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker = DeadDirectionTracker(DeadDirectionConfig(rows_per_read=4096), model)
    tracker.attach(forward=lambda: model(x[:2]))

    def step() -> None:
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def sampled_step() -> None:
        tracker.reset()
        with tracker.gate.sampling():
            step()

    t_step, _ = median_time(step, device, train_steps, warmup=1)
    t_sampled, _ = median_time(sampled_step, device, max(2, train_steps // 2), warmup=0)
    t_read, reads = median_time(
        lambda: tracker.read(step=0, reduce=False, reset=False), device, repeats, warmup=0
    )
    report = tracker.read(step=0, reduce=False, reset=False)
    tracker.detach()
    taps = len(tracker.taps)
    points = len(tracker.layout.points) if tracker.layout is not None else 0
    finite = math.isfinite(report.sigma_min_ratio_min)
    return {
        "model": f"{n_layer}x{width}",
        "n_layer": n_layer,
        "width": width,
        "params": params,
        "tokens_per_step": batch * cfg.block_size,
        "norms": len(tracker.norms),
        "points": points,
        "taps": taps,
        "acc_mib": tracker.memory_bytes() / 2**20,
        "step_s": t_step,
        "sampled_extra_s": max(0.0, t_sampled - t_step),
        "read_s": t_read,
        "read_all_s": reads,
        "read_finite": finite,
    }


def every_for(cost_s: float, step_s: float, budget: float) -> int:
    """Smallest ``every_n_steps`` with ``cost / (every * step) <= budget``.

    Example::

        >>> every_for(0.5, 0.1, 0.01)   # a 0.5 s read, 0.1 s steps, 1%: every 500 steps
        500
    """
    return max(1, math.ceil(cost_s / (budget * step_s) - 1e-9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 512, 1024, 1536, 2048])
    parser.add_argument("--eigh-only-dims", type=int, nargs="*", default=[4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--models", nargs="*", default=["2x128", "4x256", "8x256", "8x512", "4x1024"]
    )
    parser.add_argument("--train-steps", type=int, default=2, help="timed steps per model")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: reproducible on a shared machine)"
    )
    parser.add_argument("--out", default=None, help="also write <out>.md and <out>.json")
    parser.add_argument(
        "--spectrum",
        choices=("test", "power-law"),
        default="test",
        help="part 1's matrix: the log-scaled X^T X (default) or Q diag(i^-2) Q^T",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    info = machine()
    print(machine_line(info), flush=True)
    t_start = time.perf_counter()

    prim: list[dict[str, Any]] = []
    for d in args.dims:
        costs = primitive_costs(d, args.repeats, 1 if d <= 1024 else 0, spectrum=args.spectrum)
        prim.append({"d": d, **costs})
        print(f"d={d}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in costs.items()), flush=True)
    for d in args.eigh_only_dims:
        costs = primitive_costs(d, 1, 0, only=("symmetric_eigh", "eigvalsh"))
        prim.append({"d": d, **costs})
        print(f"d={d}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in costs.items()), flush=True)
    big = [p for p in prim if p["d"] >= 1024] or prim
    a, b = fit_power([p["d"] for p in big], [p["symmetric_eigh"] for p in big])

    def ms(p: dict[str, Any], key: str) -> str:
        return f"{1e3 * p[key]:.1f}" if key in p else "-"

    def eighs(p: dict[str, Any], *keys: str) -> str:
        if not all(k in p for k in keys):
            return "-"
        return f"{sum(p[k] for k in keys) / p['symmetric_eigh']:.2f}"

    prim_table = markdown_table(
        ["d", *[f"{k} ms" for k in PRIMITIVES], "layer + point dense (x eigh)",
         "layer + point fast (x eigh)", "layer + point now (x eigh)", "eigh GFLOP/s (9 d^3)"],
        [
            [p["d"], *[ms(p, k) for k in PRIMITIVES],
             eighs(p, "kernel_read", "schur_quotient", "sigma_min"),
             eighs(p, "kernel_read_fast", "schur_quotient", "sigma_min_fast"),
             eighs(p, "kernel_read_fast", "input_reads"),
             f"{9 * p['d'] ** 3 / p['symmetric_eigh'] / 1e9:.1f}"]
            for p in prim
        ],
    )  # fmt: skip
    fit_line = (
        f"fit over d >= 1024: symmetric_eigh ~ {a:.3g} * d^{b:.2f} s "
        f"(d = 4096: {a * 4096**b:.1f} s, d = 8192: {a * 8192**b:.0f} s)"
    )
    print("\n" + prim_table + "\n" + fit_line, flush=True)

    models: list[dict[str, Any]] = []
    for spec in args.models:
        n_layer, width = parse_model(spec)
        r = model_read_cost(n_layer, width, args.repeats, args.train_steps)
        # The cost model: per norm a kernel read and a Schur read, per point not a norm input
        # nothing extra (shared taps) but a sigma_min eigh at every point.
        by_d = {p["d"]: p for p in prim if "kernel_read" in p}
        if width in by_d:
            p = by_d[width]
            r["predicted_read_s"] = (
                r["norms"] * (p["kernel_read_fast"] + p["input_reads"])
                + max(r["points"] - r["norms"], 0) * p["sigma_min_fast"]
            )
        cost = r["read_s"] + r["sampled_extra_s"]
        r["every_1pct"] = every_for(cost, r["step_s"], 0.01)
        r["every_3pct"] = every_for(cost, r["step_s"], 0.03)
        r["overhead_at_50"] = cost / (50 * r["step_s"])
        models.append(r)
        print(
            f"{spec}: step {1e3 * r['step_s']:.0f} ms, sampled extra "
            f"{1e3 * r['sampled_extra_s']:.0f} ms, read {1e3 * r['read_s']:.0f} ms",
            flush=True,
        )
    model_table = markdown_table(
        [
            "model (L x d)",
            "params",
            "tokens/step",
            "norms",
            "points",
            "taps",
            "accumulators MiB",
            "train step ms",
            "sampled-step extra ms",
            "read ms (median)",
            "read ms predicted from part 1",
            "overhead at every=50",
            "every_n_steps for <= 1%",
            "for <= 3%",
        ],
        [
            [
                r["model"],
                f"{r['params'] / 1e6:.1f}M",
                r["tokens_per_step"],
                r["norms"],
                r["points"],
                r["taps"],
                f"{r['acc_mib']:.1f}",
                f"{1e3 * r['step_s']:.0f}",
                f"{1e3 * r['sampled_extra_s']:.0f}",
                f"{1e3 * r['read_s']:.0f}",
                f"{1e3 * r['predicted_read_s']:.0f}" if "predicted_read_s" in r else "-",
                f"{100 * r['overhead_at_50']:.1f}%",
                r["every_1pct"],
                r["every_3pct"],
            ]
            for r in models
        ],
    )
    took = time.perf_counter() - t_start
    text = (
        f"{machine_line(info)}\n\n### Read primitives (median of {args.repeats}; d >= 4096 once)"
        f"\n\n{prim_table}\n\n{fit_line}\n\n### Whole DeadDirectionTracker.read\n\n{model_table}"
        f"\n\n(total {took:.0f} s)"
    )
    print("\n" + text)
    write_outputs(
        args.out,
        text,
        {"machine": info, "primitives": prim, "eigh_fit": {"a": a, "b": b}, "models": models},
    )


if __name__ == "__main__":
    main()
