"""Real text found on every machine: the Python standard library's own source, read at run
time (no download, no data committed, the same bytes on every machine with the same Python), cut
into byte-level next-token windows for the example GPT."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

# The demo's corpus and `normscope scan`'s default are the same files: one definition.
from normscope.cli.data import stdlib_files, stdlib_root


def stdlib_text(max_bytes: int = 4_000_000) -> bytes:
    """The Python standard library's own sources, sorted by path, concatenated, truncated.

    Args:
        max_bytes: at most this many bytes (CPython 3.11 has about 11 MB to give).

    Returns:
        The bytes; the same on every machine with the same Python version.

    Raises:
        RuntimeError: fewer than 10,000 bytes of source were found (a stripped Python).

    Example::

        >>> text = stdlib_text(100_000)
        >>> len(text), b"import" in text
        (100000, True)
    """
    root = stdlib_root()
    chunks, total = [], 0
    for path in stdlib_files(root):
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:  # an unreadable file is skipped, not fatal
            continue
        chunks.append(data)
        total += len(data)
    text = b"".join(chunks)[:max_bytes]
    if len(text) < min(max_bytes, 10_000):
        raise RuntimeError(f"found only {len(text)} bytes of standard-library source under {root}")
    return text


class ByteDataset(Dataset):
    """Random windows of ``block_size + 1`` bytes as ``(x, y)`` next-byte pairs, seeded.

    Args:
        data: the bytes as a 1-D ``uint8`` tensor.
        block_size: tokens per example; ``y`` is ``x`` shifted by one byte.
        samples: number of windows (the dataset's length).
        seed: seed of the window starts.
    """

    def __init__(self, data: torch.Tensor, block_size: int, samples: int, seed: int) -> None:
        if len(data) < block_size + 2:
            raise ValueError(f"ByteDataset needs > {block_size + 1} bytes, got {len(data)}")
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
    """Train and validation loaders over the standard library's source.

    The split is by position (the last ``val_fraction`` of the bytes, i.e. other modules), so
    validation windows never overlap training ones.

    Args:
        block_size: tokens per example.
        batch_size: examples per batch.
        seed: seed of the training windows (validation uses ``seed + 1``).
        val_fraction: share of the text held out, in ``(0, 1)``.
        max_bytes: how much text to read (see :func:`stdlib_text`).
        train_samples, val_samples: windows per epoch in each loader.

    Returns:
        ``(train_loader, val_loader)``; ``train_loader.dataset.data`` is the training bytes.

    Example::

        >>> train, val = make_dataloaders(block_size=16, batch_size=4, max_bytes=200_000)
        >>> x, y = next(iter(train))
        >>> tuple(x.shape), bool((x[:, 1:] == y[:, :-1]).all())
        ((4, 16), True)
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"make_dataloaders val_fraction must be in (0, 1), got {val_fraction}")
    data = torch.frombuffer(bytearray(stdlib_text(max_bytes)), dtype=torch.uint8)
    cut = int(len(data) * (1 - val_fraction))
    train = ByteDataset(data[:cut], block_size, train_samples, seed)
    val = ByteDataset(data[cut:], block_size, val_samples, seed + 1)
    return (
        DataLoader(train, batch_size=batch_size, shuffle=False),
        DataLoader(val, batch_size=batch_size, shuffle=False),
    )
