"""``SigmaMinRatioRule`` and the error bars of the ratios it reads: a ratio read from few rows per
dimension decides nothing, the same ratio from many rows alerts; a sudden drop, a collapse that
persists, the warm-up; ``below_floor`` (the per-source classification) decides as the rule. The
intervals themselves are checked in tests/functional/test_ratio_intervals.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from normscope.alerts import SigmaMinRatioRule, below_floor
from normscope.functional.profile import sigma_min_profile


def _flat(profile) -> dict[str, float]:
    return {f"dd/{k}": v for k, v in profile.as_dict().items()}


def _read(ratio: float, rows_per_dim: float, d: int = 16) -> dict[str, float]:
    """A two-point profile whose step ratio is exactly ``ratio``, read from N = ratio * d rows
    (identity-shaped second moments: sigma_min exact)."""
    n = int(rows_per_dim * d)
    s0 = torch.eye(d, dtype=torch.float64)
    s1 = torch.eye(d, dtype=torch.float64) * ratio**2
    return _flat(sigma_min_profile(["p0", "p1"], [s0, s1], [n, n], [None, "mlp"]))


def test_a_read_from_few_rows_does_not_alert_where_many_rows_would():
    """The README's example: a step ratio of 0.4 read from N/d = 2 cannot decide (it may be
    the Marchenko-Pastur bias: NaN interval, undecided); from N/d = 50 it alerts."""
    few, many = _read(0.4, 2), _read(0.4, 50)
    assert few["dd/p1/sigma_min_step"] == pytest.approx(0.4, rel=1e-12)
    assert math.isnan(few["dd/p1/sigma_min_step_hi"]) and few["dd/rows_per_dim"] == 2
    rule = SigmaMinRatioRule()
    assert rule.evaluate(few, step=1) == []
    assert rule.undecided == {"p1": "too_few_rows_for_bounds"}
    alerts = SigmaMinRatioRule().evaluate(many, step=1)
    assert [a.point for a in alerts] == ["p1"]
    assert "rows per dimension" in alerts[0].message
    # under the line but the interval reaches above it: not confident, no alert
    near = _read(0.5, 8)
    assert near["dd/p1/sigma_min_step_hi"] > 0.6
    rule = SigmaMinRatioRule()
    assert rule.evaluate(near, step=1) == [] and rule.undecided == {"p1": "not_confident"}


def test_a_ratio_without_interval_or_rows_does_not_decide():
    """A ratio logged with neither its interval (``_hi``) nor the rows behind it cannot be
    judged: no alert, the point is undecided."""
    bare = {"dd/p1/sigma_min_step": 0.5, "dd/p1/sigma_min_ratio": 0.9}
    rule = SigmaMinRatioRule()
    assert rule.evaluate(bare, step=3) == []
    assert rule.undecided == {"p1": "too_few_rows_for_bounds"}


def test_the_source_classification_decides_as_the_rule():
    """below_floor (per-source reads: n_rows per point and one rows_per_dim) gives the rule's
    verdict: None with too few rows, True below with confidence, False at or above the line."""
    rule = SigmaMinRatioRule()
    base = {"sigma_min_ratio": 0.3, "sigma_min_step": 0.3}
    assert below_floor({**base, "n_rows": 32, "rows_per_dim": 2.0}, rule) is None
    assert below_floor({**base, "n_rows": 800, "rows_per_dim": 50.0}, rule) is True
    healthy = {"sigma_min_ratio": 0.95, "sigma_min_step": 1.02}
    assert below_floor({**healthy, "n_rows": 800, "rows_per_dim": 50.0}, rule) is False
    assert below_floor({**healthy, "n_rows": 32, "rows_per_dim": 2.0}, rule) is None


def test_a_confident_step_collapse_alerts_whatever_an_old_margin_key_says():
    """The no-cancellation margin is gone (issue 33: negative at every healthy point): a step
    of 0.5 whose interval top is 0.56 alerts, and a ``no_cancellation_margin`` key in an old
    log changes nothing (no ``contradicts_margin`` verdict any more)."""
    read = {
        "dd/p1/sigma_min_step": 0.5,
        "dd/p1/sigma_min_step_hi": 0.56,
        "dd/p1/sigma_min_ratio": 1.5,
        "dd/p1/sigma_min_ratio_hi": 1.6,
        "dd/rows_per_dim": 50.0,
    }
    for old in ({}, {"dd/p1/no_cancellation_margin": 0.1}):
        rule = SigmaMinRatioRule()
        alerts = rule.evaluate({**read, **old}, step=1)
        assert [a.point for a in alerts] == ["p1"] and rule.undecided == {}
        assert "premise" not in alerts[0].message


def test_a_sudden_drop_alerts_on_the_higher_floor_a_slow_dip_does_not():
    """A step ratio of 0.5 from N/d = 8 (interval top 0.79: under 0.85, not under 0.6) alerts
    only as a sudden drop: after a read of 1.0 at the same point, not at the first read, not
    after 0.8 (0.5 is not under 0.6 x 0.8), and a checkpointed rule remembers the last read.
    The run's first read (taken at initialisation) is no reference for a drop
    (``drop_from_first_read=False``): the drop is judged from the second read on."""
    low = _read(0.5, 8)
    assert 0.6 < low["dd/p1/sigma_min_step_hi"] < 0.85
    rule = SigmaMinRatioRule()
    assert rule.evaluate(low, step=1) == []  # no previous read: not confident
    restored = SigmaMinRatioRule()
    restored.load_state_dict(SigmaMinRatioRule().state_dict())
    first_only = SigmaMinRatioRule()
    first_only.evaluate(_read(1.0, 8), step=1)
    assert first_only.evaluate(low, step=2) == []  # against the first read: not a drop
    rule = SigmaMinRatioRule()
    rule.evaluate(_read(1.0, 8), step=1)
    rule.evaluate(_read(1.0, 8), step=2)
    restored.load_state_dict(rule.state_dict())
    for r in (rule, restored):
        alerts = r.evaluate(low, step=3)
        assert [a.point for a in alerts] == ["p1"]
        assert "sudden drop from 1 at the previous read" in alerts[0].message
    slow = SigmaMinRatioRule()
    slow.evaluate(_read(0.8, 8), step=1)
    slow.evaluate(_read(0.8, 8), step=2)
    assert slow.evaluate(low, step=3) == []
    off = SigmaMinRatioRule(drop=None)
    off.evaluate(_read(1.0, 8), step=1)
    off.evaluate(_read(1.0, 8), step=2)
    assert off.evaluate(low, step=3) == []


def test_a_collapse_that_persists_alerts_once():
    """After a sudden drop fires, the same point read at 0.5 again (interval top 0.79: over
    0.6, under 0.85) stays below: no second alert when it later dips under 0.6 for good."""
    rule = SigmaMinRatioRule()
    for step in (1, 2):  # the first read is no reference for a drop: two healthy reads
        rule.evaluate(_read(1.0, 8), step=step)
    fired = [rule.evaluate(_read(r, 8), step=s) for s, r in ((3, 0.5), (4, 0.5), (5, 0.3))]
    assert [[a.point for a in f] for f in fired] == [["p1"], [], []]
    assert rule.below["p1"] == 3
    rule.evaluate(_read(1.0, 8), step=6)  # recovered: the next collapse alerts again
    assert [a.point for a in rule.evaluate(_read(0.3, 8), step=7)] == ["p1"]


def test_warmup_reads_never_alert_and_a_collapse_that_outlasts_them_alerts_once():
    """``warmup_reads=2``: a collapse read at every read from the first is silent for two reads
    and alerts at the third, once (it once never alerted: its count had passed ``patience``
    during the warm-up); with ``patience=2`` a collapse that starts after the warm-up alerts
    at its second read below."""
    collapsed, healthy = _read(0.3, 50), _read(1.0, 50)
    rule = SigmaMinRatioRule(warmup_reads=2)
    fired = [[a.step for a in rule.evaluate(collapsed, step=s)] for s in range(1, 6)]
    assert fired == [[], [], [3], [], []]
    patient = SigmaMinRatioRule(warmup_reads=2, patience=2)
    reads = [healthy, healthy, healthy, collapsed, collapsed, collapsed]
    fired = [[a.step for a in patient.evaluate(r, step=s)] for s, r in enumerate(reads, 1)]
    assert fired == [[], [], [], [], [5], []]
    early = SigmaMinRatioRule(warmup_reads=1, patience=2)
    fired = [[a.step for a in early.evaluate(collapsed, step=s)] for s in range(1, 5)]
    assert fired == [[], [2], [], []]  # one read below in the warm-up counts toward patience
