"""One event, one page (issue 43): the real default rules on a synthetic divergence page the
first rule and one follow-up and count the rest; every alert carries its remedy; the pager's
state survives a checkpoint; a real ``Trainer`` on a diverging tiny GPT pages at most twice."""

from __future__ import annotations

import logging

import pytest
import torch

from normscope import DeadDirectionMonitor
from normscope.alerts import (
    REMEDIES,
    Alert,
    LogSink,
    Pager,
    WandbSink,
    build_sinks,
    default_dead_direction_rules,
    format_alerts,
)
from normscope.engine.publish import Publisher
from tests.support.tiny_models import LitTiny, cpu_trainer, token_loader

LAYERS = [f"h.{i}.ln_{j}" for i in range(6) for j in (1, 2)]  # 12 LayerNorms


def divergence() -> list[tuple[int, dict[str, float]]]:
    """Reads every 10 steps: attention logits blow up at step 20, then the LayerNorms lose
    their kernel one after another (steps 30-140), the stream's scale runs away at step 60 and
    the gains cross zero at step 70; then 12 quiet reads (still lost, nothing new)."""
    reads = []
    for k in range(1, 28):
        step = 10 * k
        m = {f"dd/{p}/kernel_residual": 1e-12 for p in LAYERS}
        lost = max(0, min(len(LAYERS), k - 2))
        m.update({f"dd/{p}/kernel_residual": 0.02 for p in LAYERS[:lost]})
        if k <= 2:
            m["dd/h.0.attn/max_logit"] = 3.0 if k == 1 else 2000.0
        m["dd/rms_growth_max"] = 900.0 if k == 6 else 1.2
        m["dd/gamma_crossed_max"] = 0.4 if k >= 7 else 0.0
        reads.append((step, m))
    return reads


def publisher(pages: list[Alert], pager: Pager | None = None) -> Publisher:
    return Publisher(
        label="DeadDirectionMonitor",
        name=None,
        log_per_layer="all",
        sinks=build_sinks([pages.append]),
        targets=[],
        warn_once=lambda key, message: None,
        pager=pager,
    )


def rules() -> list:
    return default_dead_direction_rules({p: "layernorm" for p in LAYERS}, None)


def test_a_divergence_pages_the_first_rule_and_one_follow_up_and_counts_the_rest(caplog):
    pages: list[Alert] = []
    pub, rs = publisher(pages), rules()
    with caplog.at_level(logging.WARNING, logger="normscope"):
        fired = [a for step, m in divergence() for a in pub.publish(m, step, rs, 1000)[0]]
    # 12 kernels lost on 12 layers, the logits, the scale, the gains: 15 alerts, one event
    assert len(fired) == 15 and {a.event for a in fired} == {1}
    assert [(a.rule, a.step) for a in pages] == [
        ("attention_logit_growth", 20),
        ("stream_scale_growth", 60),  # the kernels lost before it are consequences: counted
    ]
    assert [a.paged for a in fired].count(False) == 13
    assert pub.alerts_fired == fired  # counted alerts stay in the record
    # the event ended after 10 quiet reads: one count line
    lines = [r.getMessage() for r in caplog.records if "more alert" in r.getMessage()]
    assert lines == ["normscope: 13 more alerts in this event (see the summary)"]
    # every alert says what to try, and the summary names each with its step and remedy
    assert all(a.remedy == REMEDIES[a.rule] for a in fired)
    text = format_alerts(fired)
    assert text.startswith("normscope alerts: 15 (2 paged, 13 counted)")
    assert "step 140: layernorm_kernel_lost at h.5.ln_2" in text
    assert all(f"{rule}: {REMEDIES[rule]}" in text for rule in {a.rule for a in fired})


def test_an_alert_after_the_quiet_reads_is_a_new_event_and_pages():
    pages: list[Alert] = []
    pub, rs = publisher(pages, Pager(quiet_reads=2)), rules()
    calm = {"dd/rms_growth_max": 1.2}
    for step, m in enumerate([{"dd/rms_growth_max": 900.0}, calm, calm, {"dd/rows_rejected": 5}]):
        pub.publish(m, step, rs, 1000)
    assert [(a.rule, a.event, a.paged) for a in pub.alerts_fired] == [
        ("stream_scale_growth", 1, True),
        ("non_finite_rows", 2, True),
    ]
    assert len(pages) == 2


