"""Norm discovery against the real ``transformers`` classes and a numpy reference.

Tolerances: the modules run in float32, the reference in float64; a float32 normalisation of a
width-32 row is exact to a few ulps (about 1e-6 relative), so 1e-5 relative leaves a margin,
while the wrong kind (centred vs not) or the wrong convention (``w`` vs ``1 + w``) misses by
O(1).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from normscope.taps import (
    NormDiscoveryError,
    discover_norm_layers,
    find_norm_layers,
    full_tensor_float64,
    register_norm_adapter,
    unregister_norm_adapter,
)
from tests.support.hf_models import HF_ARCHITECTURES, HIDDEN, build_hf_model

torch.set_num_threads(1)

# Parameter-free v-norms of Gemma 4 (with_scale=False) expose no width: reported, not read.
EXPECTED_UNRECOGNISED = {
    "gemma4": {"model.layers.0.self_attn.v_norm", "model.layers.1.self_attn.v_norm"},
    "gemma4_ple": {"model.layers.0.self_attn.v_norm", "model.layers.1.self_attn.v_norm"},
}
ONE_PLUS_W = {"gemma", "gemma2", "gemma3"}


def numpy_norm(x: np.ndarray, kind: str, eps: float) -> np.ndarray:
    if kind == "layernorm":
        x = x - x.mean(-1, keepdims=True)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def randomise(model: nn.Module, seed: int = 1) -> None:
    """Give every norm weight and bias distinct values, so that w and 1 + w differ everywhere."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            for attr in ("weight", "bias"):
                p = getattr(m, attr, None)
                if isinstance(p, nn.Parameter) and p.dim() == 1:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + 0.3)


@pytest.mark.parametrize("arch", sorted(HF_ARCHITECTURES))
def test_kinds_and_conventions_per_architecture(arch: str) -> None:
    model, _ = build_hf_model(arch)
    found = discover_norm_layers(model, warn=False)
    assert found.norms, arch
    assert {n.kind for n in found.norms} == {HF_ARCHITECTURES[arch].norm_kind}
    expected_conv = "1+w" if arch in ONE_PLUS_W else "w"
    assert {n.convention for n in found.norms} == {expected_conv}
    assert {u.name for u in found.unrecognised} == EXPECTED_UNRECOGNISED.get(arch, set())
    paths = dict(model.named_modules())
    for n in found.norms:
        assert n.name and paths[n.name] is n.module
        # the stream width, or head_dim for the QK-norms of Gemma 3/4
        assert n.dim in (HIDDEN, 8), (n.name, n.dim)


@pytest.mark.parametrize("arch", sorted(HF_ARCHITECTURES))
def test_gamma_and_beta_reproduce_the_module_forward(arch: str) -> None:
    """norm(x) * gamma + beta, from the discovered kind, gamma and beta, is the module's output."""
    model, _ = build_hf_model(arch)
    randomise(model)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)) + 0.5
    for n in find_norm_layers(model) if arch not in EXPECTED_UNRECOGNISED else _quiet(model):
        xd = x[:, : n.dim].contiguous()
        with torch.no_grad():
            y = n.module(xd).double().numpy()
        beta = n.beta()
        ref = numpy_norm(xd.double().numpy(), n.kind, n.eps) * n.gamma().numpy()
        ref = ref + (0.0 if beta is None else beta.numpy())
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5, err_msg=n.name)


def _quiet(model: nn.Module) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return find_norm_layers(model)


@pytest.mark.parametrize("cls", [GemmaRMSNorm, Gemma4RMSNorm, LlamaRMSNorm, T5LayerNorm])
def test_effective_gamma_from_known_weights(cls: type) -> None:
    norm = cls(6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([-1.0, -0.5, 0.0, 0.25, 1.0, 3.0]))
    (found,) = find_norm_layers(nn.Sequential(norm))
    w = torch.tensor([-1.0, -0.5, 0.0, 0.25, 1.0, 3.0], dtype=torch.float64)
    expected = 1.0 + w if cls is GemmaRMSNorm else w
    assert found.kind == "rmsnorm" and found.evidence == "probe"
    assert torch.equal(found.gamma(), expected)
    assert found.beta() is None


def test_gemma_one_plus_w_is_added_in_float64() -> None:
    """With a bf16 weight of 1e-3, bf16 arithmetic would round 1 + w to 1.0 exactly."""
    norm = GemmaRMSNorm(4).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.fill_(1e-3)
    (found,) = find_norm_layers(nn.Sequential(norm))
    w64 = norm.weight.detach().double()
    assert torch.all((1.0 + norm.weight.detach()) == 1.0)  # the trap
    assert found.convention == "1+w"
    assert torch.equal(found.gamma(), 1.0 + w64)
    assert torch.all(found.gamma() > 1.0)


