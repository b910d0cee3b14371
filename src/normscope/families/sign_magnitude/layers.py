"""Which Linear layers the sign–magnitude family watches and probes, found from the model."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from normscope.taps.norms import NormLayer, find_norm_layers
from normscope.taps.stacks import longest_stack, same_class_stacks

__all__ = ["default_probe_layers", "find_block_linears", "find_norm_layers_or_empty"]

#: the names of the Linears that write a branch's output back to the stream
_OUT_NAMES = ("c_proj", "o_proj", "out_proj", "dense", "down_proj", "fc2", "wo", "dense_4h_to_h")


def _block_stack(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The longest ``nn.ModuleList`` whose children share one class: the transformer's blocks.

    ModuleList only (an ``nn.Sequential`` stack would change which Linears are monitored), and
    a list of ModuleLists/ModuleDicts still counts (``exclude_children=()``), as it always has."""
    return longest_stack(same_class_stacks(model, kinds=(nn.ModuleList,), exclude_children=()))


def find_block_linears(model: nn.Module) -> list[str]:
    """Paths of every ``nn.Linear`` inside the model's block stack (embeddings and the output
    head excluded); every Linear of the model when there is no block stack."""
    stack = _block_stack(model)
    prefix = f"{stack[0]}." if stack is not None and stack[0] else ""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and (stack is None or name.startswith(prefix))
    ]


def default_probe_layers(linears: Sequence[str], blocks: int = 3) -> list[str]:
    """An attention and an MLP output projection in the first, middle and last block: the
    Linear layers whose output is added to the stream, i.e. what the next norm reads."""
    by_block: dict[str, list[str]] = {}
    for name in linears:
        parts = name.split(".")
        idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if idx is None:
            continue
        by_block.setdefault(".".join(parts[: idx + 1]), []).append(name)
    keys = list(by_block)
    if not keys:
        return list(linears[:2])
    picks = sorted({0, len(keys) // 2, len(keys) - 1})[:blocks]
    chosen: list[str] = []
    for i in picks:
        layers = by_block[keys[i]]
        is_attn = [any(k in n for k in ("attn", "attention")) for n in layers]
        attn = [n for n, a in zip(layers, is_attn) if a]
        rest = [n for n, a in zip(layers, is_attn) if not a]
        # the output projection of each branch: a known name, else the branch's last Linear
        for group in (attn, rest):
            named = [n for n in group if n.split(".")[-1] in _OUT_NAMES]
            chosen += (named or group)[-1:]
    return chosen


def find_norm_layers_or_empty(model: nn.Module) -> list[NormLayer]:
    """The model's norm layers (where a probe takes its ``y``); ``[]`` when it has none."""
    try:
        return find_norm_layers(model)
    except ValueError:
        return []
