"""The dead-direction family: norm layers' kernels, ``Delta_gamma``, the residual ``sigma_min``
profile, the stream and attention reads (docs/metrics.md §1).

One module per concern:

* :mod:`~normscope.families.dead_direction.config`: :class:`DeadDirectionConfig`, every
  option checked once (``config.build()`` gives the family);
* :mod:`~normscope.families.dead_direction.family`: :class:`DeadDirectionFamily`, what the
  engine drives;
* :mod:`~normscope.families.dead_direction.tracker`: :class:`DeadDirectionTracker`, the hooks,
  accumulators and memory;
* :mod:`~normscope.families.dead_direction.window`, :mod:`~normscope.families.dead_direction.read`,
  :mod:`~normscope.families.dead_direction.solve`,
  :mod:`~normscope.families.dead_direction.stream`: the one read path, which returns what it
  computed and leaves the tracker's memory to the tracker;
* :mod:`~normscope.families.dead_direction.report`: :class:`NormReport`,
  :class:`DeadDirectionReport`;
* :mod:`~normscope.families.dead_direction.render`: the read line, table and summary.
"""

from normscope.families.dead_direction.config import DeadDirectionConfig
from normscope.families.dead_direction.family import DeadDirectionFamily
from normscope.families.dead_direction.report import DeadDirectionReport, NormReport
from normscope.families.dead_direction.tracker import DeadDirectionTracker

__all__ = [
    "DeadDirectionConfig",
    "DeadDirectionFamily",
    "DeadDirectionReport",
    "DeadDirectionTracker",
    "NormReport",
]
