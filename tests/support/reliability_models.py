"""Real models and data for the reliability tests: what a monitor meets in a long run (corrupt
rows, padding-only batches, widths that change, sparse inputs, huge activations, a logger that
refuses its keys), built on the tiny pre-norm LM of ``tests/support/tiny_models.py``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.support.tiny_models import LitTiny, token_loader

# ------------------------------------------------------------------------------ a logger


class DDFailingCSVLogger(CSVLogger):
    """A CSV logger whose backend refuses normscope's keys (``prefix``); other keys are logged."""

    def __init__(self, *args: Any, prefix: str = "dd/", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefix = prefix
        self.refused = 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if any(k.startswith(self.prefix) for k in metrics):
            self.refused += 1
            raise OSError(f"backend refused {self.prefix} keys")
        super().log_metrics(metrics, step)


# ------------------------------------------------------------------------------- the models


class FreeLayerNorm(nn.Module):
    """A LayerNorm without parameters: it normalises whatever width it is given (found by
    evidence, gamma = ones)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=self.eps)


class NarrowingLM(LitTiny):
    """From step ``narrow_at`` on, the parameter-free final norm is also applied to the first
    half of the stream (an auxiliary head): the layer's input width changes mid-run."""

    def __init__(self, narrow_at: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        d = self.model.ln_f.normalized_shape[0]
        self.model.ln_f = FreeLayerNorm(d)
        self.aux_head = nn.Linear(d // 2, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.wte(idx) + m.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in m.h:
            x = block(x)
        logits = m.head(m.ln_f(x))
        if self.training and self.global_step >= self.hparams.narrow_at:
            logits = logits + self.aux_head(m.ln_f(x[..., : x.shape[-1] // 2]))
        return logits


class FeatureLM(LitTiny):
    """Tokens plus a per-token float feature vector added to the embedding (batches
    ``(ids, targets, features)``). A non-finite loss skips the step (``return None``): the
    usual guard, so one corrupt batch cannot poison the weights."""

    def forward(self, idx: torch.Tensor, feats: torch.Tensor | None = None) -> torch.Tensor:
        m = self.model
        x = m.wte(idx) + m.wpe(torch.arange(idx.shape[1], device=idx.device))
        if feats is not None:
            x = x + feats
        for block in m.h:
            x = block(x)
        return m.head(m.ln_f(x))

    def training_step(self, batch, batch_idx):
        x, y, feats = batch
        loss = F.cross_entropy(self(x, feats).flatten(0, 1), y.flatten())
        if not torch.isfinite(loss):
            return None
        self.log("train/loss", loss)
        return loss


def corrupt_feature_loader(
    bad_batch: int, bad_rows: dict[int, float], batch_size: int = 16, d: int = 16
) -> DataLoader:
    """``token_loader``'s data plus zero features, except in batch ``bad_batch``, where sample
    ``i`` of ``bad_rows`` carries ``bad_rows[i]`` (NaN or +/-Inf) in one channel of every token."""
    base = token_loader(batch_size=batch_size).dataset
    ids, targets = base.tensors
    feats = torch.zeros(*ids.shape, d)
    for i, value in bad_rows.items():
        feats[bad_batch * batch_size + i, :, 3] = value
    return DataLoader(TensorDataset(ids, targets, feats), batch_size=batch_size, shuffle=False)


class DictLM(LitTiny):
    """Dict batches ``{"input_ids", "attention_mask", "labels"}`` (padding = mask 0), the loss a
    masked mean that is 0, not NaN, on a batch that is all padding."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(input_ids)

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"])
        keep = batch["attention_mask"].flatten().float()
        per_token = F.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), reduction="none"
        )
        loss = (per_token * keep).sum() / keep.sum().clamp_min(1.0)
        self.log("train/loss", loss)
        return loss


def padded_dict_loader(padding_only_batches: Sequence[int], batch_size: int = 16) -> DataLoader:
    """``token_loader``'s data as dict samples; every sample of the listed batches is padding."""
    ids, targets = token_loader(batch_size=batch_size).dataset.tensors
    mask = torch.ones_like(ids)
    for b in padding_only_batches:
        mask[b * batch_size : (b + 1) * batch_size] = 0
    samples = [
        {"input_ids": ids[i], "attention_mask": mask[i], "labels": targets[i]}
        for i in range(len(ids))
    ]
    return DataLoader(samples, batch_size=batch_size, shuffle=False)


class ScaledLM(LitTiny):
    """A stream of huge activations: the embedding times ``scale``, plus ``offset`` times a
    fixed unit vector in every row (float32 forward, as a real model would run it)."""

    def __init__(self, scale: float = 1.0, offset: float = 0.0, **kw: Any) -> None:
        super().__init__(**kw)
        g = torch.Generator().manual_seed(7)
        u = torch.randn(self.model.ln_f.normalized_shape[0], generator=g)
        self.register_buffer("offset_dir", offset * u / u.norm())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.wte(idx) + m.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = x * self.hparams.scale + self.offset_dir
        for block in m.h:
            x = block(x)
        return m.head(m.ln_f(x))


class SparseFeatureModel(nn.Module):
    """Sparse bag-of-features input -> ``encoder`` Linear -> pre-norm MLP blocks -> head."""

    def __init__(self, features: int = 64, d: int = 16, layers: int = 2, classes: int = 4):
        super().__init__()
        self.encoder = nn.Linear(features, d)
        self.h = nn.ModuleList(
            nn.ModuleDict(
                {"ln": nn.LayerNorm(d), "fc": nn.Linear(d, 2 * d), "proj": nn.Linear(2 * d, d)}
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encoder(x.to_sparse())  # a sparse COO input: the encoder's hook cannot reshape it
        for block in self.h:
            x = x + block["proj"](F.gelu(block["fc"](block["ln"](x))))
        return self.head(self.ln_f(x))


class LitSparse(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = SparseFeatureModel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def sparse_loader(n: int = 128, features: int = 64, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(n, features, generator=g) < 0.1).float()
    y = (x[:, :4].sum(1) % 4).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class NoNormLit(L.LightningModule):
    """A model with no normalisation layer at all (an MLP regressor)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = self(batch[0]).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def regression_loader(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g)), batch_size=8)


__all__ = [
    "DDFailingCSVLogger",
    "DictLM",
    "FeatureLM",
    "FreeLayerNorm",
    "LitSparse",
    "NarrowingLM",
    "NoNormLit",
    "ScaledLM",
    "corrupt_feature_loader",
    "padded_dict_loader",
    "regression_loader",
    "sparse_loader",
]
