"""Norm-layer outputs for the functional tests: gains, residual-like inputs, a LayerNorm run in
float32 as a model would, and a ``StreamingCovariance`` filled in a few batches."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from normscope.functional import StreamingCovariance


def make_gamma(d: int, seed: int) -> torch.Tensor:
    """gamma ~ U(0.2, 2): far from the ones direction, so v* is a real prediction."""
    g = torch.Generator().manual_seed(seed)
    return (0.2 + 1.8 * torch.rand(d, generator=g)).float()


def make_inputs(d: int, n: int, seed: int) -> torch.Tensor:
    """Float32 rows with a channel offset and an anisotropic mixing, like a residual stream."""
    g = torch.Generator().manual_seed(seed + 1000)
    mix = torch.eye(d) + 0.3 * torch.randn(d, d, generator=g) / math.sqrt(d)
    return (torch.randn(n, d, generator=g) @ mix + 3 * torch.randn(d, generator=g)).float()


def accumulate(rows: torch.Tensor, batches: int = 4) -> StreamingCovariance:
    acc = StreamingCovariance(rows.shape[-1])
    for chunk in rows.chunk(batches):
        acc.update(chunk)
    return acc


def layer_norm_rows(x: torch.Tensor, gamma: torch.Tensor, seed: int) -> torch.Tensor:
    beta = torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(seed + 7))
    return F.layer_norm(x, (x.shape[-1],), gamma, beta.float(), eps=1e-5)
