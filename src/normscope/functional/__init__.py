"""Pure math on tensors: accumulators and reads (METRICS.md). No hooks, no Lightning, no logging."""

from normscope.functional.covariance import StreamingCovariance, symmetric_eigh
from normscope.functional.dead_direction import (
    GammaRead,
    KernelRead,
    SchurRead,
    deepening,
    gamma_read,
    kernel_read,
    predicted_kernel,
    schur_quotient,
)
from normscope.functional.profile import (
    ProfilePoint,
    SigmaMinProfile,
    cancellation_fraction,
    sigma_min,
    sigma_min_profile,
)

__all__ = ["StreamingCovariance", "symmetric_eigh"]
__all__ += ["GammaRead", "KernelRead", "SchurRead", "deepening", "gamma_read", "kernel_read"]
__all__ += ["predicted_kernel", "schur_quotient"]
__all__ += ["ProfilePoint", "SigmaMinProfile", "cancellation_fraction", "sigma_min"]
__all__ += ["sigma_min_profile"]
