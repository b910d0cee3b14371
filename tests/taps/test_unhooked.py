"""Between sampled windows an eager model carries no normscope hook: the dead-direction taps
and the attention-logit hooks are registered when a window opens and removed when it closes
(``DeadDirectionFamily.keep_hooks`` keeps them, as on a compiled model); the reads are the
same either way, also over gradient accumulation and a deferred read."""

from __future__ import annotations

import math

import pytest
import torch
from examples.nanogpt import GPT, GPTConfig, make_optimizer
from torch import nn

from normscope import DeadDirectionConfig, Monitor
from normscope.taps.attention import AttentionLogits
from normscope.taps.hooks import Gate, TapSet

torch.set_num_threads(1)
STEPS = 7


def hook_counts(model: torch.nn.Module) -> list[tuple[int, int]]:
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def run(keep: bool, *, micro: int = 1, batch: int = 8, **config):
    """A plain loop over the demo GPT with ``every_n_steps=3``: the hook counts after each
    optimiser step, the output hooks ``ln_1`` of block 0 holds during each forward, the reads
    and the counts of a fresh (unmonitored) model."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    optimizer = make_optimizer(model, 1e-3, 0.1)
    during: list[int] = []
    norm = model.transformer.h[0].ln_1
    norm.register_forward_hook(lambda m, args, out: during.append(len(m._forward_hooks)))
    fresh = hook_counts(model)  # the probe above is the model's own
    monitor = Monitor.of(
        DeadDirectionConfig(**config),
        model,
        every_n_steps=3,
        alerts=(),
        verbose=False,
        overhead_warn=None,
    )
    monitor.family.keep_hooks = keep
    data = torch.Generator().manual_seed(1)
    after, reads = [], {}
    for step in range(STEPS):
        for k in range(micro):
            x = torch.randint(0, 256, (batch, 16), generator=data)
            monitor.begin(step, x)
            _, loss = model(x, x)
            (loss / micro).backward()
            last = k == micro - 1
            if last:
                optimizer.step()
                optimizer.zero_grad()
            result = monitor.end(step + 1 if last else step)
            if not last:
                assert hook_counts(model) == fresh or keep  # between micro-batches too
        after.append(hook_counts(model))
        if result.report is not None:
            reads[step] = result.report.as_dict()
    monitor.detach()
    assert hook_counts(model) == fresh  # teardown removed everything
    return fresh, after, during, reads


def assert_same_reads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for step in a:
        assert a[step].keys() == b[step].keys()
        for key, value in a[step].items():
            other = b[step][key]
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(other), (step, key)
            else:
                assert other == pytest.approx(value, rel=1e-9, abs=1e-12), (step, key)


def test_no_hook_between_sampled_windows_and_the_same_reads():
    fresh, after, during, reads = run(keep=False)
    # step 0: discovery; then the baseline window (step 1) and every 3rd step (2, 5)
    assert sorted(reads) == [1, 2, 5]
    assert all(counts == fresh for counts in after)  # never a hook left after a step
    # during the forwards: the probe alone, or the probe and the tap on a sampled step (step
    # 0's forward carries residual discovery's temporary hooks instead)
    assert during[0] > 1 and during[1:] == [2, 2, 1, 1, 2, 1], during
    kept_fresh, kept_after, kept_during, kept_reads = run(keep=True)
    assert kept_after[-1] != kept_fresh  # the switch keeps them, as on a compiled model
    assert kept_during[1:] == [2] * (STEPS - 1)
    assert_same_reads(reads, kept_reads)
    assert reads[1]["dd/attn_modules_read"] == 2  # the attention hooks came back too


def test_gradient_accumulation_and_a_deferred_read_fold_what_they_folded():
    """Two micro-batches a step, each opening and closing the window; 2 x 16 rows a
    micro-batch against 4 d = 128 needed, so each read waits (deferred) over several steps:
    the hooks come back at every open and the reads are those of hooks kept throughout."""
    fresh, after, during, reads = run(keep=False, micro=2, batch=1)
    kept = run(keep=True, micro=2, batch=1)[3]
    assert all(counts == fresh for counts in after)
    assert reads and during.count(2) > 2 * len(reads)  # windows of several steps
    assert_same_reads(reads, kept)


def test_tapset_unhook_and_hook_keep_the_rows_and_are_idempotent():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    taps = TapSet(model, Gate())
    tap = taps.add("1", "output", dim=8)
    with taps.gate.sampling():
        model(torch.randn(32, 4))
    taps.unhook()
    taps.unhook()
    assert not taps.hooked and not model[1]._forward_hooks
    with taps.gate.sampling():
        model(torch.randn(32, 4))  # unhooked: not read
    assert tap.accumulator.count == 32
    taps.hook()
    taps.hook()
    assert taps.hooked and len(model[1]._forward_hooks) == 1
    with taps.gate.sampling():
        model(torch.randn(32, 4))
    assert tap.accumulator.count == 64  # the same accumulator goes on
    taps.remove()
    assert not model[1]._forward_hooks


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits: AttentionLogits | None = None
        self.unhooked_inside: list[bool] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if self.logits is not None:
            self.unhooked_inside.append(self.logits.unhook())
        return (q @ k.mT).softmax(-1)


def test_attention_unhook_waits_for_the_forward_it_reads():
    model = _Attention()
    logits = AttentionLogits(model, [""], Gate())
    q, k = torch.eye(3) * 2, torch.eye(3) * 3
    model.logits = logits
    with logits.gate.sampling():
        model(q, k)
    assert model.unhooked_inside == [False]  # mid-read: its forward hook must end the read
    assert logits.hooked and logits.take()[""].item() == 6.0
    model.logits = None
    assert logits.unhook() and not logits.hooked
    assert not model._forward_hooks and not model._forward_pre_hooks
    with logits.gate.sampling():
        model(q, k)
    assert logits.take()[""] is None  # unhooked: nothing read
    logits.hook()
    logits.hook()
    assert len(model._forward_hooks) == 1 and len(model._forward_pre_hooks) == 1
    with logits.gate.sampling():
        model(q, k)
    assert logits.take()[""].item() == 6.0
    logits.remove()
