"""The ternary QAT example: the STE layer is exact, and a short run logs both twins."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from examples import ternary_qat
from normscope.functional import ternary_quantize


def test_ternary_linear_forward_is_quantised_and_gradient_straight_through():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    layer.__class__ = ternary_qat.TernaryLinear
    x = torch.randn(4, 16)
    q, s = ternary_quantize(layer.weight)
    expected = F.linear(x, (s * q).float(), layer.bias)
    out = layer(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    out.sum().backward()
    # straight-through: d out / d W is the gradient of a plain linear layer
    torch.testing.assert_close(layer.weight.grad, torch.ones(4, 8).T @ x)


def test_short_run_reads_both_twins():
    runs = ternary_qat.main(["--steps", "4", "--every", "2", "--layers", "1", "--width", "32"])
    assert set(runs) == {"full precision", "ternary QAT"}
    for monitor in runs.values():
        steps = [s for s, _ in monitor.history]
        assert steps == [1, 2, 4]
        last = monitor.history[-1][1]
        assert 0 < last["sm/ternary_alignment_mean"] < 1
        assert 0 <= last["sm/sign_churn_mean"] < 1
