"""``normscope.alerts`` on its own: each rule's decision, debounce and checkpoint state, and the
sinks. (``SigmaMinRatioRule`` has tests of its own next to its row-aware interval; W&B delivery
of alerts is tested in a real offline run in ``tests/engine/test_wandb.py``.)"""

from __future__ import annotations

import logging
import math

import pytest

from normscope.alerts import (
    Alert,
    CallableRule,
    CallableSink,
    KernelLossRule,
    LogSink,
    OutlierRule,
    SignChurnSpikeRule,
    WandbSink,
    build_sinks,
)


def test_kernel_loss_fires_once_per_layer_until_it_recovers_and_only_on_layernorms() -> None:
    rule = KernelLossRule(max_kernel_residual=1e-4)
    rule.kinds = {"ln": "layernorm", "rms": "rmsnorm", "dead": "layernorm"}
    bad = {
        "dd/ln/kernel_residual": 3e-3,
        "dd/rms/kernel_residual": 1e-2,  # an RMSNorm has no kernel to lose
        "dd/dead/kernel_residual": 1.0,
        "dd/dead/dead_channels": 2,  # read against span{e_i}: not this rule's business
    }
    first = rule.evaluate(bad, step=10)
    assert [(a.point, a.step, a.value, a.threshold) for a in first] == [("ln", 10, 3e-3, 1e-4)]
    assert "lost its exact kernel at step 10" in first[0].message
    assert rule.evaluate(bad, step=20) == []  # still firing: not repeated
    assert rule.evaluate({"dd/ln/kernel_residual": 1e-15}, step=30) == []  # recovered
    assert len(rule.evaluate(bad, step=40)) == 1  # lost again: fires again
    assert rule.evaluate({"dd/ln/kernel_residual": math.nan}, step=50) == []  # NaN never fires
    # the firing state survives a checkpoint
    restored = KernelLossRule()
    restored.kinds = rule.kinds
    restored.load_state_dict(rule.state_dict())
    assert restored.evaluate(bad, step=60) == []


def test_outlier_rule_reads_every_layer_and_refuses_a_meaningless_threshold() -> None:
    rule = OutlierRule(max_leverage_above=50.0)
    metrics = {"sm/a/max_leverage": 51.0, "sm/b/max_leverage": 49.0, "sm/max_leverage_max": 51.0}
    alerts = rule.evaluate(metrics, step=3)
    assert [a.point for a in alerts] == ["a"] and alerts[0].key == "sm/a/max_leverage"
    assert rule.evaluate(metrics, step=4) == []
    state = rule.state_dict()
    assert state == {"firing": ["a"]}
    with pytest.raises(ValueError, match="must be > 1"):
        OutlierRule(max_leverage_above=1.0)


def test_sign_churn_spike_needs_two_reads_of_history_and_both_limits() -> None:
    rule = SignChurnSpikeRule(factor=5.0, min_churn=0.01)
    assert rule.evaluate({"sm/sign_churn_mean": 0.5}, 1) == []  # history only
    assert rule.evaluate({"sm/sign_churn_mean": 0.001}, 2) == []
    # median of [0.5, 0.001] (upper middle) is 0.5: 2.4 < 5 x 0.5 does not fire
    assert rule.evaluate({"sm/sign_churn_mean": 2.4}, 3) == []
    quiet = SignChurnSpikeRule(factor=5.0, min_churn=0.01)
    for step, v in enumerate([0.001, 0.001, 0.001]):
        quiet.evaluate({"sm/sign_churn_mean": v}, step)
    # 5x the median (0.005) but under min_churn (0.01): a spike of nothing is not an alert
    assert quiet.evaluate({"sm/sign_churn_mean": 0.009}, 4) == []
    fired = quiet.evaluate({"sm/sign_churn_mean": 0.2}, 5)
    assert len(fired) == 1 and fired[0].threshold == pytest.approx(0.01)
    restored = SignChurnSpikeRule()
    restored.load_state_dict(quiet.state_dict())
    assert restored.history == quiet.history
    with pytest.raises(ValueError, match="factor must be > 1"):
        SignChurnSpikeRule(factor=1.0)


def test_callable_rule_turns_messages_and_alerts_into_alerts() -> None:
    own = Alert("mine", "dd/x", 7, 1.0, 2.0, "custom")
    rule = CallableRule("spike", lambda m, step: ["one", own] if m["x"] > 1 else None)
    assert rule.evaluate({"x": 0}, 7) == []
    alerts = rule.evaluate({"x": 2}, 7)
    assert [a.message for a in alerts] == ["one", "custom"]
    assert alerts[0].rule == "spike" and alerts[0].step == 7 and math.isnan(alerts[0].value)
    assert alerts[1] is own


