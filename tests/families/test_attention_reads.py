"""The attention-logit read (docs/metrics.md §1.7) under a real Lightning ``Trainer``: a
query-key blow-up mid-fit alerts once at the first read after it, the keys land in the logger
and ``callback_metrics``, ``attention=None`` reads nothing, and a model without an attention
module logs the count 0 and nothing else. The rule on its own: tests/alerts/test_attention_rule.py."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from normscope import DeadDirectionConfig, DeadDirectionMonitor, DeadDirectionTracker
from tests.support.fits import MemoryLogger
from tests.support.tiny_models import LitTiny, TinyLM, cpu_trainer, token_loader


class QKBlowUp(LitTiny):
    """At optimiser step ``at`` block 1's query and key projections are multiplied by
    ``factor`` (every logit of that layer by ``factor ** 2``), as a run whose query-key
    product grows does over many steps."""

    def __init__(self, at: int, factor: float) -> None:
        super().__init__(lr=1e-3)
        self.at, self.factor = at, factor

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == self.at:
            attn = self.model.h[1].attn
            d = attn.embed_dim
            with torch.no_grad():
                attn.in_proj_weight[: 2 * d].mul_(self.factor)
                attn.in_proj_bias[: 2 * d].mul_(self.factor)


def test_a_query_key_blow_up_alerts_once_naming_the_layer():
    torch.manual_seed(0)
    logger = MemoryLogger()
    monitor = DeadDirectionMonitor(every_n_steps=5, verbose=False, alerts=())
    trainer = cpu_trainer(26, [monitor], logger=logger, log_every_n_steps=5)
    trainer.fit(QKBlowUp(at=12, factor=6.0), train_dataloaders=token_loader(n=512))
    reads = dict(logger.calls_with("dd/attn_logit_max"))
    assert sorted(reads) == [2, 5, 10, 15, 20, 25]  # the first: the baseline step 1
    for m in reads.values():
        assert m["dd/attn_modules_read"] == 2.0
        assert m["dd/attn_logit_max"] == max(
            m["dd/model.h.0.attn/max_logit"], m["dd/model.h.1.attn/max_logit"]
        )
    before, after = reads[10], reads[15]
    assert before["dd/attn_logit_max"] < 10  # a healthy tiny LM: logits of a few units
    assert after["dd/model.h.1.attn/max_logit"] > 30 > after["dd/model.h.0.attn/max_logit"]
    fired = [(a.rule, a.step, a.point) for a in monitor.alerts_fired]
    assert fired == [("attention_logit_growth", 15, "model.h.1.attn")], fired
    metrics = trainer.callback_metrics
    assert float(metrics["dd/attn_logit_max"]) == pytest.approx(reads[25]["dd/attn_logit_max"])


def test_attention_none_reads_no_logit():
    torch.manual_seed(0)
    logger = MemoryLogger()
    monitor = DeadDirectionMonitor(every_n_steps=5, verbose=False, alerts=(), attention=None)
    trainer = cpu_trainer(6, [monitor], logger=logger, log_every_n_steps=1)
    trainer.fit(LitTiny(), train_dataloaders=token_loader(n=128))
    logged = {k for _, m in logger.calls for k in m}
    assert "dd/sigma_min_ratio_min" in logged
    assert not any("logit" in k or k.startswith("dd/attn") for k in logged), logged


def test_a_list_of_modules_reads_those_only_and_bad_values_say_so():
    torch.manual_seed(0)
    logger = MemoryLogger()
    monitor = DeadDirectionMonitor(
        every_n_steps=5, verbose=False, alerts=(), attention=["model.h.0.attn"]
    )
    trainer = cpu_trainer(6, [monitor], logger=logger, log_every_n_steps=1)
    trainer.fit(LitTiny(), train_dataloaders=token_loader(n=128))
    read = dict(logger.calls_with("dd/attn_logit_max"))[5]
    assert read["dd/attn_modules_read"] == 1.0 and "dd/model.h.1.attn/max_logit" not in read
    assert read["dd/attn_logit_max"] == read["dd/model.h.0.attn/max_logit"]
    with pytest.raises(MisconfigurationException, match="attention must be"):
        DeadDirectionMonitor(attention="everything")
    monitor = DeadDirectionMonitor(verbose=False, alerts=(), attention=["model.h.9.attn"])
    with pytest.raises(MisconfigurationException, match="no module 'model.h.9.attn'"):
        cpu_trainer(2, [monitor]).fit(LitTiny(), train_dataloaders=token_loader(n=64))


def test_no_attention_module_logs_the_count_zero_and_nothing_else():
    torch.manual_seed(0)
    model = TinyLM()
    x = torch.randint(0, 32, (4, 16))
    tracker = DeadDirectionTracker(DeadDirectionConfig(attention=[]), model)
    tracker.attach(forward=lambda: model(x))
    with tracker.gate.sampling():
        model(x)
    got = tracker.read(0).as_dict()
    tracker.detach()
    assert got["dd/attn_modules_read"] == 0.0
    assert not any(k.endswith(("max_logit", "attn_logit_max")) for k in got)


def test_a_read_that_keeps_its_window_keeps_the_logits_too():
    torch.manual_seed(0)
    model = TinyLM()
    x = torch.randint(0, 32, (4, 16))
    tracker = DeadDirectionTracker(DeadDirectionConfig(), model)
    tracker.attach(forward=lambda: model(x))
    with tracker.gate.sampling():
        model(x)
    kept = tracker.read(0, reset=False).as_dict()
    again = tracker.read(1).as_dict()  # the same window, then a new one
    with tracker.gate.sampling():
        model(x * 0 + 1)
    fresh = tracker.read(2).as_dict()
    tracker.detach()
    assert kept["dd/attn_modules_read"] == 2.0
    assert again["dd/attn_logit_max"] == kept["dd/attn_logit_max"]
    assert fresh["dd/attn_logit_max"] != kept["dd/attn_logit_max"]  # other tokens, new window
