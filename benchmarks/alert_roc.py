"""The sigma_min alert's operating point, measured on sweeps of runs, never on one.

    python benchmarks/alert_roc.py               # the full sweep (about 1 h on one CPU thread)
    python benchmarks/alert_roc.py --quick       # a small slice (about 1 min; the tests run it)
    python benchmarks/alert_roc.py --errors      # interval coverage against a large reference

**Healthy runs**: the demo GPT (examples/nanogpt.py, 4 layers, batch 32 x 64 = 2,048 token rows
a step, data from examples/data.py) at widths 64/128/256, LayerNorm and RMSNorm, 5 seeds each,
trained 100 steps. On every run, six real monitors read at once (``DeadDirectionMonitor`` driven
by :class:`normscope.Monitor`, each its own hooks and schedule): ``every_n_steps`` 1,
5 and 50 times ``rows_per_read`` 512 and 4096 (one forward a step: rows per step), the first
read included (``--rows default``: the monitor's default, ``8 d`` per read, instead). Any alert on these
is a false alarm.

**Collapsing runs**: the same model with the cancelling MLP branch of block 2 (``f(x) =
mlp(ln_2(x)) - s x P``, P a rank-8 projector) switched on at a random step in [10, 40], at
strength ``s`` 0.5, 0.8 and 0.95, and a second kind, a *ramp*: ``s`` grows from 0 to 0.95 over
40 steps (a branch that slowly learns to cancel). Reads every 5 steps at both row caps;
detection delay = reads from the first read after the switch (for a ramp: the first read at
``s >= 0.8``; an alert before that counts 0) to the first alert at the point after that block.

Each read's ``dd/`` metrics are kept (JSONL, ``--out``) and the rules judged on the same reads:
``v1`` is version 1's rule (raw ratios under 0.8, reads from ``2 d`` rows), ``rows, floor 0.8``
and ``rows, floor 0.6`` the rule with intervals (the interval's top under the floor, reads from
``4 d`` rows), and ``default`` what ``SigmaMinRatioRule()`` does: floor 0.6, and 0.85 for a step
ratio that fell under 0.6 x its previous read (a sudden drop). Version 1 read at ``2 d`` rows where the
new monitor waits for ``4 d``: the one configuration where that differs (width 256 at 512 rows a
step) runs an extra pair of monitors reading at ``2 d`` for ``v1``.

Only the residual profile is read (``max_memory`` holds the profile's accumulators and nothing
more: no norm-layer reads), which changes nothing the rule sees.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from alert_runs import Run, run_batches, simulate  # noqa: E402
from examples.data import stdlib_text  # noqa: E402
from examples.nanogpt import GPT, GPTConfig, make_optimizer  # noqa: E402

from normscope import scan_model  # noqa: E402
from normscope.alerts import SigmaMinRatioRule, default_dead_direction_rules  # noqa: E402
from normscope.functional.profile import ratio_bounds  # noqa: E402

#: the rules as they were judged before issue 32: both ratios watched, one alert per point
BEFORE = {
    "watch": ("ratio", "step"),
    "one_per_episode": False,
    "confirm_near_floor": False,
    "drop_from_first_read": True,
}

RULES = {
    "v1": lambda: SigmaMinRatioRule(tolerance=0.2, min_rows_per_dim=2, drop=None, **BEFORE),
    "rows, floor 0.8": lambda: SigmaMinRatioRule(tolerance=0.2, drop=None, **BEFORE),
    "rows, floor 0.6": lambda: SigmaMinRatioRule(tolerance=0.4, drop=None, **BEFORE),
    "default before issue 32": lambda: SigmaMinRatioRule(**BEFORE),  # floor 0.6; drop 0.85
    # issue 32: the step ratio only, one alert per episode, a hover at the floor confirmed,
    # no sudden drop against the first read
    "default": lambda: SigmaMinRatioRule(),
}


def _v1_view(metrics: dict[str, float]) -> dict[str, float]:
    """A read as version 1's rule saw it: the ratios alone (no rows), each its own interval."""
    drop = ("_lo", "_hi", "/rows_per_dim")
    out = {k: v for k, v in metrics.items() if not k.endswith(drop)}
    for key in [k for k in out if k.endswith(("/sigma_min_ratio", "/sigma_min_step"))]:
        out[f"{key}_lo"] = out[f"{key}_hi"] = out[key]
    return out


def _block_point(metrics: dict[str, float], block: int, layers: int) -> str | None:
    """The point right after the cancelling MLP (input of block ``block + 1``'s ln_1)."""
    target = f".h.{block + 1}.ln_1/" if block + 1 < layers else ".ln_f/"
    for k in metrics:
        if target in k:
            return k.split("/")[1]
    return None


