"""Bad input in real Lightning fits: corrupt rows, padding-only batches, too few rows, odd or
broken gammas, models without norms, wrong names, huge activations. The monitor never crashes,
never alerts on what it cannot read, says why a number is NaN, and reads what it can exactly.

What is already covered elsewhere is not repeated: NaN/Inf rows and masks of the accumulator
(tests/functional/test_covariance.py), NaN gamma and too few rows in ``scan_model``
(tests/families/test_scan.py), a model without norms and an unknown layer name for
``DeadDirectionMonitor`` (tests/adapters/test_dead_direction_monitor.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from normscope import DeadDirectionMonitor, SignMagnitudeMonitor
from normscope.taps.hooks import call_model
from tests.support.fits import (
    fit,
    logged_steps,
    normscope_failures,
    read_csv,
    recorded_warnings,
    rows_with,
)
from tests.support.reliability_models import (
    DictLM,
    FeatureLM,
    NoNormLit,
    ScaledLM,
    corrupt_feature_loader,
    padded_dict_loader,
    regression_loader,
)
from tests.support.tiny_models import LitTiny, token_loader


def test_nan_and_inf_rows_are_dropped_counted_and_the_rest_read_exactly(tmp_path):
    """Batch 2 carries three corrupt sequences (NaN, +Inf, -Inf features): every tapped tensor
    drops their 3 x 16 rows, ``dd/rows_rejected`` counts them, the other 208 rows give the
    exact LayerNorm kernel; the step is skipped by the model's own guard."""
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=3, verbose=False, rows_per_read="all")
    loader = corrupt_feature_loader(bad_batch=2, bad_rows={0: math.nan, 5: math.inf, 9: -math.inf})
    with recorded_warnings() as records:
        trainer = fit(tmp_path, FeatureLM(), [monitor], steps=6, loader=loader)
    assert normscope_failures(records) == []
    rows = read_csv(trainer)
    reads = rows_with(rows, "dd/rows_rejected")
    # windows: steps 1 (the baseline: step 0's forward is residual discovery's), 2 and 5
    assert [int(r["step"]) for r in reads] == [2, 3, 6]
    taps = len(monitor.tracker.taps)
    assert [float(r["dd/rows_rejected"]) for r in reads] == [0.0, 48.0 * taps, 0.0]
    assert [float(r["dd/model.ln_f/n_rows"]) for r in reads] == [256.0, 208.0, 256.0]
    corrupt = reads[1]
    assert float(corrupt["dd/model.ln_f/gamma_alignment"]) >= 0.9999
    assert float(corrupt["dd/model.ln_f/kernel_residual"]) <= 1e-10
    assert math.isfinite(float(corrupt["dd/sigma_min_ratio_min"]))
    # the model's guard skipped step 2's update (Lightning re-logs the previous loss there)
    assert logged_steps(rows, "train/loss") == list(range(6))
    assert all(math.isfinite(float(r["train/loss"])) for r in rows_with(rows, "train/loss"))
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
    assert not monitor.disabled
    # the corrupt rows are what NonFiniteRule watches: one alert, at the read that held them
    assert [(a.rule, a.step) for a in monitor.alerts_fired] == [("non_finite_rows", 3)]


def test_padding_only_batches_add_no_rows_and_a_padding_only_window_waits(tmp_path):
    """Micro-batch 2 (the first of step 1, the baseline window: step 0's forwards are residual
    discovery's) is all padding: the first read has only micro-batch 3's 256 rows. The
    window of step 3 is all padding: no read of zero rows, the window stays open one more step
    and reads step 4's rows instead. Padding is never counted as rejected."""
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False, rows_per_read="all")
    loader = padded_dict_loader(padding_only_batches=[2, 6, 7])
    with recorded_warnings() as records:
        trainer = fit(
            tmp_path, DictLM(), [monitor], steps=6, loader=loader, accumulate_grad_batches=2
        )
    assert normscope_failures(records) == []
    reads = rows_with(read_csv(trainer), "dd/rows_rejected")
    assert [int(r["step"]) for r in reads] == [2, 5, 6]
    assert [float(r["dd/model.ln_f/n_rows"]) for r in reads] == [256.0, 512.0, 512.0]
    assert {float(r["dd/rows_rejected"]) for r in reads} == {0.0}
    assert all(float(r["dd/model.ln_f/gamma_alignment"]) >= 0.9999 for r in reads)
    losses = [float(r["train/loss"]) for r in rows_with(read_csv(trainer), "train/loss")]
    assert all(math.isfinite(v) for v in losses)


