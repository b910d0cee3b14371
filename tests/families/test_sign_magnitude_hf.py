"""The sign–magnitude family on real Hugging Face model code: GPT-2's ``Conv1D`` read as the
linear layer it is (weight ``(in, out)``), the Trainer's 0-dim ``num_items_in_batch`` left out
of the probe batch's cut, and the probes run through the model's real training forward in a
Lightning wrapper with no ``forward()`` -- under the Hugging Face ``Trainer`` and the Lightning
``Trainer``, on tiny GPT-2, Llama and GPT-NeoX configs (2 layers, width 32, vocabulary 64)."""

from __future__ import annotations

import math
import warnings

import lightning as L
import pytest
import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

from normscope import SignMagnitudeMonitor
from normscope.adapters.transformers import watch
from normscope.families.sign_magnitude import SignMagnitudeConfig, SignMagnitudeTracker
from normscope.families.sign_magnitude.family import slice_batch
from normscope.families.sign_magnitude.layers import find_block_linears, weight_matrix
from normscope.families.sign_magnitude.probes import Probes
from tests.support.hf_models import BATCH, SEQ, TokenSamples, build_hf_model, token_batch

ARCHS = ["gpt2", "llama", "gpt_neox_sequential"]
STEPS, EVERY = 4, 2
#: probe reads (asymmetry and ternary readiness) that every probed layer must log
PROBE_KEYS = ("asymmetry_ratio", "quant_transverse_rel")
WEIGHT_KEYS = ("sign_alignment", "ternary_alignment", "ternary_sparsity", "max_leverage")


def _model(arch: str) -> nn.Module:
    model, _ = build_hf_model(arch)
    return model.train()


def _config() -> SignMagnitudeConfig:
    return SignMagnitudeConfig(probe_samples=2)


def _check_read(logs: dict[str, float], prefix: str = "sm/") -> None:
    """Real per-layer reads, finite, and the probe reads present and finite."""
    for metric in (*WEIGHT_KEYS, *PROBE_KEYS):
        keys = [k for k in logs if k.startswith(prefix) and k.endswith(f"/{metric}")]
        assert keys, f"no {metric} key logged"
        assert all(math.isfinite(logs[k]) for k in keys), {k: logs[k] for k in keys}
    assert logs.get(f"{prefix}reads_disabled", 0.0) == 0.0


