"""The Lightning adapters."""

from normscope.callbacks.dead_direction import DeadDirectionMonitor
from normscope.callbacks.sign_magnitude import SignMagnitudeMonitor

__all__ = ["DeadDirectionMonitor", "SignMagnitudeMonitor"]