def test_gamma_is_a_detached_float64_copy() -> None:
    model = nn.Sequential(nn.LayerNorm(4, dtype=torch.float64))
    (found,) = find_norm_layers(model)
    g = found.gamma()
    assert g.dtype == torch.float64 and not g.requires_grad
    g.add_(5.0)
    assert torch.equal(model[0].weight.detach(), torch.ones(4, dtype=torch.float64))


def test_torch_norm_variants() -> None:
    model = nn.Sequential(
        nn.LayerNorm(4, elementwise_affine=False),
        nn.LayerNorm(4, bias=False),
        nn.RMSNorm(4),  # eps=None: finfo(dtype).eps at run time
        nn.RMSNorm(4, eps=1e-5, elementwise_affine=False),
    )
    found = find_norm_layers(model)
    assert [(n.name, n.kind, n.convention) for n in found] == [
        ("0", "layernorm", "none"),
        ("1", "layernorm", "w"),
        ("2", "rmsnorm", "w"),
        ("3", "rmsnorm", "none"),
    ]
    assert torch.equal(found[0].gamma(), torch.ones(4, dtype=torch.float64))
    assert found[0].beta() is None and found[1].beta() is None
    assert found[2].eps == torch.finfo(torch.float32).eps and found[3].eps == 1e-5


class WeirdNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x / x.abs().amax(-1, keepdim=True)


class PreNorm(nn.Module):
    """A lucidrains-style wrapper: a norm inside, then a function."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fn = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.norm(x))


def odd_model() -> nn.Module:
    return nn.ModuleDict(
        {
            "pre": PreNorm(4),
            "weird": WeirdNorm(4),
            "bn": nn.BatchNorm1d(4),
            "gn": nn.GroupNorm(2, 4),
            "ln2d": nn.LayerNorm((2, 4)),
        }
    )


def test_unrecognised_norms_are_reported_by_name() -> None:
    with pytest.warns(UserWarning) as record:
        found = find_norm_layers(odd_model())
    assert [n.name for n in found] == ["pre.norm"]
    (w,) = [r for r in record if "look like norms" in str(r.message)]
    message = str(w.message)
    for path, cls in [("weird", "WeirdNorm"), ("bn", "BatchNorm1d"), ("gn", "GroupNorm")]:
        assert f"{path} ({cls})" in message
    assert "ln2d (LayerNorm)" in message and "register_norm_adapter" in message
    assert "pre (PreNorm)" not in message  # a wrapper of a recognised norm is not noise
    data = discover_norm_layers(odd_model(), warn=False)
    reasons = {u.name: u.reason for u in data.unrecognised}
    assert set(reasons) == {"weird", "bn", "gn", "ln2d"}
    assert "not a transformer norm" in reasons["bn"] and "not a transformer norm" in reasons["gn"]
    assert "2 trailing dimensions" in reasons["ln2d"]
    assert data.wrappers == ("pre",)


class ScaledLayerNorm(nn.Module):
    """Named like a LayerNorm, but it only scales: the probe must not take it for a norm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


def test_a_norm_named_class_whose_forward_is_no_norm_is_reported() -> None:
    found = discover_norm_layers(nn.Sequential(nn.LayerNorm(4), ScaledLayerNorm(4)), warn=False)
    assert [n.name for n in found.norms] == ["0"]
    (odd,) = found.unrecognised
    assert (odd.name, odd.class_name) == ("1", "ScaledLayerNorm")
    assert odd.reason.startswith("its forward matches neither LayerNorm nor RMSNorm")


def test_explicit_layers_and_unknown_names() -> None:
    model, _ = build_hf_model("gpt2")
    picked = find_norm_layers(model, layers=["transformer.ln_f", "transformer.h.1.ln_2"])
    assert [n.name for n in picked] == ["transformer.h.1.ln_2", "transformer.ln_f"]
    assert [n.name for n in find_norm_layers(model, layers="transformer.ln_f")] == [
        "transformer.ln_f"
    ]
    with pytest.raises(NormDiscoveryError) as err:
        find_norm_layers(model, layers=["transformer.h.0.ln_3"])
    msg = str(err.value)
    assert "'transformer.h.0.ln_3' is not a norm layer of GPT2LMHeadModel" in msg
    assert "available norm layers: transformer.h.0.ln_1, transformer.h.0.ln_2" in msg
    with pytest.raises(NormDiscoveryError, match=r"'weird' is a WeirdNorm: no adapter"):
        find_norm_layers(odd_model(), layers=["weird"])


