"""A model ready to scan (:class:`LoadedModel`) and what a model says about its inputs: the
longest input it takes and its vocabulary size. Shared by the two loaders,
:mod:`normscope.cli.loading` (model directories) and :mod:`normscope.cli.factory` (Python
factories)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["LoadedModel", "max_positions", "vocab_size"]


@dataclass
class LoadedModel:
    """A model ready to scan and how to feed it.

    Attributes:
        model: the module, in float32 on the device, eval mode. A bfloat16/float16 checkpoint
            is upcast (exactly): a float32 forward keeps the LayerNorm kernel at ~1e-14.
        tokenizer: a Hugging Face tokenizer or a callable ``str -> list[int]``.
        tokenizer_name: what the tokenizer is, for the report.
        source: ``"huggingface"`` or ``"factory"``.
        name: the model as the user named it.
        class_name: the model's class.
        as_dict: feed ``{"input_ids", "attention_mask"}`` batches (else id tensors).
        max_positions: longest input the model takes, when it says.
        make_twin: ``seed -> nn.Module``, the random-init twin of the same architecture.
        twin_how: one sentence on how the twin is built.
        notes: things the report should say (missing weights, a byte tokenizer...).
    """

    model: nn.Module
    tokenizer: Any
    tokenizer_name: str
    source: str
    name: str
    class_name: str
    as_dict: bool
    max_positions: int | None
    make_twin: Callable[[int], nn.Module]
    twin_how: str
    notes: list[str] = field(default_factory=list)


def max_positions(config: Any, tokenizer: Any) -> int | None:
    """The longest input the config or the tokenizer declares (``max_position_embeddings``,
    ``n_positions``, ``n_ctx``, ``max_seq_len``, ``model_max_length``), or None."""
    sizes = [
        getattr(config, key, None)
        for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
    ]
    sizes.append(getattr(tokenizer, "model_max_length", None))
    sizes = [int(s) for s in sizes if isinstance(s, int) and 0 < s < 1_000_000]
    return min(sizes) if sizes else None


def vocab_size(model: nn.Module) -> int | None:
    """The number of rows of the model's token embedding, or None without one."""
    get = getattr(model, "get_input_embeddings", None)
    emb = None
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
    if not isinstance(emb, nn.Embedding):
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None
