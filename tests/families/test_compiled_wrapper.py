"""The usual Lightning wrapper around a compiled Hugging Face model: a ``LightningModule`` with
no ``forward()`` that holds ``torch.compile(GPT2LMHeadModel)`` as ``self.model`` and calls
``self.model(**batch)`` in ``training_step``. Both families find the model it holds by default
(no ``example_forward=``): the dead-direction family's discovery forward reads the residual
profile, the sign-magnitude probes run. Compiled with dynamo's ``eager`` backend: the wrapper's
discovery is what is tested, not code generation."""

from __future__ import annotations

import math
import warnings

import lightning as L
import torch

from normscope import DeadDirectionMonitor, SignMagnitudeMonitor
from tests.support.hf_models import TokenSamples, build_hf_model

STEPS, EVERY = 4, 2


class Wrapper(L.LightningModule):
    """No ``forward()``: the training step calls the compiled model it holds."""

    def __init__(self) -> None:
        super().__init__()
        model, _ = build_hf_model("gpt2")
        self.model = torch.compile(model.train(), backend="eager")

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_both_families_find_the_compiled_model_a_wrapper_holds(tmp_path):
    torch.manual_seed(0)
    dd = DeadDirectionMonitor(every_n_steps=EVERY, rows_per_read="all", verbose=False)
    sm = SignMagnitudeMonitor(every_n_steps=EVERY, probe_samples=2, verbose=False)
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        callbacks=[dd, sm],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    loader = torch.utils.data.DataLoader(TokenSamples(), batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Wrapper(), train_dataloaders=loader)
    disabled = [str(w.message) for w in caught if "profile disabled" in str(w.message)]
    assert not disabled, disabled  # the default discovery forward went through self.model
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["dd/profile_points"] > 0
    assert math.isfinite(metrics["dd/sigma_min_ratio_min"])
    probes = [k for k in metrics if k.startswith("sm/") and k.endswith("/asymmetry_ratio")]
    assert probes and all(math.isfinite(metrics[k]) for k in probes)
    assert not dd.disabled and not sm.disabled
