"""Pure math on tensors: accumulators and reads (docs/metrics.md). No hooks, no Lightning, no logging."""

from normscope.functional.attention import logit_max, mha_logit_max, sdpa_logit_max
from normscope.functional.covariance import StreamingCovariance, fetch_counts
from normscope.functional.dead_direction import (
    GammaRead,
    KernelRead,
    SchurRead,
    deepening,
    gamma_read,
    kernel_read,
    predicted_kernel,
    rmsnorm_alignment_max,
    rows_comparable,
    schur_quotient,
)
from normscope.functional.depth import DepthRead, InputRead, direction_depth, input_reads
from normscope.functional.eigh import symmetric_eigh, symmetric_eigvalsh
from normscope.functional.gamma import gamma_reads
from normscope.functional.kernel import centring_residual
from normscope.functional.moments import DiagonalMoment
from normscope.functional.premise import PLACEMENTS, POST_NORM
from normscope.functional.profile import (
    ProfilePoint,
    SigmaMinProfile,
    sigma_min,
    sigma_min_profile,
)
from normscope.functional.retention import RetentionRead, sublayer_retention
from normscope.functional.stream import (
    effective_rank,
    gain_drift,
    gain_drifts,
    nonfinite_share,
    offset_share,
    stream_rms,
    stream_scales,
)

__all__ = ["DiagonalMoment", "StreamingCovariance", "symmetric_eigh", "symmetric_eigvalsh"]
__all__ += ["logit_max", "mha_logit_max", "sdpa_logit_max"]
__all__ += ["GammaRead", "KernelRead", "SchurRead", "deepening", "gamma_read", "kernel_read"]
__all__ += ["predicted_kernel", "rmsnorm_alignment_max", "rows_comparable", "schur_quotient"]
__all__ += ["RetentionRead", "sublayer_retention"]
__all__ += ["ProfilePoint", "SigmaMinProfile", "sigma_min"]
__all__ += ["sigma_min_profile"]
__all__ += ["InputRead", "input_reads"]
__all__ += ["DepthRead", "direction_depth", "PLACEMENTS", "POST_NORM", "centring_residual"]
__all__ += ["effective_rank", "gain_drift", "nonfinite_share", "offset_share", "stream_rms"]
__all__ += ["fetch_counts", "gain_drifts", "gamma_reads", "stream_scales"]

from normscope.functional.sign_magnitude import (  # noqa: E402
    OutlierRead,
    ProbeRead,
    WeightRead,
    asymmetry_ratio,
    asymmetry_theory,
    binary_quantization_error,
    binary_quantize,
    flip_perturbation,
    matched_magnitude_perturbation,
    outlier_amplitudes,
    probe_read,
    quant_transverse_rel,
    radial_fraction,
    sign_alignment,
    sign_churn,
    ternary_alignment,
    ternary_quantization_error,
    ternary_quantize,
    ternary_sparsity,
    transverse_energy,
    weight_read,
)

__all__ += ["OutlierRead", "ProbeRead", "WeightRead", "asymmetry_ratio", "asymmetry_theory"]
__all__ += ["binary_quantization_error", "binary_quantize", "flip_perturbation"]
__all__ += ["matched_magnitude_perturbation", "outlier_amplitudes", "probe_read"]
__all__ += ["quant_transverse_rel", "radial_fraction", "sign_alignment", "sign_churn"]
__all__ += ["ternary_alignment", "ternary_quantization_error", "ternary_quantize"]
__all__ += ["ternary_sparsity", "transverse_energy", "weight_read"]
