"""The pathology zoo's saved reads replayed as ``spectral_every = k`` would have read them
(issue 42: "every rule catches what it caught before").

A monitor with ``DeadDirectionConfig(spectral_every=k)`` computes the spectral tier (the
decompositions) at its first read and every ``k``-th after it; the reads between are cheap: the
same fold, the same cheap keys, the spectral keys absent (``normscope.families.dead_direction.
report.cheap_key``). So a zoo run saved at ``spectral_every = 1`` (every read full) is what the
``k`` run would have seen once its reads ``1, 2, ...`` with ``(read - 1) % k != 0`` lose their
spectral keys -- unless the read escalates, as the live monitor's does: a cheap read whose
``dd/final_out_offset_share`` is at or over the collapse rule's least firing share (``jump_to``,
0.95) computes the spectral tier too. The rules, replayed over those reads, decide as the live
rules would have (a rule without its keys does not decide; episodes, patience and spans count
the reads it sees). ``--no-escalate``: the schedule alone.

    python benchmarks/tier_replay.py /tmp/zoo.jsonl                     # k = 1, 5, 10
    python benchmarks/tier_replay.py /tmp/zoo.jsonl --spectral-every 1 3 --rules today
    python benchmarks/tier_replay.py /tmp/zoo.jsonl --no-escalate       # the schedule alone

Prints, per ``k``, the zoo table (``benchmarks/pathology_zoo.py``'s) and, per pathology run, the
first alert and whether it is still at or before the ground truth; then the runs whose verdict
changed from ``k = 1``. Runs in seconds: no training.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import pathology_zoo as zoo  # noqa: E402

from normscope.alerts import RepresentationCollapseRule  # noqa: E402
from normscope.families.dead_direction.report import cheap_key  # noqa: E402

_RULE = RepresentationCollapseRule()
#: the live monitor's escalation line with the default rules (``DeadDirectionFamily.
#: escalation_line``): the least share at which the collapse rule can fire
ESCALATE_ABOVE = min(_RULE.alert_above, _RULE.jump_to or 1.0)


def thin(
    reads: list[dict[str, Any]], every: int, escalate_above: float | None = ESCALATE_ABOVE
) -> list[dict[str, Any]]:
    """``reads`` (one run's, in order) as a ``spectral_every = every`` monitor logs them: the
    spectral keys kept on the first read and every ``every``-th after it and on a read whose
    final-norm output offset share is at or over ``escalate_above`` (None: never), dropped
    elsewhere.

    Example::

        >>> reads = [{"read": i, "metrics": {"dd/rows_rejected": 0.0,
        ...           "dd/sigma_min_ratio_min": 1.2}} for i in (1, 2, 3)]
        >>> [sorted(r["metrics"]) for r in thin(reads, 2)]  # doctest: +NORMALIZE_WHITESPACE
        [['dd/rows_rejected', 'dd/sigma_min_ratio_min'], ['dd/rows_rejected'],
         ['dd/rows_rejected', 'dd/sigma_min_ratio_min']]
    """
    if every < 1:
        raise ValueError(f"thin: every must be >= 1, got {every}")
    out = []
    for i, r in enumerate(sorted(reads, key=lambda r: r["read"])):
        r = copy.copy(r)
        share = r["metrics"].get("dd/final_out_offset_share", math.nan)
        escalates = escalate_above is not None and share >= escalate_above
        if i % every and not escalates:
            r["metrics"] = {k: v for k, v in r["metrics"].items() if cheap_key(k)}
        out.append(r)
    return out


def verdicts(runs: dict[str, dict], judged: dict[str, dict]) -> dict[str, str]:
    """Per pathology run: ``caught`` (an alert at or before the ground truth's read), ``late``,
    ``missed``; per twin or control arm: ``quiet`` or ``N false``."""
    out = {}
    for name, meta in runs.items():
        j = judged[name]
        p = zoo.PATHOLOGIES.get(meta["pathology"])
        if meta["arm"] == "twin" or p is None or p.gt is None:
            out[name] = f"{len(j['alerts'])} false" if j["alerts"] else "quiet"
            continue
        gt, first = j["gt_cross"], j["first_alert"]
        if first is None:
            out[name] = "missed"
        elif gt and gt["read"] and first["read"] <= gt["read"]:
            out[name] = f"caught (read {first['read']}, GT read {gt['read']})"
        else:
            out[name] = f"late (read {first['read']}, GT read {gt and gt['read']})"
    return out


def _escalated(reads: list[dict[str, Any]], every: int, line: float | None) -> int:
    """Reads off the schedule that escalate (the spectral tier computed for the share)."""
    ordered = sorted(reads, key=lambda r: r["read"])
    return sum(
        1
        for i, r in enumerate(ordered)
        if i % every
        and line is not None
        and r["metrics"].get("dd/final_out_offset_share", math.nan) >= line
    )


def replay(
    paths: Iterable[str],
    everys: list[int],
    rule_set: str = "today",
    escalate_above: float | None = ESCALATE_ABOVE,
) -> dict[str, Any]:
    """Judge the saved runs at each ``spectral_every``; returns the tables and the verdicts."""
    runs, reads = zoo.load(list(paths))
    out: dict[str, Any] = {"tables": {}, "verdicts": {}}
    for k in everys:
        thinned = {name: thin(rs, k, escalate_above) for name, rs in reads.items()}
        rows, judged = zoo.zoo_table(runs, thinned, rule_set)
        out["tables"][k] = rows
        out["verdicts"][k] = verdicts(runs, judged)
        healthy = [n for n, m in runs.items() if m["arm"] == "twin"]
        out.setdefault("escalated", {})[k] = {
            arm: (
                sum(_escalated(reads[n], k, escalate_above) for n in names),
                sum(len(reads[n]) for n in names),
            )
            for arm, names in (("healthy twins", healthy), ("all", list(runs)))
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="the zoo's saved JSONL(.gz) files")
    ap.add_argument("--spectral-every", type=int, nargs="+", default=[1, 5, 10])
    ap.add_argument("--rules", default="today", help=f"a rule set ({', '.join(zoo.RULE_SETS)})")
    ap.add_argument("--no-escalate", action="store_true", help="the schedule alone")
    args = ap.parse_args(argv)
    line = None if args.no_escalate else ESCALATE_ABOVE
    got = replay(args.paths, args.spectral_every, args.rules, line)
    base = got["verdicts"][args.spectral_every[0]]
    for k in args.spectral_every:
        print(f"\n### spectral_every = {k} (rules: {args.rules}; escalation at {line})\n")
        print(zoo._md(zoo.TABLE_HEAD, got["tables"][k]))
        esc = got["escalated"][k]
        print(
            "\nreads escalated off the schedule: "
            + "; ".join(f"{arm} {n} of {total}" for arm, (n, total) in esc.items())
        )
        if k == args.spectral_every[0]:
            continue
        changed = {n: (base[n], v) for n, v in got["verdicts"][k].items() if v != base[n]}
        print(f"\nverdicts changed from spectral_every = {args.spectral_every[0]}: {len(changed)}")
        for name, (was, now) in sorted(changed.items()):
            print(f"  {name}: {was} -> {now}")
    return got


if __name__ == "__main__":
    main()
