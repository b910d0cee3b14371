"""The engine: :class:`Monitor`, one trainer-agnostic owner of the read lifecycle, driving a
family through :class:`Family`. Adapters (:mod:`normscope.adapters`) and plain loops call it.

Modules: ``monitor`` (the lifecycle: schedule, windows, the read, fail-open, checkpoint state),
``publish`` (targets, ``log_per_layer``, W&B summaries and charts, rules and sinks), ``ranks``
(the agreement of ranks), ``cost`` (the cost guard), ``keys`` (key naming of named monitors),
``family`` (the protocol), ``worker`` (the read thread)."""

from normscope._distributed import world_size
from normscope.engine.family import Family, StepResult
from normscope.engine.monitor import Monitor
from normscope.engine.publish import Target

__all__ = ["Family", "Monitor", "StepResult", "Target", "world_size"]