# --------------------------------------------------------------------------- Conv1D
def test_conv1d_reads_equal_the_transposed_linear():
    """A model with a ``Conv1D`` and its twin with the ``nn.Linear`` holding the transposed
    weight read the same: weight reads exactly (the same (out, in) matrix), outlier reads to
    1e-12 relative (the same inputs, folded in another order of addition at most) and probe
    reads to 1e-9 relative (the forward's matmul, ``addmm`` against ``F.linear``, rounds
    differently in float32); the probe restores the ``Conv1D`` weight bit-exactly."""

    class Block(nn.Module):
        def __init__(self, proj: nn.Module) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(16)
            self.proj = proj
            self.out = nn.LayerNorm(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(x + self.proj(self.ln(x)))

    class Stack(nn.Module):
        def __init__(self, proj: nn.Module) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(proj)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks[0](x)

    torch.manual_seed(0)
    conv = Conv1D(16, 16)
    linear = nn.Linear(16, 16)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    models = [Stack(p) for p in (conv, linear)]
    x = torch.randn(4, 5, 16)
    reads = []
    for model in models:
        tracker = SignMagnitudeTracker(model, SignMagnitudeConfig(probe_layers=["blocks.0.proj"]))
        assert tracker.layers == ["blocks.0.proj"]
        tracker.attach()
        before = model.blocks[0].proj.weight.detach().clone()
        with tracker.gate.sampling():
            model(x)
        reads.append(tracker.read(0, probe=lambda m=model: m(x)).as_dict())
        assert torch.equal(model.blocks[0].proj.weight, before)  # restored bit-exactly
    ours, theirs = reads
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if key.endswith(("sign_alignment", "sign_alignment_rowwise", "ternary_alignment")):
            assert ours[key] == value, key
        elif key.endswith(("leverage",)):
            assert math.isclose(ours[key], value, rel_tol=1e-12), key
        elif math.isfinite(value):
            assert math.isclose(ours[key], value, rel_tol=1e-9, abs_tol=1e-12), key
    assert torch.equal(weight_matrix(conv), linear.weight)


def test_gpt2_conv1d_layers_are_found_and_probed():
    """GPT-2's projections are ``Conv1D``: all four per block are watched, and the default
    probes are the attention and MLP output projections (``c_proj``)."""
    model = _model("gpt2")
    assert find_block_linears(model) == [
        f"transformer.h.{i}.{p}"
        for i in range(2)
        for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    tracker = SignMagnitudeTracker(model, SignMagnitudeConfig())
    assert tracker.probe_layers == [
        "transformer.h.0.attn.c_proj",
        "transformer.h.0.mlp.c_proj",
        "transformer.h.1.attn.c_proj",
        "transformer.h.1.mlp.c_proj",
    ]
    probes = Probes(
        model, [m for m in model.modules() if isinstance(m, nn.LayerNorm)], flip_rate=0.01, seed=0
    )
    ids = token_batch()
    read = probes.probe_one("transformer.h.0.mlp.c_proj", lambda: model(input_ids=ids))
    assert math.isfinite(read.asymmetry_ratio) and read.asymmetry_ratio > 0


def test_slice_batch_leaves_0_dim_tensors_and_other_values():
    batch = {
        "input_ids": torch.zeros(4, 3),
        "num_items_in_batch": torch.tensor(12),
        "return_dict": True,
        "pair": (torch.ones(4), None),
    }
    cut = slice_batch(batch, 2)
    assert cut["input_ids"].shape == (2, 3) and cut["pair"][0].shape == (2,)
    assert cut["num_items_in_batch"].item() == 12 and cut["return_dict"] is True


# --------------------------------------------------------------------------- HF Trainer
def _hf_trainer(tmp_path, arch: str) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-2,
        logging_steps=1000,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = transformers.Trainer(model=_model(arch), args=args, train_dataset=TokenSamples())
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    return trainer


@pytest.mark.parametrize("arch", ARCHS)
def test_hugging_face_trainer_logs_sign_magnitude_reads(tmp_path, arch):
    """Under the Hugging Face ``Trainer`` (which passes a 0-dim ``num_items_in_batch`` to the
    forward) every read lands in ``log_history`` with finite per-layer and probe reads, and no
    read is disabled."""
    trainer = _hf_trainer(tmp_path, arch)
    callback = watch(trainer, _config(), every_n_steps=EVERY, alerts=())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a disabled read warns: fail here
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="transformers")
        trainer.train()
    rows = [r for r in trainer.state.log_history if "sm/sign_alignment_mean" in r]
    assert [int(r["step"]) for r in rows] == [1, 2, 4]
    assert callback.engine.family.tracker.failed == {}
    _check_read(rows[-1])


# --------------------------------------------------------------------------- Lightning
class Wrapper(L.LightningModule):
    """The usual wrapper: a Hugging Face model called in ``training_step``, no ``forward()``."""

    def __init__(self, arch: str) -> None:
        super().__init__()
        self.model = _model(arch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("arch", ARCHS)
def test_lightning_wrapper_without_forward_probes_through_the_training_forward(tmp_path, arch):
    """A ``LightningModule`` with no ``forward()``: the probes replay the call its
    ``training_step`` made (``self.model(**batch)``, cut to ``probe_samples``), so the
    asymmetry and ternary-readiness reads are logged, finite, with no read disabled."""
    monitor = SignMagnitudeMonitor(every_n_steps=EVERY, probe_samples=2, verbose=False, alerts=())
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    loader = torch.utils.data.DataLoader(TokenSamples(), batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.fit(Wrapper(arch), train_dataloaders=loader)
    family = monitor.engine.family
    assert family.capture is not None and family.capture.call.path == "model"
    assert family.capture.call.kwargs["input_ids"].shape == (2, SEQ)  # cut, on the CPU
    assert family.tracker.failed == {}
    assert monitor.reads == 3
    _check_read(monitor.engine.history[-1][1] | monitor.last_report.as_dict(), "sm/")
