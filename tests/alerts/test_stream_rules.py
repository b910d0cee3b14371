"""The stream rules (issue 32, docs/alerts.md) on real tiny models: gain drift and a runaway
stream scale under a real Lightning ``Trainer``, a complete representation collapse read by
``scan_model``; and one ``sigma_min_collapse`` alert per episode across points."""

from __future__ import annotations

import math

import pytest
import torch

from normscope import DeadDirectionMonitor, scan_model
from normscope.alerts import (
    GainDriftRule,
    RepresentationCollapseRule,
    ScaleGrowthRule,
    SigmaMinRatioRule,
    default_dead_direction_rules,
)
from tests.support.fits import MemoryLogger
from tests.support.tiny_models import DecayedGains, LitTiny, TinyLM, cpu_trainer, token_loader


def test_gain_decay_alerts_once_at_the_first_read_under_a_quarter():
    torch.manual_seed(0)
    module = DecayedGains(gain_wd=30.0)  # lr x wd = 0.09 a step: x0.91 a step
    logger = MemoryLogger()
    monitor = DeadDirectionMonitor(every_n_steps=5, verbose=False, alerts=())
    trainer = cpu_trainer(31, [monitor], logger=logger, log_every_n_steps=5)
    trainer.fit(module, train_dataloaders=token_loader(n=512))
    reads = logger.calls_with("dd/gamma_scale_min")
    first_under = next(s for s, m in reads if m["dd/gamma_scale_min"] < 0.25)
    fired = [(a.rule, a.step) for a in monitor.alerts_fired]
    assert fired == [("norm_gain_drift", first_under)], fired
    alert = monitor.alerts_fired[0]
    assert alert.key == "dd/gamma_scale_min" and alert.value < 0.25 and alert.point


def test_healthy_fit_raises_no_stream_alert():
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=5, verbose=False, alerts=())
    trainer = cpu_trainer(40, [monitor])
    trainer.fit(LitTiny(), train_dataloaders=token_loader(n=1024))
    assert monitor.alerts_fired == [], [a.message for a in monitor.alerts_fired]
    names = [r.name for r in monitor.rules]
    assert {"representation_collapse", "norm_gain_drift", "stream_scale_growth"} <= set(names)


class BlowUp(LitTiny):
    """At optimiser step ``at`` the token embedding is multiplied by ``factor`` (a bad update
    that blows the stream's scale up): the reads after it see a stream ``factor`` x larger."""

    def __init__(self, at: int, factor: float) -> None:
        super().__init__(lr=1e-3)
        self.at, self.factor = at, factor

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == self.at:
            with torch.no_grad():
                self.model.wte.weight.mul_(self.factor)
                self.model.wpe.weight.mul_(self.factor)


def test_a_runaway_stream_scale_alerts_once():
    torch.manual_seed(0)
    logger = MemoryLogger()
    monitor = DeadDirectionMonitor(every_n_steps=5, verbose=False, alerts=())
    trainer = cpu_trainer(21, [monitor], logger=logger, log_every_n_steps=5)
    trainer.fit(BlowUp(at=7, factor=1000.0), train_dataloaders=token_loader(n=512))
    reads = dict(logger.calls_with("dd/gamma_scale_min"))
    # the read after the blow-up: the residual points grow by about the factor (the branches
    # add what they add on top: less than the factor at the deeper points, never 1)
    assert reads[10]["dd/rms_growth_max"] > 300 and reads[5]["dd/rms_growth_max"] < 10
    fired = [(a.rule, a.step) for a in monitor.alerts_fired]
    assert ("stream_scale_growth", 10) in fired
    assert sum(r == "stream_scale_growth" for r, _ in fired) == 1  # growth back to ~1: no more


