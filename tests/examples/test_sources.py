"""examples/sources.py run for real: a Lightning fit on two sources, a collapse confined to one
source (distribution-dependent) against one in every source (intrinsic)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from examples import sources
from normscope import DeadDirectionMonitor

torch.set_num_threads(1)


def test_source_only_collapse_is_distribution_dependent():
    monitor = sources.main(["--mode", "source", "--quiet"])
    # steps 2 (baseline window 1: step 0's forward is residual discovery's), 10, 20, 30; the
    # cancel starts at step 20
    assert monitor.reads == 4
    m = monitor.last_report.as_dict()
    point = "model.h.2.ln_1"  # after block 1's MLP
    assert m[f"dd.code/{point}/sigma_min_step"] < 0.2  # measured 0.06
    assert m[f"dd.prose/{point}/sigma_min_step"] > 0.8
    assert m["dd/sigma_min_ratio_min"] > 0.8  # the pooled read does not alarm (measured 0.87)
    assert m["dd/collapse_class"] == 2.0 and m[f"dd/{point}/collapse_class"] == 2.0
    fired = [a for a in monitor.alerts_fired if a.step == 30]
    assert [a.rule for a in fired] == ["source_collapse"]
    assert f"collapse at {point} after mlp under source 'code' only" in fired[0].message
    assert all(a.step == 30 for a in monitor.alerts_fired)  # nothing before the cancel


def test_intrinsic_collapse_in_every_source():
    monitor = sources.main(["--mode", "intrinsic", "--quiet"])
    m = monitor.last_report.as_dict()
    assert m["dd/collapse_class"] == 1.0
    c = monitor.last_report.collapses[0]
    assert (c.point, c.kind, c.below) == ("model.h.2.ln_1", "intrinsic", ("code", "prose"))
    rules = {a.rule for a in monitor.alerts_fired}
    assert rules == {"sigma_min_collapse", "source_collapse"}
    assert any("in every source" in a.message for a in monitor.alerts_fired)


def _fit(**monitor_kw):
    torch.manual_seed(0)
    module = sources.LitSource(cancel_at=5)
    # every row: a source's own profile needs 4 d of its own rows (a quarter of them here)
    monitor = DeadDirectionMonitor(
        every_n_steps=4, alerts=(), verbose=False, rows_per_read="all", **monitor_kw
    )
    trainer = L.Trainer(
        max_steps=8, callbacks=[monitor], accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    loader = DataLoader(sources.Mixture(n=256, code_share=0.25), batch_size=32)
    trainer.fit(module, loader)
    return monitor, trainer


def test_pooled_keys_identical_to_a_fit_without_sources():
    plain, _ = _fit()
    split, trainer = _fit(sources=lambda batch: batch["source"])
    a, b = plain.last_report.as_dict(), split.last_report.as_dict()
    assert {k: b[k] for k in a} == pytest.approx(a, rel=0, abs=0, nan_ok=True)
    assert "dd.code/sigma_min_ratio_min" in trainer.callback_metrics
    assert "dd/collapse_class" in trainer.callback_metrics
