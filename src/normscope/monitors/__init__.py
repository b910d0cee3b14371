"""The trackers: `DeadDirectionTracker`, `SignMagnitudeTracker` and `scan_model`, the reads run on a
schedule, independent of any trainer (the Lightning callbacks in `normscope.callbacks` drive them)."""

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
