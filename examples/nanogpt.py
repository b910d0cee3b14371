"""A small pre-norm GPT, real text found on every machine, and a LightningModule around them.

Shared by the demo run (``examples/demo.py``), the collapse example, the tests and the
benchmarks. One readable file in the spirit of Karpathy's nanoGPT ``model.py``: GPT-2 module
names (``transformer.h.0.ln_1`` ...), LayerNorm or RMSNorm by a flag, byte-level tokens.

The text is the Python standard library's own source, read at run time: no download, no data
committed, the same bytes on every machine with the same Python.
"""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    dropout: float = 0.0
    bias: bool = True


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(config.n_embd, bias=config.bias)
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {config.norm!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    """The usual GELU MLP, with a switch that makes the branch cancel part of the stream.

    With ``cancel > 0`` the branch adds ``-cancel * (x @ P)``, where ``x`` is the block's
    *stream* (not ``ln_2(x)``) and ``P`` projects onto ``cancel_rank`` fixed random directions.
    Then ``<x, f(x)> < 0`` along those directions: the no-cancellation hypothesis of the
    sigma_min theory fails there, and ``sigma_min`` of the stream drops at this sublayer
    (by ``1 - cancel`` along ``P`` when the rest of the branch is small).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.cancel = 0.0
        self.register_buffer("cancel_projector", torch.zeros(config.n_embd, config.n_embd))

    def set_cancel(self, strength: float, rank: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        d = self.cancel_projector.shape[0]
        q, _ = torch.linalg.qr(torch.randn(d, rank, generator=g))
        self.cancel_projector.copy_(q @ q.T)
        self.cancel = float(strength)

    def forward(self, h: torch.Tensor, stream: torch.Tensor | None = None) -> torch.Tensor:
        out = self.c_proj(self.gelu(self.c_fc(h)))
        if self.cancel and stream is not None:
            out = out - self.cancel * (stream @ self.cancel_projector)
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x), stream=x)
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=make_norm(config),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


# --------------------------------------------------------------------------- data
def stdlib_text(max_bytes: int = 4_000_000) -> bytes:
    """The Python standard library's own ``.py`` sources, sorted, concatenated, truncated."""
    root = Path(sysconfig.get_paths()["stdlib"] or os.path.dirname(os.__file__))
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    if len(text) < 10_000:
        raise RuntimeError(f"found only {len(text)} bytes of standard-library source under {root}")
    return text


class ByteDataset(Dataset):
    """Random windows of ``block_size + 1`` bytes: ``(x, y)`` next-byte pairs, seeded."""

    def __init__(self, data: torch.Tensor, block_size: int, samples: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = data
        self.block_size = block_size
        self.starts = torch.randint(0, len(data) - block_size - 1, (samples,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        chunk = self.data[s : s + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def make_dataloaders(
    block_size: int = 64,
    batch_size: int = 32,
    seed: int = 0,
    val_fraction: float = 0.05,
    max_bytes: int = 4_000_000,
    train_samples: int = 100_000,
    val_samples: int = 512,
) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders over the standard library's source (split by position)."""
    data = torch.frombuffer(bytearray(stdlib_text(max_bytes)), dtype=torch.uint8)
    cut = int(len(data) * (1 - val_fraction))
    train = ByteDataset(data[:cut], block_size, train_samples, seed)
    val = ByteDataset(data[cut:], block_size, val_samples, seed + 1)
    return (
        DataLoader(train, batch_size=batch_size, shuffle=False),
        DataLoader(val, batch_size=batch_size, shuffle=False),
    )


# --------------------------------------------------------------------------- Lightning
class LitGPT(L.LightningModule):
    """The GPT as a LightningModule; module paths inside are ``model.transformer.h.0.ln_1`` etc.

    ``cancel_at_step`` switches on the cancelling MLP branch of block ``cancel_layer`` at that
    optimiser step (the collapse example).
    """

    def __init__(
        self,
        config: GPTConfig | None = None,
        lr: float = 3e-3,
        warmup_steps: int = 20,
        cancel_at_step: int | None = None,
        cancel_layer: int = 2,
        cancel_strength: float = 0.95,
    ) -> None:
        super().__init__()
        config = config or GPTConfig()
        self.save_hyperparameters(
            {
                "config": asdict(config),
                "lr": lr,
                "warmup_steps": warmup_steps,
                "cancel_at_step": cancel_at_step,
                "cancel_layer": cancel_layer,
                "cancel_strength": cancel_strength,
            }
        )
        self.model = GPT(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]

    def on_train_batch_start(self, batch, batch_idx):
        if (
            self.hparams.cancel_at_step is not None
            and self.global_step == self.hparams.cancel_at_step
        ):
            self.model.transformer.h[self.hparams.cancel_layer].mlp.set_cancel(
                self.hparams.cancel_strength
            )

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val/loss", loss, prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warm = max(1, self.hparams.warmup_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
