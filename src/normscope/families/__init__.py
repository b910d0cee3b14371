"""The families: what each kind of monitoring taps and reads, independent of any loop.

* :class:`DeadDirectionTracker` (and :class:`DeadDirectionFamily`, its schedule-side glue for the
  engine): norm layers' kernels, ``Delta_gamma``, the residual ``sigma_min`` profile;
* :class:`SignMagnitudeTracker` (:class:`SignMagnitudeFamily`, built from a
  :class:`SignMagnitudeConfig`): weight signs, outliers, probes;
* :func:`scan_model`: the dead-direction reads on any model, post hoc.

The engine (:mod:`normscope.engine`) drives a family through a small protocol
(:class:`normscope.engine.Family`); the adapters (:mod:`normscope.adapters`) drive the engine.
"""

from normscope.families.dead_direction import (
    DeadDirectionFamily,
    DeadDirectionReport,
    DeadDirectionTracker,
    NormReport,
)
from normscope.families.scan import scan_model
from normscope.families.sign_magnitude import (
    SignMagnitudeConfig,
    SignMagnitudeFamily,
    SignMagnitudeReport,
    SignMagnitudeTracker,
)

__all__ = [
    "DeadDirectionFamily",
    "DeadDirectionReport",
    "DeadDirectionTracker",
    "NormReport",
    "SignMagnitudeConfig",
    "SignMagnitudeFamily",
    "SignMagnitudeReport",
    "SignMagnitudeTracker",
    "scan_model",
]
