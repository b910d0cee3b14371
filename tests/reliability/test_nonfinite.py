"""Non-finite activations mid-run (issue 32): the read that first holds NaN rows is made at once
(never deferred for rows), ``NonFiniteRule`` alerts there once, and no key keeps a stale value in
``trainer.callback_metrics``."""

from __future__ import annotations

import math

import torch

from normscope import DeadDirectionMonitor
from normscope.alerts import NonFiniteRule
from tests.support.tiny_models import LitTiny, cpu_trainer, token_loader


class NaNFrom(LitTiny):
    """The embedding's output turns NaN from optimiser step ``at`` on (a blown-up run)."""

    def __init__(self, at: int) -> None:
        super().__init__(lr=1e-3)
        self.at = at

        def poison(module, args, out):
            return out * math.nan if self.global_step >= self.at else out

        self.model.wte.register_forward_hook(poison)


def test_nan_rows_alert_at_the_first_read_and_leave_no_stale_key(recwarn):
    torch.manual_seed(0)
    seen = []
    monitor = DeadDirectionMonitor(every_n_steps=10, verbose=False, alerts=(seen.append,))
    trainer = cpu_trainer(45, [monitor])
    trainer.fit(NaNFrom(at=33), train_dataloaders=token_loader(n=1024))
    assert not monitor.disabled, monitor.failure
    # reads at 2 (the baseline window, step 1), 10, 20, 30, then 40: the window of step 39 holds
    # only NaN rows and is read at its end, not deferred
    fired = [(a.rule, a.step) for a in monitor.alerts_fired]
    assert fired == [("non_finite_rows", 40)], fired
    assert [a.rule for a in seen] == ["non_finite_rows"]
    assert monitor.last_read_step == 40
    last = monitor.last_report.as_dict()
    assert last["dd/rows_rejected"] > 0
    # a key the clean reads published is not left at its last clean value
    value = float(trainer.callback_metrics["dd/gamma_alignment_min"])
    assert math.isnan(value), value
    assert float(trainer.callback_metrics["dd/rows_rejected"]) == last["dd/rows_rejected"]


def test_the_rule_fires_once_an_episode_and_rearms():
    rule = NonFiniteRule()
    got = [len(rule.evaluate({"dd/rows_rejected": v}, s)) for s, v in enumerate([0, 5, 9, 0, 3])]
    assert got == [0, 1, 0, 0, 1]
    state = rule.state_dict()
    fresh = NonFiniteRule()
    fresh.load_state_dict(state)
    assert fresh.evaluate({"dd/rows_rejected": 1.0}, 9) == []  # still the same episode