def test_many_steps_with_fewer_rows_than_d_read_nan_with_a_reason_and_never_alert(tmp_path):
    """One 8-token sequence per step, d = 16: a window is kept open for every_n_steps more
    steps, then read with its 24 rows (< 2 d): NaN, reason insufficient_rows, no alert."""
    torch.manual_seed(0)
    caught = []
    monitor = DeadDirectionMonitor(
        every_n_steps=2, alerts=(caught.append,), verbose=False, rows_per_read="all"
    )
    loader = token_loader(n=64, t=8, batch_size=1)
    with recorded_warnings() as records:
        trainer = fit(tmp_path, LitTiny(), [monitor], steps=12, loader=loader)
    assert normscope_failures(records) == []
    assert trainer.global_step == 12
    reads = rows_with(read_csv(trainer), "dd/model.ln_f/n_rows")
    # windows 1-3 (step 0's forward is residual discovery's), 5-7, 9-11, deferred in full
    assert [int(r["step"]) for r in reads] == [4, 8, 12]
    for r in reads:
        assert float(r["dd/model.ln_f/n_rows"]) == 24.0
        for key in ("model.ln_f/gamma_alignment", "model.h.0.ln_1/schur_quotient",
                    "model.h.1.ln_2/sigma_min", "sigma_min_ratio_min"):  # fmt: skip
            assert math.isnan(float(r[f"dd/{key}"])), key
    report = monitor.last_report
    assert {n.kernel.reason for n in report.norms.values()} == {"insufficient_rows"}
    assert {n.schur.reason for n in report.norms.values()} == {"insufficient_rows"}
    assert {p.reason for p in report.profile.points} == {"insufficient_rows"}
    assert caught == [] and monitor.alerts_fired == []


def test_zero_and_negative_gammas_are_read_for_what_they_are(tmp_path):
    """Three dead channels in the final norm, half the channels of the first norm negative:
    the dead channels are counted and found in the null space, a negative gamma keeps the
    exact kernel (v* = gamma^-1 / ||gamma^-1|| has the signs), and nothing alerts."""
    torch.manual_seed(0)
    module = LitTiny()
    with torch.no_grad():
        module.model.ln_f.weight[:3] = 0.0
        module.model.h[0].ln_1.weight[::2] *= -1.5
    caught = []
    # a separate discovery forward keeps step 0's window (the gammas as set, before an update)
    monitor = DeadDirectionMonitor(
        every_n_steps=100, alerts=(caught.append,), verbose=False, example_forward=call_model
    )
    fit(tmp_path, module, [monitor], steps=1)
    report = monitor.last_report
    final, first = report.norms["model.ln_f"], report.norms["model.h.0.ln_1"]
    assert final.gamma.dead_channels == 3 and final.gamma.dead_index == (0, 1, 2)
    assert final.kernel.reason == "dead_channels" and final.kernel.null_dim >= 3
    assert final.kernel.subspace_alignment >= 0.9999  # every dead e_i lies in the null space
    assert math.isnan(final.schur.schur_quotient) and final.schur.reason == "dead_channels"
    assert first.gamma.gamma_min == pytest.approx(-1.5) and first.gamma.dead_channels == 0
    assert first.kernel.gamma_alignment >= 0.9999 and first.kernel.kernel_residual <= 1e-10
    assert first.kernel.norm_class == "layernorm-like"
    assert caught == []


