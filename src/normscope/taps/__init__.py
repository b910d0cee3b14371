"""Finding layers: norm adapters (``norms``) and residual-stream points (``residual``)."""

from normscope.taps.norms import (
    NormDiscovery,
    NormDiscoveryError,
    NormLayer,
    UnrecognisedNorm,
    discover_norm_layers,
    find_norm_layers,
    full_tensor_float64,
    register_norm_adapter,
    unregister_norm_adapter,
)
from normscope.taps.residual import (
    ResidualDiscovery,
    ResidualDiscoveryError,
    ResidualLayout,
    ResidualPoint,
    find_residual_points,
    tap_input,
    tap_output,
)

__all__ = [
    "NormDiscovery",
    "NormDiscoveryError",
    "NormLayer",
    "ResidualDiscovery",
    "ResidualDiscoveryError",
    "ResidualLayout",
    "ResidualPoint",
    "UnrecognisedNorm",
    "discover_norm_layers",
    "find_norm_layers",
    "find_residual_points",
    "full_tensor_float64",
    "register_norm_adapter",
    "tap_input",
    "tap_output",
    "unregister_norm_adapter",
]
