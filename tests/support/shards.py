"""What the DDP fits of ``distributed_fits.py`` train on, and the schedule of their reads: a
fixed dict dataset of ``token_loader``'s sequences with a right-padding ``attention_mask``
(rank 1's batch of step 0 all padding), each rank's shard of it as ``DistributedSampler``
(``shuffle=False``) deals it, the same samples naming their source, and the Lightning modules
that train on them. The tests rebuild a rank's batches from here (``shard_batches``), so that
one process can read the same rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tests.support.tiny_models import LitTiny, token_loader

BATCH = 16  # per rank
WORLD = 2
EXACT_EVERY = 3  # reads after steps 1, 3, 6 ...
EXACT_WINDOWS = (0, 2, 5)  # ... of the rows of these steps
EXACT_STOP = 6  # rank 1 alone asks to stop at the read of step 6 ...
EXACT_MAX_STEPS = 8  # ... so both ranks end at 6, not 8


def padding_length(i: int) -> int:
    """Valid tokens of sample ``i``; 0 for rank 1's samples of step 0 (all padding)."""
    if i % WORLD == 1 and i < WORLD * BATCH:
        return 0
    return 8 + (5 * i) % 9


class DictTokens(Dataset):
    """The ``token_loader`` sequences as dict samples with a right-padding ``attention_mask``."""

    def __init__(self) -> None:
        self.x, self.y = token_loader().dataset.tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = torch.zeros(self.x.shape[1], dtype=torch.long)
        mask[: padding_length(i)] = 1
        return {"input_ids": self.x[i], "attention_mask": mask, "labels": self.y[i]}


def shard_batches(step: int) -> list[dict[str, torch.Tensor]]:
    """The batch each rank trains on at ``step`` (``DistributedSampler``, ``shuffle=False``:
    rank ``r`` takes samples ``r, r + WORLD, ...``), in rank order."""
    data = DictTokens()
    out = []
    for rank in range(WORLD):
        idx = [rank + WORLD * (BATCH * step + j) for j in range(BATCH)]
        items = [data[i] for i in idx]
        out.append({k: torch.stack([it[k] for it in items]) for k in items[0]})
    return out


class LitDict(LitTiny):
    """``LitTiny`` on dict batches: ``forward(input_ids, attention_mask=None)``, as a Hugging
    Face model is called; the mask only tells the monitor which rows are padding. Its loader
    shards the data with ``DistributedSampler(shuffle=False)`` (Lightning's own sampler would
    shuffle a training set)."""

    def train_dataloader(self) -> DataLoader:
        data = DictTokens()
        sampler = DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.global_rank, shuffle=False
        )
        return DataLoader(data, batch_size=BATCH, sampler=sampler)

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> torch.Tensor:
        return self.model(input_ids)

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def source_of(i: int) -> str:
    """Sample ``i``'s source: rank 0 (even samples) sees ``a`` and ``c`` only, rank 1 (odd
    samples) ``a`` and ``b`` only; rank 1's first window is all padding (no row at all)."""
    return "b" if i % 4 == 1 else ("c" if i % 8 == 0 else "a")


class SourceTokens(DictTokens):
    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**super().__getitem__(i), "source": source_of(i)}


def source_batches(step: int) -> list[dict[str, Any]]:
    """``shard_batches`` with each sample's source, in rank order."""
    out = []
    for rank, batch in enumerate(shard_batches(step)):
        idx = [rank + WORLD * (BATCH * step + j) for j in range(BATCH)]
        out.append({**batch, "source": [source_of(i) for i in idx]})
    return out


class LitSources(LitDict):
    """``LitDict`` on samples that name their source (``source``: a str per sample)."""

    def train_dataloader(self) -> DataLoader:
        data = SourceTokens()
        sampler = DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.global_rank, shuffle=False
        )
        return DataLoader(data, batch_size=BATCH, sampler=sampler)

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, source: Any = None):
        return self.model(input_ids)
