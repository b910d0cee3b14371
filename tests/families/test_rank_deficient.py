"""Inputs that do not span the width (issue 33): a ViT with 4x4 patches and a byte-level LM.

A 4x4 RGB patch has 3 * 4 * 4 = 48 values: with the class token and 65 positions the ViT's
stream entry has rank at most 48 + 1 + 65 = 114 under d = 192. A byte vocabulary (256 ids) plus
64 positions spans at most 320 of d = 384. Before issue 33 the first point's ``sigma_min`` was
0 or rounding (every cumulative ratio NaN, or up to 645,191) and ``dd/gamma_alignment_min``
read 0.0003-0.055 while the kernel held (``subspace_alignment`` 0.9999999999996). Now: the
ratios are read from the first point that spans (``dd/profile_anchor_depth``), the headline
alignment is each norm's ``kernel_alignment``, the inputs that do not span are counted
(``dd/rank_deficient_inputs``) and one warning says so. What is asserted is what holds on any
seed: the kernel's exactness (float64 reads of float32 rows: >= 0.9999), finite ratios from the
anchor on, and the warning's words.
"""

from __future__ import annotations

import math
import warnings

import torch
from examples.vit import ViT, synthetic_images
from transformers import GPT2Config, GPT2LMHeadModel

from normscope import scan_model


def _scan(model, batches):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = scan_model(model, batches)
    said = [str(w.message) for w in caught if "do not span" in str(w.message)]
    return report, said


def _assert_reads_hold(report, said) -> None:
    logged = report.as_dict()
    assert len(said) == 1, said  # one warning, in words, naming the key
    assert "dd/profile_anchor_depth" in said[0] or "live_dim" in said[0]
    assert logged["dd/gamma_alignment_min"] >= 0.9999
    for name, norm in report.norms.items():
        assert norm.kernel.kernel_alignment >= 0.9999, name
        assert math.isfinite(norm.delta_gamma), name  # read on the live subspace
        assert math.isfinite(norm.depth.control_delta_gamma), name
    profile = report.profile
    assert profile.anchor_depth >= 1 and logged["dd/profile_anchor_depth"] == profile.anchor_depth
    assert profile.points[0].reason == "rank_deficient"
    after = [p.sigma_min_ratio for p in profile.points[profile.anchor_depth :]]
    assert after[0] == 1.0 and all(math.isfinite(r) and 0 < r < 1e3 for r in after)
    assert math.isfinite(logged["dd/sigma_min_ratio_min"])


def test_a_vit_with_4x4_patches_reads_from_the_first_point_that_spans() -> None:
    torch.manual_seed(0)
    model = ViT(image_size=32, patch_size=4, dim=192, depth=2, heads=3, num_classes=4)
    images, _ = synthetic_images(16, seed=1)  # 16 x 65 tokens = 1,040 rows >= 4 d
    report, said = _scan(model, [images[:8], images[8:]])
    _assert_reads_hold(report, said)
    # the entry's rank: at most 48 patch values + class token + 65 positions
    assert report.norms["blocks.0.norm1"].depth.live_dim <= 48 + 1 + 65
    assert report.as_dict()["dd/rank_deficient_inputs"] >= 1


def test_a_byte_level_lm_reads_from_the_first_point_that_spans() -> None:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=64, n_embd=384, n_layer=2, n_head=6, n_inner=768
    )
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 256, (8, 64), generator=gen)} for _ in range(4)]
    report, said = _scan(model, batches)  # 2,048 rows = 5.3 d
    _assert_reads_hold(report, said)
    assert report.norms["transformer.h.0.ln_1"].depth.live_dim <= 256 + 64
