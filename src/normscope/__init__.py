"""normscope: watch the geometry of a transformer's normalisation layers and residual stream."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
