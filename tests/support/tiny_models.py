"""Tiny real models and data for the suite: a pre-norm transformer LM that trains in seconds on a
CPU, with an optional cancelling MLP branch (the collapse case), one whose norm gains decay, and
a quiet CPU ``Trainer``."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, d: int, heads: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.ln_1 = norm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_2 = norm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.cancel = 0.0  # > 0: the MLP branch also removes part of the stream (collapse)
        self.register_buffer("proj", torch.zeros(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        f = self.mlp(self.ln_2(x))
        if self.cancel:
            f = f - self.cancel * (x @ self.proj)  # <x, f(x)> < 0 along proj: no-cancellation fails
        return x + f


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int = 32, d: int = 16, layers: int = 2, heads: int = 2, norm: str = "layernorm"
    ):
        super().__init__()
        norm_cls = nn.LayerNorm if norm == "layernorm" else nn.RMSNorm
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(64, d)
        self.h = nn.ModuleList(Block(d, heads, norm_cls) for _ in range(layers))
        self.ln_f = norm_cls(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))

    def set_cancel(self, layer: int, strength: float, rank: int = 4, seed: int = 0) -> None:
        """Switch on a cancelling MLP branch in block ``layer``: it subtracts ``strength`` times
        the stream's projection onto ``rank`` random directions."""
        g = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(self.ln_f.normalized_shape[0], rank, generator=g))
        block = self.h[layer]
        block.proj.copy_(q @ q.T)
        block.cancel = strength


TINY_NORMS = ("h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f")  # TinyLM's, at 2 layers


class LitTiny(L.LightningModule):
    def __init__(
        self,
        lr: float = 3e-3,
        cancel_at_step: int | None = None,
        cancel_layer: int = 1,
        cancel_strength: float = 0.95,
        **model_kwargs,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyLM(**model_kwargs)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def on_train_batch_start(self, batch, batch_idx):
        if (
            self.hparams.cancel_at_step is not None
            and self.global_step == self.hparams.cancel_at_step
        ):
            self.model.set_cancel(self.hparams.cancel_layer, self.hparams.cancel_strength)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class DecayedGains(LitTiny):
    """Strong decoupled weight decay on the norm gains; keeps each step's gains before its
    forward (what the window's read uses)."""

    def __init__(self, gain_wd: float) -> None:
        super().__init__(lr=3e-3)
        self.gain_wd = gain_wd
        self.gains: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, batch, batch_idx):
        self.gains[self.global_step] = {
            f"model.{n}": self.model.get_submodule(n).weight.detach().double().clone()
            for n in TINY_NORMS
        }

    def configure_optimizers(self):
        gains = [self.model.get_submodule(n).weight for n in TINY_NORMS]
        ids = {id(p) for p in gains}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return torch.optim.AdamW(
            [{"params": rest}, {"params": gains, "weight_decay": self.gain_wd}], lr=self.hparams.lr
        )


def token_loader(
    n: int = 256, t: int = 16, vocab: int = 32, batch_size: int = 16, seed: int = 0
) -> DataLoader:
    """Next-token pairs from a fixed random Markov chain: learnable, deterministic."""
    g = torch.Generator().manual_seed(seed)
    trans = torch.softmax(3 * torch.randn(vocab, vocab, generator=g), dim=1)
    seq = torch.zeros(n, t + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(vocab, (n,), generator=g)
    for i in range(t):
        seq[:, i + 1] = torch.multinomial(trans[seq[:, i]], 1, generator=g).squeeze(1)
    return DataLoader(TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=batch_size, shuffle=False)


class NoNormModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def cpu_trainer(max_steps: int, callbacks: list, **kw) -> L.Trainer:
    """A quiet one-process CPU ``Trainer`` for the tests: no progress bar, model summary,
    checkpointing or logger unless ``kw`` says otherwise."""
    settings = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    settings.update(kw)
    return L.Trainer(max_steps=max_steps, callbacks=callbacks, **settings)
