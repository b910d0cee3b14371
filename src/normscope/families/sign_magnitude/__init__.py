"""The sign–magnitude family (docs/metrics.md §2), one module per concern:

* :mod:`.config` -- :class:`SignMagnitudeConfig`, every option checked once; ``build()``;
* :mod:`.family` -- :class:`SignMagnitudeFamily`, what the engine drives;
* :mod:`.tracker` -- :class:`SignMagnitudeTracker`, the hooks and reads for any loop;
* :mod:`.probes` -- the probe reads; :mod:`.layers` -- which Linears are watched and probed;
* :mod:`.report` -- :class:`SignMagnitudeReport`, a read as its logged keys.
"""

from normscope.families.sign_magnitude.config import SignMagnitudeConfig
from normscope.families.sign_magnitude.family import SignMagnitudeFamily
from normscope.families.sign_magnitude.layers import default_probe_layers, find_block_linears
from normscope.families.sign_magnitude.report import SignMagnitudeReport
from normscope.families.sign_magnitude.tracker import SignMagnitudeTracker

__all__ = [
    "SignMagnitudeConfig",
    "SignMagnitudeFamily",
    "SignMagnitudeReport",
    "SignMagnitudeTracker",
    "default_probe_layers",
    "find_block_linears",
]
