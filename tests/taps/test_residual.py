"""Residual-point discovery on real ``transformers`` models and a hand-written one.

The expected layouts are written out by hand from each architecture's source (2 layers each):
a pre-norm model has ``p_0`` plus one point after each sublayer (attn, mlp, attn, mlp); a
parallel one has ``p_0`` plus one point per block; a post-norm one is profiled over block outputs.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from normscope.taps import (
    NormLayer,
    ResidualDiscoveryError,
    ResidualLayout,
    find_norm_layers,
    find_residual_points,
    tap_input,
    tap_output,
)
from tests.support.hf_models import (
    HF_ARCHITECTURES,
    TinyPreNormTransformer,
    build_hf_model,
    token_batch,
)

torch.set_num_threads(1)

PRE = [None, "attn", "mlp", "attn", "mlp"]


def prenorm(prefix: str, first: str, second: str, final: str) -> list[str]:
    return [
        f"{prefix}.0.{first}",
        f"{prefix}.0.{second}",
        f"{prefix}.1.{first}",
        f"{prefix}.1.{second}",
        final,
    ]


def per_layer(prefix: str, *names: str) -> set[str]:
    return {f"{prefix}.{i}.{n}" for i in range(2) for n in names}


SANDWICH = ("post_attention_layernorm", "post_feedforward_layernorm")
QK = ("self_attn.q_norm", "self_attn.k_norm")
LLAMA = prenorm("model.layers", "input_layernorm", "post_attention_layernorm", "model.norm")
GEMMA2 = prenorm("model.layers", "input_layernorm", "pre_feedforward_layernorm", "model.norm")

# arch -> (style, point names, sublayers, final norm, branch norms)
EXPECTED: dict[str, tuple[str, list[str], list, str | None, set[str]]] = {
    "gpt2": (
        "pre-norm",
        prenorm("transformer.h", "ln_1", "ln_2", "transformer.ln_f"),
        PRE,
        "transformer.ln_f",
        set(),
    ),
    "gpt_neox_sequential": (
        "pre-norm",
        prenorm(
            "gpt_neox.layers",
            "input_layernorm",
            "post_attention_layernorm",
            "gpt_neox.final_layer_norm",
        ),
        PRE,
        "gpt_neox.final_layer_norm",
        set(),
    ),
    "gpt_neox_parallel": (
        "parallel",
        [
            "gpt_neox.layers.0.input_layernorm",
            "gpt_neox.layers.1.input_layernorm",
            "gpt_neox.final_layer_norm",
        ],
        [None, "block", "block"],
        "gpt_neox.final_layer_norm",
        set(),
    ),
    "opt": (
        "pre-norm",
        prenorm(
            "model.decoder.layers",
            "self_attn_layer_norm",
            "final_layer_norm",
            "model.decoder.final_layer_norm",
        ),
        PRE,
        "model.decoder.final_layer_norm",
        set(),
    ),
    "bloom": (
        "pre-norm",
        prenorm("transformer.h", "input_layernorm", "post_attention_layernorm", "transformer.ln_f"),
        PRE,
        "transformer.ln_f",
        set(),
    ),
    "phi": (
        "parallel",
        [
            "model.layers.0.input_layernorm",
            "model.layers.1.input_layernorm",
            "model.final_layernorm",
        ],
        [None, "block", "block"],
        "model.final_layernorm",
        set(),
    ),
    "vit": (
        "pre-norm",
        prenorm("layers", "layernorm_before", "layernorm_after", "layernorm"),
        PRE,
        "layernorm",
        set(),
    ),
    "bert": (
        "post-norm",
        ["encoder.layer.0", "encoder.layer.0.output", "encoder.layer.1.output"],
        [None, "block", "block"],
        None,
        set(),
    ),
    "llama": ("pre-norm", LLAMA, PRE, "model.norm", set()),
    "mistral": ("pre-norm", LLAMA, PRE, "model.norm", set()),
    "qwen2": ("pre-norm", LLAMA, PRE, "model.norm", set()),
    "gemma": ("pre-norm", LLAMA, PRE, "model.norm", set()),
    "gemma2": ("sandwich", GEMMA2, PRE, "model.norm", per_layer("model.layers", *SANDWICH)),
    "gemma3": ("sandwich", GEMMA2, PRE, "model.norm", per_layer("model.layers", *SANDWICH, *QK)),
    "gemma4": ("sandwich", GEMMA2, PRE, "model.norm", per_layer("model.layers", *SANDWICH, *QK)),
    # PLE adds a third branch after the MLP in the same step: that step is labelled "block"
    "gemma4_ple": (
        "sandwich",
        GEMMA2,
        [None, "attn", "block", "attn", "block"],
        "model.norm",
        per_layer("model.layers", *SANDWICH, *QK, "post_per_layer_input_norm"),
    ),
    "t5_encoder": (
        "pre-norm",
        prenorm(
            "encoder.block", "layer.0.layer_norm", "layer.1.layer_norm", "encoder.final_layer_norm"
        ),
        PRE,
        "encoder.final_layer_norm",
        set(),
    ),
    "handwritten": ("pre-norm", prenorm("blocks", "ln1", "ln2", "ln_f"), PRE, "ln_f", set()),
}


def quiet_norms(model: nn.Module) -> list[NormLayer]:
    with pytest.warns(UserWarning, match="v_norm") if "Gemma4" in type(model).__name__ else _null():
        return find_norm_layers(model)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def assert_clean(model: nn.Module) -> None:
    for name, m in model.named_modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, name
        assert not m._forward_hooks_with_kwargs and not m._forward_pre_hooks_with_kwargs, name


def capture(model: nn.Module, forward, layout: ResidualLayout) -> list[torch.Tensor]:
    """Hook the points the way a monitor does and return their tensors in order."""
    seen: dict[int, torch.Tensor] = {}
    handles = []
    modules = dict(model.named_modules())
    for p in layout.points:
        m = modules[p.module_name]
        if p.where == "input":

            def pre(mod, args, kwargs, k=p.depth):
                seen.setdefault(k, tap_input(args, kwargs).detach().clone())

            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        else:

            def post(mod, args, out, k=p.depth):
                seen.setdefault(k, tap_output(out).detach().clone())

            handles.append(m.register_forward_hook(post))
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    return [seen[k] for k in range(len(layout.points))]


def block_io(model: nn.Module, forward, layout: ResidualLayout) -> tuple[torch.Tensor, ...]:
    """The first block's input and the last block's output, hooked independently."""
    modules = dict(model.named_modules())
    got: dict[str, torch.Tensor] = {}

    def pre(m, args, kwargs) -> None:
        got.setdefault("in", tap_input(args, kwargs).clone())

    def post(m, args, out) -> None:
        got.setdefault("out", tap_output(out).clone())

    h1 = modules[layout.blocks[0]].register_forward_pre_hook(pre, with_kwargs=True)
    h2 = modules[layout.blocks[-1]].register_forward_hook(post)
    with torch.no_grad():
        forward()
    h1.remove()
    h2.remove()
    return got["in"], got["out"]


@pytest.mark.parametrize("arch", sorted(HF_ARCHITECTURES))
def test_layout_per_architecture(arch: str) -> None:
    model, forward = build_hf_model(arch)
    model.train()  # discovery must switch dropout off itself, then restore the flags
    layout = find_residual_points(model, forward, quiet_norms(model))
    style, names, sublayers, final_norm, branch = EXPECTED[arch]
    assert layout.style == style
    assert [p.name for p in layout.points] == names
    assert [p.sublayer for p in layout.points] == sublayers
    assert [p.depth for p in layout.points] == list(range(len(names)))
    assert layout.final_norm == final_norm
    assert set(layout.branch_norms) == branch
    assert len(layout.blocks) == 2
    for p in layout.points[1:]:  # a named sublayer is a real module inside a block
        if p.sublayer_module is not None:
            model.get_submodule(p.sublayer_module)
            assert any(p.sublayer_module.startswith(f"{b}.") for b in layout.blocks), p
    assert layout.points[0].sublayer_module is None
    assert_clean(model)
    assert all(m.training for m in model.modules())
    model.eval()
    points = capture(model, forward, layout)
    first_in, last_out = block_io(model, forward, layout)
    assert torch.equal(points[0].reshape(first_in.shape), first_in)
    assert torch.equal(points[-1].reshape(last_out.shape), last_out)
    for a, b in zip(points, points[1:]):
        assert not torch.equal(a.reshape(b.shape), b)  # each point is a new tensor


def test_each_point_names_the_sublayer_module_before_it() -> None:
    """What an alert names (issue 33): the module that produced the step, not the norm that
    reads the point after it."""
    model, forward = build_hf_model("gpt2")
    layout = find_residual_points(model, forward)
    assert [p.sublayer_module for p in layout.points] == [
        None, "transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.1.attn",
        "transformer.h.1.mlp",
    ]  # fmt: skip


def test_parallel_points_are_read_by_both_norms() -> None:
    model, forward = build_hf_model("gpt_neox_parallel")
    layout = find_residual_points(model, forward)
    assert layout.points[0].readers == (
        "gpt_neox.layers.0.input_layernorm",
        "gpt_neox.layers.0.post_attention_layernorm",
    )
    assert any("parallel residual" in n for n in layout.notes)


def test_post_norm_note_for_bert() -> None:
    model, forward = build_hf_model("bert")
    layout = find_residual_points(model, forward)
    assert [(p.module_name, p.where) for p in layout.points] == [
        ("encoder.layer.0", "input"),
        ("encoder.layer.0", "output"),
        ("encoder.layer.1", "output"),
    ]
    (note,) = [n for n in layout.notes if n.startswith("post-norm")]
    assert "sigma_min theory" in note and "assumes pre-norm" in note
    assert layout.branch_norms == ()


def test_handwritten_points_are_the_stream() -> None:
    """Recompute x_k = x_{k-1} + f(x_{k-1}) by hand and compare with what the points carry."""
    model, forward = build_hf_model("handwritten")
    layout = find_residual_points(model, forward)
    points = capture(model, forward, layout)
    with torch.no_grad():
        x = model.embed(token_batch())
        expected = [x]
        for b in model.blocks:
            h = b.ln1(x)
            x = x + b.attn(h, h, h, need_weights=False)[0]
            expected.append(x)
            x = x + b.mlp(b.ln2(x))
            expected.append(x)
    # the same float32 ops in the same order: bit-identical on the CPU
    for got, want in zip(points, expected, strict=True):
        assert torch.equal(got, want)


def test_zero_branches_still_make_new_points() -> None:
    """Zeroed output projections give x + 0 == x in value: identity must tell them apart."""
    model, forward = build_hf_model("handwritten")
    with torch.no_grad():
        for b in model.blocks:
            b.attn.out_proj.weight.zero_()
            b.attn.out_proj.bias.zero_()
            b.mlp[2].weight.zero_()
            b.mlp[2].bias.zero_()
    layout = find_residual_points(model, forward)
    assert layout.style == "pre-norm"
    assert [p.sublayer for p in layout.points] == PRE


def test_gemma4_layer_scalar_keeps_the_mlp_label() -> None:
    model, forward = build_hf_model("gemma4")
    for layer in model.model.layers:
        layer.layer_scalar.fill_(0.7)
    layout = find_residual_points(model, forward, quiet_norms(model))
    assert [p.sublayer for p in layout.points] == PRE
    (note,) = [n for n in layout.notes if "layer_scalar" in n]
    assert "model.layers.0: 0.7" in note and "model.layers.1: 0.7" in note


def test_encoder_decoder_profiles_the_decoder_and_says_so() -> None:
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    model = transformers.T5Model(cfg).eval()
    ids = token_batch()
    layout = find_residual_points(model, lambda: model(input_ids=ids, decoder_input_ids=ids))
    assert layout.blocks == ("decoder.block.0", "decoder.block.1")
    # self-attention, cross-attention (EncDecAttention), feed-forward (DenseReluDense)
    assert [p.sublayer for p in layout.points] == [None] + ["attn", "attn", "mlp"] * 2
    assert layout.final_norm == "decoder.final_layer_norm"
    assert any("encoder.block (2 x T5Block)" in n for n in layout.notes)


def test_no_final_norm_ends_on_the_block_output() -> None:
    model = TinyPreNormTransformer()
    model.ln_f = nn.Identity()
    ids = token_batch()
    layout = find_residual_points(model, lambda: model(ids))
    last = layout.points[-1]
    assert (last.name, last.module_name, last.where, last.sublayer) == (
        "blocks.1.output",
        "blocks.1",
        "output",
        "mlp",
    )
    assert layout.final_norm is None
    assert any("no norm after the stack" in n for n in layout.notes)


def test_no_block_stack_is_an_error() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with pytest.raises(ResidualDiscoveryError, match=r"no block stack in Sequential: looked for"):
        find_residual_points(model, lambda: model(torch.randn(2, 4)))


def test_blocks_that_do_not_run_in_sequence_are_an_error() -> None:
    class SideBySide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = TinyPreNormTransformer().blocks

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum(b(x) for b in self.blocks)

    model = SideBySide().eval()
    x = torch.randn(2, 8, 32)
    with pytest.raises(ResidualDiscoveryError, match="block 1 does not read block 0's output"):
        find_residual_points(model, lambda: model(x))
    assert_clean(model)


def test_a_failing_forward_leaves_no_hook_and_restores_training() -> None:
    model, _ = build_hf_model("handwritten")
    model.train()

    def broken() -> None:
        model(token_batch(vocab=1000))  # ids out of the embedding's range

    with pytest.raises(ResidualDiscoveryError, match="the forward callable failed"):
        find_residual_points(model, broken)
    assert_clean(model)
    assert all(m.training for m in model.modules())


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma4", "gpt_neox_parallel", "bert"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_models_give_the_same_layout(arch: str, dtype: torch.dtype) -> None:
    model, forward = build_hf_model(arch)
    model.to(dtype)
    norms = quiet_norms(model)
    assert {n.convention for n in norms} == ({"1+w"} if arch == "gemma2" else {"w"})
    layout = find_residual_points(model, forward, norms)
    style, names, sublayers, final_norm, branch = EXPECTED[arch]
    assert (layout.style, [p.name for p in layout.points]) == (style, names)
    assert [p.sublayer for p in layout.points] == sublayers
    assert set(layout.branch_norms) == branch


def test_a_listed_subset_of_norms_reads_block_boundaries_and_says_so() -> None:
    """``layers=[first, last]`` on a 6-block pre-norm LM: the stream is found from those two
    norms alone, so five blocks are read at their boundaries (8 points, not 13), and the
    layout's last note says the other notes know only the listed norms; all 13 listed is the
    same layout as "auto", with no such note."""
    from normscope.families import DeadDirectionConfig, DeadDirectionTracker
    from tests.support.tiny_models import TinyLM

    torch.manual_seed(0)
    model = TinyLM(layers=6, d=16)
    x = torch.randint(32, (8, 16))
    every = [n for n, _ in model.named_modules() if n.endswith(("ln_1", "ln_2", "ln_f"))]
    layouts = {}
    for key, layers in (("auto", "auto"), ("two", ["h.0.ln_1", "h.5.ln_2"]), ("all", every)):
        tracker = DeadDirectionTracker(DeadDirectionConfig(layers=layers), model)
        tracker.attach(forward=lambda: model(x))
        tracker.detach()
        tracker.attach()  # hooked again (a monitor kept for a second fit): the note once
        layouts[key] = tracker.layout
        tracker.detach()
    assert len(layouts["auto"].points) == 13 and layouts["auto"].style == "pre-norm"
    assert layouts["all"] == layouts["auto"]
    two = layouts["two"]
    # blocks 0-4 at their outputs; block 5's listed ln_2 still splits it into attn and mlp
    assert [p.sublayer for p in two.points] == [None] + ["block"] * 5 + ["attn", "mlp"]
    assert two.notes[-1].startswith("found from the 2 listed norm layers of the model's 13")
    assert sum("listed norm layers" in n for n in two.notes) == 1
    assert not any("listed norm layers" in n for n in layouts["auto"].notes)
