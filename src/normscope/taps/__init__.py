"""Finding layers and hooking them: norm adapters (``norms``), residual-stream points
(``residual``), the block stack (``stacks``), and the gated hooks of both families (``hooks``)."""

from normscope.taps.hooks import Gate, Tap, TapSet
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
from normscope.taps.stacks import same_class_stacks

__all__ = [
    "Gate",
    "NormDiscovery",
    "NormDiscoveryError",
    "NormLayer",
    "ResidualDiscovery",
    "ResidualDiscoveryError",
    "ResidualLayout",
    "ResidualPoint",
    "Tap",
    "TapSet",
    "UnrecognisedNorm",
    "discover_norm_layers",
    "find_norm_layers",
    "find_residual_points",
    "same_class_stacks",
    "full_tensor_float64",
    "register_norm_adapter",
    "tap_input",
    "tap_output",
    "unregister_norm_adapter",
]
