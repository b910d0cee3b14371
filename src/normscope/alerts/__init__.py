"""Alert rules, debounce and sinks.

A *rule* looks at one read (the flat metric dict a monitor logs, plus the step) and returns the
alerts it raises; it keeps its own debounce state (patience, warm-up) and can be checkpointed.
A *sink* delivers an alert: to Python logging, to W&B (``run.alert``), to a callable of yours.
Stopping training is not a sink but a monitor option (``stop_on_alert``), because the decision
must be reduced across processes so that every rank stops at the same step.

Modules, by kind of rule (each name below is importable from ``normscope.alerts``):

* :mod:`~normscope.alerts.base`: the :class:`Alert` record, the :class:`AlertRule` protocol,
  :class:`EpisodeRule` (fire once per episode), :class:`CallableRule` (a rule of yours);
* :mod:`~normscope.alerts.sigma_min`: :class:`SigmaMinRatioRule`, :func:`below_floor`;
* :mod:`~normscope.alerts.sources`: the per-source classification (:class:`Collapse`,
  :func:`classify_collapses`, :func:`collapse_keys`, :func:`source_reads`, :func:`describe`)
  and :class:`SourceCollapseRule`;
* :mod:`~normscope.alerts.stream`: :class:`NonFiniteRule`, :class:`RepresentationCollapseRule`,
  :class:`GainDriftRule`, :class:`ScaleGrowthRule`, :func:`spread_bounds`;
* :mod:`~normscope.alerts.attention`: :class:`AttentionLogitRule`;
* :mod:`~normscope.alerts.weights`: :class:`KernelLossRule`, :class:`OutlierRule`,
  :class:`SignChurnSpikeRule`;
* :mod:`~normscope.alerts.defaults`: :func:`default_dead_direction_rules`;
* :mod:`~normscope.alerts.remedies`: :data:`REMEDIES`, what to try for each default rule (each
  rule's ``remedy``, on every alert it raises);
* :mod:`~normscope.alerts.paging`: :class:`Pager` (one event, one page: which alerts reach the
  sinks, which are counted) and :func:`format_alerts` (the end-of-fit list);
* :mod:`~normscope.alerts.sinks`: :class:`LogSink`, :class:`WandbSink`, :class:`CallableSink`,
  :func:`build_sinks`, :func:`alert_text`.

The why of each rule and the measurements behind its defaults: docs/alerts.md.

Example::

    from normscope.alerts import SigmaMinRatioRule, CallableRule
    rules = [SigmaMinRatioRule(alert_below=1.0, tolerance=0.4, patience=2),
             CallableRule("loss_spike", lambda m, step: "kernel lost" if m.get("x", 0) > 1 else None)]
    DeadDirectionMonitor(rules=rules, alerts=("log", my_pager))
"""

from __future__ import annotations

from normscope.alerts.attention import AttentionLogitRule
from normscope.alerts.base import Alert, AlertRule, CallableRule, EpisodeRule
from normscope.alerts.defaults import default_dead_direction_rules
from normscope.alerts.paging import Pager, format_alerts
from normscope.alerts.remedies import REMEDIES
from normscope.alerts.sigma_min import SigmaMinRatioRule, below_floor
from normscope.alerts.sinks import CallableSink, LogSink, WandbSink, alert_text, build_sinks
from normscope.alerts.sources import (
    CLASS_CODE,
    Collapse,
    SourceCollapseRule,
    classify_collapses,
    collapse_keys,
    describe,
    source_reads,
)
from normscope.alerts.stream import (
    GainDriftRule,
    NonFiniteRule,
    RepresentationCollapseRule,
    ScaleGrowthRule,
    spread_bounds,
)
from normscope.alerts.weights import KernelLossRule, OutlierRule, SignChurnSpikeRule

__all__ = [
    "CLASS_CODE",
    "Alert",
    "AlertRule",
    "AttentionLogitRule",
    "CallableRule",
    "CallableSink",
    "Collapse",
    "EpisodeRule",
    "GainDriftRule",
    "KernelLossRule",
    "LogSink",
    "NonFiniteRule",
    "OutlierRule",
    "Pager",
    "REMEDIES",
    "RepresentationCollapseRule",
    "ScaleGrowthRule",
    "SigmaMinRatioRule",
    "SignChurnSpikeRule",
    "SourceCollapseRule",
    "WandbSink",
    "alert_text",
    "below_floor",
    "build_sinks",
    "classify_collapses",
    "collapse_keys",
    "default_dead_direction_rules",
    "describe",
    "format_alerts",
    "source_reads",
    "spread_bounds",
]