def test_no_norm_found_names_the_model_and_what_was_looked_for() -> None:
    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), WeirdNorm(4))

    with pytest.raises(NormDiscoveryError) as err:
        find_norm_layers(GPT())
    assert str(err.value) == (
        "no normalisation layer found in GPT (looked for LayerNorm, RMSNorm, *RMSNorm, "
        "*LayerNorm); not understood: body.2 (WeirdNorm); pass layers=[...] or "
        "register_norm_adapter(...)"
    )
    with pytest.raises(NormDiscoveryError, match="found in LayerNorm"):
        find_norm_layers(nn.LayerNorm(4))  # the root is never a norm


def test_register_norm_adapter_for_a_user_class() -> None:
    model = nn.Sequential(nn.Linear(4, 4), WeirdNorm(4), nn.LayerNorm(4))
    with torch.no_grad():
        model[1].scale.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    register_norm_adapter(WeirdNorm, kind="rmsnorm", gamma=lambda m: m.scale, eps=0.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # recognised now: no warning
            found = find_norm_layers(model)
        assert [(n.name, n.kind, n.dim, n.eps, n.evidence) for n in found] == [
            ("1", "rmsnorm", 4, 0.0, "adapter"),
            ("2", "layernorm", 4, 1e-5, "class"),
        ]
        assert torch.equal(found[0].gamma(), torch.tensor([1.0, 2.0, 3.0, 4.0]).double())
        assert found[0].beta() is None
        # a predicate adapter registered later takes precedence, over built-ins too
        register_norm_adapter(
            lambda m: isinstance(m, nn.LayerNorm),
            kind="layernorm",
            gamma=lambda m: 2 * m.weight,
            beta=lambda m: m.bias,
            dim=4,
        )
        ln = find_norm_layers(model)[1]
        assert ln.evidence == "adapter" and torch.equal(ln.gamma(), torch.full((4,), 2.0).double())
        assert torch.equal(ln.beta(), torch.zeros(4, dtype=torch.float64))
    finally:
        assert unregister_norm_adapter(WeirdNorm)
        for match, *_ in list(_registered()):
            unregister_norm_adapter(match)
    assert _registered() == []
    with pytest.raises(ValueError, match="kind must be one of"):
        register_norm_adapter(WeirdNorm, kind="batchnorm", gamma=lambda m: m.scale)


def _registered() -> list:
    from normscope.taps import norms

    return list(norms.USER_ADAPTERS)


def test_full_tensor_float64_copies() -> None:
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    out = full_tensor_float64(w)
    assert out.dtype == torch.float64 and not out.requires_grad
    assert out.data_ptr() != w.data_ptr()


def _fsdp_worker(rank: int, world: int, out_dir: str) -> None:
    # a file store, not a TCP port: no race with other test runs for a free port
    store = f"file://{os.path.join(out_dir, 'store')}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = nn.Sequential(nn.Linear(8, 8), GemmaRMSNorm(8), LlamaRMSNorm(8), nn.LayerNorm(8))
        with torch.no_grad():
            for m in model[1:]:
                m.weight.copy_(torch.arange(8.0) / 8)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        assert all(hasattr(m.weight, "full_tensor") for m in model[1:])  # sharded: DTensors
        found = find_norm_layers(model)
        rows = [(n.kind, n.convention, n.evidence, n.dim, n.gamma().tolist()) for n in found]
        torch.save(rows, os.path.join(out_dir, f"rank{rank}.pt"))
        # both ranks done before either tears gloo down: a rank that destroyed its group while
        # the other's fully_shard collectives were in flight aborted ("terminate called without
        # an active exception", SIGABRT, seen once in CI)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_gammas_are_read_in_full(tmp_path) -> None:
    mp.spawn(_fsdp_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    w = (np.arange(8.0) / 8).tolist()
    for rank in range(2):
        rows = torch.load(tmp_path / f"rank{rank}.pt")
        # the probe cannot run a forward on shards: the class source decides (1 + w for Gemma)
        assert rows == [
            ("rmsnorm", "1+w", "source", 8, [1.0 + v for v in w]),
            ("rmsnorm", "w", "source", 8, w),
            ("layernorm", "w", "class", 8, w),
        ]
