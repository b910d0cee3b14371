"""The reads a monitor runs on a schedule, independent of the trainer."""

from normscope.monitors.dead_direction import DeadDirectionReport, DeadDirectionTracker, NormReport
from normscope.monitors.scan import scan_model

__all__ = ["DeadDirectionReport", "DeadDirectionTracker", "NormReport", "scan_model"]
