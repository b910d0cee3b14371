"""SignMagnitudeMonitor in real Lightning fits, and the probe's bit-exact restore."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from normscope import ConfigurationError, DeadDirectionMonitor, Monitor, SignMagnitudeMonitor
from normscope.families.sign_magnitude import (
    SignMagnitudeConfig,
    SignMagnitudeTracker,
    find_block_linears,
)
from tests.support.fits import fit, read_csv, rows_with
from tests.support.tiny_models import LitTiny, TinyLM


def test_fit_logs_sm_keys(tmp_path):
    torch.manual_seed(0)
    monitor = SignMagnitudeMonitor(every_n_steps=3, verbose=False, alerts=())
    trainer = fit(tmp_path, LitTiny(norm="rmsnorm"), monitor, steps=6, name="sm")
    rows = rows_with(read_csv(trainer), "sm/sign_alignment_mean")
    assert [int(r["step"]) for r in rows] == [1, 3, 6]
    last = rows[-1]
    layer = "model.h.1.mlp.2"  # the MLP output projection of the last block
    for metric in (
        "sign_alignment",
        "ternary_alignment",
        "ternary_sparsity",
        "sign_churn",
        "max_leverage",
        "outlier_leverage",
    ):
        assert math.isfinite(float(last[f"sm/{layer}/{metric}"])), metric
    # trained a few steps from Kaiming-uniform init: uniform weights have cos^2 = 3/4
    assert 0.6 < float(last[f"sm/{layer}/sign_alignment"]) < 0.8
    assert 0 < float(last[f"sm/{layer}/sign_churn"]) < 0.5
    assert rows[0][f"sm/{layer}/sign_churn"] in ("nan", "")  # no previous read yet
    probed = [k for k in last if k.endswith("/asymmetry_ratio") and last[k] not in ("", "nan")]
    assert probed, "probe reads must be logged"
    assert monitor.reads == 3


def test_block_linears_exclude_head():
    names = find_block_linears(TinyLM())
    assert "head" not in names
    assert "h.0.mlp.0" in names and "h.1.mlp.2" in names


def test_probe_restores_every_parameter_bit_exactly():
    torch.manual_seed(0)
    model = TinyLM(norm="rmsnorm")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 32, (4, 16))
    model(x).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt_state = {
        k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)} for k, v in opt.state.items()
    }
    tracker = SignMagnitudeTracker(
        model, SignMagnitudeConfig(probe_layers=["h.0.mlp.2", "h.1.mlp.2"])
    )
    tracker.attach()
    report = tracker.read(0, probe=lambda: model(x))
    assert set(report.probes) == {"h.0.mlp.2", "h.1.mlp.2"}
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    for key, p in model.named_parameters():
        assert torch.equal(p.grad, grads[key]), key
    for k, v in opt.state.items():
        for n, t in v.items():
            if torch.is_tensor(t):
                assert torch.equal(t, opt_state[k][n])
    assert model.training and all(m.training for m in model.modules())
    probe = report.probes["h.1.mlp.2"]
    # An output projection feeding a residual stream is not the toy block of the theory (there
    # the perturbed weight sits before a ReLU and the normaliser reads the branch alone): here
    # the ratio is a measurement (0.76 on this model), only its sanity is asserted.
    assert 0 < probe.asymmetry_ratio < 100
    assert 0 <= probe.radial_fraction_flip <= 1 and 0 < probe.quant_transverse_rel < 1
    tracker.detach()


def test_bad_arguments():
    with pytest.raises(MisconfigurationException, match="every_n_steps"):
        SignMagnitudeMonitor(every_n_steps=0)
    with pytest.raises(MisconfigurationException, match="flip_rate"):
        SignMagnitudeMonitor(flip_rate=1.5)
    with pytest.raises(ValueError, match="available"):
        SignMagnitudeTracker(TinyLM(), SignMagnitudeConfig(layers=["nope"]))


@pytest.mark.parametrize(
    ("option", "bad"),
    [
        ("flip_rate", 0.0),
        ("probe_samples", 0),
        ("max_leverage_alert", 1.0),
        ("churn_spike_factor", 0.5),
        ("min_churn", -0.1),
        ("example_forward", "model"),
        ("probe_layers", "h.0.mlp.2"),
        ("layers", "h.0.mlp.0"),
    ],
)
def test_the_config_checks_each_option_once_naming_it(option, bad):
    """``SignMagnitudeConfig`` refuses a bad option when it is made; the callback builds one
    from its arguments and raises the same message as Lightning's exception."""
    with pytest.raises(ConfigurationError, match=f"SignMagnitudeMonitor: {option} must be"):
        SignMagnitudeConfig(**{option: bad})
    with pytest.raises(MisconfigurationException, match=f"{option} must be"):
        SignMagnitudeMonitor(**{option: bad})


def test_the_plain_loop_factory_takes_the_config():
    config = SignMagnitudeConfig(probe_layers=(), max_leverage_alert=None)
    monitor = Monitor.of(config, TinyLM(), every_n_steps=3, alerts=())
    assert monitor.family.config is config and monitor.every_n_steps == 3
    assert [r.name for r in monitor.rules] == ["sign_churn_spike"]
    assert monitor.tracker.probe_layers == [] and monitor.tracker.config is config


@pytest.mark.parametrize("monitor", [SignMagnitudeMonitor, DeadDirectionMonitor])
def test_layers_must_be_auto_or_a_list_of_paths(monitor):
    """One module path given as a string is refused at construction (the sign-magnitude
    monitor once took it as a list of its characters); any iterable of paths is kept as a
    list, a generator included."""
    for bad in ("model.h.0.mlp.0", 3, ["model.h.0.mlp.0", 3]):
        with pytest.raises(MisconfigurationException, match="layers must be 'auto' or a list"):
            monitor(layers=bad)

    def layers(built):  # a family with a config (DeadDirectionConfig) keeps them there
        family = built.engine.family
        return family.config.layers if hasattr(family, "config") else family.layers

    assert list(layers(monitor(layers=(p for p in ["a.b", "c"])))) == ["a.b", "c"]
    assert layers(monitor()) == "auto"
