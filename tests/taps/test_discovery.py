"""Residual discovery from the training step's own forward (issue 13): real Lightning fits on
the CPU, tiny models, a few steps each.

A LightningModule without ``forward()`` still gets its ``sigma_min`` profile; scaled branches
(``x + alpha * f``, a learned scalar, LayerScale, ``1/sqrt(2L)``) are found sublayer by
sublayer; a branch no module computes falls back to the block boundaries with one warning; a
model with no block stack says so once and logs ``dd/profile_points`` = 0.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normscope import DeadDirectionMonitor
from normscope.taps.residual import ResidualDiscovery, find_residual_points
from tests.support.fits import fit, read_csv, recorded_warnings, rows_with
from tests.support.tiny_models import Block, LitTiny, token_loader

D, HEADS, LAYERS, VOCAB = 16, 2, 2, 32


pytestmark = pytest.mark.usefixtures("one_thread")


def fit_warned(
    tmp_path: Path, module: L.LightningModule, monitor: DeadDirectionMonitor, steps: int
):
    """``fit`` on ``token_loader(vocab=VOCAB)``: the trainer and every warning's message."""
    with recorded_warnings() as caught:
        trainer = fit(tmp_path, module, monitor, steps=steps, loader=token_loader(vocab=VOCAB))
    return trainer, [str(w.message) for w in caught]


def reads(trainer: L.Trainer, key: str = "dd/profile_points") -> list[dict[str, str]]:
    return rows_with(read_csv(trainer), key)


def cancel_projector(d: int, rank: int = 8, seed: int = 0) -> torch.Tensor:
    """A rank-``rank`` orthogonal projector (the cancelling branch of examples/collapse_alert)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, rank, generator=g))
    return q @ q.T


class _Lit(L.LightningModule):
    """Shared training logic. No ``forward()``: ``training_step`` runs the layers inline."""

    def __init__(self, cancel_at_step: int | None = None, cancel_layer: int = 1) -> None:
        super().__init__()
        self.cancel_at_step, self.cancel_layer = cancel_at_step, cancel_layer
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(64, D)
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def on_train_batch_start(self, batch, batch_idx):
        if self.cancel_at_step is not None and self.global_step == self.cancel_at_step:
            block = self.h[self.cancel_layer]
            block.proj.copy_(cancel_projector(D))
            block.cancel = 0.95

    def training_step(self, batch, batch_idx):
        idx, y = batch
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class NoForward(_Lit):
    """The tiny LM's blocks held as attributes of the LightningModule, no ``forward()``."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.h = nn.ModuleList(Block(D, HEADS, nn.LayerNorm) for _ in range(LAYERS))


class ScaledBlock(nn.Module):
    """``x + c * attn(ln_1(x))`` then ``x + c * mlp(ln_2(x))``, with dropout modules inside the
    branches (discovery watches a training-mode forward), and the cancelling branch."""

    def __init__(self, scale: str) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.Dropout(0.1)
        )
        self.scale = scale
        if scale == "learned":
            self.alpha = nn.Parameter(torch.tensor(0.7))
        elif scale == "layerscale":
            self.gamma_1 = nn.Parameter(torch.linspace(0.05, 0.5, D))
            self.gamma_2 = nn.Parameter(torch.linspace(0.5, 0.05, D))
        self.cancel = 0.0
        self.register_buffer("proj", torch.zeros(D, D))

    def c(self, which: int) -> float | torch.Tensor:
        if self.scale == "alpha":
            return 0.5  # a python float: Granite's residual_multiplier
        if self.scale == "learned":
            return self.alpha
        if self.scale == "layerscale":
            return self.gamma_1 if which == 1 else self.gamma_2
        return 1 / math.sqrt(2 * LAYERS)  # muP-style depth scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.c(1) * self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        f = self.mlp(self.ln_2(x))
        if self.cancel:
            f = f - self.cancel * (x @ self.proj) / self.c(2)
        return x + self.c(2) * f


class Scaled(_Lit):
    def __init__(self, scale: str, **kw) -> None:
        super().__init__(**kw)
        self.h = nn.ModuleList(ScaledBlock(scale) for _ in range(LAYERS))