def test_the_pager_resumes_mid_event_from_its_state():
    first, pages = Pager(), []
    reads = divergence()
    pub = publisher(pages, first)
    rs = rules()
    for step, m in reads[:4]:
        pub.publish(m, step, rs, 1000)
    resumed = Pager()
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == first.state_dict() and resumed.open and resumed.pages == 1
    # the event goes on: the scale growth still pages as the one follow-up, nothing else does
    pub2 = publisher(pages, resumed)
    rs2 = rules()
    for r, r2 in zip(rs, rs2, strict=True):
        r2.load_state_dict(r.state_dict())
    for step, m in reads[4:]:
        pub2.publish(m, step, rs2, 1000)
    assert [(a.rule, a.step) for a in pages] == [
        ("attention_logit_growth", 20),
        ("stream_scale_growth", 60),
    ]


def test_options_are_checked():
    with pytest.raises(ValueError, match="max_pages_per_event"):
        Pager(max_pages_per_event=0)
    with pytest.raises(ValueError, match="quiet_reads"):
        Pager(quiet_reads=0)
    every = Pager(max_pages_per_event=None, consequences=())
    got = every.sort([Alert(r, "k", 1, 1.0, 0.5, "m") for r in ("a", "b", "c", "a")])
    assert [a.paged for a in got] == [True, True, True, False]  # once per rule per event


def test_the_remedy_reaches_the_log_line_and_the_wandb_text(caplog):
    alert = Alert(
        "norm_gain_drift",
        "dd/gamma_scale_min",
        40,
        0.2,
        0.25,
        "gains drifted",
        remedy=REMEDIES["norm_gain_drift"],
    )
    with caplog.at_level(logging.WARNING, logger="normscope"), pytest.warns(UserWarning):
        LogSink()(alert)
    assert caplog.records[-1].getMessage() == f"gains drifted -- try: {alert.remedy}"

    class Run:
        alerts: list[dict] = []

        def alert(self, **kw):
            self.alerts.append(kw)

    long = Alert("r" * 100, "k", 1, 1.0, 0.5, "x" * 2000, remedy="y")
    run = Run()
    WandbSink()(long, [run])
    assert len(run.alerts[0]["text"]) <= 1000 and len(run.alerts[0]["title"]) < 64


def test_every_default_rule_carries_a_remedy():
    from normscope.alerts import OutlierRule, SignChurnSpikeRule, SourceCollapseRule

    everything = rules() + [SourceCollapseRule(), OutlierRule(), SignChurnSpikeRule()]
    everything += default_dead_direction_rules({}, {})  # the sigma_min rule
    assert {r.name for r in everything} == set(REMEDIES)
    assert all(r.remedy == REMEDIES[r.name] and 0 < len(r.remedy) < 300 for r in everything)


class SGDTiny(LitTiny):
    """The tiny GPT under plain SGD at learning rate 10: it diverges within a few steps."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_a_diverging_fit_pages_at_most_twice(caplog):
    torch.manual_seed(0)
    pages: list[Alert] = []
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=True, alerts=(pages.append,))
    trainer = cpu_trainer(30, [monitor])
    with caplog.at_level(logging.INFO, logger="normscope"):
        trainer.fit(SGDTiny(lr=10.0, layers=4, d=32), train_dataloaders=token_loader(n=1024))
    assert not monitor.disabled, monitor.failure
    fired = monitor.alerts_fired
    assert len(fired) > 2, [(a.rule, a.step) for a in fired]
    assert 1 <= len(pages) <= 2
    assert [a for a in fired if a.paged] == pages
    assert all(a.remedy for a in fired)
    summary = next(r.getMessage() for r in caplog.records if "normscope alerts:" in r.getMessage())
    assert all(f"step {a.step}: {a.rule}" in summary for a in fired)
    counted = [r.getMessage() for r in caplog.records if "more alert" in r.getMessage()]
    assert counted == [
        f"normscope: {len(fired) - len(pages)} more alerts in this event (see the summary)"
    ]
