"""The no-cancellation margin through the tracker (issue 18): same rows at every residual point,
``M_k`` between neighbours, the margin against a numpy float64 reference, negative exactly at a
cancelling sublayer, logged by a real Lightning fit, and budgeted under ``max_memory``.

The test model is a pre-norm stack whose healthy blocks satisfy the theorem's premise by
construction: ``f(x) = 0.5 x + W ln(x)`` with a small ``W``, so ``M_k ~ S_{k-1} > 0``; a block
may also cancel, ``f -= 0.9 x P`` (``P`` a rank-2 projector): along ``P``, ``M_k`` is about
``(1 - 1.8) S`` and the margin is negative there, and only there.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from normscope import DeadDirectionMonitor, scan_model
from normscope.alerts import CallableRule
from normscope.families.dead_direction import DeadDirectionTracker
from tests.callbacks.tiny_models import LitTiny, TinyLM, cpu_trainer, token_loader

torch.set_num_threads(1)
D = 16


class Block(nn.Module):
    def __init__(self, d: int, alpha: float, seed: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.proj = nn.Linear(d, d)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.proj.weight.copy_(0.005 * torch.randn(d, d, generator=g))
            self.proj.bias.zero_()
        self.alpha = alpha
        self.cancel = 0.0
        q, _ = torch.linalg.qr(torch.randn(d, 2, generator=g))
        self.register_buffer("P", q @ q.T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.alpha * x + self.proj(self.ln(x))
        if self.cancel:
            f = f - self.cancel * (x @ self.P)
        return x + f


class Stack(nn.Module):
    def __init__(self, d: int = D, layers: int = 4, alpha: float = 0.5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, alpha, seed=k) for k in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def batches(n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(D) + 0.3 * torch.randn(D, D, generator=g)
    return [torch.randn(4, 32, D, generator=g) @ mix for _ in range(n)]


def stream_rows(model: Stack, xs: list[torch.Tensor]) -> list[np.ndarray]:
    """Every residual point's rows (each block's input, then ln_f's), float64, via hooks."""
    rows: dict[int, list[np.ndarray]] = {}
    mods = [*model.blocks, model.ln_f]
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, args, k=k: rows.setdefault(k, []).append(
                args[0].reshape(-1, D).double().numpy()
            )
        )
        for k, m in enumerate(mods)
    ]
    with torch.no_grad():
        for x in xs:
            model(x)
    for h in hooks:
        h.remove()
    return [np.concatenate(rows[k]) for k in range(len(mods))]


def numpy_margins(points: list[np.ndarray]) -> list[float]:
    out = [math.nan]
    for a, b in zip(points[:-1], points[1:]):
        f = b - a
        m = (a.T @ f + f.T @ a) / len(a)
        out.append(np.linalg.eigvalsh(m)[0] / np.linalg.eigvalsh(a.T @ a / len(a))[0])
    return out


@pytest.mark.parametrize("cancel_block", [None, 2])
def test_margin_matches_numpy_and_is_negative_exactly_at_the_cancelling_sublayer(cancel_block):
    torch.manual_seed(0)
    model = Stack()
    if cancel_block is not None:
        model.blocks[cancel_block].cancel = 0.9
    xs = batches()
    report = scan_model(model, xs)
    profile = report.profile
    names = [p.name for p in profile.points]
    assert names == ["blocks.0.ln", "blocks.1.ln", "blocks.2.ln", "blocks.3.ln", "ln_f"]
    margins = profile.no_cancellation_margin
    ref = numpy_margins(stream_rows(model, xs))
    assert len(margins) == len(names) and math.isnan(margins[0])
    np.testing.assert_allclose(margins[1:], ref[1:], rtol=1e-9)
    # point k sits after block k-1: the cancelling block's output is point cancel_block + 1
    negative = [k for k, m in enumerate(margins) if m < 0]
    assert negative == ([] if cancel_block is None else [cancel_block + 1])
    # the theorem on the same rows: step^2 >= 1 + margin at every point
    for p, m in zip(profile.points[1:], margins[1:]):
        assert p.sigma_min_step**2 >= 1 + m - 1e-9
    logged = report.as_dict()
    assert logged["dd/no_cancellation_margin_min"] == min(margins[1:])
    assert logged["dd/ln_f/no_cancellation_margin"] == margins[-1]
    assert math.isnan(logged["dd/blocks.0.ln/no_cancellation_margin"])


