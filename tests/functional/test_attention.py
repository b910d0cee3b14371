"""The attention-logit reads (docs/metrics.md §1.7) against numpy references.

Tolerances: float64 inputs are compared to numpy's float64 products at 1e-12 relative (one
``E``-term dot product per entry, E <= 16: round-off near 1e-15); float32 inputs at 1e-5
relative (float32 products, ~1e-7 per term)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normscope.functional import attention as att
from normscope.functional.attention import logit_max, mha_logit_max, query_rows, sdpa_logit_max


def _reference(q, k, keep=None, add=None, scale=None):
    """Largest ``scale q_i . k_j`` over the pairs ``keep`` allows, in float64 numpy."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = np.einsum("...le,...se->...ls", q, k) * s
    if add is not None:
        logits = logits + np.asarray(add, np.float64)
    if keep is not None:
        logits = np.where(np.broadcast_to(keep, logits.shape), logits, -np.inf)
    return logits.max()


@pytest.fixture
def qk():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 7, 16, generator=g, dtype=torch.float64) * 3
    k = torch.randn(3, 4, 9, 16, generator=g, dtype=torch.float64) * 3
    return q, k


def test_logit_max_takes_the_largest_entry_and_says_nan_and_overflow():
    x = torch.tensor([[1.0, 3.5, -math.inf], [0.5, -2.0, 2.0]])
    assert logit_max(x).item() == 3.5 and logit_max(x).dtype == torch.float64
    assert logit_max(torch.full((2, 2), -math.inf)).item() == -math.inf  # everything masked
    assert logit_max(torch.empty(0, 3)).item() == -math.inf
    assert math.isnan(logit_max(torch.tensor([1.0, math.nan])).item())
    assert logit_max(torch.tensor([1.0, math.inf], dtype=torch.float16)).item() == math.inf
    with pytest.raises(TypeError, match="floating-point"):
        logit_max(torch.tensor([1, 2]))


def test_sdpa_read_matches_numpy_unmasked_causal_and_scaled(qk):
    q, k = qk
    assert sdpa_logit_max(q, k).item() == pytest.approx(_reference(q, k), rel=1e-12)
    causal = np.tril(np.ones((7, 9), bool))  # SDPA's is_causal: top-left aligned
    got = sdpa_logit_max(q, k, is_causal=True).item()
    assert got == pytest.approx(_reference(q, k, keep=causal), rel=1e-12)
    assert sdpa_logit_max(q, k, scale=0.5).item() == pytest.approx(
        _reference(q, k, scale=0.5), rel=1e-12
    )


def test_sdpa_read_masks_like_sdpa_bool_and_additive(qk):
    q, k = qk
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(3, 1, 7, 9, generator=g) > 0.5
    keep[..., 0] = True  # every query row keeps one key
    got = sdpa_logit_max(q, k, attn_mask=keep).item()
    assert got == pytest.approx(_reference(q, k, keep=keep.numpy()), rel=1e-12)
    add = torch.randn(7, 9, generator=g, dtype=torch.float64)
    got = sdpa_logit_max(q, k, attn_mask=add).item()
    assert got == pytest.approx(_reference(q, k, add=add.numpy()), rel=1e-12)
    # the additive mask as SDPA sees it: its output equals softmax(logits + mask) @ v
    v = torch.randn(3, 4, 9, 5, dtype=torch.float64, generator=g)
    logits = q @ k.mT / 4.0 + add
    assert torch.allclose(
        F.scaled_dot_product_attention(q, k, v, attn_mask=add), logits.softmax(-1) @ v
    )


def test_sdpa_read_with_grouped_keys_repeats_each_key_head_for_its_group():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 5, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64)
    k[:, 1] *= 10  # the second key head: the largest logits, only for query heads 3-5
    full = k.repeat_interleave(3, dim=1)
    got = sdpa_logit_max(q, k, enable_gqa=True).item()
    assert got == pytest.approx(_reference(q, full), rel=1e-12)
    with pytest.raises(ValueError, match="multiple"):
        sdpa_logit_max(q[:, :5], k, enable_gqa=True)


