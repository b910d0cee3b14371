"""The shared block-stack finder: unit tests, and identity with the old sign–magnitude logic."""

from __future__ import annotations

import pytest
from torch import nn

from normscope.families.sign_magnitude import find_block_linears
from normscope.families.sign_magnitude.layers import is_linear
from normscope.taps.stacks import longest_stack, same_class_stacks
from tests.support.hf_models import HF_ARCHITECTURES, build_hf_model
from tests.support.tiny_models import TinyLM


def _old_block_stack(model: nn.Module):
    """Verbatim copy of the old ``sign_magnitude._block_stack`` (the reference)."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if len({type(m) for m in module}) == 1 and (best is None or len(module) > len(best[1])):
                best = (name, module)
    return best


def _old_find_block_linears(model: nn.Module) -> list[str]:
    """The old logic around the old stack; which layers count is ``is_linear`` now (GPT-2's
    ``Conv1D`` too: it used to be ``isinstance(m, nn.Linear)``, which found none in GPT-2)."""
    stack = _old_block_stack(model)
    prefix = f"{stack[0]}." if stack is not None and stack[0] else ""
    return [
        name
        for name, m in model.named_modules()
        if is_linear(m) and (stack is None or name.startswith(prefix))
    ]


@pytest.mark.parametrize("arch", sorted(HF_ARCHITECTURES))
def test_find_block_linears_unchanged_on_hf_models(arch: str) -> None:
    model, _ = build_hf_model(arch)
    assert find_block_linears(model) == _old_find_block_linears(model)


def test_find_block_linears_unchanged_on_tiny_model() -> None:
    model = TinyLM()
    assert find_block_linears(model) == _old_find_block_linears(model)


def test_mixed_classes_empty_nesting_and_kinds() -> None:
    mixed = nn.ModuleList([nn.ReLU(), nn.GELU()])
    assert same_class_stacks(nn.Sequential(mixed)) == []
    assert same_class_stacks(nn.ModuleList()) == []
    nested = nn.ModuleList([nn.ModuleList([nn.ReLU()]), nn.ModuleList([nn.ReLU()])])
    assert [p for p, _ in same_class_stacks(nested)] == ["0", "1"]
    assert [p for p, _ in same_class_stacks(nested, exclude_children=())] == ["", "0", "1"]
    seq = nn.Sequential(nn.ReLU(), nn.ReLU())
    assert [p for p, _ in same_class_stacks(seq)] == [""]
    assert same_class_stacks(seq, kinds=(nn.ModuleList,)) == []
    assert longest_stack([]) is None
