"""Pure math on tensors: accumulators and reads (METRICS.md). No hooks, no Lightning, no logging."""

from normscope.functional.covariance import StreamingCovariance, symmetric_eigh

__all__ = ["StreamingCovariance", "symmetric_eigh"]
