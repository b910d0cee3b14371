"""A small pre-norm GPT, real text found on every machine, and a LightningModule around them.

Shared by the demo run (``examples/demo.py``), the collapse example, the tests and the
benchmarks. One readable file in the spirit of Karpathy's nanoGPT ``model.py``: GPT-2 module
names (``transformer.h.0.ln_1`` ...), LayerNorm or RMSNorm by a flag, byte-level tokens.

The text is the Python standard library's own source, read at run time: no download, no data
committed, the same bytes on every machine with the same Python.

    python examples/nanogpt.py                  # 300 plain AdamW steps; prints loss and step time
    python examples/nanogpt.py --norm rmsnorm

Measured on a shared 2-core CPU, default config, batch 32 x 64 bytes, forward + backward +
AdamW: 0.20-0.33 s a step with one thread (300 steps in 100 s while other jobs ran), 1.0-1.1 s
with two threads when another process held a core. The loss goes from 5.34 at step 0 to about 2.4
after 300 steps (lr 3e-3, 20 warm-up steps).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

# The demo's corpus and `normscope scan`'s default are the same files: one definition.
from normscope.cli.data import stdlib_files, stdlib_root

NORMS = ("layernorm", "rmsnorm")


@dataclass
class GPTConfig:
    """Shape of the GPT. The defaults train 300 steps on two CPU cores in well under a minute."""

    vocab_size: int = 256  # bytes
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    dropout: float = 0.0
    bias: bool = True


def make_norm(config: GPTConfig) -> nn.Module:
    """torch's own ``nn.LayerNorm`` or ``nn.RMSNorm`` over ``n_embd``, as ``config.norm`` says."""
    if config.norm == "layernorm":
        return nn.LayerNorm(config.n_embd, bias=config.bias)
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd)
    raise ValueError(f"GPTConfig.norm must be one of {NORMS}, got {config.norm!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({config.n_embd}) must be a multiple of n_head ({config.n_head})"
            )
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, c / heads)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    """The GPT-2 GELU MLP, with a switch that makes the branch cancel part of the stream.

    With ``cancel = s > 0`` the branch output becomes ``f(x) = mlp(ln_2(x)) - s * x P``, where
    ``x`` is the block's *stream* (passed in as ``stream``, not ``ln_2(x)``: the norm would
    rescale it) and ``P`` is the orthogonal projector onto ``cancel_rank`` fixed random
    directions. After the skip, ``x + f(x) = x (I - s P) + mlp(ln_2(x))``: along ``P`` the
    stream keeps only ``1 - s`` of itself, so its smallest singular value drops at this
    sublayer (to about ``1 - s`` of a typical one when the rest of the branch is small).

    Why this breaks the no-cancellation hypothesis of METRICS.md §1.4: the cancel term alone
    gives ``<x, -s x P> = -s ||x P||^2 < 0`` for every row with a component in ``P``, and for
    ``v`` in the range of ``P`` the quadratic form of ``X^T F + F^T X`` is ``-2 s ||X v||^2``:
    not positive semi-definite, so ``sigma_min`` is free to fall.

    ``cancel`` is a plain float (set it directly, or with :meth:`set_cancel`); at 0 the branch
    is the ordinary MLP, bit for bit. ``P`` is a non-persistent buffer rebuilt from its seed,
    so checkpoints do not carry it and switching the term on never touches the global RNG.
    """

    def __init__(self, config: GPTConfig, cancel_rank: int = 8, cancel_seed: int = 0) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.cancel = 0.0
        self.register_buffer(
            "cancel_projector", torch.zeros(config.n_embd, config.n_embd), persistent=False
        )
        self._build_projector(cancel_rank, cancel_seed)

    def _build_projector(self, rank: int, seed: int) -> None:
        d = self.cancel_projector.shape[0]
        if not 1 <= rank <= d:
            raise ValueError(f"MLP cancel rank must be in [1, n_embd={d}], got {rank}")
        g = torch.Generator().manual_seed(seed)  # own generator: the model's init RNG is untouched
        q, _ = torch.linalg.qr(torch.randn(d, rank, generator=g, dtype=torch.float64))
        self.cancel_projector.copy_((q @ q.T).to(self.cancel_projector))
        self.cancel_rank = rank

    def set_cancel(self, strength: float, rank: int | None = None, seed: int | None = None) -> None:
        """Switch the cancelling term on (``strength > 0``) or off (``0``).

        Args:
            strength: ``s`` in ``f(x) = mlp(ln_2(x)) - s * x P``; ``0 <= s``. ``s = 1`` removes
                the stream's component along ``P`` entirely.
            rank: if given, rebuild ``P`` onto this many random directions.
            seed: if given (or with ``rank``), the seed of those directions (default 0).

        Example::

            >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2))
            >>> model.transformer.h[0].mlp.set_cancel(0.95)
            >>> model.transformer.h[0].mlp.cancel
            0.95
        """
        if not strength >= 0:
            raise ValueError(f"MLP cancel strength must be >= 0, got {strength}")
        if rank is not None or seed is not None:
            self._build_projector(rank or self.cancel_rank, seed or 0)
        self.cancel = float(strength)

    def forward(self, h: torch.Tensor, stream: torch.Tensor | None = None) -> torch.Tensor:
        out = self.c_proj(self.gelu(self.c_fc(h)))
        if self.cancel and stream is not None:
            out = out - self.cancel * (stream @ self.cancel_projector)
        return out


