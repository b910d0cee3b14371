"""Tiny transformer models for tests: real ``transformers`` code, small configs, random init, CPU.

Every builder returns ``(model, forward)``: the model in eval mode and a zero-argument callable
that runs one forward pass on a small fixed example batch (what
:func:`normscope.taps.find_residual_points` and the monitors take). Nothing is downloaded:
each model is built from a config at random initialisation (seeded, so the same call gives
the same weights), with a hidden width of 32-64, 2 layers and 2-4 heads. The RMSNorm
builders ``llama``, ``mistral``, ``qwen2``, ``gemma`` and ``gemma2`` also take
``hidden_size`` (``build_hf_model("llama", hidden_size=1024)``).

``HF_ARCHITECTURES`` maps a name to ``(builder, norm kind)``, the kind being what
:func:`normscope.taps.find_norm_layers` must report for the model's norms ("layernorm" or
"rmsnorm"). ``"handwritten"`` is a plain ``nn.Module`` pre-norm transformer
(:class:`TinyPreNormTransformer`), the kind of model a user writes.

Example::

    >>> from tests.support.hf_models import HF_ARCHITECTURES, build_hf_model
    >>> model, forward = build_hf_model("llama")
    >>> out = forward()                    # logits of a (2, 8) batch of token ids
    >>> builder, kind = HF_ARCHITECTURES["gemma2"]
    >>> kind
    'rmsnorm'
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402  (after HF_HUB_OFFLINE: never reach for the hub)

__all__ = [
    "HF_ARCHITECTURES",
    "HFArchitecture",
    "TinyPreNormTransformer",
    "build_hf_model",
    "token_batch",
]

VOCAB = 64
HIDDEN = 32
LAYERS = 2
BATCH, SEQ = 2, 8

Forward = Callable[[], object]
Built = tuple[nn.Module, Forward]


def token_batch(
    batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB, seed: int = 0
) -> torch.Tensor:
    """A fixed ``(batch, seq)`` tensor of token ids, drawn from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


class TokenSamples(torch.utils.data.Dataset):
    """``n`` fixed token sequences of length ``seq`` as a causal LM's samples (labels = inputs):
    what the Hugging Face ``Trainer`` and a Lightning wrapper calling ``model(**batch)`` take."""

    def __init__(self, seq: int = SEQ, n: int = 64) -> None:
        self.seq, self.n = seq, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = token_batch(1, self.seq, VOCAB, seed=i)[0]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _causal_lm(model: nn.Module) -> Built:
    ids = token_batch()
    model.eval()
    return model, lambda: model(input_ids=ids)


def _seeded(fn: Callable[..., Built]) -> Callable[..., Built]:
    def build(**options: object) -> Built:
        torch.manual_seed(0)
        return fn(**options)

    build.__name__ = fn.__name__
    build.__doc__ = fn.__doc__
    return build


@_seeded
def gpt2() -> Built:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=4,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _causal_lm(transformers.GPT2LMHeadModel(cfg))


def _gpt_neox(parallel: bool) -> Built:
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        use_parallel_residual=parallel,
    )
    return _causal_lm(transformers.GPTNeoXForCausalLM(cfg))


@_seeded
def gpt_neox_parallel() -> Built:
    """GPT-NeoX with ``use_parallel_residual=True``: both norms of a block read its input."""
    return _gpt_neox(True)


@_seeded
def gpt_neox_sequential() -> Built:
    """GPT-NeoX with ``use_parallel_residual=False``: an ordinary pre-norm block."""
    return _gpt_neox(False)


@_seeded
def opt() -> Built:
    cfg = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        ffn_dim=64,
        word_embed_proj_dim=HIDDEN,
        max_position_embeddings=32,
        do_layer_norm_before=True,
    )
    return _causal_lm(transformers.OPTForCausalLM(cfg))


@_seeded
def bloom() -> Built:
    """BLOOM adds the residual *inside* its attention and MLP modules (``dropout_add``)."""
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=4)
    return _causal_lm(transformers.BloomForCausalLM(cfg))


@_seeded
def phi() -> Built:
    """Phi: one norm per block, attention and MLP in parallel on its output."""
    cfg = transformers.PhiConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=32,
    )
    return _causal_lm(transformers.PhiForCausalLM(cfg))


@_seeded
def vit() -> Built:
    """ViT on a (2, 3, 16, 16) image batch, patch 8: 4 patches + CLS = 5 rows per image."""
    cfg = transformers.ViTConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=8,
        num_channels=3,
    )
    model = transformers.ViTModel(cfg, add_pooling_layer=False).eval()
    pixels = torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    return model, lambda: model(pixel_values=pixels)


@_seeded
def bert() -> Built:
    """BERT: post-LN, the LayerNorm comes after each residual add."""
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    ids = token_batch()
    return model, lambda: model(input_ids=ids)


def _llama_like(
    config_cls: type, model_cls: type, hidden_size: int = HIDDEN, **extra: object
) -> Built:
    cfg = config_cls(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        **extra,
    )
    return _causal_lm(model_cls(cfg))


@_seeded
def llama(hidden_size: int = HIDDEN) -> Built:
    return _llama_like(transformers.LlamaConfig, transformers.LlamaForCausalLM, hidden_size)


@_seeded
def mistral(hidden_size: int = HIDDEN) -> Built:
    return _llama_like(transformers.MistralConfig, transformers.MistralForCausalLM, hidden_size)


@_seeded
def qwen2(hidden_size: int = HIDDEN) -> Built:
    return _llama_like(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, hidden_size)


