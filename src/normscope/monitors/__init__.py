"""The reads a monitor runs on a schedule, independent of the trainer."""

from normscope.monitors.dead_direction import DeadDirectionReport, DeadDirectionTracker, NormReport
from normscope.monitors.scan import scan_model
from normscope.monitors.sign_magnitude import SignMagnitudeReport, SignMagnitudeTracker

__all__ = [
    "DeadDirectionReport",
    "DeadDirectionTracker",
    "NormReport",
    "SignMagnitudeReport",
    "SignMagnitudeTracker",
    "scan_model",
]