def test_a_diverged_run_with_nan_gammas_alerts_once_and_the_monitor_stays_alive(tmp_path):
    """A NaN in the final norm's gamma: its output rows are all rejected, the loss is NaN and
    every weight follows after the first update. Each window that holds rejected rows is read at
    its end, never kept open for rows; ``NonFiniteRule`` alerts once, at the first read; the
    reads log NaN with reasons and rejected-row counts; no failure, the fit runs to the end."""
    torch.manual_seed(0)
    module = LitTiny()
    with torch.no_grad():
        module.model.ln_f.weight[5] = math.nan
    caught = []
    # a separate discovery forward keeps step 0 (finite weights but ln_f) in the first window
    monitor = DeadDirectionMonitor(
        every_n_steps=2,
        alerts=(caught.append,),
        verbose=False,
        example_forward=call_model,
        rows_per_read="all",
    )
    with recorded_warnings() as records:
        trainer = fit(tmp_path, module, [monitor], steps=8)
    assert normscope_failures(records) == []
    assert trainer.global_step == 8 and not monitor.disabled
    assert [(a.rule, a.step) for a in caught] == [("non_finite_rows", 1)]
    reads = rows_with(read_csv(trainer), "dd/rows_rejected")
    # windows 0 (the baseline), 1, 3, 5, 7: read at their own ends, none deferred
    assert [int(r["step"]) for r in reads] == [1, 2, 4, 6, 8]
    first, second = reads[:2]
    assert math.isnan(float(first["dd/model.ln_f/gamma_min"]))
    # step 0: the final norm's 256 output rows; step 1: every tap's 256 rows
    assert float(first["dd/rows_rejected"]) == 256
    # the first norm's rows of step 0 are finite and read with step 0's gamma: exact kernel
    assert float(first["dd/model.h.0.ln_1/n_rows"]) == 256
    assert float(first["dd/model.h.0.ln_1/gamma_alignment"]) >= 0.9999
    assert float(second["dd/rows_rejected"]) == 256 * len(monitor.tracker.taps)
    assert math.isnan(float(second["dd/sigma_min_ratio_min"]))
    norm = monitor.last_report.norms["model.ln_f"]
    assert norm.gamma.reason == "non_finite_gamma" and norm.kernel.reason == "insufficient_rows"


def test_sign_magnitude_monitor_on_a_model_without_norms(tmp_path):
    """No norm layer: the weight and outlier reads work, the probes have no normaliser to read
    (NaN), and the fit runs without a failure."""
    torch.manual_seed(0)
    monitor = SignMagnitudeMonitor(every_n_steps=2, verbose=False, alerts=())
    with recorded_warnings() as records:
        trainer = fit(tmp_path, NoNormLit(), [monitor], steps=4, loader=regression_loader())
    assert normscope_failures(records) == []
    last = rows_with(read_csv(trainer), "sm/sign_alignment_mean")[-1]
    assert 0 < float(last["sm/net.0/sign_alignment"]) <= 1
    assert math.isfinite(float(last["sm/net.2/max_leverage"]))
    assert math.isnan(float(last["sm/asymmetry_ratio_mean"]))
    assert not monitor.disabled and monitor.reads == 3


@pytest.mark.parametrize(
    "kwargs", [{"layers": ["model.h.9.mlp.0"]}, {"probe_layers": ["model.h.0.mlp.9"]}]
)
def test_sign_magnitude_unknown_names_list_the_available_layers(tmp_path, kwargs):
    monitor = SignMagnitudeMonitor(verbose=False, alerts=(), **kwargs)
    with pytest.raises(MisconfigurationException, match=r"available: .*model\.h\.0\.mlp\.0"):
        fit(tmp_path, LitTiny(), [monitor], steps=1)


