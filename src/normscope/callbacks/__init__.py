"""The Lightning adapters."""

from normscope.callbacks.dead_direction import DeadDirectionMonitor

__all__ = ["DeadDirectionMonitor"]