def judge(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rule on every monitor's reads: false alarms and detection delays."""
    series: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        series[(r["run"], r["every"], r["max_rows"], r["per_dim"])].append(r)
    out: dict[str, Any] = {"healthy": {}, "collapse": {}}
    for rule_name, make in RULES.items():
        healthy_reads = healthy_alerts = 0
        alarms_by: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # config -> [alerts, reads]
        collapse: list[dict[str, Any]] = []
        false_alarms = out.setdefault("false_alarms", [])
        for (run, every, rows, per_dim), reads in series.items():
            first = reads[0]
            if rule_name == "v1":  # version 1 read from 2 d rows: those monitors where they ran
                if per_dim == 4.0 and (run, every, rows, 2.0) in series:
                    continue
            elif per_dim != 4.0:
                continue
            rule = make()
            fired_steps = []
            for r in sorted(reads, key=lambda r: r["step"]):
                m = _v1_view(r["metrics"]) if rule_name == "v1" else r["metrics"]
                alerts = rule.evaluate(m, r["step"])
                fired_steps.append((r["step"], r["cancel"], [a.point for a in alerts]))
            if first["kind"] == "healthy":
                n_alerts = sum(1 for _, _, pts in fired_steps if pts)
                for s, _, pts in fired_steps:
                    if pts:
                        false_alarms.append((rule_name, run, every, rows, s, pts))
                healthy_reads += len(fired_steps)
                healthy_alerts += n_alerts
                key = f"w{first['width']} every {every} rows {rows}"
                alarms_by[key][0] += n_alerts
                alarms_by[key][1] += len(fired_steps)
            else:
                point = _block_point(reads[0]["metrics"], first["block"], first["layers"])
                after = [(s, c, pts) for s, c, pts in fired_steps if s >= first["switch_at"]]
                # a ramp counts from its first read at strength >= 0.8 (an alert before: 0)
                start = next(
                    (i for i, (_s, c, _p) in enumerate(after) if c >= 0.8 - 1e-9), len(after)
                )
                if first["kind"] != "ramp":
                    start = 0
                delay = at_strength = None
                for i, (_s, c, pts) in enumerate(after):
                    if point in pts:
                        delay, at_strength = max(i - start + 1, 0), c
                        break
                early = sum(1 for s, _, pts in fired_steps if s < first["switch_at"] and pts)
                collapse.append(
                    {
                        "kind": first["kind"],
                        "strength": first["strength"],
                        "width": first["width"],
                        "norm": first["norm"],
                        "rows": rows,
                        "delay": delay,
                        "at_strength": at_strength,
                        "early_alerts": early,
                    }
                )
        out["healthy"][rule_name] = {
            "reads": healthy_reads,
            "alerts": healthy_alerts,
            "per_1000": 1000 * healthy_alerts / max(healthy_reads, 1),
            "by_config": {k: tuple(v) for k, v in sorted(alarms_by.items())},
        }
        out["collapse"][rule_name] = collapse
    return out


def sweep(
    quick: bool,
    rng: random.Random,
    offset: int = 0,
    n_seeds: int | None = None,
    *,
    caps: tuple[int | None, ...] = (512, 4096),
    widths: tuple[int, ...] | None = None,
    strengths: tuple[float, ...] | None = None,
) -> list[Run]:
    """The runs: healthy seeds ``offset ..`` (5, 1 with ``quick``), collapsing seeds
    ``100 + offset ..`` (2, 1 with ``quick``); ``n_seeds`` overrides both counts. ``caps``:
    the ``rows_per_read`` of the monitors (None: the default, ``8 d``); ``widths`` and
    ``strengths`` (of the step collapses; the ramp comes with 0.95) narrow the sweep."""
    widths = widths or ((32, 64) if quick else (64, 128, 256))
    seeds = range(offset, offset + (n_seeds or (1 if quick else 5)))
    steps = 30 if quick else 100
    healthy_sched = [(e, r) for e in ((1, 5) if quick else (1, 5, 50)) for r in caps]
    runs = [
        Run("healthy", w, n, s, steps=steps, schedules=healthy_sched)
        for w in widths
        for n in ("layernorm", "rmsnorm")
        for s in seeds
    ]
    kinds = [("step", 0.95)] if quick else [("step", 0.5), ("step", 0.8), ("step", 0.95)]
    kinds += [] if quick else [("ramp", 0.95)]
    if strengths is not None:
        kinds = [(k, s) for k, s in kinds if s in strengths]
    for w in widths:
        for n in ("layernorm", "rmsnorm"):
            for s in range(offset, offset + (n_seeds or (1 if quick else 2))):
                for kind, strength in kinds:
                    switch = rng.randint(5, 10) if quick else rng.randint(10, 40)
                    length = 15 if kind == "step" else 45
                    runs.append(
                        Run(
                            kind,
                            w,
                            n,
                            100 + s,
                            strength=strength,
                            switch_at=switch,
                            steps=switch + length,
                            schedules=[(5, r) for r in caps],
                        )
                    )
    return runs


def detection_table(collapse: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    rows = []
    groups = sorted(
        {(c["kind"], c["strength"]) for cs in collapse.values() for c in cs},
        key=lambda g: (g[0] == "ramp", g[1]),
    )
    for kind, strength in groups:
        label = f"ramp to {strength}" if kind == "ramp" else f"strength {strength}"
        cells = [label]
        for rule_name in RULES:
            cs = [c for c in collapse[rule_name] if (c["kind"], c["strength"]) == (kind, strength)]
            within2 = sum(1 for c in cs if c["delay"] is not None and c["delay"] <= 2)
            caught = [c["delay"] for c in cs if c["delay"] is not None]
            mean = f"{sum(caught) / len(caught):.1f}" if caught else "-"
            at = [c["at_strength"] for c in cs if c["at_strength"] is not None]
            extra = f", at s = {sum(at) / len(at):.2f}" if kind == "ramp" and at else ""
            cells.append(f"{within2}/{len(cs)} (mean delay {mean}{extra})")
        rows.append(cells)
    return rows


def errors(quick: bool) -> list[list[str]]:
    """Interval coverage: ratios read from N rows against a reference from many more rows."""
    data = torch.frombuffer(bytearray(stdlib_text(2_000_000)), dtype=torch.uint8)
    out = []
    for width in (32, 64) if quick else (64, 128, 256):
        for norm, stage in [(n, s) for n in ("layernorm", "rmsnorm") for s in ("init", "trained")]:
            torch.manual_seed(0)
            model = GPT(GPTConfig(n_layer=2 if quick else 4, n_embd=width, n_head=4, norm=norm))
            run = Run("healthy", width, norm, 0)
            if stage == "trained":  # 100 steps (10 with --quick) of the sweep's training
                opt = make_optimizer(model, lr=1e-3, weight_decay=0.1)
                train = run_batches(data, run, seed=0)
                for _ in range(10 if quick else 100):
                    x, y = next(train)
                    model(x, y)[1].backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            model.eval()
            gen = run_batches(data, run, seed=7)
            ref_batches = [next(gen)[0] for _ in range(8 if quick else 48)]
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref = scan_model(model, ref_batches, layers="auto").as_dict()
                for per_dim in (4, 8, 16, 32):
                    rows = per_dim * width
                    if rows > 2048:
                        continue
                    covered = below_hi = total = 0
                    worst = 0.0
                    for b in range(4):
                        m = scan_model(model, [ref_batches[b]], max_rows_per_batch=rows).as_dict()
                        for k, v in m.items():
                            if not k.endswith(("/sigma_min_ratio", "/sigma_min_step")):
                                continue
                            if k.startswith("dd/") and math.isfinite(v) and v != 1.0:
                                truth = ref[k]
                                lo, hi = ratio_bounds(v, rows, per_dim)
                                total += 1
                                covered += lo <= truth <= hi
                                below_hi += truth <= hi
                                worst = min(worst, math.log(v / truth))
                    out.append(
                        [
                            f"{width}",
                            f"{norm}, {stage}",
                            f"{per_dim}",
                            f"{below_hi}/{total}",
                            f"{covered}/{total}",
                            f"{worst:+.3f}",
                        ]
                    )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--errors", action="store_true")
    p.add_argument("--out", default=None, help="JSONL of every read (default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the switch-on steps")
    p.add_argument("--seed-offset", type=int, default=0, help="held-out runs: other seeds")
    p.add_argument("--seeds", type=int, default=None, help="seeds per configuration")
    p.add_argument("--judge", nargs="+", default=None, help="judge the reads of --out JSONLs")
    p.add_argument("--only", choices=("healthy", "collapse"), default=None, help="one half")
    p.add_argument(
        "--rows",
        choices=("caps", "default"),
        default="caps",
        help="caps: rows_per_read 512 and 4096; default: the monitor's default (8 d per read)",
    )
    p.add_argument("--widths", type=int, nargs="+", default=None, help="narrow the sweep")
    p.add_argument("--strengths", type=float, nargs="+", default=None, help="narrow the sweep")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if args.errors:
        rows = errors(args.quick)
        print(
            "| width | model | N/d | reference <= hi (no false alarm) | reference in [lo, hi] "
            "| worst log(read/reference) |"
        )
        print("|---:|---|---:|---:|---:|---:|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return {"errors": rows}
    started = time.perf_counter()
    if args.judge:
        records = []
        for path in args.judge:
            with open(path) as fh:
                records += [json.loads(line) for line in fh]
        n_runs = len({r["run"] for r in records})
    else:
        runs = sweep(
            args.quick,
            random.Random(args.seed),
            args.seed_offset,
            args.seeds,
            caps=(None,) if args.rows == "default" else (512, 4096),
            widths=tuple(args.widths) if args.widths else None,
            strengths=tuple(args.strengths) if args.strengths else None,
        )
        if args.only:
            runs = [r for r in runs if (r.kind == "healthy") == (args.only == "healthy")]
        n_runs = len(runs)
        data = torch.frombuffer(bytearray(stdlib_text(2_000_000)), dtype=torch.uint8)
        records = []
        out = open(args.out, "w") if args.out else None  # noqa: SIM115 - written run by run
        for i, run in enumerate(runs, 1):
            t0 = time.perf_counter()
            got = simulate(run, data)
            records += got
            if out is not None:
                out.writelines(json.dumps(r) + "\n" for r in got)
                out.flush()
            print(f"[{i}/{n_runs}] {run.name}: {time.perf_counter() - t0:.0f} s", flush=True)
        if out is not None:
            out.close()
    verdict = judge(records)
    print(f"\n{n_runs} runs, {len(records)} reads, {time.perf_counter() - started:.0f} s")
    print("\n| rule | healthy reads | false alarms | per 1,000 reads |")
    print("|---|---:|---:|---:|")
    for name, h in verdict["healthy"].items():
        print(f"| {name} | {h['reads']} | {h['alerts']} | {h['per_1000']:.1f} |")
    print("\nfalse alarms by configuration (alerts/reads): ")
    for name, h in verdict["healthy"].items():
        bad = {k: v for k, v in h["by_config"].items() if v[0]}
        print(f"  {name}: {bad or 'none'}")
    for rule_name, run, every, rows, step, points in verdict["false_alarms"]:
        if rule_name != "v1":
            print(f"  {rule_name}: {run}, every {every}, rows {rows}, step {step}: {points}")
    print("\n| collapse | " + " | ".join(f"{n}: within 2 reads" for n in RULES) + " |")
    print("|---|" + "---:|" * len(RULES))
    for r in detection_table(verdict["collapse"]):
        print("| " + " | ".join(r) + " |")
    print("\nmisses of 'default' (delay > 2 or none), by width and row cap:")
    misses = defaultdict(int)
    for c in verdict["collapse"]["default"]:
        if c["strength"] >= 0.8 and (c["delay"] is None or c["delay"] > 2):
            misses[(c["kind"], c["strength"], c["width"], str(c["rows"]))] += 1
    print("  " + (", ".join(f"{k}: {v}" for k, v in sorted(misses.items())) or "none"))
    verdict["stream"] = stream_alarms(records)
    s = verdict["stream"]
    print(
        f"\nstream and attention rules (issue 32) on the healthy reads: {s['alerts']} alerts in "
        f"{s['reads']} reads, {s['judged']} of them with a finite dd/rms_growth_max, "
        f"{s['attn_judged']} with a finite dd/attn_logit_max (largest {s['attn_max']:.4g}) "
        f"({s['by_rule'] or 'none'})"
    )
    verdict["records"] = len(records)
    return verdict


def stream_alarms(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The monitor's stream rules on every healthy monitor's reads (every alert is false). Only
    the residual points are read here (no norm layer): ``stream_scale_growth`` and
    ``non_finite_rows`` decide, and ``attention_logit_growth`` on the attention read (which no
    memory budget removes); ``representation_collapse`` and ``norm_gain_drift`` need the final
    norm's and the gains' reads and stay silent."""
    series: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["kind"] == "healthy":
            series[(r["run"], r["every"], r["max_rows"], r["per_dim"])].append(r)
    reads = alerts = judged = attn_judged = 0
    attn_max = -math.inf
    by_rule: dict[str, int] = defaultdict(int)
    for rs in series.values():
        rules = default_dead_direction_rules({}, None, kernel=False)
        for r in sorted(rs, key=lambda r: r["step"]):
            reads += 1
            judged += math.isfinite(r["metrics"].get("dd/rms_growth_max", math.nan))
            logit = r["metrics"].get("dd/attn_logit_max", math.nan)
            if math.isfinite(logit):
                attn_judged += 1
                attn_max = max(attn_max, logit)
            for rule in rules:
                for a in rule.evaluate(r["metrics"], r["step"]):
                    alerts += 1
                    by_rule[a.rule] += 1
    return {
        "reads": reads,
        "alerts": alerts,
        "judged": judged,
        "attn_judged": attn_judged,
        "attn_max": attn_max,
        "by_rule": dict(by_rule),
    }


if __name__ == "__main__":
    main()
