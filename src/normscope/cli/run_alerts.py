"""The alerts of a finished run, for ``normscope report``: the ones the run logged, else the
monitor's default rules re-evaluated over its logged reads.

A run can say that it alerted in two ways: W&B alert records (``run.alert``, sent by the
``"wandb"`` sink, with their text), and the ``dd/alert/<rule>`` keys the Hugging Face
``TrainerCallback`` logs beside a read that fired (the rule and the step, no text). CSV and
TensorBoard logs of a Lightning fit hold neither: the default rules
(:func:`~normscope.alerts.default_dead_direction_rules`) are evaluated again over the reads, in
step order, with each norm's declared kind inferred from ``norm_class`` and ``kind_mismatch``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from normscope.alerts import (
    SourceCollapseRule,
    classify_collapses,
    default_dead_direction_rules,
)
from normscope.cli.figures import KERNEL_ALERT_LABEL

__all__ = [
    "declared_kinds",
    "is_post_norm",
    "log_sources",
    "logged_key_alerts",
    "reevaluate_alerts",
    "run_alerts",
    "source_classes",
]

Reads = Mapping[float, Mapping[str, float]]
_ALERT_KEY = "dd/alert/"


def declared_kinds(norms: Sequence[str], reads: Reads) -> dict[str, str]:
    """Each norm's declared kind from ``norm_class`` (+1 / -1) and ``kind_mismatch``.

    Example::

        >>> declared_kinds(["a", "b"], {1.0: {"dd/a/norm_class": 1.0, "dd/b/norm_class": 1.0,
        ...                                   "dd/b/kind_mismatch": 1.0}})
        {'a': 'layernorm', 'b': 'rmsnorm'}
    """
    kinds = {}
    for name in norms:
        for values in reads.values():
            cls = values.get(f"dd/{name}/norm_class")
            mismatch = values.get(f"dd/{name}/kind_mismatch", 0.0)
            if cls in (1.0, -1.0):
                looks_ln = (cls == 1.0) != (mismatch == 1.0)
                kinds[name] = "layernorm" if looks_ln else "rmsnorm"
                break
    return kinds


def log_sources(reads: Reads) -> list[str]:
    """The sources of a log with per-source reads (``dd.<source>/sigma_min_ratio_min``)."""
    found = {
        k[len("dd.") : -len("/sigma_min_ratio_min")]
        for values in reads.values()
        for k in values
        if k.startswith("dd.") and k.endswith("/sigma_min_ratio_min") and k.count("/") == 1
    }
    return sorted(found)


def is_post_norm(points: Sequence[str]) -> bool:
    """A post-norm log: every point after ``p_0`` is a block's ``.output`` (the monitor reads
    post-norm stacks at block outputs)."""
    return len(points) > 1 and all(p.endswith(".output") for p in points[1:])


def reevaluate_alerts(
    reads: Reads, norms: Sequence[str], points: Sequence[str], objective: str = "tokens"
) -> list[dict[str, Any]]:
    """The monitor's default rules over the logged reads, in step order (``objective``: the
    collapse rule's, as ``DeadDirectionMonitor(objective=...)``).

    Post-norm logs (every point after ``p_0`` named ``<block>.output``) get no sigma_min rule,
    as in the monitor. Returns ``{"step", "title", "text", "level", "origin"}`` dicts."""
    post_norm = is_post_norm(points)
    rules = default_dead_direction_rules(
        declared_kinds(norms, reads),
        None if post_norm else {p: None for p in points},  # depth order for the upstream rule
        sources=bool(log_sources(reads)),
        objective=objective,
    )
    out = []
    for step, values in reads.items():
        for rule in rules:
            for a in rule.evaluate(values, int(step)):
                metric = a.key.rsplit("/", 1)[-1]
                out.append(
                    {
                        "step": float(step),
                        "title": f"normscope: {a.rule}",
                        "text": a.message
                        if a.rule == SourceCollapseRule.name
                        else f"{a.rule} at {a.point} at step {int(step)}: {metric} "
                        f"{a.value:.3g} (threshold {a.threshold:.3g})",
                        "level": "WARN",
                        "origin": "re-evaluated",
                    }
                )
    return out


def logged_key_alerts(
    reads: Reads, norms: Sequence[str], points: Sequence[str], objective: str = "tokens"
) -> list[dict[str, Any]]:
    """The alerts a run logged as ``dd/alert/<rule>`` keys (the Hugging Face adapter's), one per
    rule and read; the text is the re-evaluated rule's at that read when it names the same rule
    (its point and value), else the key itself."""
    again: dict[tuple[float, str], str] = {}
    for a in reevaluate_alerts(reads, norms, points, objective):
        again.setdefault((a["step"], a["title"]), a["text"])
    out = []
    for step, values in reads.items():
        for key, value in values.items():
            if key.startswith(_ALERT_KEY) and value:
                rule = key[len(_ALERT_KEY) :]
                title = f"normscope: {rule}"
                text = again.get((step, title), f"{rule} at step {step:g} (logged as {key})")
                out.append(
                    {"step": float(step), "title": title, "text": text, "level": "WARN",
                     "origin": "logged"}
                )  # fmt: skip
    return out


def _alert_is_of(alert: Mapping[str, Any], name: str | None) -> bool:
    """A logged alert record of the monitor ``name`` (titles ``normscope[name]: ...``; the
    unnamed monitor's ``normscope: ...``)."""
    title = str(alert.get("title", ""))
    return title.startswith(f"normscope[{name}]:" if name else "normscope:")


def run_alerts(
    source: str,
    records: Sequence[Mapping[str, Any]],
    reads: Reads,
    norms: Sequence[str],
    points: Sequence[str],
    name: str | None = None,
    objective: str = "tokens",
) -> tuple[list[dict[str, Any]], str]:
    """The run's alerts and a note that says where they come from: the W&B alert records of
    the monitor ``name``, else its logged ``dd/alert/<rule>`` keys, else the default rules
    re-evaluated over the reads."""
    mine = [{**a, "origin": "logged"} for a in records if _alert_is_of(a, name)]
    if mine:
        return mine, f"alerts: the {len(mine)} alert record(s) the run logged (run.alert)"
    if any(k.startswith(_ALERT_KEY) for values in reads.values() for k in values):
        keyed = logged_key_alerts(reads, norms, points, objective)
        return keyed, (
            f"alerts: the {len(keyed)} alert(s) the run logged as dd/alert/<rule> keys (the "
            "Hugging Face callback's); the text is the default rules' at that read"
        )
    what = (
        "W&B run holds no alert record"
        if source == "wandb"
        else f"{source} log holds no alert records"
    )
    alerts = reevaluate_alerts(reads, norms, points, objective)
    return alerts, (
        f"alerts: the {what}; the monitor's default rules (SigmaMinRatioRule(), "
        f"KernelLossRule({KERNEL_ALERT_LABEL})) were re-evaluated over the logged reads"
    )


def source_classes(values: Mapping[str, float]) -> tuple[str, str]:
    """The shallowest collapse's class and point in one read's per-source keys, as the monitor
    classifies them, or ``("none", "-")``."""
    collapses = classify_collapses(values)
    return (collapses[0].kind, collapses[0].point) if collapses else ("none", "-")
