"""Per-source reads: an intrinsic dead direction versus a distribution-dependent one.

Two calibration sources, ``prose`` (token ids 0..31) and ``code`` (token ids 32..63, whose
embeddings carry a marker along one channel). A tiny pre-norm transformer trains on a mixture
of both; at ``--cancel-at`` the MLP branch of block ``--cancel-layer`` starts cancelling a
rank-4 part of the stream:

* ``--mode source`` (default): only on ``code`` rows (a gate on the marker channel). The code
  source's ``sigma_min`` collapses at that sublayer; prose stays healthy; the pooled read dips
  only mildly: a monitor of the pooled covariance alone would not say what is going on.
* ``--mode intrinsic``: on every row: every source collapses there.

``DeadDirectionMonitor(sources="source")`` reads each batch's ``source`` field (one label per
sample), keeps a float64 accumulator per source and residual point, logs
``dd.<source>/<point>/<metric>`` next to the unchanged pooled ``dd/...`` keys, classifies the
collapse (``dd/collapse_class``: 1 intrinsic, 2 distribution-dependent) and alerts with the
source named.

    python -m examples.sources                    # distribution-dependent collapse
    python -m examples.sources --mode intrinsic   # intrinsic collapse
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from normscope import DeadDirectionMonitor

VOCAB = 64
CODE_FIRST = 32  # token ids >= this are the "code" source
MARKER = 6.0  # the code tokens' embedding offset along channel 0


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.cancel = 0.0  # > 0: the MLP branch also removes part of the stream
        self.gated = True  # True: only on the rows of code tokens (the code source)
        self.code_rows: torch.Tensor | float = 1.0  # (batch, tokens, 1), set by SourceLM
        self.register_buffer("proj", torch.zeros(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        f = self.mlp(self.ln_2(x))
        if self.cancel:
            gate = self.code_rows if self.gated else 1.0
            f = f - self.cancel * gate * (x @ self.proj)
        return x + f


class SourceLM(nn.Module):
    """A pre-norm LM whose code tokens carry a marker channel (channel 0); its cancelling
    branch (:meth:`set_cancel`) can act on the code tokens' rows alone."""

    def __init__(self, d: int = 16, layers: int = 3, heads: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(64, d)
        marker = torch.zeros(VOCAB, d)
        marker[CODE_FIRST:, 0] = MARKER
        self.register_buffer("marker", marker)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.marker[input_ids] + self.wpe(pos)
        code_rows = (input_ids >= CODE_FIRST).to(x.dtype)[..., None]
        for block in self.h:
            block.code_rows = code_rows
            x = block(x)
        return self.head(self.ln_f(x))

    def set_cancel(
        self, layer: int, strength: float, *, gated: bool, rank: int = 4, seed: int = 0
    ) -> None:
        """The MLP branch of block ``layer`` subtracts ``strength`` times the stream's
        projection on ``rank`` random directions orthogonal to the marker channel; ``gated``:
        on the rows of code tokens only (the branch reads the token ids)."""
        d = self.ln_f.normalized_shape[0]
        g = torch.Generator().manual_seed(seed)
        basis = torch.randn(d, rank, generator=g)
        basis[0] = 0.0  # orthogonal to the marker: the gate stays what it was
        q, _ = torch.linalg.qr(basis)
        block = self.h[layer]
        block.proj.copy_(q @ q.T)
        block.cancel = strength
        block.gated = gated


class Mixture(Dataset):
    """Next-token samples, ``code_share`` of them code: each source its own Markov chain on its
    own token range. Items are dicts: ``input_ids``, ``labels``, ``source`` (a str)."""

    def __init__(self, n: int = 512, t: int = 16, code_share: float = 0.5, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        half = VOCAB // 2
        chains = [torch.softmax(3 * torch.randn(half, half, generator=g), 1) for _ in range(2)]
        n_code = round(n * code_share)
        self.items = []
        for i in range(n):
            src = 1 if (i * n_code) // n != ((i + 1) * n_code) // n else 0  # interleaved
            seq = torch.zeros(t + 1, dtype=torch.long)
            seq[0] = torch.randint(half, (1,), generator=g)
            for j in range(t):
                seq[j + 1] = torch.multinomial(chains[src][seq[j]], 1, generator=g)
            seq = seq + src * CODE_FIRST
            self.items.append(
                {"input_ids": seq[:-1], "labels": seq[1:], "source": ("prose", "code")[src]}
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


class LitSource(L.LightningModule):
    def __init__(
        self,
        lr: float = 1e-3,
        cancel_at: int | None = 20,
        cancel_layer: int = 1,
        strength: float = 0.95,
        gated: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = SourceLM()

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        return self.model(input_ids)

    def on_train_batch_start(self, batch, batch_idx):
        hp = self.hparams
        if hp.cancel_at is not None and self.global_step == hp.cancel_at:
            self.model.set_cancel(hp.cancel_layer, hp.strength, gated=hp.gated)

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> DeadDirectionMonitor:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("source", "intrinsic"), default="source")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--cancel-at", type=int, default=20)
    p.add_argument("--cancel-layer", type=int, default=1)
    p.add_argument("--code-share", type=float, default=0.25)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    module = LitSource(
        cancel_at=args.cancel_at, cancel_layer=args.cancel_layer, gated=args.mode == "source"
    )
    loader = DataLoader(Mixture(code_share=args.code_share), batch_size=32, shuffle=False)
    monitor = DeadDirectionMonitor(
        every_n_steps=args.every,
        sources="source",
        # every row: each source's own profile decides from 4 d of its own rows, and the code
        # source is a quarter of them (the default, 8 d pooled, leaves it undecided)
        rows_per_read="all",
        alerts=("log",),
        verbose=not args.quiet,
        overhead_warn=None,
    )
    trainer = L.Trainer(
        max_steps=args.steps,
        callbacks=[monitor],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, loader)
    report = monitor.last_report
    if report is not None and not args.quiet:
        m = report.as_dict()
        print(f"pooled sigma_min_ratio_min {m.get('dd/sigma_min_ratio_min', math.nan):.3g}")
        for name in report.sources:
            print(f"{name}: sigma_min_ratio_min {m[f'dd.{name}/sigma_min_ratio_min']:.3g}")
        for c in report.collapses:
            print(f"{c.point} (depth {c.depth}): {c.kind}; below: {c.below}, above: {c.above}")
        for a in monitor.alerts_fired:
            print(f"alert at step {a.step}: {a.message}")
    return monitor


if __name__ == "__main__":
    main()
