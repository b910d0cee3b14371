"""normscope in a LitGPT-style Lightning Fabric loop, and the same for a ViT.

LitGPT's own ``pretrain.py`` and ``finetune/*`` build their ``Fabric`` without callbacks, so a
LitGPT user copies its loop and adds the monitor -- the complete recipe, four lines::

    monitor = DeadDirectionMonitor(every_n_steps=...)
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[monitor], loggers=CSVLogger(...))
    ...
    fabric.call("on_train_batch_start", fabric, model, batch, i)        # before the forward
    ...forward, fabric.backward(loss), optimizer.step()...
    fabric.call("on_train_batch_end", fabric, model, loss, batch, i)    # after optimizer.step()
    ...
    fabric.call("on_fit_end", fabric, model)  # the last read published, every hook removed

Four LitGPT block structures (``--model``), tiny sizes:

* ``pythia``: GPT-NeoX / Pythia parallel residual with LayerNorm,
  ``x + attn(norm_1(x)) + mlp(norm_2(x))``;
* ``sequential``: sequential LayerNorm, ``x = x + attn(norm_1(x)); x = x + mlp(norm_2(x))``;
* ``llama``: sequential with RMSNorm and the SwiGLU ``LLaMAMLP``;
* ``gemma``: sequential with Gemma's unit-offset RMSNorm (the gain is ``1 + w``), ``GemmaMLP``
  and embeddings scaled by ``sqrt(n_embd)``;

and ``vit``: a timm-style ViT with 4x4 patches (:mod:`examples.vit`) on synthetic images.

When ``litgpt`` can be imported the four are ``litgpt.GPT(litgpt.Config(...))`` itself. Else
the same structures are built here, with LitGPT's module names (``transformer.h.<i>.norm_1``,
``attn``, ``norm_2``, ``mlp``, ``transformer.ln_f``) and its ``Block.forward`` for each: the
metric keys are those of a real LitGPT run, and from the same weights the logits are litgpt's
(``tests/examples/test_litgpt_fabric.py`` checks it where litgpt imports). ``litgpt`` is not in
the test extra: litgpt 0.5.13 pins ``huggingface-hub<1.4``, the ``transformers`` 5.25 here
needs ``>=2.4``, and pip's fallback, litgpt 0.5.9, pins ``numpy<2`` and ``psutil==7``.

    python -m examples.litgpt_fabric --model pythia --steps 20
    python -m examples.litgpt_fabric --model vit --steps 20 --every 5
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch import nn

from examples.vit import ViT, synthetic_images
from normscope import DeadDirectionMonitor

__all__ = ["GPT", "MODELS", "Config", "RMSNorm", "build", "have_litgpt", "main", "train"]

MODELS = ("pythia", "sequential", "llama", "gemma", "vit")

#: ``litgpt.Config`` arguments of each style (the hand-built :class:`Config` takes the same)
STYLES: dict[str, dict[str, Any]] = {
    "pythia": dict(
        name="tiny-pythia",
        parallel_residual=True,
        norm_class_name="LayerNorm",
        mlp_class_name="GptNeoxMLP",
        bias=True,
        rotary_percentage=0.25,
    ),
    "sequential": dict(
        name="tiny-sequential",
        parallel_residual=False,
        norm_class_name="LayerNorm",
        mlp_class_name="GptNeoxMLP",
        bias=True,
        rotary_percentage=1.0,
    ),
    "llama": dict(
        name="tiny-llama",
        parallel_residual=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        bias=False,
        rotary_percentage=1.0,
    ),
    "gemma": dict(  # litgpt gives RMSNorm its unit offset when "Gemma" is in the name
        name="tiny-Gemma",
        parallel_residual=False,
        norm_class_name="RMSNorm",
        mlp_class_name="GemmaMLP",
        bias=False,
        scale_embeddings=True,
        gelu_approximate="tanh",
        rotary_percentage=1.0,
    ),
}


def have_litgpt() -> bool:
    try:
        import litgpt  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------- LitGPT's blocks, by hand
@dataclass
class Config:
    """The part of ``litgpt.Config`` these four styles use."""

    name: str = ""
    block_size: int = 32
    vocab_size: int = 256
    padded_vocab_size: int = 256
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    intermediate_size: int = 256
    parallel_residual: bool = False
    norm_class_name: str = "LayerNorm"
    norm_eps: float = 1e-5
    mlp_class_name: str = "GptNeoxMLP"
    bias: bool = True
    rotary_percentage: float = 0.25  # litgpt.Config's default
    rope_base: int = 10000
    scale_embeddings: bool = False
    gelu_approximate: str = "none"

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rope_n_elem(self) -> int:
        return int(self.rotary_percentage * self.head_size)

    def norm(self) -> nn.Module:
        """``config.norm_class(n_embd, eps=norm_eps)`` as litgpt builds it."""
        if self.norm_class_name == "RMSNorm":
            return RMSNorm(self.n_embd, eps=self.norm_eps, add_unit_offset="Gemma" in self.name)
        return nn.LayerNorm(self.n_embd, eps=self.norm_eps)


class RMSNorm(nn.Module):
    """litgpt's ``RMSNorm``: ``x / rms(x) * w`` in float32; with ``add_unit_offset`` (Gemma) the
    gain is ``1 + w``. ``w`` starts at ones in both (as litgpt initialises it)."""

    def __init__(self, size: int, dim: int = -1, eps: float = 1e-6, add_unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim
        self.add_unit_offset = add_unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        weight = (1 + self.weight) if self.add_unit_offset else self.weight
        return (x_normed * weight.float()).to(dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    """litgpt's attention without KV cache or grouped queries: fused ``qkv``, RoPE on the first
    ``rope_n_elem`` dims of each head, causal SDPA, ``proj``."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        c = self.config
        q, k, v = self.qkv(x).view(b, t, 3, c.n_head, c.head_size).permute(2, 0, 3, 1, 4)
        n = c.rope_n_elem
        q = torch.cat((apply_rope(q[..., :n], cos, sin), q[..., n:]), dim=-1)
        k = torch.cat((apply_rope(k[..., :n], cos, sin), k[..., n:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GptNeoxMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.config.gelu_approximate))


class LLaMAMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class GemmaMLP(LLaMAMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.fc_1(x), approximate=self.config.gelu_approximate)
        return self.proj(gate * self.fc_2(x))


_MLPS = {"GptNeoxMLP": GptNeoxMLP, "LLaMAMLP": LLaMAMLP, "GemmaMLP": GemmaMLP}


class Block(nn.Module):
    """litgpt's ``Block`` (no post-branch norms, no shared attention norm)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.norm_1 = config.norm()
        self.attn = CausalSelfAttention(config)
        self.post_attention_norm = nn.Identity()
        self.norm_2 = config.norm()
        self.mlp = _MLPS[config.mlp_class_name](config)
        self.post_mlp_norm = nn.Identity()
        self.config = config

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # as litgpt writes it: parallel  x + attn(norm_1(x)) + mlp(norm_2(x))
        #                      sequential x = x + attn(norm_1(x)); x + mlp(norm_2(x))
        x_normed = self.norm_1(x)
        attention_output = self.post_attention_norm(self.attn(x_normed, cos, sin))
        if self.config.parallel_residual:
            x_normed = self.norm_2(x)
            x = attention_output + x
        else:
            x = attention_output + x
            x_normed = self.norm_2(x)
        return self.post_mlp_norm(self.mlp(x_normed)) + x


class GPT(nn.Module):
    """litgpt's ``GPT``: ``transformer.wte``, ``transformer.h``, ``transformer.ln_f``,
    ``lm_head``; ``forward(idx)`` gives the logits."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=config.norm(),
            )
        )
        n = config.rope_n_elem
        theta = 1.0 / (config.rope_base ** (torch.arange(0, n, 2).float() / n))
        angles = torch.outer(torch.arange(config.block_size).float(), theta).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        cos, sin = self.cos[:t].unsqueeze(0), self.sin[:t].unsqueeze(0)
        x = self.transformer.wte(idx)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        return self.lm_head(self.transformer.ln_f(x))

    def _init_weights(self, module: nn.Module) -> None:
        """litgpt's: normal(0, 0.02) weights, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


# ---------------------------------------------------------------- models and data
def build(
    model: str, *, n_layer: int = 2, n_embd: int = 64, use_litgpt: bool | None = None
) -> nn.Module:
    """The ``model`` style with ``n_layer`` blocks of width ``n_embd`` (a ViT: ``n_layer``
    blocks of width 192 -- wider than a 48-value patch whatever ``n_embd`` says).
    ``use_litgpt=None``: litgpt's own ``GPT`` when it imports, else the hand-built one."""
    if model == "vit":
        return ViT(image_size=32, patch_size=4, dim=192, depth=n_layer, heads=3, num_classes=4)
    if model not in STYLES:
        raise ValueError(f"--model must be one of {MODELS}, got {model!r}")
    args = dict(
        STYLES[model],
        block_size=32,
        vocab_size=256,
        padded_vocab_size=256,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=4,
        intermediate_size=4 * n_embd,
        norm_eps=1e-5,
    )
    if use_litgpt is None:
        use_litgpt = have_litgpt()
    if use_litgpt:
        import litgpt

        gpt = litgpt.GPT(litgpt.Config(**args))
    else:
        gpt = GPT(Config(**args))
    gpt.apply(gpt._init_weights)
    return gpt