def test_alert_title_fits_wandb_and_as_dict_is_complete() -> None:
    alert = Alert("sigma_min_collapse", "dd/p/sigma_min_step", 5, 0.1, 0.5, "m", "p", "mlp" * 30)
    assert len(alert.title) <= 63 and alert.title.startswith("normscope: sigma_min_collapse")
    assert set(alert.as_dict()) == {
        "rule",
        "key",
        "step",
        "value",
        "threshold",
        "point",
        "sublayer",
        "monitor",
        "message",
        "remedy",
        "event",
        "paged",
    }


def test_sinks_deliver_and_build_sinks_refuses_unknown_names(caplog) -> None:
    got: list[Alert] = []
    sinks = build_sinks(("log", "wandb", got.append))
    assert [type(s) for s in sinks] == [LogSink, WandbSink, CallableSink]
    alert = Alert("r", "k", 1, 0.0, 1.0, "the message")
    with caplog.at_level(logging.WARNING, logger="normscope"):
        with pytest.warns(UserWarning, match="normscope alert: the message"):
            for sink in sinks:
                sink(alert, None)  # no trainer: the W&B sink has no run and does nothing
    assert got == [alert] and "the message" in caplog.text
    assert build_sinks(None) == [] and len(build_sinks("log")) == 1
    with pytest.raises(ValueError, match="unknown sink 'pager'"):
        build_sinks(["pager"])


def test_every_deliberate_error_shares_one_base_and_keeps_its_builtin() -> None:
    import normscope
    from normscope.cli.errors import CLIError
    from normscope.runs import RunReadError
    from normscope.taps.norms import NormDiscoveryError
    from normscope.taps.residual import ResidualDiscoveryError

    for cls in (NormDiscoveryError, ResidualDiscoveryError, RunReadError):
        assert issubclass(cls, normscope.NormscopeError) and issubclass(cls, ValueError)
    assert issubclass(CLIError, normscope.NormscopeError)


def _collapse_read(share: float, ratio: float = 0.6) -> dict[str, float]:
    return {
        "dd/ln_f/rankme": 2.0,
        "dd/ln_f/n_rows": 1024.0,
        "dd/final_rows_per_dim": 16.0,
        "dd/final_out_offset_share": share,
        "dd/final_rankme_centred": 48.0,
        "dd/sigma_min_ratio_min": ratio,
    }


def test_representation_collapse_fires_on_the_jump_not_at_the_line():
    """Issue 41's self-supervised collapse: offset share 0.07 (step 2), then 0.986, 0.992,
    0.993, 0.994 (steps 10-40). The frozen rule fired at step 40; the jump fires at step 10."""
    from normscope.alerts import RepresentationCollapseRule

    rule = RepresentationCollapseRule()
    fired = []
    for step, share in ((2, 0.07), (10, 0.986), (20, 0.992), (30, 0.993), (40, 0.994)):
        fired += [a.step for a in rule.evaluate(_collapse_read(share), step)]
    assert fired == [10]
    frozen = RepresentationCollapseRule(jump_to=None)
    fired = []
    for step, share in ((2, 0.07), (10, 0.986), (20, 0.992), (30, 0.993), (40, 0.994)):
        fired += [a.step for a in frozen.evaluate(_collapse_read(share), step)]
    assert fired and fired[0] > 10


def test_representation_collapse_stays_quiet_on_a_language_models_first_steps():
    """The demo's offset share rises from low in the unigram phase, past the jump line, with
    the stream's width kept (smallest ratio 1.13-1.82, docs/alerts.md); and a jump without the
    profile (no narrowing to read) never fires on one read."""
    from normscope.alerts import RepresentationCollapseRule

    rule = RepresentationCollapseRule()
    for step, (share, ratio) in enumerate(((0.29, 4.65), (0.9941, 1.13), (0.97, 1.5), (0.7, 9.4))):
        assert rule.evaluate(_collapse_read(share, ratio), step) == []
    rule = RepresentationCollapseRule()
    assert rule.evaluate(_collapse_read(0.07, math.nan), 2) == []
    assert rule.evaluate(_collapse_read(0.986, math.nan), 10) == []
