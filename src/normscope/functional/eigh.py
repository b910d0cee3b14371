"""Float64 symmetric eigensolves with a CPU fallback: the dense decompositions of the reads.

A co-moment is symmetric only up to rounding and a device solver can fail on ill-conditioned
input (docs/PITFALLS "Numerics"): both functions symmetrise first and retry on the CPU.
"""

from __future__ import annotations

import torch

__all__ = ["symmetric_eigh", "symmetric_eigvalsh"]


def _symmetrised(matrix: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.device]:
    """``(A + A^T) / 2`` in float64 and the matrix's device; a clear error if not square."""
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"{where}: expected a square matrix, got shape {tuple(matrix.shape)}")
    a = matrix if matrix.dtype == torch.float64 else matrix.to(torch.float64)
    return (a + a.T) * 0.5, matrix.device


def symmetric_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 eigen-decomposition of a symmetric matrix, eigenvalues ascending.

    Symmetrises ``(A + A^T) / 2`` first (a co-moment is symmetric only up to rounding). Runs
    ``torch.linalg.eigh`` on the matrix's own device; if the device solver fails (it can on
    ill-conditioned input, and some backends have no float64 solver) it retries on the CPU and
    returns the result on the original device.

    Returns:
        ``(eigenvalues (d,), eigenvectors (d, d))``, columns the eigenvectors.
    """
    a, device = _symmetrised(matrix, "symmetric_eigh")
    try:
        evals, evecs = torch.linalg.eigh(a)
    except (RuntimeError, NotImplementedError, TypeError):
        if device.type == "cpu":
            raise
        evals, evecs = torch.linalg.eigh(a.cpu())
        evals, evecs = evals.to(device), evecs.to(device)
    return evals, evecs


def symmetric_eigvalsh(matrix: torch.Tensor) -> torch.Tensor:
    """Float64 eigenvalues (ascending) of a symmetric matrix, without eigenvectors.

    What :func:`symmetric_eigh` does, values only: about 0.25-0.45x of its time at d >= 512
    (``benchmarks/read_cost.py``). Same symmetrisation and CPU fallback.

    Example::

        >>> import torch
        >>> symmetric_eigvalsh(torch.tensor([[2.0, 1.0], [1.0, 2.0]])).tolist()
        [1.0, 3.0]
    """
    a, device = _symmetrised(matrix, "symmetric_eigvalsh")
    try:
        return torch.linalg.eigvalsh(a)
    except (RuntimeError, NotImplementedError, TypeError):
        if device.type == "cpu":
            raise
        return torch.linalg.eigvalsh(a.cpu()).to(device)
