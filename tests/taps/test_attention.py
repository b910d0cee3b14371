"""The attention-logit taps (normscope.taps.attention) on real models: which modules are found,
what a sampled forward reads (against logits rebuilt by hand, and the ``sdpa`` and ``eager``
attention of Hugging Face models against each other), and what a closed gate, a raising
forward, a copy and a bad argument do."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from examples.nanogpt import GPT, GPTConfig
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from normscope import DeadDirectionConfig, Monitor
from normscope.functional.attention import sample_positions
from normscope.taps.attention import AttentionLogits, find_attention_modules
from normscope.taps.hooks import Gate
from tests.support.hf_models import build_hf_model
from tests.support.tiny_models import TinyLM


def _read(model: nn.Module, forward, names=None) -> dict[str, float | None]:
    gate = Gate()
    logits = AttentionLogits(model, names or find_attention_modules(model, "auto"), gate)
    with torch.no_grad(), gate.sampling():
        forward()
    out = {n: (None if v is None else v.item()) for n, v in logits.take().items()}
    logits.remove()
    return out


def test_nanogpt_read_equals_its_causal_logits_rebuilt_by_hand():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16))
    x = torch.randint(0, 256, (3, 16))
    qkv = {}
    hooks = [
        b.attn.c_attn.register_forward_hook(lambda m, a, o, i=i: qkv.__setitem__(i, o))
        for i, b in enumerate(model.transformer.h)
    ]
    got = _read(model, lambda: model(x))
    for h in hooks:
        h.remove()
    for i, name in enumerate(["transformer.h.0.attn", "transformer.h.1.attn"]):
        q, k, _ = qkv[i].double().split(32, dim=2)
        q, k = (t.view(3, 16, 4, 8).transpose(1, 2) for t in (q, k))
        logits = (q @ k.mT / math.sqrt(8)).masked_fill(
            torch.ones(16, 16, dtype=torch.bool).triu(1), -math.inf
        )
        assert got[name] == pytest.approx(logits.max().item(), rel=1e-5)  # float32 forward


def test_nanogpt_read_on_a_row_budget_takes_the_drawn_query_positions():
    """``max_rows``: a forward of more token rows than the budget reads the queries of
    ``ceil(budget / batch)`` positions, drawn from the tap's own seeded generator, against every
    key; the read equals the logits rebuilt by hand at the positions the same draw gives."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=16))
    x = torch.randint(0, 256, (3, 16))
    qkv = {}
    hook = model.transformer.h[0].attn.c_attn.register_forward_hook(
        lambda m, a, o: qkv.__setitem__(0, o)
    )
    gate = Gate()
    logits = AttentionLogits(model, ["transformer.h.0.attn"], gate, max_rows=12, seed=5)
    with torch.no_grad(), gate.sampling():
        model(x)
    got = logits.take()["transformer.h.0.attn"].item()
    logits.remove()
    hook.remove()
    at = sample_positions(16, 3, 12, torch.Generator().manual_seed(5))  # the same first draw
    assert at.numel() == 4  # ceil(12 rows / 3 sequences)
    q, k, _ = qkv[0].double().split(32, dim=2)
    q, k = (t.view(3, 16, 4, 8).transpose(1, 2) for t in (q, k))
    full = (q @ k.mT / math.sqrt(8)).masked_fill(
        torch.ones(16, 16, dtype=torch.bool).triu(1), -math.inf
    )
    assert got == pytest.approx(full[..., at, :].max().item(), rel=1e-5)  # float32 forward
    assert got <= full.max().item() * (1 + 1e-6)


def test_the_monitor_gives_the_attention_read_the_streams_row_budget():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16))
    monitor = Monitor.of(DeadDirectionConfig(), model, every_n_steps=1, alerts=(), verbose=False)
    x = torch.randint(0, 256, (64, 16))
    for _ in range(2):  # discovery's step, then the first read
        with monitor.step(x):
            model(x)
    tracker = monitor.family.tracker
    assert tracker.attention.max_rows == tracker.rows_per_forward(32) == 256  # 8 d of 1024 rows
    assert monitor.last_report is not None
    monitor.detach()


def test_multiheadattention_read_equals_its_logits():
    torch.manual_seed(0)
    model = TinyLM(d=16, heads=2)
    x = torch.randint(0, 32, (3, 10))
    got = _read(model, lambda: model(x))
    assert set(got) == {"h.0.attn", "h.1.attn"}
    block = model.h[0]
    with torch.no_grad():
        h = block.ln_1(model.wte(x) + model.wpe(torch.arange(10))).double()
        w, b = block.attn.in_proj_weight.double(), block.attn.in_proj_bias.double()
        q = (h @ w[:16].T + b[:16]).view(3, 10, 2, 8).transpose(1, 2)
        k = (h @ w[16:32].T + b[16:32]).view(3, 10, 2, 8).transpose(1, 2)
        logits = (q @ k.mT / math.sqrt(8)).masked_fill(
            torch.ones(10, 10, dtype=torch.bool).triu(1), -math.inf
        )
    assert got["h.0.attn"] == pytest.approx(logits.max().item(), rel=1e-5)


