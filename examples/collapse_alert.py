"""A residual-stream collapse, caught live.

The demo GPT trains normally; at step ``--cancel-at`` the MLP branch of block ``--cancel-layer``
starts cancelling part of the stream (``f(x) = mlp(ln_2(x)) - 0.95 x P``, P a rank-8 projector:
``<x, f(x)> < 0``, the no-cancellation hypothesis broken on purpose). DeadDirectionMonitor's
next read sees ``sigma_min`` fall at exactly that sublayer, raises the alert (console, Python
logging, W&B), and with ``stop_on_alert=True`` training stops.

    python -m examples.collapse_alert                # cancel at step 100 in block 2, stop on alert
    python -m examples.collapse_alert --no-stop      # keep training: watch the model adapt
"""

from __future__ import annotations

import argparse

from examples import demo


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cancel-at", type=int, default=100)
    p.add_argument("--cancel-layer", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--no-stop", action="store_true")
    p.add_argument("--out", default="normscope_runs/collapse")
    p.add_argument("--no-wandb", action="store_true")
    args = p.parse_args(argv)
    demo_args = [
        "--cancel-at",
        str(args.cancel_at),
        "--cancel-layer",
        str(args.cancel_layer),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--out",
        args.out,
    ]
    # every read full: the sigma_min rule reads the spectral tier, which the default tiers
    # (spectral_every="auto": one read in five from width 65) would reach up to 4 reads later
    demo_args += ["--spectral-every", "1"]
    demo_args += [] if args.no_stop else ["--stop-on-alert"]
    demo_args += ["--no-wandb"] if args.no_wandb else []
    monitor = demo.main(demo_args)
    if monitor.alerts_fired:
        first = monitor.alerts_fired[0]
        print(f"first alert: step {first.step}, {first.point} ({first.sublayer}): {first.message}")
    else:
        print("no alert fired")
    return monitor


if __name__ == "__main__":
    main()
