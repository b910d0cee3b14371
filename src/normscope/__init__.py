"""normscope: watch the geometry of a transformer's normalisation layers and residual stream.

    from normscope import DeadDirectionMonitor, Monitor, scan_model

The public names are imported lazily, so that ``import normscope.functional`` does not pull in
Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "DeadDirectionMonitor": "normscope.adapters.lightning",
    "SignMagnitudeMonitor": "normscope.adapters.lightning",
    "Monitor": "normscope.engine",
    "DeadDirectionTracker": "normscope.families",
    "DeadDirectionReport": "normscope.families",
    "SignMagnitudeTracker": "normscope.families",
    "SignMagnitudeConfig": "normscope.families",
    "scan_model": "normscope.families",
    "NormscopeError": "normscope._common",
    "ConfigurationError": "normscope._common",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'normscope' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