@pytest.mark.parametrize(
    "arch", ["gpt2", "llama", "bert", "opt", "gpt_neox_parallel", "gemma3", "vit", "t5_encoder"]
)
def test_hugging_face_sdpa_and_eager_attention_read_the_same_logits(arch):
    """Two code paths, one quantity: ``sdpa`` is read from the query and key passed to
    ``scaled_dot_product_attention`` (Llama's after RoPE, with grouped keys), ``eager`` from
    its softmax's input; they agree to float32 round-off on every attention module."""
    model, forward = build_hf_model(arch)
    names = find_attention_modules(model, "auto")
    assert len(names) == 2, names  # one per layer, the innermost (BERT: attention.self)
    assert model.config._attn_implementation == "sdpa"
    sdpa = _read(model, forward)
    model.set_attn_implementation("eager")
    eager = _read(model, forward)
    for name in names:
        assert sdpa[name] is not None and math.isfinite(sdpa[name]), (name, sdpa)
        assert sdpa[name] == pytest.approx(eager[name], rel=1e-5, abs=1e-7), (name, sdpa, eager)


def test_a_closed_gate_reads_nothing_and_pushes_no_mode():
    torch.manual_seed(0)
    model = TinyLM()
    gate = Gate()
    logits = AttentionLogits(model, ["h.0.attn"], gate)
    seen = []
    model.h[0].attn.register_forward_pre_hook(  # runs after the monitor's pre-hook
        lambda *_: seen.append(len(_get_current_function_mode_stack()))
    )
    model(torch.randint(0, 32, (2, 8)))
    assert logits.take() == {"h.0.attn": None} and seen == [0]
    with gate.sampling():
        model(torch.randint(0, 32, (2, 8)))
    assert logits.take()["h.0.attn"] is not None and seen[-1] == 1  # active inside the forward
    assert _get_current_function_mode_stack() == []  # and gone after it
    logits.remove()


def test_window_keeps_the_maximum_over_forwards_and_starts_over():
    torch.manual_seed(0)
    model = TinyLM()
    gate = Gate()
    logits = AttentionLogits(model, ["h.0.attn"], gate)
    x = torch.randint(0, 32, (2, 8))
    with gate.sampling():
        model(x)
    one = logits.maxima["h.0.attn"].item()
    with torch.no_grad():
        model.h[0].attn.in_proj_weight.mul_(2)  # q and k x2: logits x4
    with gate.sampling():
        model(x)
    assert logits.maxima["h.0.attn"].item() == pytest.approx(4 * one, rel=1e-5)
    assert logits.calls["h.0.attn"] == 2
    assert logits.take()["h.0.attn"].item() == pytest.approx(4 * one, rel=1e-5)
    assert logits.maxima["h.0.attn"] is None and logits.calls["h.0.attn"] == 0
    logits.remove()


class Raising(nn.Module):
    def forward(self, x):
        x.softmax(-1)
        raise RuntimeError("boom")


def test_a_raising_forward_leaves_no_mode_behind():
    model = nn.ModuleDict({"attn": Raising()})
    gate = Gate()
    logits = AttentionLogits(model, ["attn"], gate)
    with gate.sampling(), pytest.raises(RuntimeError, match="boom"):
        model["attn"](torch.ones(2, 3))
    assert _get_current_function_mode_stack() == []
    assert logits.take()["attn"].item() == 1.0  # what it read before raising stands
    logits.remove()


class BadLogits(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


def test_a_read_that_fails_warns_once_and_the_forward_goes_on(monkeypatch):
    from normscope.taps import attention as taps_attention

    def broken(*_args):
        raise RuntimeError("cannot read")

    monkeypatch.setattr(taps_attention, "logit_max", broken)
    model = nn.ModuleDict({"attn": BadLogits()})
    gate = Gate()
    logits = AttentionLogits(model, ["attn"], gate)
    x = torch.randn(2, 3)
    with gate.sampling(), pytest.warns(RuntimeWarning, match="attention-logit read of 'attn'"):
        out = model["attn"](x)
    assert torch.equal(out, x.softmax(-1))
    with gate.sampling():
        model["attn"](x)  # disabled: no second warning, nothing read
    assert logits.take() == {"attn": None} and "cannot read" in logits.failed["attn"]
    logits.remove()


def test_a_copied_or_pickled_model_is_not_watched():
    torch.manual_seed(0)
    model = TinyLM()
    gate = Gate()
    logits = AttentionLogits(model, ["h.0.attn"], gate)
    twin = copy.deepcopy(model)
    thawed = pickle.loads(pickle.dumps(model))
    with gate.sampling():
        twin(torch.randint(0, 32, (2, 8)))
        thawed(torch.randint(0, 32, (2, 8)))
    assert logits.take() == {"h.0.attn": None}
    logits.remove()


def test_find_attention_modules_auto_list_none_and_errors():
    model = TinyLM()
    assert find_attention_modules(model, "auto") == ["h.0.attn", "h.1.attn"]
    assert find_attention_modules(model, ["h.1.attn"]) == ["h.1.attn"]
    assert find_attention_modules(model, None) == []
    with pytest.raises(ValueError, match="no module 'h.9.attn'"):
        find_attention_modules(model, ["h.9.attn"])
    with pytest.raises(ValueError, match='"auto"'):
        find_attention_modules(model, "all")
