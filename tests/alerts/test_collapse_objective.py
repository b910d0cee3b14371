"""``RepresentationCollapseRule(objective=...)`` (issue 41, docs/alerts.md): a language model's
first steps and an embedding's collapse look the same at the final norm, so the rule is told
which the model trains. The trajectories are the held-out zoo's (Hugging Face configs at width
256, ``8 d = 2048`` rows a read, ``benchmarks/RESULTS.md``), copied from its saved reads."""

from __future__ import annotations

import pytest
import torch

from normscope import DeadDirectionConfig, DeadDirectionMonitor
from normscope._common import ConfigurationError
from normscope.alerts import RepresentationCollapseRule, rule_tier
from tests.support.tiny_models import LitTiny, cpu_trainer, token_loader

ROWS = 2048.0


def _read(share: float, spectral: bool = True) -> dict[str, float]:
    """One read of the final norm ``ln_f`` (width 256) as the monitor logs it: the cheap keys,
    and on a spectral read its RankMe (which names the final norm), the centred RankMe and the
    smallest ``sigma_min`` ratio (the Llama's: 140 of 256, 1.43: the stream keeps its width)."""
    out = {
        "dd/ln_f/n_rows": ROWS,
        "dd/final_rows_per_dim": ROWS / 256,
        "dd/final_out_offset_share": share,
    }
    if spectral:
        out |= {
            "dd/ln_f/rankme": 10.0,
            "dd/final_rankme_centred": 140.0,
            "dd/sigma_min_ratio_min": 1.43,
        }
    return out


def _fired(rule: RepresentationCollapseRule, shares, spectral_every: int = 1) -> list[int]:
    return [
        i
        for i, s in enumerate(shares)
        if rule.evaluate(_read(s, spectral=i % spectral_every == 0), 10 * i)
    ]


# the Llama self-supervised collapse (pooled embeddings made to agree, no stop-gradient), seed 0
LLAMA_SSL = [0.1414, 0.9967, 0.9992, 0.9994, 0.9996, 0.9996]
# a GPT-2 language model's unigram phase (the non-finite pathology's healthy twin, seed 1)
GPT2_LM = [0.8062, 0.9995, 0.9300, 0.9996, 0.9992, 0.9990, 0.7000]
# the ViT's contrastive twin (negatives keep the spread), seed 0
VIT_TWIN = [0.0832, 0.6541, 0.6603, 0.4762, 0.7219, 0.4071, 0.4584]
# the ViT at width 512, whose collapse settles under 0.99 (0.556 -> 0.914 -> 0.976 -> 0.989)
VIT_512 = [0.5556, 0.9139, 0.9762, 0.9876, 0.9893]


def test_an_embedding_collapse_fires_at_the_read_that_loses_the_spread():
    rule = RepresentationCollapseRule(objective="embedding")
    assert _fired(rule, LLAMA_SSL) == [1]  # one alert: the episode holds while it stays
    alert_rule = RepresentationCollapseRule(objective="embedding")
    alerts = [a for i, s in enumerate(LLAMA_SSL) for a in alert_rule.evaluate(_read(s), 10 * i)]
    assert "down from 85.9% at step 0" in alerts[0].message and alerts[0].threshold == 0.95
    # settling under 0.99 is no escape: 0.976 is confidently over 0.95 after a spread read
    assert _fired(RepresentationCollapseRule(objective="embedding"), VIT_512) == [2]
    # the default (a language model) holds the same reads apart: the stream keeps its width
    assert _fired(RepresentationCollapseRule(), LLAMA_SSL) == []


def test_the_objective_is_what_tells_a_language_models_first_steps_from_a_collapse():
    assert _fired(RepresentationCollapseRule(), GPT2_LM) == []  # no narrowing read: quiet
    # the same reads in an embedding model are a collapse: the first read is not clearly under
    # 0.8, so it takes two reads over 0.99 in a row (0.93 between breaks the first pair)
    assert _fired(RepresentationCollapseRule(objective="embedding"), GPT2_LM) == [4]
    assert _fired(RepresentationCollapseRule(objective="embedding"), VIT_TWIN) == []


def test_an_embedding_rule_reads_the_cheap_tier_and_survives_a_resume():
    rule = RepresentationCollapseRule(objective="embedding")
    assert rule_tier(rule) == "cheap" and rule_tier(RepresentationCollapseRule()) == "spectral"
    # spectral_every=5: reads 1-4 carry no RankMe; the collapse at read 1 is still read there
    assert _fired(RepresentationCollapseRule(objective="embedding"), LLAMA_SSL, 5) == [1]
    rule.evaluate(_read(0.3), 0)  # the spread reference, and the final norm's name
    resumed = RepresentationCollapseRule(objective="embedding")
    resumed.load_state_dict(rule.state_dict())
    assert resumed.spread_seen == (0, pytest.approx(0.7)) and resumed.final_norm == "ln_f"
    assert [a.point for a in resumed.evaluate(_read(0.97, spectral=False), 10)] == ["ln_f"]
    with pytest.raises(ValueError, match="objective"):
        RepresentationCollapseRule(objective="ssl")


def test_the_monitor_takes_the_objective_and_refuses_a_bad_one():
    with pytest.raises(ConfigurationError, match="objective"):
        DeadDirectionConfig(objective="contrastive")
    monitor = DeadDirectionMonitor(every_n_steps=5, objective="embedding", verbose=False, alerts=())
    rule = next(r for r in monitor.rules if isinstance(r, RepresentationCollapseRule))
    assert rule.objective == "embedding" and rule_tier(rule) == "cheap"
    torch.manual_seed(0)
    trainer = cpu_trainer(20, [monitor])
    trainer.fit(LitTiny(), train_dataloaders=token_loader(n=512))
    # the rule judged the run's reads (it learnt the final norm from the first, spectral, one)
    assert rule.final_norm is not None and rule.final_norm.endswith("ln_f")
