"""``normscope.taps.hooks`` on its own: the gate, the fold into float64 against numpy, the mask,
fail-open per module, activation-checkpoint recomputes, removal."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from normscope.functional.moments import DiagonalMoment
from normscope.taps.hooks import Gate, TapSet, in_backward_recompute


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8))


def test_a_closed_gate_folds_nothing_and_an_open_one_folds_every_row_exactly() -> None:
    model = _model()
    taps = TapSet(model, Gate())
    out = taps.add("1", "output", dim=8)
    inp = taps.add("1", "input", dim=8)
    x = torch.randn(5, 7, 4)
    model(x)  # gate closed: nothing folded
    assert out.accumulator.count == 0 and inp.accumulator.count == 0
    with taps.gate.sampling():
        y = model[1](model[0](x))
        model(x)
    rows = y.detach().double().reshape(-1, 8).numpy()
    rows = np.concatenate([rows, rows])  # the two sampled forwards
    assert out.accumulator.count == 70
    # float64 fold of float32 rows against numpy's float64 covariance of the same rows: only
    # the order of the float64 sums differs (measured ~1e-16 relative)
    np.testing.assert_allclose(
        out.accumulator.covariance().numpy(), np.cov(rows.T, bias=True), rtol=0, atol=1e-12
    )
    assert not taps.gate.open  # the block restored the closed gate


def test_sampling_restores_the_previous_state_and_applies_the_mask() -> None:
    model = _model()
    taps = TapSet(model, Gate())
    tap = taps.add("1", "input", dim=8)
    x = torch.randn(3, 6, 4)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[0, 3:] = 0  # three padding rows
    with taps.gate.sampling(mask):
        with taps.gate.sampling():  # nested: no mask inside
            assert taps.gate.mask is None
        assert taps.gate.mask is mask
        model(x)
    assert taps.gate.mask is None and not taps.gate.open
    assert tap.accumulator.count == 18 - 3
    kept = model[0](x).detach().double()[mask.bool()].numpy()
    np.testing.assert_allclose(tap.accumulator.mean.numpy(), kept.mean(0), rtol=0, atol=1e-12)
    # a mask whose shape does not match the tensor's leading dimensions is not applied
    tap.accumulator.reset()
    with taps.gate.sampling(torch.ones(2, 2)):
        model(x)
    assert tap.accumulator.count == 18


def test_add_is_idempotent_and_remove_takes_every_hook_away() -> None:
    model = _model()
    taps = TapSet(model, Gate())
    a = taps.add("1", "output", dim=8)
    assert taps.add("1", "output", dim=8) is a and len(taps) == 1
    assert taps.memory_bytes() == 8 * 8 * 8
    with pytest.raises(ValueError, match="where must be 'input' or 'output'"):
        taps.add("1", "middle", dim=8)
    taps.remove()
    with taps.gate.sampling():
        model(torch.randn(4, 4))
    assert a.accumulator.count == 0


def test_a_failing_tap_disables_its_module_only_and_warns_once() -> None:
    model = _model()
    taps = TapSet(model, Gate())
    bad_in = taps.add("1", "input", dim=5)  # the wrong width: the fold raises inside the hook
    bad_out = taps.add("1", "output", dim=8)
    good = taps.add("2", "output", dim=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with taps.gate.sampling():
            model(torch.randn(4, 4))
            model(torch.randn(4, 4))
    msgs = [str(w.message) for w in caught if "normscope: the tap" in str(w.message)]
    assert len(msgs) == 1 and "'1'" in msgs[0] and "width 5" in msgs[0]
    # both taps of the module are off and their partial windows dropped; the next layer is read
    assert bad_in.failed and bad_out.failed and bad_out.accumulator.count == 0
    assert good.failed is None and good.accumulator.count == 8


@pytest.mark.parametrize("reentrant", [True, False])
def test_forwards_recomputed_by_activation_checkpointing_are_not_counted(reentrant) -> None:
    model = _model()
    taps = TapSet(model, Gate())
    tap = taps.add("1", "output", dim=8)
    x = torch.randn(6, 4, requires_grad=True)
    with taps.gate.sampling():
        y = checkpoint(model, x, use_reentrant=reentrant)
        y.sum().backward()  # recomputes the forward inside backward
    assert tap.accumulator.count == 6
    assert not in_backward_recompute()  # outside a backward pass


def test_keyword_inputs_are_tapped() -> None:
    class Kw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(input=x)

    model = Kw()
    taps = TapSet(model, Gate())
    tap = taps.add("norm", "input", dim=8)
    with taps.gate.sampling():
        model(torch.randn(3, 8))
    assert tap.accumulator.count == 3


def test_a_removed_set_hooks_again_when_its_taps_are_added_again() -> None:
    # a monitor detached at the end of one fit and attached for the next must read again
    model = _model()
    taps = TapSet(model, Gate())
    tap = taps.add("1", "output", dim=8)
    taps.remove()
    assert taps.add("1", "output", dim=8) is tap  # the same accumulator, hooked again
    with taps.gate.sampling():
        model(torch.randn(4, 4))
    assert tap.accumulator.count == 4
    taps.add("1", "output", dim=8)  # already hooked: not twice
    with taps.gate.sampling():
        model(torch.randn(4, 4))
    assert tap.accumulator.count == 8


def test_make_builds_another_accumulator_and_on_fail_takes_the_warning() -> None:
    model = _model()
    failures: list[tuple[str, str]] = []
    taps = TapSet(
        model, Gate(), on_fail=lambda tap, reason: failures.append((tap.module_name, reason))
    )
    diag = taps.add("2", "input", dim=8, make=DiagonalMoment)
    bad = taps.add("1", "input", dim=5, make=DiagonalMoment)
    assert isinstance(diag.accumulator, DiagonalMoment)
    assert taps.memory_bytes() == diag.accumulator.memory_bytes() + bad.accumulator.memory_bytes()
    x = torch.randn(3, 6, 4)
    mask = torch.ones(3, 6)
    mask[1, :2] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on_fail given: the set itself does not warn
        with taps.gate.sampling(mask):
            model(x)
    assert failures == [("1", failures[0][1])] and "width 5" in failures[0][1]
    assert bad.failed is not None and diag.failed is None
    kept = model[1](model[0](x)).detach().double()[mask.bool()].numpy()
    assert diag.accumulator.count == 16
    # sums of squares in float64 against numpy's: only the summation order differs
    np.testing.assert_allclose(
        diag.accumulator.second_moment_diagonal().numpy(), (kept**2).mean(0), rtol=1e-13, atol=0
    )