def test_every_point_folds_the_same_sampled_rows():
    """128 rows a forward, 48 kept: with a zero branch in block 1, point 2 is point 1 row for
    row, so on the same rows S_2 == S_1 (step exactly 1) and M_2 == 0 (margin exactly 0).
    Independent subsets would make them differ."""
    torch.manual_seed(0)
    model = Stack()
    with torch.no_grad():
        model.blocks[1].alpha = 0.0
        model.blocks[1].proj.weight.zero_()
    tracker = DeadDirectionTracker(model, max_rows_per_step=48, seed=3)
    xs = batches(4)
    tracker.attach(forward=lambda: model(xs[0]))
    with torch.no_grad(), tracker.gate.sampling():
        for x in xs:
            model(x)
    taps = tracker.point_taps
    assert [t.accumulator.count for t in taps] == [4 * 48] * 5
    assert torch.equal(taps[1].accumulator.second_moment(), taps[2].accumulator.second_moment())
    assert tracker.taps.chain.cross[1].count == 4 * 48
    profile = tracker.read(0, reduce=False).profile
    assert profile.points[2].sigma_min_step == 1.0
    assert profile.no_cancellation_margin[2] == 0.0
    assert all(m > 0 for k, m in enumerate(profile.no_cancellation_margin) if k not in (0, 2))
    tracker.detach()


def test_margin_off_and_memory_budget():
    """Each link costs 8 d^2 (2 KiB at d = 16). TinyLM(layers=4): 9 points (18 KiB), 8 links
    (16 KiB), 9 norm outputs (18 KiB). A budget of 36 KiB keeps the profile and its links and
    what is left for norms; 20 KiB keeps the profile, drops the margin and says so."""
    torch.manual_seed(0)
    model = TinyLM(layers=4)
    x = torch.randint(0, 32, (4, 16))
    full = DeadDirectionTracker(model)
    full.attach(forward=lambda: model(x))
    assert full.memory_bytes() == 52 * 1024
    full.detach()
    off = DeadDirectionTracker(model, margin=False)
    off.attach(forward=lambda: model(x))
    assert off.memory_bytes() == 36 * 1024 and off.taps.chain.cross == []
    with off.gate.sampling():
        model(x)
    profile = off.read(0, reduce=False).profile
    assert not profile.margin_measured and all(
        math.isnan(m) for m in profile.no_cancellation_margin
    )
    assert "dd/no_cancellation_margin_min" not in off.read(0, reduce=False).as_dict()
    off.detach()
    for budget, links in ((36 * 1024, True), (20 * 1024, False)):
        tracker = DeadDirectionTracker(model, max_memory=budget)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tracker.attach(forward=lambda: model(x))
        text = " ".join(str(w.message) for w in caught)
        assert tracker.memory_bytes() <= budget
        assert len(tracker.layout.points) == 9 and tracker.margin is links
        assert [n.name for n in tracker.norms] == ["ln_f"]  # 2 KiB left: its output tap
        assert ("no-cancellation margin (not read)" in text) is (not links)
        with tracker.gate.sampling():
            model(x)
        margins = tracker.read(0, reduce=False).profile.no_cancellation_margin
        assert any(math.isfinite(m) for m in margins) is links
        tracker.detach()


def test_a_lightning_fit_logs_the_margin_and_it_is_negative_at_the_cancelling_branch():
    """LitTiny's cancelling MLP (block 1, from step 2): its point (model.ln_f) reads a negative
    margin; every point's key and the run-level minimum reach the logger."""
    torch.manual_seed(0)
    seen: list[dict[str, float]] = []
    rule = CallableRule("record", lambda m, s: seen.append(dict(m)) and None)
    monitor = DeadDirectionMonitor(every_n_steps=3, rules=[rule], alerts=(), verbose=False)
    cpu_trainer(3, [monitor]).fit(
        LitTiny(cancel_at_step=2, cancel_layer=1, cancel_strength=0.95),
        train_dataloaders=token_loader(),
    )
    first, last = seen[0], seen[-1]
    points = [p.name for p in monitor.tracker.layout.points]
    for read in (first, last):
        assert all(f"dd/{p}/no_cancellation_margin" in read for p in points)
        margins = [read[f"dd/{p}/no_cancellation_margin"] for p in points[1:]]
        assert read["dd/no_cancellation_margin_min"] == min(margins)
    assert last["dd/model.ln_f/no_cancellation_margin"] < 0


def test_a_failing_cross_moment_disables_the_margin_only():
    """A cross-moment update that raises inside the hook: one warning, the margins stop, the
    profile and the norm reads go on, the forward is untouched."""
    torch.manual_seed(0)
    model = Stack()
    tracker = DeadDirectionTracker(model)
    xs = batches(2)
    tracker.attach(forward=lambda: model(xs[0]))

    def broken(*args, **kwargs):
        raise RuntimeError("cross-moment exploded")

    tracker.taps.chain.cross[1].update = broken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), tracker.gate.sampling():
            out = [model(x) for x in xs]
    texts = [str(w.message) for w in caught if "normscope" in str(w.message)]
    assert len(texts) == 1 and "cross-moments failed" in texts[0]
    assert all(torch.isfinite(o).all() for o in out)
    report = tracker.read(0, reduce=False)
    assert not report.profile.margin_measured
    assert all(math.isfinite(p.sigma_min) for p in report.profile.points)
    assert len(report.norms) == 5 and report.failed_taps == {}
    tracker.detach()