def test_sdpa_read_in_chunks_gives_the_same_maximum(qk, monkeypatch):
    q, k = qk
    whole = sdpa_logit_max(q, k, is_causal=True, attn_mask=torch.ones(7, 9, dtype=torch.bool))
    monkeypatch.setattr(att, "CHUNK_ENTRIES", 3 * 4 * 9 * 2)  # two query rows a chunk
    # a matmul of 2 query rows and one of 7 may sum the width's 16 products in another order
    # (BLAS picks its kernel by shape): the same maximum to float64 rounding, not bit for bit
    # (a clean clone read 26.613756433203665 against 26.613756433203662); 1e-12 relative, as
    # this file's other float64 reads
    chunked = sdpa_logit_max(q, k, is_causal=True).item()
    assert chunked == pytest.approx(whole.item(), rel=1e-12)


def test_sdpa_read_of_float32_and_bad_arguments(qk):
    q, k = (t.float() for t in qk)
    assert sdpa_logit_max(q, k).item() == pytest.approx(_reference(q, k), rel=1e-5)
    with pytest.raises(ValueError, match="widths differ"):
        sdpa_logit_max(q, k[..., :8])
    with pytest.raises(ValueError, match="float tensor"):
        sdpa_logit_max(torch.ones(3, dtype=torch.long), k)


@pytest.mark.parametrize("batch_first", [False, True])
def test_mha_read_matches_the_logits_of_nn_multiheadattention(batch_first):
    """The reference: ``nn.MultiheadAttention``'s own attention weights (need_weights,
    unaveraged) are ``softmax(logits)``; the logits are rebuilt from the module's weights in
    numpy and must give those weights back before their maximum is compared."""
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64) * 2  # (N, L, E)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    seq = x if batch_first else x.transpose(0, 1)
    _, weights = mha(
        seq, seq, seq, key_padding_mask=pad, attn_mask=causal, average_attn_weights=False
    )
    w = mha.in_proj_weight.detach().numpy()
    b = mha.in_proj_bias.detach().numpy()
    xn = x.numpy()
    q = (xn @ w[:16].T + b[:16]).reshape(2, 6, 4, 4).transpose(0, 2, 1, 3)
    k = (xn @ w[16:32].T + b[16:32]).reshape(2, 6, 4, 4).transpose(0, 2, 1, 3)
    keep = ~causal.numpy()[None, None] & ~pad.numpy()[:, None, None, :]
    logits = np.where(keep, q @ k.transpose(0, 1, 3, 2) / 2.0, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    assert np.allclose(probs, weights.detach().numpy(), atol=1e-12)
    # what F.multi_head_attention_forward receives: (L, N, E), the module's parameters
    got = mha_logit_max(
        x.transpose(0, 1),
        x.transpose(0, 1),
        4,
        mha.in_proj_weight,
        mha.in_proj_bias,
        key_padding_mask=pad,
        attn_mask=causal,
    ).item()
    assert got == pytest.approx(logits.max(), rel=1e-12)


def test_mha_read_with_added_key_and_zero_attention():
    torch.manual_seed(4)
    mha = nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True).double()
    x = torch.randn(5, 1, 8, dtype=torch.float64)
    _, weights = mha(x, x, x, average_attn_weights=False)  # keys: 5 + bias_k + zero
    got = mha_logit_max(
        x, x, 2, mha.in_proj_weight, mha.in_proj_bias, bias_k=mha.bias_k, add_zero_attn=True
    ).item()
    e = 8
    w, b = mha.in_proj_weight.detach(), mha.in_proj_bias.detach()
    q = (x[:, 0] @ w[:e].T + b[:e]).view(5, 2, 4).transpose(0, 1)
    k = torch.cat([x[:, 0] @ w[e : 2 * e].T + b[e : 2 * e], mha.bias_k.detach()[0]])
    k = torch.cat([k.view(6, 2, 4).transpose(0, 1), torch.zeros(2, 1, 4, dtype=k.dtype)], 1)
    logits = q @ k.mT / 2.0
    assert torch.allclose(logits.softmax(-1), weights[0], atol=1e-12)
    assert got == pytest.approx(logits.max().item(), rel=1e-12)


