"""One monitor kept across two ``Trainer.fit`` calls (a second stage, a fine-tune) reads the
second fit exactly as a fresh monitor does (but for the reads against an earlier read): teardown
removed the hooks, the next fit puts them back. Before the fix the dead-direction taps stayed unhooked and the second fit read 0 rows."""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch

from normscope import DeadDirectionMonitor, SignMagnitudeMonitor
from tests.support.tiny_models import LitTiny, cpu_trainer, token_loader


class _Reads(L.Callback):
    """Every report the monitor publishes in one fit, as ``(step, report dict)``."""

    def __init__(self, monitor) -> None:
        self.monitor, self.got, self._last = monitor, [], None

    def on_train_start(self, trainer, pl_module) -> None:
        self._last = self.monitor.last_report  # the previous fit's last read is not this fit's

    def on_train_batch_end(self, trainer, *args) -> None:
        report = self.monitor.last_report
        if report is not None and report is not self._last:
            self._last = report
            self.got.append((report.step, report.as_dict()))


# reads against an earlier read, which the reused monitor has from the first fit: the previous
# signs of sign_churn and the stream reads' memory (gains at the first batch, the last RMS),
# and the final norm's share on the discovery forward (the first fit's: not rediscovered);
# delta_gamma needs no baseline (it reads against its own control)
_HISTORY = ("churn", "gamma_scale", "gamma_crossed", "rms_growth", "_init")


@pytest.mark.parametrize("family", ["dd", "sm"])
def test_a_monitor_reused_for_a_second_fit_reads_it_as_a_fresh_one(family: str) -> None:
    # every row read (no subsample): the reused monitor's subsample generator has moved on in
    # the first fit, so a sampled subset would differ from a fresh monitor's
    make = (
        (lambda **kw: DeadDirectionMonitor(rows_per_read="all", **kw))
        if family == "dd"
        else SignMagnitudeMonitor
    )
    torch.manual_seed(0)
    model = LitTiny()
    reused = make(every_n_steps=4, verbose=False, alerts=())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's few-batches notices
        cpu_trainer(4, [reused]).fit(model, token_loader())
        twin = copy.deepcopy(model)
        runs = {}
        for label, lit, monitor in (
            ("reused", model, reused),
            ("fresh", twin, make(every_n_steps=4, verbose=False, alerts=())),
        ):
            grab = _Reads(monitor)
            torch.manual_seed(1)
            cpu_trainer(8, [monitor, grab]).fit(lit, token_loader())
            runs[label] = grab.got
    steps = [s for s, _ in runs["fresh"]]
    assert len(steps) == 3 and [s for s, _ in runs["reused"]] == steps
    rows_key = f"{family}/rows_per_dim" if family == "dd" else "sm/max_leverage_max"
    for (_, a), (_, b) in zip(runs["reused"], runs["fresh"]):
        assert a[rows_key] > 0
        assert {k for k in a if not any(h in k for h in _HISTORY)} == {
            k for k in b if not any(h in k for h in _HISTORY)
        }
        for key in a:  # the same rows, the same float64 arithmetic: equal, NaN where NaN
            if any(h in key for h in _HISTORY):
                continue
            assert a[key] == b[key] or (a[key] != a[key] and b[key] != b[key]), key
