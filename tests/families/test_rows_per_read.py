"""``rows_per_read``: one row budget per read window (default ``8 d``), shared by the window's
forwards -- the micro-batches of gradient accumulation and the ranks -- so that a read folds
about the budget, not a quota per forward (issue 35)."""

from __future__ import annotations

import pytest
import torch

from normscope import ConfigurationError, DeadDirectionConfig, DeadDirectionTracker, Monitor
from tests.support.tiny_models import TinyLM

torch.set_num_threads(1)
D = 16


def tracker_after(forwards: int, share: int = 1, **kw) -> DeadDirectionTracker:
    torch.manual_seed(0)
    model = TinyLM(d=D)
    x = torch.randint(0, 32, (8, 32))  # 256 rows a forward, over 8 d = 128
    tracker = DeadDirectionTracker(DeadDirectionConfig(**kw), model)
    tracker.attach(forward=lambda: model(x))
    tracker.share_rows(share)
    for _ in range(forwards):
        with tracker.gate.sampling():
            model(x)
    return tracker


def counts(tracker: DeadDirectionTracker) -> set[int]:
    return {t.accumulator.count for t in tracker.taps.taps.values()}


def test_the_default_budget_is_8d_per_read_and_shared_by_the_forwards():
    assert DeadDirectionConfig().rows_per_read_at(D) == 8 * D == 128
    assert counts(tracker_after(1)) == {128}  # 256 rows seen, 8 d folded at every tap
    assert counts(tracker_after(2, share=2)) == {128}  # 64 + 64: two micro-batches share it
    assert counts(tracker_after(3, share=2)) == {192}  # a third forward (deferral) adds its share
    assert counts(tracker_after(2, share=4)) == {64}  # 4 forwards planned (2 ranks x 2): 32 each
    assert counts(tracker_after(2, rows_per_read="all")) == {512}
    assert counts(tracker_after(1, rows_per_read=100)) == {100}
    report = tracker_after(2, share=2).read(0)
    assert report.profile.points[0].n_rows == 128 and report.as_dict()["dd/rows_per_dim"] == 8.0


@pytest.mark.parametrize("bad", [0, -1, "8d", 1.5, True])
def test_a_bad_budget_is_refused(bad):
    with pytest.raises(ConfigurationError, match="DeadDirectionMonitor: rows_per_read"):
        DeadDirectionConfig(rows_per_read=bad)  # checked once, where every path builds it


def test_gradient_accumulation_shares_the_budget_in_a_plain_loop():
    """Two micro-batches per optimiser step through the engine: the read folds 8 d rows in
    all (64 from each micro-batch), not 8 d from each."""
    torch.manual_seed(0)
    model = TinyLM(d=D)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = Monitor.of(
        DeadDirectionConfig(), model, every_n_steps=2, alerts=(), verbose=False, overhead_warn=None
    )
    rows = []
    for step in range(6):
        for micro in range(2):  # micro-batches of optimiser step `step`
            monitor.begin(step, None)
            model(torch.randint(0, 32, (8, 32))).sum().backward()
            last = micro == 1
            if last:
                opt.step()
                opt.zero_grad()
            result = monitor.end(step + 1 if last else step)
            if not last:
                assert result.report is None  # mid accumulation
            elif result.report is not None:
                rows.append(result.report.profile.points[0].n_rows)
    monitor.close()
    assert rows and set(rows) == {128}, rows


def test_with_sources_the_budget_is_the_pooled_one():
    """``sources=`` changes no pooled read, so not the budget either: 8 d, shared alike."""
    tracker = DeadDirectionTracker(
        DeadDirectionConfig(sources="source", max_sources=3), TinyLM(d=D)
    )
    assert tracker.rows_per_forward(D) == 8 * D
    tracker.share_rows(2)
    assert tracker.rows_per_forward(D) == 4 * D


def test_the_budget_goes_to_real_rows_before_padding():
    """Three quarters of a forward's 512 rows are padding: the 8 d = 128 rows drawn are all
    real (128 <= 128 kept), not a quarter of them as a draw blind to the mask would give."""
    torch.manual_seed(0)
    model = TinyLM(d=D)
    x = torch.randint(0, 32, (16, 32))
    mask = torch.zeros(16, 32, dtype=torch.long)
    mask[:, :8] = 1  # 128 real rows
    tracker = DeadDirectionTracker(DeadDirectionConfig(), model)
    tracker.attach(forward=lambda: model(x))
    with tracker.gate.sampling(mask=mask):
        model(x)
    assert counts(tracker) == {128}