def _collapsed(model: TinyLM, noise: float) -> TinyLM:
    """Every block's branches zeroed and every token and position embedded as one shared
    vector plus ``noise`` x an isotropic random part: rows of the final stream are one point."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        d = model.wte.weight.shape[1]
        shared = torch.randn(d, generator=g) + 3.0
        model.wte.weight.copy_(shared + noise * torch.randn(model.wte.weight.shape, generator=g))
        model.wpe.weight.copy_(noise * torch.randn(model.wpe.weight.shape, generator=g))
        for block in model.h:
            block.attn.out_proj.weight.zero_()
            block.attn.out_proj.bias.zero_()
            block.mlp[2].weight.zero_()
            block.mlp[2].bias.zero_()
    return model


def test_scan_of_a_collapsed_model_alerts_and_its_twin_does_not():
    torch.manual_seed(0)
    batches = [x for x, _ in token_loader(n=128)]
    collapsed = scan_model(_collapsed(TinyLM(norm="rmsnorm"), noise=0.02), batches).as_dict()
    healthy = scan_model(TinyLM(norm="rmsnorm"), batches).as_dict()
    assert collapsed["dd/final_out_offset_share"] > 0.995
    assert collapsed["dd/final_rankme_centred"] > 0.5 * 16  # the rest is isotropic noise
    assert healthy["dd/final_out_offset_share"] < 0.5
    rule = RepresentationCollapseRule()  # two reads in a row
    assert rule.evaluate(collapsed, 0) == []
    assert [a.rule for a in rule.evaluate(collapsed, 1)] == ["representation_collapse"]
    assert RepresentationCollapseRule(patience=1).evaluate(healthy, 0) == []
    # the monitor's default rules on two such reads, as a re-evaluated log would see them
    rules = default_dead_direction_rules({}, None, kernel=False)
    fired = {a.rule for step in (0, 1) for r in rules for a in r.evaluate(collapsed, step)}
    assert fired == {"representation_collapse"}, fired


def test_a_shared_vector_with_structured_rest_is_not_a_complete_collapse():
    """The zoo's high-learning-rate twin: offset share 0.9999, but what varies varies along a
    few directions (centred RankMe 12 of 64): no alert; the same with noise-like rest: one."""
    base = {"dd/ln_f/rankme": 1.2, "dd/ln_f/n_rows": 1024.0, "dd/final_rows_per_dim": 16.0}
    base["dd/final_out_offset_share"] = 0.9999
    one = RepresentationCollapseRule(patience=1)
    assert one.evaluate({**base, "dd/final_rankme_centred": 12.2}, 9) == []
    got = RepresentationCollapseRule(patience=1).evaluate(
        {**base, "dd/final_rankme_centred": 48.9}, 9
    )
    assert [a.rule for a in got] == ["representation_collapse"]
    # rows that cannot tell 0.992 from the 0.99 line: 64 rows, spread interval top above 1%
    few = {**base, "dd/ln_f/n_rows": 64.0, "dd/final_rows_per_dim": 1.0}
    few |= {"dd/final_out_offset_share": 0.992, "dd/final_rankme_centred": 50.0}
    assert RepresentationCollapseRule(patience=1).evaluate(few, 9) == []


def _final(share: float, spread_rank: float, narrowest: float = 0.7) -> dict[str, float]:
    """One read of a 64-wide final norm from 512 rows (the zoo's), as the monitor logs it, with
    the smallest ``sigma_min`` ratio over the residual points (``narrowest``)."""
    return {
        "dd/ln_f/rankme": 1.5,
        "dd/ln_f/n_rows": 512.0,
        "dd/final_rows_per_dim": 8.0,
        "dd/final_out_offset_share": share,
        "dd/final_rankme_centred": spread_rank,
        "dd/sigma_min_ratio_min": narrowest,
    }


def _first_alert(rule: RepresentationCollapseRule, reads) -> int | None:
    fired = [i for i, m in enumerate(reads) if rule.evaluate(m, 10 * i)]
    return fired[0] if fired else None


def test_a_collapse_seen_arriving_alerts_at_one_read():
    """The zoo's self-supervised collapse: 0.18-0.62 at step 1, 0.982-0.996 at step 9 with the
    rest spread (centred RankMe 38-51 of 64) and the stream narrowing (smallest sigma_min ratio
    0.42-0.83): the transition read alerts alone."""
    reads = [_final(0.55, 49.0, 1.1), _final(0.994, 49.0, 0.76), _final(0.9985, 50.0, 0.7)]
    assert _first_alert(RepresentationCollapseRule(), reads) == 1
    assert (
        _first_alert(RepresentationCollapseRule(rise_from=None, jump_to=None), reads) == 2
    )  # as before
    # without the sigma_min profile (no stream found): no transition, two reads
    blind = [{k: v for k, v in m.items() if k != "dd/sigma_min_ratio_min"} for m in reads]
    assert _first_alert(RepresentationCollapseRule(), blind) == 2


def test_a_state_seen_from_the_first_read_needs_two():
    """A model that starts there (a language model's first steps), or one that reaches it
    through a read between ``rise_from`` and the line (the demo GPT: 0.93 at step 2)."""
    rule = RepresentationCollapseRule()
    assert _first_alert(rule, [_final(0.995, 50.0), _final(0.996, 50.0)]) == 1
    through = [_final(0.93, 49.1, 0.98), _final(0.9941, 46.4, 0.8), _final(0.9987, 43.3, 0.7)]
    assert _first_alert(RepresentationCollapseRule(), through) == 2
    # a read the rows cannot tell from the 0.99 line (0.9915 from 512 rows) breaks the frozen
    # rule's transition and counts for nothing: two decided reads after it ...
    ambiguous = [_final(0.5, 49.0), _final(0.9915, 48.0), _final(0.995, 48.0), _final(0.996, 48.0)]
    assert _first_alert(RepresentationCollapseRule(jump_to=None), ambiguous) == 3
    # ... while the jump (0.5 to confidently over 0.95 in one read, the stream narrowing) is the
    # collapse arriving, whatever line it settles under
    assert _first_alert(RepresentationCollapseRule(), ambiguous) == 1


def test_a_healthy_jump_whose_stream_keeps_its_width_does_not_alert_at_once():
    """Two healthy runs with the same jump: the zoo's RMSNorm logit-growth twin (lr 0.03,
    qk-norm), seed 1: 0.585 at step 1, 1.0000 at step 9 (a 155 x scale transient, centred
    RankMe 39 of 64, then 18, 11, ...); the demo GPT at lr 1e-3 read every 12 steps: 0.554 at
    step 2, 0.9933 at step 12 (RankMe 47), 0.961 at step 24. No point narrower than the stream's
    input in either (smallest sigma_min ratio 1.19, 1.37)."""
    twin = [_final(0.585, 48.0, 1.05), _final(0.99998, 39.3, 1.19), _final(0.99997, 17.9, 1.3)]
    assert _first_alert(RepresentationCollapseRule(), twin) is None
    one = {
        "patience": 1,
        "rise_from": None,
        "jump_to": None,
        "narrower_below": None,
    }  # offset, rest
    assert _first_alert(RepresentationCollapseRule(**one), twin) == 1
    demo = [_final(0.554, 49.0, 1.06), _final(0.9933, 47.3, 1.37), _final(0.961, 29.2, 1.23)]
    assert _first_alert(RepresentationCollapseRule(), demo) is None
    assert _first_alert(RepresentationCollapseRule(**one), demo) == 1


def test_a_language_models_early_plateau_keeps_its_width_and_never_alerts():
    """The demo GPT's early phase (every token predicts the unigram distribution): offset share
    over 0.99 with an unstructured rest (centred RankMe 37-47 of 64) for two reads and more,
    the stream as wide as its input (smallest ratio 1.13-1.82). Without the width condition
    it fired in 4 of 15 demo runs; with it, never. An embedding that collapsed itself (the
    input p_0 over the line) needs no narrowing: its ratios cannot fall."""
    plateau = [_final(0.93, 49.1, 1.1), _final(0.9941, 46.4, 1.2), _final(0.9987, 43.3, 1.3)]
    plateau.append(_final(0.995, 40.0, 1.5))
    assert _first_alert(RepresentationCollapseRule(), plateau) is None
    assert _first_alert(RepresentationCollapseRule(narrower_below=None), plateau) == 2
    collapsed_input = {"dd/h.0.ln_1/depth": 0.0, "dd/h.0.ln_1/offset_share": 0.999}
    embedded = [{**m, **collapsed_input} for m in plateau]
    assert _first_alert(RepresentationCollapseRule(), embedded) == 2


def test_the_transition_survives_a_checkpoint():
    rule = RepresentationCollapseRule()
    rule.evaluate(_final(0.4, 49.0), 1)
    state = rule.state_dict()
    assert state["was_low"] is True
    resumed = RepresentationCollapseRule()
    resumed.load_state_dict(state)
    assert [a.rule for a in resumed.evaluate(_final(0.995, 49.0), 9)] == ["representation_collapse"]
    # an older checkpoint without it: no transition known, two reads
    old = RepresentationCollapseRule()
    old.load_state_dict({"firing": False, "count": 0})
    assert old.evaluate(_final(0.995, 49.0), 9) == []
    with pytest.raises(ValueError, match="rise_from"):
        RepresentationCollapseRule(rise_from=0.995)


def test_rules_rearm_after_a_read_that_says_no():
    gain, growth = GainDriftRule(), ScaleGrowthRule()
    seq = [0.9, 0.2, 0.1, 0.6, 0.2]
    got = [len(gain.evaluate({"dd/gamma_scale_min": v}, i)) for i, v in enumerate(seq)]
    assert got == [0, 1, 0, 0, 1]
    got = [len(growth.evaluate({"dd/rms_growth_max": v}, i)) for i, v in enumerate([2, 500, 400])]
    assert got == [0, 1, 0]
    assert growth.evaluate({"dd/rms_growth_max": math.nan}, 9) == [] and growth.firing
    crossed = GainDriftRule().evaluate({"dd/gamma_scale_min": 0.9, "dd/gamma_crossed_max": 0.2}, 3)
    assert [a.key for a in crossed] == ["dd/gamma_crossed_max"]
    state = gain.state_dict()
    fresh = GainDriftRule()
    fresh.load_state_dict(state)
    assert fresh.evaluate({"dd/gamma_scale_min": 0.1}, 9) == []  # the same episode


def _point(step: float, hi: float) -> dict[str, float]:
    return {"sigma_min_step": step, "sigma_min_step_hi": hi}


def test_sigma_collapse_hopping_between_points_is_one_alert():
    """The issue's variant: one collapse read below at two points in turn (interval tops
    0.59-0.61 against the 0.6 floor) raised 8 alerts in 30 reads; one per episode now."""
    rule = SigmaMinRatioRule()
    rule.sublayers = {"h.1": "mlp", "h.2": "attn"}
    reads = [("h.1", 0.5, 0.59), ("h.2", 0.5, 0.59), ("h.1", 0.48, 0.58), ("h.2", 0.5, 0.59)]
    fired = []
    for i, (where, step, hi) in enumerate(reads):
        other = "h.2" if where == "h.1" else "h.1"
        metrics = {f"dd/{where}/{k}": v for k, v in _point(step, hi).items()}
        metrics |= {f"dd/{other}/{k}": v for k, v in _point(0.7, 0.75).items()}
        metrics["dd/rows_per_dim"] = 16.0
        fired += [(i, a.point) for a in rule.evaluate(metrics, i)]
    assert fired == [(0, "h.1")]
    healthy = {f"dd/{p}/{k}": v for p in ("h.1", "h.2") for k, v in _point(1.0, 1.2).items()}
    assert rule.evaluate({**healthy, "dd/rows_per_dim": 16.0}, 9) == []  # the episode ends
    again = {**healthy, "dd/h.2/sigma_min_step": 0.4, "dd/h.2/sigma_min_step_hi": 0.5}
    assert [a.point for a in rule.evaluate({**again, "dd/rows_per_dim": 16.0}, 10)] == ["h.2"]
    old = SigmaMinRatioRule(one_per_episode=False)  # the previous behaviour: one per point
    old.sublayers = dict(rule.sublayers)
    n = 0
    for i, (where, step, hi) in enumerate(reads):
        other = "h.2" if where == "h.1" else "h.1"
        metrics = {f"dd/{where}/{k}": v for k, v in _point(step, hi).items()}
        metrics |= {f"dd/{other}/{k}": v for k, v in _point(0.7, 0.75).items()}
        n += len(old.evaluate({**metrics, "dd/rows_per_dim": 16.0}, i))
    assert n == 2  # each point fires once (both stay under the 0.85 drop floor after)


def test_cumulative_ratio_is_watched_only_when_asked_and_then_with_patience():
    """A cumulative fall no step accounts for (each step 0.8-0.9, above the floor) is not a
    collapse by default; watched, it fires after ratio_patience reads."""
    m = {"dd/h.3/sigma_min_step": 0.82, "dd/h.3/sigma_min_step_hi": 1.0}
    m |= {"dd/h.3/sigma_min_ratio": 0.36, "dd/h.3/sigma_min_ratio_hi": 0.45}
    m["dd/rows_per_dim"] = 16.0
    assert SigmaMinRatioRule().evaluate(m, 1) == []
    both = SigmaMinRatioRule(watch=("ratio", "step"), ratio_patience=2)
    assert both.evaluate(m, 1) == []
    assert [a.key for a in both.evaluate(m, 2)] == ["dd/h.3/sigma_min_ratio"]


def test_a_ratio_hovering_at_the_floor_needs_a_second_read_below():
    """The healthy contrastive twin of the zoo (seed 1, no biases): one point's step ratio at
    0.49-0.50 for reads, interval tops 0.61, 0.599, 0.63 -- one read under 0.6 by chance. A fall
    from above the line fires at once; from undecided, on the second read below."""

    def run(tops: list[float]) -> list[int]:
        rule = SigmaMinRatioRule()
        rule.sublayers = {"h.1": "mlp"}
        fired = []
        for i, hi in enumerate(tops):
            m = {"dd/h.1/sigma_min_step": hi / 1.25, "dd/h.1/sigma_min_step_hi": hi}
            fired += [i for _ in rule.evaluate({**m, "dd/rows_per_dim": 16.0}, i)]
        return fired

    assert run([0.62, 0.61, 0.599, 0.63, 0.62]) == []
    assert run([0.62, 0.61, 0.59, 0.58]) == [3]  # a slow onset: one read later
    assert run([0.9, 0.55]) == [1]  # from above the line: at once
    assert run([0.55]) == [0]  # the first read has no history: at once


def test_no_sudden_drop_against_the_first_read():
    """Healthy contrastive twins of the zoo (seeds 2, 3) halve one point's step ratio between
    the first read (step 1) and the second (step 9): 0.90 to 0.51, interval top 0.65. Judged
    against the first read that was a sudden drop; from the third read on it is one."""

    def run(steps: list[tuple[float, float]], **kw) -> list[int]:
        rule = SigmaMinRatioRule(**kw)
        rule.sublayers = {"h.2": "mlp"}
        fired = []
        for i, (step, hi) in enumerate(steps):
            m = {"dd/h.2/sigma_min_step": step, "dd/h.2/sigma_min_step_hi": hi}
            fired += [i for _ in rule.evaluate({**m, "dd/rows_per_dim": 16.0}, i)]
        return fired

    twin = [(0.90, 1.13), (0.51, 0.65), (0.64, 0.80), (0.66, 0.83)]
    assert run(twin) == []
    assert run(twin, drop_from_first_read=True) == [1]
    later = [(0.90, 1.13), (0.92, 1.15), (0.51, 0.65)]
    assert run(later) == [2]  # a sudden drop against the second read: at once