class MatmulBlock(nn.Module):
    """``x + x @ A + attn(ln_1(x))``: the matmul is no module, so the attention step cannot be
    told apart from the stream."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.A = nn.Parameter(0.1 * torch.randn(D, D))
        self.cancel = 0.0
        self.register_buffer("proj", torch.zeros(D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + x @ self.A + self.attn(h, h, h, need_weights=False)[0]
        f = self.mlp(self.ln_2(x))
        if self.cancel:
            f = f - self.cancel * (x @ self.proj)
        return x + f


class Matmul(_Lit):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.h = nn.ModuleList(MatmulBlock() for _ in range(LAYERS))


class NoStack(L.LightningModule):
    """Norm layers, but no stack of blocks: there is no residual stream to find."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def training_step(self, batch, batch_idx):
        idx, y = batch
        return F.cross_entropy(self.head(self.ln(self.wte(idx))).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


PRE_NORM_SUBLAYERS = [None, "attn", "mlp", "attn", "mlp"]


def test_module_without_forward_gets_a_profile(tmp_path):
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    trainer, caught = fit_warned(tmp_path, NoForward(), monitor, steps=6)
    assert not [m for m in caught if "residual profile disabled" in m], caught
    layout = monitor.tracker.layout
    assert [p.sublayer for p in layout.points] == PRE_NORM_SUBLAYERS
    assert layout.points[-1].name == "ln_f"
    rows = reads(trainer)
    # the baseline window is step 1 (step 0's forward is discovery's): reads after 2, 4, 6
    assert [int(r["step"]) for r in rows] == [2, 4, 6]
    assert {float(r["dd/profile_points"]) for r in rows} == {5.0}
    assert all(math.isfinite(float(r["dd/sigma_min_ratio_min"])) for r in rows)
    assert float(rows[-1]["dd/h.1.ln_2/n_rows"]) == 128  # rows_per_read's default, 8 d
    # discovery's temporary hooks are gone; the taps went with teardown
    assert not any(
        m._forward_hooks or m._forward_pre_hooks for m in monitor.tracker.model.modules()
    )


def test_module_without_forward_alerts_on_a_cancelling_branch(tmp_path):
    torch.manual_seed(0)
    caught_alerts = []
    monitor = DeadDirectionMonitor(
        every_n_steps=2, alerts=(caught_alerts.append,), stop_on_alert=True, verbose=False
    )
    trainer, _ = fit_warned(tmp_path, NoForward(cancel_at_step=4), monitor, steps=20)
    assert caught_alerts, "the cancelling branch must raise an alert"
    alert = caught_alerts[0]
    assert alert.rule == "sigma_min_collapse"
    assert alert.sublayer == "mlp" and ("h.1" in alert.point or "ln_f" in alert.point)
    assert alert.step >= 5 and alert.value < 0.8
    assert trainer.global_step < 20


@pytest.mark.parametrize("scale", ["alpha", "learned", "layerscale", "mup"])
def test_scaled_branches_are_found_sublayer_by_sublayer(tmp_path, scale):
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    trainer, caught = fit_warned(tmp_path, Scaled(scale), monitor, steps=2)
    layout = monitor.tracker.layout
    assert layout.fallback is None, layout.fallback
    assert [p.sublayer for p in layout.points] == PRE_NORM_SUBLAYERS, layout
    assert [p.name for p in layout.points] == [
        "h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"
    ]  # fmt: skip
    assert any(n.startswith("scaled branches") for n in layout.notes), layout.notes
    assert not [m for m in caught if "block boundaries" in m]
    (row,) = reads(trainer)
    assert float(row["dd/profile_points"]) == 5
    assert math.isfinite(float(row["dd/sigma_min_ratio_min"]))


@pytest.mark.parametrize("scale", ["alpha", "learned", "layerscale", "mup"])
def test_scaled_branch_models_alert_on_a_cancelling_branch(tmp_path, scale):
    torch.manual_seed(0)
    alerts = []
    monitor = DeadDirectionMonitor(
        every_n_steps=2, alerts=(alerts.append,), stop_on_alert=True, verbose=False
    )
    fit_warned(tmp_path, Scaled(scale, cancel_at_step=4), monitor, steps=20)
    assert alerts and alerts[0].rule == "sigma_min_collapse", alerts
    assert alerts[0].sublayer == "mlp" and alerts[0].step >= 5


def test_a_branch_no_module_computes_falls_back_to_block_boundaries(tmp_path):
    torch.manual_seed(0)
    alerts = []
    monitor = DeadDirectionMonitor(
        every_n_steps=2, alerts=(alerts.append,), stop_on_alert=True, verbose=False
    )
    trainer, caught = fit_warned(tmp_path, Matmul(cancel_at_step=4), monitor, steps=20)
    said = [m for m in caught if "block boundaries" in m]
    assert len(said) == 1, caught  # said once
    assert "h.0.ln_2" in said[0] and "x + x @ A" in said[0]
    layout = monitor.tracker.layout
    assert layout.fallback is not None
    assert [(p.name, p.where, p.sublayer) for p in layout.points] == [
        ("h.0", "input", None),
        ("h.0.output", "output", "block"),
        ("h.1.output", "output", "block"),
    ]
    assert "h.0.ln_2" not in layout.branch_norms
    assert {float(r["dd/profile_points"]) for r in reads(trainer)} == {3.0}
    # the block boundaries still see the collapse, at the cancelling block's output
    assert alerts and alerts[0].point == "h.1.output" and alerts[0].sublayer == "block"


def test_no_block_stack_says_so_once_and_logs_zero_points(tmp_path):
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    trainer, caught = fit_warned(tmp_path, NoStack(), monitor, steps=4)
    said = [m for m in caught if "residual profile disabled" in m]
    assert len(said) == 1, caught
    assert "no block stack" in said[0]
    assert "example_forward=" in said[0] and "residual=False" in said[0]
    rows = reads(trainer)
    # no discovery step to skip: the norms are read from step 0, as before
    assert [int(r["step"]) for r in rows] == [1, 2, 4]
    assert {float(r["dd/profile_points"]) for r in rows} == {0.0}
    assert float(rows[-1]["dd/ln/gamma_alignment"]) >= 0.9999
    assert not monitor.disabled


def test_example_forward_keeps_the_separate_discovery_forward(tmp_path):
    torch.manual_seed(0)
    calls = []

    def example_forward(module, batch):
        calls.append(torch.is_grad_enabled())
        return module(batch[0])

    monitor = DeadDirectionMonitor(every_n_steps=4, example_forward=example_forward, verbose=False)
    trainer, caught = fit_warned(tmp_path, LitTiny(), monitor, steps=8)
    assert calls == [False]  # once, under no_grad
    rows = reads(trainer)
    assert [int(r["step"]) for r in rows] == [1, 4, 8]  # the baseline is step 0's window
    assert {float(r["dd/profile_points"]) for r in rows} == {5.0}


def test_residual_discovery_object_watches_a_forward_it_did_not_run():
    torch.manual_seed(0)
    module = NoForward()
    layout_eval = find_residual_points(
        module, lambda: module.training_step((torch.randint(VOCAB, (2, 8)),) * 2, 0)
    )
    discovery = ResidualDiscovery(module).install()
    assert discovery.installed
    module.train()
    loss = module.training_step((torch.randint(VOCAB, (4, 8)),) * 2, 0)
    loss.backward()  # a backward is no forward: nothing more is recorded
    layout = discovery.finish()
    assert not discovery.installed
    assert layout.points == layout_eval.points and layout.style == "pre-norm"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_a_training_forward_with_dropout_finds_the_eval_mode_points(arch):
    """Dropout 0.1 everywhere it is configurable, the model in training mode, a backward after
    the forward: the same points as the eval-mode discovery forward (dropout modules sit
    inside the branches, so ``x + f`` stays exact)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    config = {
        "gpt2": lambda: transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
        ),
        "llama": lambda: transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_key_value_heads=4, attention_dropout=0.1,
            **small,
        ),
        "bert": lambda: transformers.BertConfig(
            hidden_size=32, intermediate_size=64, hidden_dropout_prob=0.1, **small
        ),
    }[arch]()  # fmt: skip
    model = transformers.AutoModel.from_config(config)
    ids = torch.randint(0, 64, (4, 16))
    eval_layout = find_residual_points(model, lambda: model(input_ids=ids))
    model.train()
    discovery = ResidualDiscovery(model).install()
    model(input_ids=ids)[0].sum().backward()
    layout = discovery.finish()
    assert layout.points == eval_layout.points and layout.style == eval_layout.style
    assert layout.fallback is None


def test_plain_scan_and_tracker_reports_carry_profile_points():
    """``dd/profile_points`` comes with every report, not only the callback's: a scan of the
    tiny LM reads 5 points; a tracker without the profile says 0."""
    from normscope import DeadDirectionConfig, DeadDirectionTracker
    from normscope.families.scan import scan_model
    from tests.support.tiny_models import TinyLM

    torch.manual_seed(0)
    model = TinyLM()
    batches = [torch.randint(VOCAB, (8, 16)) for _ in range(2)]
    assert scan_model(model, batches).as_dict()["dd/profile_points"] == 5.0
    tracker = DeadDirectionTracker(DeadDirectionConfig(residual=False), model)
    tracker.attach()
    tracker.gate.open = True
    with torch.no_grad():
        model(batches[0])
    tracker.gate.open = False
    assert tracker.read(step=0, reduce=False).as_dict()["dd/profile_points"] == 0.0
    tracker.detach()