@_seeded
def gemma(hidden_size: int = HIDDEN) -> Built:
    """Gemma: RMSNorm with scale ``1 + w`` (weights initialised to 0)."""
    return _llama_like(
        transformers.GemmaConfig, transformers.GemmaForCausalLM, hidden_size, head_dim=8
    )


@_seeded
def gemma2(hidden_size: int = HIDDEN) -> Built:
    """Gemma 2: sandwich norms (pre and post each sublayer), scale ``1 + w``."""
    return _llama_like(
        transformers.Gemma2Config, transformers.Gemma2ForCausalLM, hidden_size, head_dim=8
    )


@_seeded
def gemma3() -> Built:
    """Gemma 3 text model: sandwich norms plus QK-norms over head_dim, scale ``1 + w``."""
    return _llama_like(
        transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, head_dim=8, sliding_window=4
    )


def _gemma4(per_layer_input: int) -> Built:
    return _llama_like(
        transformers.Gemma4TextConfig,
        transformers.Gemma4ForCausalLM,
        head_dim=8,
        global_head_dim=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=per_layer_input,
        vocab_size_per_layer_input=VOCAB,
    )


@_seeded
def gemma4() -> Built:
    """Gemma 4 text model: sandwich norms, QK-norms and a scale-free v-norm; scale ``w``.

    Per-layer inputs (PLE) are switched off (``hidden_size_per_layer_input=0``), as in the
    large Gemma 4 models, so each block is attention then MLP.
    """
    return _gemma4(per_layer_input=0)


@_seeded
def gemma4_ple() -> Built:
    """Gemma 4 text model with per-layer inputs (PLE), as in the small E2B/E4B models.

    The block's last step then adds the MLP branch *and* the per-layer-input branch.
    """
    return _gemma4(per_layer_input=8)


@_seeded
def t5_encoder() -> Built:
    """T5 encoder: ``T5LayerNorm`` is an RMS norm despite its name."""
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=8,
        d_ff=64,
        num_layers=LAYERS,
        num_heads=4,
    )
    model = transformers.T5EncoderModel(cfg).eval()
    ids = token_batch()
    return model, lambda: model(input_ids=ids)


class TinyPreNormTransformer(nn.Module):
    """A hand-written pre-norm transformer: ``x = x + attn(ln1(x)); x = x + mlp(ln2(x))``.

    Args:
        vocab: vocabulary size.
        dim: model width ``d``.
        layers: number of blocks.
        heads: attention heads.
        norm: ``"layernorm"`` or ``"rmsnorm"`` (``nn.LayerNorm`` / ``nn.RMSNorm``).
    """

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int, norm: Callable[[int], nn.Module]) -> None:
            super().__init__()
            self.ln1 = norm(dim)
            self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
            self.ln2 = norm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    def __init__(
        self,
        vocab: int = VOCAB,
        dim: int = HIDDEN,
        layers: int = LAYERS,
        heads: int = 4,
        norm: str = "layernorm",
    ) -> None:
        super().__init__()
        norm_cls = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}[norm]
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(self.Block(dim, heads, norm_cls) for _ in range(layers))
        self.ln_f = norm_cls(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@_seeded
def handwritten() -> Built:
    model = TinyPreNormTransformer().eval()
    ids = token_batch()
    return model, lambda: model(ids)


class HFArchitecture(NamedTuple):
    """``(builder, norm_kind)``: how to build the model, and the kind of its norms."""

    builder: Callable[..., Built]
    norm_kind: str


HF_ARCHITECTURES: dict[str, HFArchitecture] = {
    "gpt2": HFArchitecture(gpt2, "layernorm"),
    "gpt_neox_parallel": HFArchitecture(gpt_neox_parallel, "layernorm"),
    "gpt_neox_sequential": HFArchitecture(gpt_neox_sequential, "layernorm"),
    "opt": HFArchitecture(opt, "layernorm"),
    "bloom": HFArchitecture(bloom, "layernorm"),
    "phi": HFArchitecture(phi, "layernorm"),
    "vit": HFArchitecture(vit, "layernorm"),
    "bert": HFArchitecture(bert, "layernorm"),
    "llama": HFArchitecture(llama, "rmsnorm"),
    "mistral": HFArchitecture(mistral, "rmsnorm"),
    "qwen2": HFArchitecture(qwen2, "rmsnorm"),
    "gemma": HFArchitecture(gemma, "rmsnorm"),
    "gemma2": HFArchitecture(gemma2, "rmsnorm"),
    "gemma3": HFArchitecture(gemma3, "rmsnorm"),
    "gemma4": HFArchitecture(gemma4, "rmsnorm"),
    "gemma4_ple": HFArchitecture(gemma4_ple, "rmsnorm"),
    "t5_encoder": HFArchitecture(t5_encoder, "rmsnorm"),
    "handwritten": HFArchitecture(handwritten, "layernorm"),
}


def build_hf_model(name: str, **options: object) -> Built:
    """Build the tiny model ``name`` (a key of :data:`HF_ARCHITECTURES`) and its forward.

    Args:
        name: architecture name, e.g. ``"gpt2"``, ``"gemma3"``, ``"handwritten"``.
        options: passed to the builder; ``hidden_size=...`` (default 32) is accepted by
            ``llama``, ``mistral``, ``qwen2``, ``gemma`` and ``gemma2``, for reads whose
            random-direction baseline ``1/sqrt(d)`` needs a wider model.

    Returns:
        ``(model, forward)``: the model in eval mode, and a zero-argument callable running one
        forward pass on a fixed small batch.
    """
    try:
        arch = HF_ARCHITECTURES[name]
    except KeyError:
        raise KeyError(
            f"unknown architecture {name!r}; known: {', '.join(sorted(HF_ARCHITECTURES))}"
        ) from None
    return arch.builder(**options)
