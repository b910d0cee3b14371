"""Cost tiers (docs/costs.md, "Tiers"): the cheap tier at every read, the spectral tier at the
first read and every ``spectral_every``-th; each rule evaluated only on reads of its tier; a
cheap read's window folds the diagonals only, a spectral read's the whole co-moments."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from normscope import DeadDirectionConfig, Monitor
from normscope._common import ConfigurationError
from normscope.alerts import KernelLossRule, NonFiniteRule, SigmaMinRatioRule, rule_tier
from normscope.families.dead_direction.report import cheap_key
from tests.support.tiny_models import TinyLM, token_loader


def _fit(config, *, steps=12, every=1, cancel_at=None, nan_at=None, model=None, state=None):
    """A plain loop of ``steps`` optimiser steps; every read's (spectral, metrics, alerts,
    callback-style named metrics)."""
    torch.manual_seed(0)
    model = model or TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = Monitor.of(config, model, every_n_steps=every, alerts=(), verbose=False)
    if state is not None:
        monitor.load_state_dict(state)
    reads = []
    batches = iter(token_loader(n=16 * steps))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(steps):
            x, y = next(batches)
            if i == cancel_at:
                model.set_cancel(1, 0.95)
            if i == nan_at:
                x = x.clone()
                model.wpe.weight.data[3] = math.nan  # non-finite rows from position 3 on
            with monitor.step((x, y)) as result:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                if torch.isfinite(loss):
                    loss.backward()
                    opt.step()
                opt.zero_grad()
                if i == nan_at:
                    model.wpe.weight.data[3] = 0.0
            if result.report is not None:
                report = result.report
                reads.append((report.spectral, report.as_dict(), result.alerts, result.metrics))
    return monitor, reads


def test_spectral_every_is_checked_once():
    assert DeadDirectionConfig().spectral_every == "auto"
    assert [DeadDirectionConfig().spectral_every_at(d) for d in (16, 64, 65, 128, 4096)] == [
        1,
        1,
        5,
        5,
        5,
    ]
    assert DeadDirectionConfig(spectral_every=7).spectral_every_at(16) == 7
    for bad in (0, -1, 2.0, True, "5", "Auto", None):
        with pytest.raises(ConfigurationError, match="spectral_every"):
            DeadDirectionConfig(spectral_every=bad)


def test_cheap_reads_log_only_cheap_keys_and_spectral_reads_all():
    _, reads = _fit(DeadDirectionConfig(spectral_every=3), steps=10)
    assert [s for s, *_ in reads] == [i % 3 == 0 for i in range(len(reads))]
    full = [m for s, m, *_ in reads if s]
    cheap = [m for s, m, *_ in reads if not s]
    assert full and cheap
    expected_cheap = {k for k in full[-1] if cheap_key(k)}
    # the second read on sets rms_growth, which the first cannot have
    for metrics in cheap:
        assert set(metrics) == expected_cheap
    assert set(full[-1]) > expected_cheap
    for key in (
        "dd/sigma_min_ratio_min",
        "dd/h.0.ln_1/gamma_alignment",
        "dd/final_rankme",
        "dd/h.0.ln_1/kernel_residual",  # needs the whole C: spectral since the diagonal fold
    ):
        assert key in full[-1] and all(key not in m for m in cheap)


@pytest.mark.parametrize("d, dead", [(32, 0), (96, 0), (96, 3)])
def test_kernel_residual_alone_equals_the_kernel_read(d, dead):
    """kernel_residual without a decomposition (Lanczos lambda_d) is kernel_read's, to float64."""
    from normscope.functional.kernel import kernel_read, kernel_residual

    g = torch.Generator().manual_seed(d + dead)
    gamma = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    gamma[:dead] = 0.0
    x = torch.randn(8 * d, d, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, d)
    y = F.layer_norm(x, (d,), gamma.clamp_min(1e-3)) * (gamma > 0)
    c = torch.cov(y.T, correction=0)
    a = kernel_read(c, gamma, 8 * d).kernel_residual
    b = kernel_residual(c, gamma, 8 * d)
    assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-18), (a, b)
    assert math.isnan(kernel_residual(c, gamma, d))  # under 2 d rows, as kernel_read


def test_callback_metrics_hold_the_last_spectral_value_on_cheap_reads():
    _, reads = _fit(DeadDirectionConfig(spectral_every=3), steps=6)
    (s0, m0, _, _), (s1, m1, _, named1) = reads[0], reads[1]
    assert s0 and not s1
    key = "dd/sigma_min_ratio_min"
    assert key not in m1 and named1[key] == m0[key]  # held, not NaN
    assert named1["dd/rows_rejected"] == m1["dd/rows_rejected"]


def test_rules_declare_their_tier():
    assert rule_tier(SigmaMinRatioRule()) == "spectral"
    assert rule_tier(KernelLossRule()) == "spectral"  # kernel_residual needs the whole C
    assert rule_tier(NonFiniteRule()) == "cheap"
    assert rule_tier(object()) == "spectral"


