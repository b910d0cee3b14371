"""The attention read on the row budget against the whole read: what it keeps and what it saves.

The demo GPT (``examples/nanogpt.py``, 4 blocks, batch 32 x 64 bytes: 2,048 token rows) at width
128 reads ``8 d = 1,024`` rows per tap, so its attention read takes the queries of 32 of the 64
positions. Two measurements:

* **Fidelity**: one model trained on random bytes (lr 3e-3, the demo's; and 3e-2, where the
  logits grow past the rule's line), two :class:`~normscope.taps.attention.AttentionLogits` on
  the same sampled forwards every 10 steps: every query, and the budget's. Printed: the ratio
  sampled / whole (median, lowest) and the first read over ``AttentionLogitRule``'s line (45)
  for each.
* **Cost**: step-interleaved copies from the same weights, every step a cheap read
  (``spectral_every`` 10^6): no monitor; the monitor; the monitor reading every query
  (``max_rows`` None); the monitor without the attention read. Median step against no monitor,
  in plain steps.

    python benchmarks/attention_budget.py --steps 200 --cost-steps 60
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: examples
from _common import gpt_copy, gpt_step  # noqa: E402
from examples.nanogpt import GPT, GPTConfig, make_optimizer  # noqa: E402

from normscope.alerts import AttentionLogitRule  # noqa: E402
from normscope.taps.attention import AttentionLogits, find_attention_modules  # noqa: E402
from normscope.taps.hooks import Gate  # noqa: E402

WIDTH, BATCH, TOKENS = 128, 32, 64


def fidelity(lr: float, steps: int, every: int = 10) -> dict[str, object]:
    """Sampled / whole attention maxima on the same forwards of one training run."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_embd=WIDTH, n_layer=4))
    opt = make_optimizer(model, lr, 0.1)
    names = find_attention_modules(model, "auto")
    gate = Gate()
    whole = AttentionLogits(model, names, gate)
    sampled = AttentionLogits(model, names, gate, max_rows=8 * WIDTH, seed=1)
    line = AttentionLogitRule().max_logit
    data = torch.randint(
        0, 256, (steps, BATCH, TOKENS + 1), generator=torch.Generator().manual_seed(0)
    )
    ratios, first = [], {}
    for step in range(steps):
        x, y = data[step, :, :-1], data[step, :, 1:]
        if step % every == every - 1:
            with gate.sampling():
                _, loss = model(x, y)
            w = max(v.item() for v in whole.take().values())
            s = max(v.item() for v in sampled.take().values())
            ratios.append(s / w)
            for name, v in (("whole", w), ("sampled", s)):
                if v > line and name not in first:
                    first[name] = step
        else:
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    whole.remove()
    sampled.remove()
    return {
        "lr": lr,
        "reads": len(ratios),
        "median": statistics.median(ratios),
        "lowest": min(ratios),
        "first_over_line": first,
    }


def cost(steps: int) -> dict[str, float]:
    """Median step of each copy against no monitor, in plain steps (every step a cheap read)."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_embd=WIDTH, n_layer=4))
    x = torch.randint(0, 256, (BATCH, TOKENS))
    y = torch.randint(0, 256, (BATCH, TOKENS))
    cheap = {"spectral_every": 10**6}
    configs = {
        "none": None,
        "budget (default)": cheap,
        "every query": cheap,
        "no attention read": {**cheap, "attention": None},
    }
    copies = {}
    for name, cfg in configs.items():
        copies[name] = gpt_copy(base, cfg, every_n_steps=1)
    times: dict[str, list[float]] = {name: [] for name in copies}
    for it in range(steps):
        for name, (model, opt, mon) in copies.items():
            if name == "every query" and mon.family.tracker.attention is not None:
                mon.family.tracker.attention.max_rows = None  # after attach sets the budget
            seconds = gpt_step(model, opt, mon, x, y)
            if it >= 4:  # discovery's step and the first, spectral, read left out
                times[name].append(seconds)
    plain = statistics.median(times["none"])
    return {name: (statistics.median(t) - plain) / plain for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps of each fidelity run")
    ap.add_argument("--cost-steps", type=int, default=60, help="interleaved steps of the cost run")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print(
        f"demo GPT width {WIDTH}, batch {BATCH} x {TOKENS} (rows {BATCH * TOKENS}), budget {8 * WIDTH}"
    )
    print("| lr | reads | sampled / whole: median | lowest | first read over the line (step) |")
    print("|---:|---:|---:|---:|---|")
    for lr in (3e-3, 3e-2):
        f = fidelity(lr, args.steps)
        over = ", ".join(f"{k} {v}" for k, v in sorted(f["first_over_line"].items())) or "none"
        print(f"| {lr:g} | {f['reads']} | {f['median']:.4f} | {f['lowest']:.4f} | {over} |")
    if args.cost_steps > 0:
        print("\n| copy | extra per step (a cheap read every step), plain steps |")
        print("|---|---:|")
        for name, extra in cost(args.cost_steps).items():
            print(f"| {name} | {extra:.3f} |")


if __name__ == "__main__":
    main()
