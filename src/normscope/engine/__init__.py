"""The engine: :class:`Monitor`, one trainer-agnostic owner of the read lifecycle (schedule,
windows, the worker, the cost guard, the agreement of ranks, publishing, fail-open, checkpoint
state), driving a family through :class:`Family`. Adapters (:mod:`normscope.adapters`) and plain
loops call it."""

from normscope.engine.monitor import Family, Monitor, StepResult, Target, world_size

__all__ = ["Family", "Monitor", "StepResult", "Target", "world_size"]
