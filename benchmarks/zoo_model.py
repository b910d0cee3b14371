"""The pathology zoo's model (benchmarks/pathology_zoo.py): a compact transformer whose every
switch is one of the zoo's causes, and whose attention is computed by hand so that the ground
truth (the largest pre-softmax logit, the attention entropy) is read outside normscope.

``ZooNet(ZooConfig(...))``: 4 layers x width 64 by default; pre-norm (``post_norm=False``) or
post-norm; LayerNorm or RMSNorm (torch's own modules, so normscope finds them by class);
biases on or off; qk-layernorm on or off (functional, with its own gains: not a norm *module*,
so the monitor's layout is the same with and without it); identity skips on or off
(``skips=False``: Dong et al. 2021's rank collapse); a switch that poisons one sequence's
embedding with NaN (the non-finite pathology). Not part of the package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ZooConfig:
    vocab: int = 256
    block: int = 32
    layers: int = 4
    heads: int = 4
    width: int = 64
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    bias: bool = True
    post_norm: bool = False
    qk_norm: bool = False
    skips: bool = True
    causal: bool = True


def make_norm(cfg: ZooConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.width, bias=cfg.bias)
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.width)
    raise ValueError(f"norm must be layernorm or rmsnorm, got {cfg.norm!r}")


class Attention(nn.Module):
    """Multi-head self-attention with explicit logits. After each forward ``max_logit`` (the
    largest |pre-softmax logit| over heads and unmasked pairs) and ``entropy`` (the mean
    attention entropy per query, nats) hold that forward's values, detached."""

    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__()
        self.heads, self.causal = cfg.heads, cfg.causal
        hd = cfg.width // cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=cfg.bias)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=cfg.bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Wortsman et al. 2023's mitigation: LayerNorm on queries and keys
            self.q_gain = nn.Parameter(torch.ones(hd))
            self.k_gain = nn.Parameter(torch.ones(hd))
        self.max_logit = math.nan
        self.entropy = math.nan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.qk_norm:
            hd = q.shape[-1]
            q = F.layer_norm(q, (hd,)) * self.q_gain
            k = F.layer_norm(k, (hd,)) * self.k_gain
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            logits = logits.masked_fill(~mask, float("-inf"))
        att = logits.softmax(dim=-1)
        with torch.no_grad():
            finite = logits[torch.isfinite(logits)]
            self.max_logit = float(finite.abs().max()) if finite.numel() else math.nan
            if torch.isnan(logits).any():
                self.max_logit = math.nan
            plogp = torch.where(att > 0, att * att.clamp_min(1e-30).log(), torch.zeros_like(att))
            self.entropy = float(-plogp.sum(-1).mean())
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.width, cfg.width, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln_1, self.attn = make_norm(cfg), Attention(cfg)
        self.ln_2, self.mlp = make_norm(cfg), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.post_norm:  # the original Transformer: norm after the sum
            x = self.ln_1(x + self.attn(x))
            return self.ln_2(x + self.mlp(x))
        if not self.cfg.skips:  # Dong et al. 2021: no identity path
            x = self.attn(self.ln_1(x))
            return self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ZooNet(nn.Module):
    """``forward(idx) -> (the final norm's output, the stream entering it)``; ``head`` maps the
    output to logits (language modelling)."""

    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.block, cfg.width)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = make_norm(cfg) if not cfg.post_norm else nn.Identity()
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.poison = False  # True: the next forward's first sequence embeds as NaN
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        if self.poison:
            x = x.clone()
            x[0] = float("nan")
        for block in self.h:
            x = block(x)
        return self.ln_f(x), x

    def attentions(self) -> list[Attention]:
        return [b.attn for b in self.h]

    def norms(self) -> dict[str, nn.Module]:
        return {n: m for n, m in self.named_modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))}
