"""``RepresentationCollapseRule(objective="embedding")`` takes the model before its first update
as its reference: the first read after residual discovery carries the final norm's offset share
on the discovery forward (``dd/final_out_offset_share_init`` and its rows; the keys themselves:
tests/families/test_init_reference.py). A collapse in the first optimiser step then fires at
the first read that shows it, not two reads later."""

from __future__ import annotations

import math

from normscope.alerts import RepresentationCollapseRule

ROWS = 2048.0


def _read(share: float, init: float | None = None, init_rows: float = 136.0) -> dict:
    """One cheap read of the final norm ``ln_f`` (width 256); ``init``: the first read after
    discovery, with the discovery forward's share from ``init_rows`` rows."""
    out = {
        "dd/ln_f/n_rows": ROWS,
        "dd/final_rows_per_dim": ROWS / 256,
        "dd/final_out_offset_share": share,
        # the spectral keys a language-model rule needs: the stream narrows
        "dd/ln_f/rankme": 10.0,
        "dd/final_rankme_centred": 140.0,
        "dd/sigma_min_ratio_min": 0.7,
    }
    if init is not None:
        out |= {
            "dd/final_out_offset_share_init": init,
            "dd/final_out_rows_init": init_rows,
            "dd/final_out_init_step": 0.0,
        }
    return out


def _fired(rule: RepresentationCollapseRule, reads: list[dict]) -> list[int]:
    return [i for i, m in enumerate(reads) if rule.evaluate(m, 2 * (i + 1))]


# the first read is already not clearly spread (one step collapsed it), the next is collapsed
SHARES = [0.93, 0.999, 0.999, 0.999]


def test_the_discovery_forward_is_the_reference_so_the_second_read_fires():
    rule = RepresentationCollapseRule(objective="embedding")
    reads = [_read(SHARES[0], init=0.25)] + [_read(s) for s in SHARES[1:]]
    assert _fired(rule, reads) == [1]
    assert rule.spread_seen == (0, 0.75) and rule.seen_at_init
    alert = RepresentationCollapseRule(objective="embedding")
    (first,) = [a for i, m in enumerate(reads) for a in alert.evaluate(m, 2 * (i + 1))]
    assert first.step == 4 and first.threshold == 0.95
    assert "down from 75.0% at step 0 (before the first update)" in first.message
    # a collapse within the first step fires at the first read itself
    assert _fired(RepresentationCollapseRule(objective="embedding"), [_read(0.97, 0.25)]) == [0]


def test_without_a_clearly_spread_init_the_rule_is_unchanged():
    plain = [_read(s) for s in SHARES]
    assert _fired(RepresentationCollapseRule(objective="embedding"), plain) == [2]  # today's
    for init, rows in ((0.9, 136.0), (0.25, 16.0), (math.nan, 136.0)):
        # 0.9: not clearly under rise_from 0.8; 16 rows: under min_rows; NaN: no share
        rule = RepresentationCollapseRule(objective="embedding")
        reads = [_read(SHARES[0], init, rows)] + plain[1:]
        assert _fired(rule, reads) == [2] and rule.spread_seen is None
    # "clearly" is the read's own test: a spread of 0.25 is over 1 - rise_from = 0.2 with
    # confidence from 4,096 rows (its interval from 0.234), not from 40 (from 0.128)
    many = RepresentationCollapseRule(objective="embedding")
    assert _fired(many, [_read(SHARES[0], 0.75, 4096.0)] + plain[1:]) == [1]
    few = RepresentationCollapseRule(objective="embedding")
    assert _fired(few, [_read(SHARES[0], 0.75, 40.0)] + plain[1:]) == [2]


def test_the_tokens_objective_ignores_the_init_keys():
    with_init = [_read(SHARES[0], init=0.25)] + [_read(s) for s in SHARES[1:]]
    plain = [_read(s) for s in SHARES]
    rule, twin = RepresentationCollapseRule(), RepresentationCollapseRule()
    assert _fired(rule, with_init) == _fired(twin, plain)
    assert rule.state_dict() == twin.state_dict() and rule.spread_seen is None


def test_a_resumed_rule_keeps_the_init_reference():
    rule = RepresentationCollapseRule(objective="embedding")
    assert rule.evaluate(_read(SHARES[0], init=0.25), 2) == []
    resumed = RepresentationCollapseRule(objective="embedding")
    resumed.load_state_dict(rule.state_dict())
    assert resumed.spread_seen == (0, 0.75) and resumed.seen_at_init
    (alert,) = resumed.evaluate(_read(SHARES[1]), 4)
    assert "at step 0 (before the first update)" in alert.message
    # an older checkpoint without the flag: the reference is a read's
    state = rule.state_dict()
    del state["seen_at_init"]
    older = RepresentationCollapseRule(objective="embedding")
    older.load_state_dict(state)
    assert older.spread_seen == (0, 0.75) and not older.seen_at_init
