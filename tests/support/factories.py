"""Python model factories for ``normscope scan package.module:factory`` (tests only).

``tiny_lm`` builds the callback tests' pre-norm LM (vocab 32: the text goes in as UTF-8 byte ids
mod 32); ``tiny_lm_with_tokenizer`` also returns a tokenizer (``str -> ids``); the others are the
bad cases the command must refuse with a message.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.support.tiny_models import TinyLM

VOCAB = 32


def tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM(vocab=VOCAB, d=16, layers=2, heads=2)


def tiny_lm_with_tokenizer() -> tuple[nn.Module, object]:
    """The model and a tokenizer: one id per character, ``ord(c) % 32``."""
    return tiny_lm(), lambda text: [ord(c) % VOCAB for c in text]


def no_norm_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))


def broken_factory() -> nn.Module:
    raise RuntimeError("the weights file is missing")


def not_a_model() -> str:
    return "a string"


INSTANCE = tiny_lm()  # a module attribute that is already an nn.Module


def source_lm_with_tokenizer() -> tuple[nn.Module, object]:
    """``examples/sources.py``'s model at random init, its MLP branch of block 1 cancelling on
    code tokens only, and a tokenizer that sends lowercase letters and blanks to the prose ids
    (0..31) and every other character to the code ids (32..63)."""
    from examples import sources

    torch.manual_seed(0)
    model = sources.SourceLM()
    model.set_cancel(1, 0.95, gated=True)

    def encode(text: str) -> list[int]:
        return [
            ord(c) % 32 + (0 if c.islower() or c.isspace() else sources.CODE_FIRST) for c in text
        ]

    return model, encode
