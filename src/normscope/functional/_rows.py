"""The argument checks every streaming accumulator makes (``StreamingCovariance``,
``DiagonalMoment``, ``StreamingCrossMoment``): a positive int width, rows of that width, a mask
of the rows' shape. Written once so that the three raise the same words."""

from __future__ import annotations

import torch


def check_dim(dim: object, who: str) -> int:
    """``dim`` if it is a positive int (not a bool), else a ``ValueError`` naming ``who``."""
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ValueError(f"{who}: dim must be a positive int, got {dim!r}")
    return dim


def check_rows(x: torch.Tensor, mask: torch.Tensor | None, dim: int, who: str) -> None:
    """A ``ValueError`` naming ``who`` unless ``x`` is ``(..., dim)`` and ``mask`` is ``None``
    or of shape ``x.shape[:-1]``."""
    if x.ndim == 0 or x.shape[-1] != dim:
        raise ValueError(
            f"{who}: rows must have width d={dim}, got a tensor of shape {tuple(x.shape)}"
        )
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"{who}: mask must have the shape of x without its last dimension, "
            f"{tuple(x.shape[:-1])}; got {tuple(mask.shape)}"
        )
