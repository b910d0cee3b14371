"""``scan_model``'s ``sigma_min`` profile on a hand-built residual stream whose answer is known.

Linear branches make every residual point a linear map of the input, so the profile is
checkable against numpy's SVD of the same rows (relative 1e-10: a float64 forward and float64
accumulators, so the two agree to rounding). A cancelling branch gives a
``sigma_min`` step below 1 at exactly that sublayer; no-cancellation branches ``f(x) = x A``,
``A + A^T`` PSD, give every ratio >= 1.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from normscope import scan_model

torch.set_num_threads(1)


class LinearBranch(nn.Module):
    """``f(x) = x A``: a sublayer branch that is exactly linear in the stream."""

    def __init__(self, a: torch.Tensor) -> None:
        super().__init__()
        self.a = nn.Parameter(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.a


class LinearBlock(nn.Module):
    """``x = x + attn(x); x = x + mlp(x)``, with a LayerNorm reading the stream before each.

    The norms read the stream as in any pre-norm block (that is how the residual points are
    found); the branches take the stream itself, so that ``x_k = x_{k-1} (I + A)`` holds exactly
    and the theorem is checkable: with ``A + A^T`` PSD, ``(I + A)^T (I + A) = I + A + A^T +
    A^T A >= I``, so ``sigma_min`` cannot fall. The norm outputs feed the model's readout.
    """

    def __init__(self, a_attn: torch.Tensor, a_mlp: torch.Tensor) -> None:
        super().__init__()
        d = a_attn.shape[0]
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = LinearBranch(a_attn), LinearBranch(a_mlp)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        read = self.ln1(x)
        x = x + self.attn(x)
        read = read + self.ln2(x)
        return x + self.mlp(x), read


class LinearResidualModel(nn.Module):
    def __init__(self, branches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LinearBlock(a, m) for a, m in branches)
        self.ln_f = nn.LayerNorm(branches[0][0].shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reads = torch.zeros_like(x)
        for block in self.blocks:
            x, read = block(x)
            reads = reads + read
        return self.ln_f(x) + reads


D = 16


def no_cancellation(seed: int) -> torch.Tensor:
    """``A = 0.05 (B B^T / d + K - K^T)``: ``A + A^T = 0.1 B B^T / d`` is PSD."""
    gen = torch.Generator().manual_seed(seed)
    b, k = torch.randn(D, D, generator=gen), torch.randn(D, D, generator=gen)
    return (0.05 * (b @ b.T / D + k - k.T)).double()


def cancelling(seed: int) -> torch.Tensor:
    """``A = -0.9 P``, ``P`` the projector onto 4 random directions: the branch removes 90% of
    the stream there (``A + A^T = -1.8 P``, not PSD)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(D, 4, generator=gen)).Q
    return (-0.9 * q @ q.T).double()


def linear_model(cancel: bool) -> tuple[LinearResidualModel, torch.Tensor]:
    """Three no-cancellation blocks (float64), ``blocks.1.mlp`` cancelling if ``cancel``; and
    256 stream rows (>= 2 d) with an offset, since sigma_min is read on uncentred moments."""
    branches = [(no_cancellation(3 * i), no_cancellation(3 * i + 1)) for i in range(3)]
    if cancel:
        branches[1] = (branches[1][0], cancelling(5))
    x = torch.randn(8, 32, D, generator=torch.Generator().manual_seed(0)) + 0.5
    return LinearResidualModel(branches).double().eval(), x.double()


def assert_profile_matches_numpy(model: LinearResidualModel, x: torch.Tensor, profile) -> None:
    """sigma_min at every point against numpy's SVD of the rows ``X M_1 M_2 ...``: float64
    forward and float64 accumulators, so they agree to rounding (1e-10)."""
    rows = x.reshape(-1, D).numpy()
    refs = [np.linalg.svd(rows, compute_uv=False)[-1]]
    for branch in (b for block in model.blocks for b in (block.attn, block.mlp)):
        rows = rows @ (np.eye(D) + branch.a.detach().numpy())
        refs.append(np.linalg.svd(rows, compute_uv=False)[-1])
    for point, ref in zip(profile.points, refs, strict=True):
        # sigma_min = sqrt(lambda_1(X^T X / n)) = s_min(X) / sqrt(n)
        assert point.sigma_min == pytest.approx(ref / math.sqrt(rows.shape[0]), rel=1e-10)


def test_no_cancellation_branches_never_lower_sigma_min() -> None:
    model, x = linear_model(cancel=False)
    report = scan_model(model, [x[:4], x[4:]])
    profile = report.profile
    assert report.layout.style == "pre-norm" and len(profile.points) == 7
    assert [p.sublayer for p in profile.points] == [None] + ["attn", "mlp"] * 3
    for p in profile.points[1:]:  # measured steps 1.046-1.096
        assert p.sigma_min_step >= 1.0 and p.sigma_min_ratio >= 1.0, p
    assert profile.sigma_min_ratio_min >= 1.0
    assert_profile_matches_numpy(model, x, profile)


def test_a_cancelling_branch_lowers_sigma_min_at_its_sublayer() -> None:
    model, x = linear_model(cancel=True)
    report = scan_model(model, [x[:4], x[4:]])
    profile = report.profile
    below = [p for p in profile.points if p.sigma_min_step < 1.0]
    # the point after blocks.1.mlp is blocks.2.ln1's input, and the step is labelled "mlp"
    assert [(p.name, p.sublayer) for p in below] == [("blocks.2.ln1", "mlp")]
    # about 0.1 x (sigma along the cancelled directions) / sigma_min: measured 0.117
    assert below[0].sigma_min_step < 0.5
    assert profile.worst_point == "blocks.2.ln1"
    assert profile.sigma_min_ratio_min == below[0].sigma_min_ratio < 1.0
    assert report.as_dict()["dd/sigma_min_ratio_min"] == profile.sigma_min_ratio_min
    assert_profile_matches_numpy(model, x, profile)
