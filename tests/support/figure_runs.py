"""Five kinds of model for the figure tests, each as a checkpoint to scan and as a short real
Lightning fit (CSV logger) to report on: what a figure must draw right on every kind.

* ``layernorm``: a pre-norm GPT-2 (the exact LayerNorm kernel);
* ``rmsnorm``: a Llama (no kernel; no ``Delta_gamma`` or deepening);
* ``post-norm``: a BERT (post-LN: a profile over block outputs, no bound);
* ``rank-deficient``: a Llama whose stream entry has rank below its width, so ``sigma_min`` of
  ``p_0`` is 0 and every ratio is NaN: scanned without its tokenizer (UTF-8 bytes: fewer
  distinct tokens than its width of 128), fitted on 8 token ids for a width of 32;
* ``deep``: a 32-block GPT-2 (65 norms, 66 residual points): too many lines for a legend.

All are built from configs at random init (seeded), widths 32-128, on the CPU in seconds.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import torch
import transformers
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from normscope import DeadDirectionMonitor
from tests.support.tiny_models import cpu_trainer, token_loader

KINDS = ("layernorm", "rmsnorm", "post-norm", "rank-deficient", "deep")
WIDTH = 32


def _gpt2(layers: int, vocab: int) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=WIDTH, n_layer=layers, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama(width: int, vocab: int) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _bert(vocab: int) -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertModel(config, add_pooling_layer=False)


def model(kind: str, for_fit: bool = False) -> nn.Module:
    """The model of ``kind`` (seed 0). ``for_fit``: the rank-deficient one for a fit (8 token
    ids into width 32), else for a scan (width 128, byte ids)."""
    torch.manual_seed(0)
    if kind == "layernorm":
        return _gpt2(2, 64)
    if kind == "rmsnorm":
        return _llama(WIDTH, 64)
    if kind == "post-norm":
        return _bert(64)
    if kind == "rank-deficient":
        return _llama(WIDTH, 8) if for_fit else _llama(128, 256)
    if kind == "deep":
        return _gpt2(32, 64)
    raise ValueError(kind)


def save_checkpoint(kind: str, path: Path) -> Path:
    """The model of ``kind`` saved with ``save_pretrained``: config.json and model.safetensors,
    no tokenizer (so ``normscope scan`` feeds UTF-8 byte ids)."""
    model(kind).save_pretrained(path)
    return path


class _Lit(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        out = self.net(input_ids=batch[0])[0]  # logits, or BERT's last hidden state
        return out.float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit_run(kind: str, root: Path, steps: int = 10) -> Path:
    """A Lightning fit of ``kind`` with ``DeadDirectionMonitor(every_n_steps=2)`` and a
    ``CSVLogger``; returns the run folder (``normscope report``'s argument)."""
    vocab = 8 if kind == "rank-deficient" else 64
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False, alerts=(), overhead_warn=None)
    trainer = cpu_trainer(steps, [monitor], logger=[CSVLogger(root, name="csv")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Lit(model(kind, for_fit=True)), train_dataloaders=token_loader(vocab=vocab))
    return root / "csv" / "version_0"
