"""A small pre-norm GPT: the model alone, in the spirit of Karpathy's nanoGPT ``model.py``.

GPT-2 module names (``transformer.h.0.ln_1`` ...), LayerNorm or RMSNorm by a flag, byte-level
tokens, and a switch that makes one block's MLP cancel part of the stream (the collapse example).
Its data is in ``examples/data.py``, the LightningModule in ``examples/lit_gpt.py``, and a plain
training run in ``examples/train_gpt.py``. Shared by the demo (``python -m examples.demo``), the
collapse example, the tests and the benchmarks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

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

    Why this breaks the no-cancellation hypothesis of docs/metrics.md §1.4: the cancel term alone
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


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (>= 2-D) only, as nanoGPT does."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr)