def test_spectral_rule_waits_for_the_next_spectral_read_and_fires():
    evaluated = []

    class Seen(SigmaMinRatioRule):
        def evaluate(self, metrics, step):
            evaluated.append(("dd/sigma_min_ratio_min" in metrics, step))
            return super().evaluate(metrics, step)

    config = DeadDirectionConfig(spectral_every=4)
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rule = Seen()
    monitor = Monitor.of(config, model, every_n_steps=1, rules=[rule], alerts=(), verbose=False)
    fired = []
    batches = iter(token_loader(n=16 * 14))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(14):
            x, y = next(batches)
            if i == 3:
                model.set_cancel(1, 0.95)
            with monitor.step((x, y)) as result:
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                opt.step()
                opt.zero_grad()
            if result.report is not None:
                fired += [
                    (a.rule, result.report.step, result.report.spectral) for a in result.alerts
                ]
    assert evaluated and all(seen for seen, _ in evaluated)  # never on a cheap read
    assert len(evaluated) == math.ceil(monitor.reads / 4)
    mine = [f for f in fired if f[0] == "sigma_min_collapse"]
    assert mine and all(spectral for *_, spectral in mine)


def test_cheap_rule_fires_on_a_cheap_read():
    _, reads = _fit(DeadDirectionConfig(spectral_every=100), steps=6, nan_at=3)
    hits = [(s, a.rule) for s, _, alerts, _ in reads for a in alerts if a.rule == "non_finite_rows"]
    assert hits and not hits[0][0], "non_finite_rows must fire on a cheap read"


def test_spectral_every_one_is_every_read_full():
    _, reads = _fit(DeadDirectionConfig(spectral_every=1), steps=4)
    assert all(s for s, *_ in reads)
    _, tiered = _fit(DeadDirectionConfig(spectral_every=2), steps=4)
    # the spectral reads of a tiered run equal the full run's reads at the same steps; to the
    # last bits only where a key reads a cheap read's diagonal (rms_growth: its denominator),
    # summed in another order than the full fold's GEMM
    for (s, m, *_), (_, full, *_) in zip(tiered, reads):
        if s:
            assert m.keys() == full.keys()
            for k in m:
                same = math.isclose(m[k], full[k], rel_tol=1e-12, abs_tol=1e-300)
                assert same or (math.isnan(m[k]) and math.isnan(full[k])), k


def test_resume_keeps_the_tier_schedule():
    monitor, reads = _fit(DeadDirectionConfig(spectral_every=3), steps=4)
    n = monitor.reads
    state = monitor.state_dict()
    assert state["family"]["reads_taken"] == n
    _, resumed = _fit(DeadDirectionConfig(spectral_every=3), steps=4, state=state)
    assert [s for s, *_ in resumed] == [(n + i) % 3 == 0 for i in range(len(resumed))]


def test_a_cheap_window_folds_the_diagonals_only():
    """The window's fold is decided when it opens, from the schedule: every tap folds the whole
    co-moment on a spectral read's window, its diagonal on a cheap one's; no escalation."""
    torch.manual_seed(0)
    model = TinyLM()
    monitor = Monitor.of(
        DeadDirectionConfig(spectral_every=3), model, every_n_steps=1, alerts=(), verbose=False
    )
    tracker = monitor.family.tracker
    folds, tiers = [], []
    batches = iter(token_loader(n=16 * 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(8):
            x, y = next(batches)
            with monitor.step((x, y)) as result:
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                if tracker.attached and tracker.gate.open:  # the window's rows are folded
                    folds.append({t.accumulator.full for t in tracker.taps.taps.values()})
            if result.report is not None:
                tiers.append(result.report.spectral)
    assert len(tiers) >= 6 and tiers == [i % 3 == 0 for i in range(len(tiers))]
    assert folds == [{s} for s in tiers]  # one mode per window, the read's tier
    assert not hasattr(tracker, "escalated") and not hasattr(monitor.family, "escalation_line")
    acc = next(iter(tracker.taps.taps.values())).accumulator
    if not acc.full:  # the open window is a cheap one: no matrix to read
        with pytest.raises(RuntimeError, match="diagonal only"):
            acc.covariance()


def test_cheap_keys_of_a_diagonal_window_equal_those_of_a_full_one():
    """The same rows read cheap (diagonal fold) and full: the stream keys agree to 1e-12
    relative (the diagonal summed in another order than the GEMM's: a few ulps)."""
    _, full = _fit(DeadDirectionConfig(spectral_every=1), steps=6)
    _, tiered = _fit(DeadDirectionConfig(spectral_every=100), steps=6)
    assert [s for s, *_ in tiered][1:] == [False] * (len(tiered) - 1)
    compared = 0
    for (s, cheap, *_), (_, whole, *_) in zip(tiered[1:], full[1:]):
        assert not s
        for k, v in cheap.items():
            if k.endswith(("/offset_share", "/rms", "/out_offset_share", "/rms_growth")):
                assert math.isclose(v, whole[k], rel_tol=1e-12, abs_tol=1e-300), (k, v, whole[k])
                compared += 1
    assert compared >= 20


def test_auto_reads_every_fifth_read_spectral_above_width_128():
    torch.manual_seed(0)
    monitor, reads = _fit(DeadDirectionConfig(), steps=24, model=TinyLM(d=144, layers=1, heads=2))
    assert monitor.family.spectral_every() == 5
    spectral = [s for s, *_ in reads]
    assert len(spectral) >= 6 and spectral[:6] == [True, False, False, False, False, True]