def test_padded_query_rows_are_left_out(qk):
    q, k = qk
    pad = torch.ones(3, 7, dtype=torch.long)
    pad[1, 4:] = 0  # sample 1: its last three tokens are padding
    rows = query_rows(pad, 3, 7)
    keep = rows.numpy()[:, None, :, None]
    got = sdpa_logit_max(q, k, query_mask=rows).item()
    assert got == pytest.approx(_reference(q, k, keep=keep), rel=1e-12)
    x = (q @ k.mT) / 4.0
    assert logit_max(x, rows).item() == pytest.approx(got, rel=1e-12)
    q2 = q.clone()
    q2[1, :, 4:] *= 100  # huge logits on the padded rows only: not read
    assert sdpa_logit_max(q2, k, query_mask=rows).item() == pytest.approx(got, rel=1e-12)
    assert sdpa_logit_max(q2, k).item() > 10 * got
    assert query_rows(pad, 3, 8) is None and query_rows(None, 3, 7) is None


def test_sdpa_read_at_sampled_positions_matches_numpy_on_those_rows(qk):
    """The row budget: only the query rows at ``positions`` (of every sequence and head), every
    key, each mask taken at those rows -- against numpy on the same rows (1e-12: float64)."""
    q, k = qk
    at = torch.tensor([1, 4, 6])
    rows = at.numpy()
    causal = np.tril(np.ones((7, 9), bool))[rows]
    got = sdpa_logit_max(q, k, is_causal=True, positions=at).item()
    assert got == pytest.approx(_reference(q[..., rows, :], k, keep=causal), rel=1e-12)
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(3, 1, 7, 9, generator=g) > 0.5
    keep[..., 0] = True
    got = sdpa_logit_max(q, k, attn_mask=keep, positions=at).item()
    assert got == pytest.approx(
        _reference(q[..., rows, :], k, keep=keep.numpy()[..., rows, :]), rel=1e-12
    )
    add = torch.randn(7, 9, generator=g, dtype=torch.float64)
    got = sdpa_logit_max(q, k, attn_mask=add, positions=at).item()
    assert got == pytest.approx(_reference(q[..., rows, :], k, add=add.numpy()[rows]), rel=1e-12)
    pad = torch.ones(3, 7, dtype=torch.long)
    pad[:, 6] = 0  # the last position is padding everywhere: of the sampled rows, 1 and 4 count
    q2 = q.clone()
    q2[:, :, 6] *= 100
    got = sdpa_logit_max(q2, k, query_mask=query_rows(pad, 3, 7), positions=at).item()
    assert got == pytest.approx(_reference(q[..., [1, 4], :], k), rel=1e-12)
    # a position never drawn is never read: a huge logit at row 0 does not show
    q3 = q.clone()
    q3[:, :, 0] *= 100
    assert sdpa_logit_max(q3, k, positions=at).item() == pytest.approx(
        sdpa_logit_max(q, k, positions=at).item(), rel=1e-12
    )


def test_sample_positions_keeps_the_budget_and_draws_anew():
    g = torch.Generator().manual_seed(0)
    first = att.sample_positions(64, 32, 1024, g)
    assert first.numel() == 32 and first.unique().numel() == 32  # ceil(1024 / 32), distinct
    assert torch.equal(first, first.sort().values) and 0 <= first.min() and first.max() < 64
    assert not torch.equal(first, att.sample_positions(64, 32, 1024, g))  # a new draw each call
    assert att.sample_positions(64, 32, 1000, g).numel() == 32  # rounded up: ceil(1000 / 32)
    assert att.sample_positions(64, 32, 2048, g) is None  # the budget covers every row
    assert att.sample_positions(64, 32, None, g) is None
    assert att.sample_positions(64, 1000, 10, g).numel() == 1  # at least one position
