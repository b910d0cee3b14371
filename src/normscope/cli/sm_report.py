"""``normscope report`` on a run that logged the sign–magnitude family only (``sm/...``, e.g. a
Hugging Face ``Trainer`` watched with ``watch(trainer, SignMagnitudeConfig())``): its run-level
reads per step, the alerts it logged, and what :func:`~normscope.cli.report.run` writes
(``report.md``, ``report.html``, ``report.json``; no figure)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from normscope._common import fmt
from normscope.engine.keys import canonical_metrics
from normscope.runs import RunLog

__all__ = ["SM_COLUMNS", "sm_reads", "summarise"]

#: the run-level keys of a sign–magnitude read (``sm/<column>``), as the table's columns
SM_COLUMNS = (
    "sign_alignment_mean",
    "ternary_alignment_mean",
    "sign_churn_mean",
    "max_leverage_max",
    "asymmetry_ratio_mean",
    "quant_transverse_rel_mean",
    "reads_disabled",
)
_ALERT_KEY = "sm/alert/"
_RULES = ("outlier_feature", "sign_churn_spike")  # the family's rules, as alert titles name them
_cell = functools.partial(fmt, finite=True)


def sm_reads(
    history: Sequence[Mapping[str, float]], name: str | None = None
) -> dict[float, dict[str, float]]:
    """The rows holding ``sm/`` keys (of the monitor ``name``), merged by step.

    Example::

        >>> sm_reads([{"step": 2.0, "sm/sign_churn_mean": 0.1, "dd/x": 1.0}])
        {2.0: {'sm/sign_churn_mean': 0.1}}
    """
    reads: dict[float, dict[str, float]] = {}
    for row in history:
        ours = {k: v for k, v in canonical_metrics(row, name).items() if k.startswith("sm/")}
        if ours:
            reads.setdefault(float(row["step"]), {}).update(ours)
    return dict(sorted(reads.items()))


def summarise(log: RunLog, name: str | None = None) -> dict[str, Any] | None:
    """What the report says about ``log``'s sign–magnitude reads (``None``: it has none):
    ``result`` (report.json), ``facts``, ``alert_lines`` and ``tables`` for the report files."""
    reads = sm_reads(log.history, name)
    if not reads:
        return None
    alerts, said = _alerts(log, reads)
    head = ["step", *SM_COLUMNS]
    rows = [[f"{s:g}", *(_cell(v.get(f"sm/{c}")) for c in SM_COLUMNS)] for s, v in reads.items()]
    layers = sorted({k.split("/")[1] for v in reads.values() for k in v if k.count("/") >= 2})
    notes = [said]
    if log.key_prefix:
        notes.append(
            f"a Hugging Face Trainer run: normscope's keys were logged under {log.key_prefix!r} "
            f"({log.key_prefix}sm/...) and are read without it; steps are the Trainer's "
            "global step"
        )
    facts = [
        f"run: {log.source} log at {log.path}",
        f"{len(reads)} sign-magnitude reads, steps {min(reads):g} to {max(reads):g}; "
        f"{len(layers)} Linear layers",
        *notes,
    ]
    result = {
        "command": "report",
        "family": "sm",
        "run": {"source": log.source, "path": str(log.path)},
        "monitor": name,
        "reads": [dict(zip(head, r)) for r in rows],
        "layers": layers,
        "alerts": alerts,
        "notes": notes,
        "files": ["report.md", "report.html", "report.json"],
    }
    alert_lines = [f"ALERT at step {a['step']:g}: {a['text']}" for a in alerts]
    return {
        "result": result,
        "facts": facts,
        "alert_lines": alert_lines,
        "tables": [("Reads", head, rows)],
    }


def _alerts(log: RunLog, reads: Mapping[float, Mapping[str, float]]):
    """The alerts the run logged: W&B alert records of the sign–magnitude rules, else the
    Hugging Face callback's ``sm/alert/<rule>`` keys; the rules are not re-evaluated."""
    records = [
        {**a, "origin": "logged"}
        for a in log.alerts
        if str(a.get("title", "")).startswith("normscope")
        and any(f": {rule}" in str(a.get("title", "")) for rule in _RULES)
    ]
    if records:
        return records, f"alerts: the {len(records)} alert record(s) the run logged (run.alert)"
    keyed = [
        {"step": step, "rule": key[len(_ALERT_KEY) :], "origin": "logged",
         "text": f"{key[len(_ALERT_KEY):]} fired (logged as {key})"}
        for step, values in reads.items()
        for key, value in values.items()
        if key.startswith(_ALERT_KEY) and value
    ]  # fmt: skip
    if keyed:
        return keyed, f"alerts: the {len(keyed)} alert(s) the run logged as sm/alert/<rule> keys"
    return [], "alerts: none logged (the sign-magnitude rules are not re-evaluated from a log)"