def token_batches(batch_size: int, seq_len: int = 32, vocab: int = 256, seed: int = 0):
    """Endless ``(x, y)`` batches from a fixed random bigram chain: each token has 3 equally
    likely successors, so the loss falls from ``ln 256`` towards ``ln 3`` as the model learns
    it. More tokens than ``n_embd``: the embedded stream at ``p_0`` is full rank."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 3), generator=g)
    while True:
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch_size,), generator=g)
        for t in range(seq_len):
            pick = torch.randint(0, 3, (batch_size,), generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        yield tokens[:, :-1], tokens[:, 1:]


def image_batches(batch_size: int, seed: int = 0):
    """Endless ``(images, labels)`` batches of :func:`examples.vit.synthetic_images`."""
    k = 0
    while True:
        yield synthetic_images(batch_size, seed=seed + k)
        k += 1


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


# ---------------------------------------------------------------- the loop
def headline(monitor: DeadDirectionMonitor, step: int, loss: float) -> str:
    """One read's headline: the ratio floor, LayerNorm's alignment floor, what was found."""
    tracker, metrics = monitor.tracker, monitor.last_report.as_dict()
    layout = tracker.layout
    align = metrics.get("dd/gamma_alignment_min", math.nan)
    return (
        f"read at step {monitor.last_report.step:>3} (after step {step:>3}, loss {loss:.3f})  "
        f"sigma_min_ratio_min {metrics.get('dd/sigma_min_ratio_min', math.nan):.3f}  "
        f"gamma_alignment_min {'n/a (no LayerNorm)' if math.isnan(align) else f'{align:.6f}'}  "
        f"norms {len(tracker.norms)}  points {len(layout.points) if layout else 0} "
        f"({layout.style if layout else 'no stream'})"
    )


def train(
    model: str = "pythia",
    steps: int = 20,
    every: int = 5,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    batch_size: int | None = None,
    lr: float = 3e-3,
    log_dir: str = "lightning_logs",
    use_litgpt: bool | None = None,
    verbose: bool = False,
    seed: int = 0,
    quiet: bool = False,
    spectral_every: int | str = "auto",
) -> tuple[DeadDirectionMonitor, nn.Module, list[float]]:
    """Train ``model`` for ``steps`` optimiser steps in a Fabric loop with the monitor; return
    the monitor (closed: the model unhooked), the model (unwrapped) and the losses.

    ``batch_size`` (default 8 sequences of 32 tokens, or 16 images of 65 tokens): a read wants
    ``4 d`` rows per step (``min_rows_per_dim``); with fewer, the monitor keeps the window open
    for another step, and a window still open when the loop ends is not read.
    ``spectral_every``: the monitor's (``"auto"``: a ViT of width 192 reads one read in five
    spectral; 1 reads every read full)."""
    torch.manual_seed(seed)
    if batch_size is None:
        batch_size = 16 if model == "vit" else 8
    net = build(model, n_layer=n_layer, n_embd=n_embd, use_litgpt=use_litgpt)
    data = image_batches(batch_size, seed) if model == "vit" else token_batches(batch_size)

    # --- normscope: the monitor as a Fabric callback -----------------------------------------
    monitor = DeadDirectionMonitor(
        every_n_steps=every, verbose=verbose, spectral_every=spectral_every
    )
    fabric = Fabric(
        accelerator="cpu",
        devices=1,
        callbacks=[monitor],
        loggers=CSVLogger(log_dir, name=f"litgpt_fabric_{model}"),
    )
    # --- LitGPT's loop, cut to its bones ------------------------------------------------------
    fabric.seed_everything(seed, verbose=False)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    net, optimizer = fabric.setup(net, optimizer)
    losses: list[float] = []
    for i, batch in zip(range(steps), data):
        batch = fabric.to_device(batch)
        fabric.call("on_train_batch_start", fabric, net, batch, i)  # normscope
        loss = loss_of(net, batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reads = monitor.reads
        fabric.call("on_train_batch_end", fabric, net, loss, batch, i)  # normscope
        losses.append(loss.item())
        if monitor.reads > reads and not quiet:
            print(headline(monitor, i + 1, losses[-1]))
    fabric.call("on_fit_end", fabric, net)  # normscope: last read published, hooks removed
    for lg in fabric.loggers:
        lg.finalize("success")
    return monitor, net.module, losses


def main(argv: list[str] | None = None) -> DeadDirectionMonitor:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="pythia")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5, help="optimiser steps between reads")
    p.add_argument("--layers", type=int, default=2, help="blocks")
    p.add_argument("--width", type=int, default=64, help="n_embd of the GPTs (a ViT: 192)")
    p.add_argument("--batch-size", type=int, default=None, help="8 sequences / 16 images")
    p.add_argument("--log-dir", default="lightning_logs")
    p.add_argument("--hand-built", action="store_true", help="never use litgpt's own GPT")
    args = p.parse_args(argv)
    started = time.perf_counter()
    kind = "litgpt.GPT" if have_litgpt() and not args.hand_built else "hand-built"
    if args.model == "vit":
        kind = "hand-built ViT, 4x4 patches"
    print(f"{args.model} ({kind}): {args.layers} blocks, {args.steps} steps")
    monitor, model, losses = train(
        args.model,
        args.steps,
        args.every,
        n_layer=args.layers,
        n_embd=args.width,
        batch_size=args.batch_size,
        log_dir=args.log_dir,
        use_litgpt=False if args.hand_built else None,
    )
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    print(
        f"done in {time.perf_counter() - started:.1f}s: {monitor.reads} reads, loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f}, alerts {len(monitor.alerts_fired)}, "
        f"disabled {monitor.disabled}, forward hooks left on the model: {hooks}"
    )
    return monitor


if __name__ == "__main__":
    main()
