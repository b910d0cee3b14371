"""Alert rules, debounce and sinks.

A *rule* looks at one read (the flat metric dict a monitor logs, plus the step) and returns the
alerts it raises; it keeps its own debounce state (patience, warm-up) and can be checkpointed.
A *sink* delivers an alert: to Python logging, to W&B (``run.alert``), to a callable of yours.
Stopping training is not a sink but a monitor option (``stop_on_alert``), because the decision
must be reduced across processes so that every rank stops at the same step.

Example::

    from normscope.alerts import SigmaMinRatioRule, CallableRule
    rules = [SigmaMinRatioRule(alert_below=1.0, tolerance=0.4, patience=2),
             CallableRule("loss_spike", lambda m, step: "kernel lost" if m.get("x", 0) > 1 else None)]
    DeadDirectionMonitor(rules=rules, alerts=("log", my_pager))
"""

from __future__ import annotations

from normscope.alerts.rules import (
    Alert,
    AlertRule,
    AttentionLogitRule,
    CallableRule,
    GainDriftRule,
    KernelLossRule,
    NonFiniteRule,
    OutlierRule,
    RepresentationCollapseRule,
    ScaleGrowthRule,
    SigmaMinRatioRule,
    SignChurnSpikeRule,
    SourceCollapseRule,
    default_dead_direction_rules,
)
from normscope.alerts.sinks import CallableSink, LogSink, WandbSink, build_sinks

__all__ = [
    "Alert",
    "AlertRule",
    "AttentionLogitRule",
    "CallableRule",
    "CallableSink",
    "GainDriftRule",
    "KernelLossRule",
    "LogSink",
    "NonFiniteRule",
    "OutlierRule",
    "RepresentationCollapseRule",
    "ScaleGrowthRule",
    "SignChurnSpikeRule",
    "SigmaMinRatioRule",
    "SourceCollapseRule",
    "WandbSink",
    "build_sinks",
    "default_dead_direction_rules",
]