class Block(nn.Module):
    """Pre-norm block: the inputs of ``ln_1`` and ``ln_2`` are the residual stream itself."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x), stream=x)  # the stream goes in for the cancel switch only
        return x


class GPT(nn.Module):
    """Byte-level GPT-2 in miniature: ``forward(idx, targets=None) -> (logits, loss)``.

    Args:
        config: the shape; see :class:`GPTConfig`.

    Example::

        >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        >>> idx, targets = torch.randint(0, 256, (2, 3, 16))
        >>> logits, loss = model(idx, targets)
        >>> tuple(logits.shape), abs(loss.item() - 5.545) < 0.1   # about ln 256 at init
        ((3, 16, 256), True)
    """

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
        if t > self.config.block_size:
            raise ValueError(f"GPT input has {t} tokens; block_size is {self.config.block_size}")
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


# --------------------------------------------------------------------------- Lightning
def lr_lambda(step: int, warmup_steps: int, decay_steps: int | None) -> float:
    """Linear warm-up to 1, then constant, or cosine down to 0.1 by ``decay_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_steps is None or decay_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (decay_steps - warmup_steps))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


class LitGPT(L.LightningModule):
    """The GPT as a LightningModule; module paths inside are ``model.transformer.h.0.ln_1`` etc.

    Args:
        config: the GPT's shape (a :class:`GPTConfig`, or its dict as saved in a checkpoint).
        lr: AdamW's peak learning rate.
        warmup_steps: optimiser steps of linear warm-up.
        lr_decay_steps: if set, cosine decay to 10% of ``lr`` by this step; else constant.
        weight_decay: applied to matrices only. Norm gammas and biases are not decayed: decay
            would shrink the gammas for a reason outside the model, and the gamma reads watch them.
        cancel_at_step: from this optimiser step on, the MLP of block ``cancel_layer`` cancels
            part of the stream with strength ``cancel_strength`` (see :class:`MLP`).

    Example::

        >>> module = LitGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2), lr=1e-3)
        >>> module.hparams.lr, type(module.get_submodule("model.transformer.h.0.ln_1")).__name__
        (0.001, 'LayerNorm')
    """

    def __init__(
        self,
        config: GPTConfig | dict[str, Any] | None = None,
        lr: float = 3e-3,
        warmup_steps: int = 20,
        lr_decay_steps: int | None = None,
        weight_decay: float = 0.01,
        cancel_at_step: int | None = None,
        cancel_layer: int = 2,
        cancel_strength: float = 0.95,
    ) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = GPTConfig(**config)
        config = config or GPTConfig()
        if cancel_at_step is not None and not 0 <= cancel_layer < config.n_layer:
            raise ValueError(f"cancel_layer must be in [0, {config.n_layer}), got {cancel_layer}")
        self.save_hyperparameters(
            {
                "config": asdict(config),
                "lr": lr,
                "warmup_steps": warmup_steps,
                "lr_decay_steps": lr_decay_steps,
                "weight_decay": weight_decay,
                "cancel_at_step": cancel_at_step,
                "cancel_layer": cancel_layer,
                "cancel_strength": cancel_strength,
            }
        )
        self.model = GPT(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        hp = self.hparams
        if hp.cancel_at_step is not None and self.global_step >= hp.cancel_at_step:
            mlp = self.model.transformer.h[hp.cancel_layer].mlp
            if mlp.cancel != hp.cancel_strength:  # also right after a resume past the step
                mlp.set_cancel(hp.cancel_strength)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val/loss", loss, prog_bar=True)

    def configure_optimizers(self):
        hp = self.hparams
        opt = make_optimizer(self.model, hp.lr, hp.weight_decay)
        warm, decay = max(1, hp.warmup_steps), hp.lr_decay_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warm, decay))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (>= 2-D) only, as nanoGPT does."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr)


# --------------------------------------------------------------------------- a plain run
def main(argv: list[str] | None = None) -> list[float]:
    """Train with a plain loop (no Lightning) and print the loss and the step time."""
    p = argparse.ArgumentParser(description="Train the example GPT on stdlib source, plainly.")
    p.add_argument("--norm", choices=NORMS, default="layernorm")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    # One thread: on a shared 2-core machine two threads ran 5x slower (1.1 s vs 0.2 s a step)
    # whenever another process held a core, as OpenMP threads wait on each other.
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPTConfig(norm=args.norm)
    model = GPT(config)
    train, _ = make_dataloaders(config.block_size, args.batch_size, seed=0)
    opt = make_optimizer(model, args.lr, 0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, 20, None))
    losses, batches, t0 = [], iter(train), time.perf_counter()
    for step in range(args.steps):
        x, y = next(batches)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.3f}")
    took = time.perf_counter() - t0
    print(f"{args.steps} steps in {took:.1f} s ({1e3 * took / args.steps:.0f} ms/step)")
    return losses


if __name__ == "__main__":
    main()
