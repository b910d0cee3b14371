"""The pathology zoo's saved reads replayed as ``spectral_every = k`` would have read them
(issue 42: "every rule catches what it caught before").

A monitor with ``DeadDirectionConfig(spectral_every=k)`` computes the spectral tier (the
decompositions) at its first read and every ``k``-th after it; the reads between are cheap: a
window folded to its diagonals, the cheap keys (the same values to float64 rounding), the
spectral keys absent (``normscope.families.dead_direction.report.cheap_key``). So a zoo run
saved at ``spectral_every = 1`` (every read full) is what the ``k`` run would have seen once its
reads ``1, 2, ...`` with ``(read - 1) % k != 0`` lose their spectral keys. The rules, replayed
over those reads, decide as the live rules would have (a rule without its keys does not decide;
episodes, patience and spans count the reads it sees).

    python benchmarks/tier_replay.py /tmp/zoo.jsonl                     # k = 1, 5, 10
    python benchmarks/tier_replay.py /tmp/zoo.jsonl --spectral-every 1 3 --rules today

Prints, per ``k``, the zoo table (``benchmarks/pathology_zoo.py``'s) and, per pathology run, the
first alert and whether it is still at or before the ground truth; then the runs whose verdict
changed from ``k = 1``. Runs in seconds: no training.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import pathology_zoo as zoo  # noqa: E402

from normscope.families.dead_direction.report import cheap_key  # noqa: E402


def thin(reads: list[dict[str, Any]], every: int) -> list[dict[str, Any]]:
    """``reads`` (one run's, in order) as a ``spectral_every = every`` monitor logs them: the
    spectral keys kept on the first read and every ``every``-th after it, dropped elsewhere.

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
        if i % every:
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


def replay(paths: Iterable[str], everys: list[int], rule_set: str = "today") -> dict[str, Any]:
    """Judge the saved runs at each ``spectral_every``; returns the tables and the verdicts."""
    runs, reads = zoo.load(list(paths))
    out: dict[str, Any] = {"tables": {}, "verdicts": {}}
    for k in everys:
        thinned = {name: thin(rs, k) for name, rs in reads.items()}
        rows, judged = zoo.zoo_table(runs, thinned, rule_set)
        out["tables"][k] = rows
        out["verdicts"][k] = verdicts(runs, judged)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="the zoo's saved JSONL(.gz) files")
    ap.add_argument("--spectral-every", type=int, nargs="+", default=[1, 5, 10])
    ap.add_argument("--rules", default="today", help=f"a rule set ({', '.join(zoo.RULE_SETS)})")
    args = ap.parse_args(argv)
    got = replay(args.paths, args.spectral_every, args.rules)
    base = got["verdicts"][args.spectral_every[0]]
    for k in args.spectral_every:
        print(f"\n### spectral_every = {k} (rules: {args.rules})\n")
        print(zoo._md(zoo.TABLE_HEAD, got["tables"][k]))
        if k == args.spectral_every[0]:
            continue
        changed = {n: (base[n], v) for n, v in got["verdicts"][k].items() if v != base[n]}
        print(f"\nverdicts changed from spectral_every = {args.spectral_every[0]}: {len(changed)}")
        for name, (was, now) in sorted(changed.items()):
            print(f"  {name}: {was} -> {now}")
    return got


if __name__ == "__main__":
    main()