# ------------------------------------------------------------------ huge activations, numpy
def np_schur(c: np.ndarray, v: np.ndarray, ridge: float = 1e-12) -> float:
    """docs/metrics.md §1.3 in numpy: R = 1 / ((v^T C^-1 v)(v^T C v)) on C + ridge trace/d I."""
    d = len(v)
    c = (c + c.T) / 2 + ridge * np.trace(c) / d * np.eye(d)
    return float(1.0 / ((v @ np.linalg.solve(c, v)) * (v @ c @ v)))


@pytest.mark.parametrize(
    "scale, offset", [(1e6, 0.0), (1.0, 1e6)], ids=["activations x 1e6", "offset 1e6"]
)
def test_huge_activations_read_like_a_float64_numpy_reference(tmp_path, scale, offset):
    """The stream at 1e6 (times 1e6, or a 1e6 offset on a unit spread): every read of the first
    window against numpy float64 on the very rows the forward produced (captured by hooks of
    our own). The centred reads (Schur quotient, kernel) are exact to 1e-9 relative. sigma_min
    (uncentred) inherits the conditioning of S = C + mu mu^T: with a 1e6 offset any float64
    method is only accurate to ~eps ||S|| / sigma_min, so that bound (x 100) is the tolerance;
    without an offset it is exact to 1e-9 too."""
    torch.manual_seed(0)
    module = ScaledLM(scale=scale, offset=offset)
    seen: dict[str, list[np.ndarray]] = {}
    gammas: dict[str, np.ndarray] = {}
    handles = []
    for name in ("model.h.0.ln_1", "model.h.1.ln_2", "model.ln_f"):
        norm = module.get_submodule(name)

        def capture(mod, args, out, name=name):
            if mod.training and not seen.get(f"{name}:done"):
                seen.setdefault(f"{name}:in", []).append(args[0].detach().double().numpy())
                seen.setdefault(f"{name}:out", []).append(out.detach().double().numpy())
                gammas.setdefault(name, mod.weight.detach().double().numpy().copy())

        handles.append(norm.register_forward_hook(capture))
    # a separate discovery forward: one window, step 0's forward, read at step 1
    monitor = DeadDirectionMonitor(
        every_n_steps=100, verbose=False, example_forward=call_model, rows_per_read="all"
    )
    fit(tmp_path, module, [monitor], steps=1)
    for h in handles:
        h.remove()
    report = monitor.last_report
    assert report.rows_rejected == 0
    points = {p.name: p for p in report.profile.points}
    for name, gamma in gammas.items():
        h = np.concatenate(seen[f"{name}:in"]).reshape(-1, 16)
        y = np.concatenate(seen[f"{name}:out"]).reshape(-1, 16)
        assert np.abs(h).max() > 1e5  # the stream really is huge
        v = (1 / gamma) / np.linalg.norm(1 / gamma)
        norm = report.norms[name]
        assert norm.n_rows == len(y) == 256
        r_ref = np_schur(np.cov(h, rowvar=False, bias=True), v)
        assert norm.schur.schur_quotient == pytest.approx(r_ref, rel=1e-9)
        c_out = np.cov(y, rowvar=False, bias=True)
        evals, evecs = np.linalg.eigh(c_out)
        assert norm.kernel.gamma_alignment == pytest.approx(abs(evecs[:, 0] @ v), abs=1e-9)
        assert norm.kernel.kernel_residual == pytest.approx(v @ c_out @ v / evals[-1], abs=1e-12)
        s = h.T @ h / len(h)
        s_evals = np.linalg.eigvalsh(s)
        sigma_ref = math.sqrt(max(s_evals[0], 0.0))
        bound = 100 * np.finfo(np.float64).eps * s_evals[-1] / (2 * sigma_ref)
        assert abs(points[name].sigma_min - sigma_ref) <= max(bound, 1e-9 * sigma_ref)
