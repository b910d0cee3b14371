"""The attention-logit read (docs/metrics.md §1.7): the largest pre-softmax attention logit.

Attention-logit growth (Dehghani et al. 2023, ViT-22B; Wortsman et al. 2023, "Small-scale proxies
for large-scale Transformer training instabilities") is a query-key product that grows until a
row's softmax is one-hot: the attention entropy collapses and training diverges. No second
moment of the residual stream sees it (the logit is a product of two projections of a norm's
output, and qk-layernorm bounds it without changing the stream), so it is read where it is made.

Both functions return the largest logit as a float64 0-d tensor on the logits' device (no host
sync), ``-inf`` when every entry is masked or there is none. A NaN logit gives NaN; an
overflowed one (``+inf`` in half precision) gives ``+inf``. Masked entries (``-inf``, or an
additive mask's large negative value) are never the largest unless everything is masked.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["logit_max", "mha_logit_max", "query_rows", "sample_positions", "sdpa_logit_max"]

#: entries of query-key products formed at once by :func:`sdpa_logit_max` (float32: 64 MiB)
CHUNK_ENTRIES = 1 << 24


def query_rows(mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """A padding mask ``(batch, tokens)`` (non-zero keeps a row) as the boolean mask of the
    query rows of logits laid out ``(batch, ..., length, keys)``; None when there is none or
    its shape is not ``(batch, length)`` (the logits are not laid out by this batch's tokens).
    """
    if mask is None or mask.ndim != 2 or tuple(mask.shape) != (batch, length):
        return None
    return mask != 0


def sample_positions(
    length: int, sequences: int, max_rows: int | None, generator: torch.Generator
) -> torch.Tensor | None:
    """The query positions a read of ``sequences`` sequences of ``length`` tokens takes under a
    budget of ``max_rows`` token rows: ``ceil(max_rows / sequences)`` positions drawn uniformly
    without replacement (ascending, on the CPU), the same in every sequence and head; None
    (every position) when the budget covers them all or there is none.

    Example::

        >>> import torch
        >>> sample_positions(64, 32, 1024, torch.Generator().manual_seed(0)).numel()
        32
        >>> sample_positions(64, 32, 4096, torch.Generator()) is None
        True
    """
    if max_rows is None or length <= 0 or sequences * length <= max_rows:
        return None
    take = max(1, -(-int(max_rows) // max(int(sequences), 1)))
    if take >= length:
        return None
    return torch.randperm(length, generator=generator)[:take].sort().values


def _rows_kept(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``logits`` ``(batch, ..., L, S)`` with the rows ``rows`` ``(batch, L)`` drops at -inf."""
    shape = (rows.shape[0],) + (1,) * (logits.ndim - 3) + (rows.shape[1], 1)
    return logits.masked_fill(~rows.view(shape), -math.inf)


def logit_max(logits: torch.Tensor, query_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The largest entry of ``logits`` (a softmax's input), float64, 0-d, on its device;
    ``query_mask`` ``(batch, L)`` (True keeps; :func:`query_rows`) leaves padded query rows of
    logits laid out ``(batch, ..., L, S)`` out.

    Example::

        >>> import torch
        >>> x = torch.tensor([[1.0, 3.5, float("-inf")], [0.5, -2.0, 2.0]])
        >>> logit_max(x).item()
        3.5
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"logit_max: logits must be a floating-point tensor, got {got}")
    x = logits.detach()
    if x.numel() == 0:
        return torch.full((), -math.inf, dtype=torch.float64, device=x.device)
    if query_mask is not None:
        x = _rows_kept(x, query_mask.to(x.device))
    return x.amax().to(torch.float64)


def sdpa_logit_max(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    query_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The largest logit ``scale * q_i . k_j`` over the pairs that take part, for the arguments of
    :func:`torch.nn.functional.scaled_dot_product_attention` (same shapes and meaning: ``query``
    ``(..., L, E)``, ``key`` ``(..., S, E)``, ``attn_mask`` boolean (True takes part) or additive,
    broadcastable to ``(..., L, S)``; ``is_causal`` the top-left causal mask; ``scale`` default
    ``1 / sqrt(E)``; ``enable_gqa``: ``key`` has fewer heads (dimension -3), each shared by a group
    of query heads), and ``query_mask`` ``(batch, L)`` (True keeps a query row: padding left out;
    ``query`` laid out ``(batch, ..., L, E)``). The products are formed in float32 (float64 for float64 inputs), a block of
    query rows at a time (at most :data:`CHUNK_ENTRIES` entries), so memory stays bounded at long
    context; the cost is one ``q k^T`` of the attention, once per call. ``positions`` (1-D
    integer, ascending, in ``[0, L)``) reads those query positions only (of every sequence and
    head: :func:`sample_positions`), against every key, masks applied as at those positions;
    the cost falls to ``len(positions) / L`` of it.

    Example::

        >>> import torch
        >>> q = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])   # (1, L=2, E=2)
        >>> k = torch.tensor([[[3.0, 0.0], [0.0, 1.0]]])
        >>> round(sdpa_logit_max(q, k, scale=1.0).item(), 6)             # q_0 . k_0
        3.0
        >>> round(sdpa_logit_max(q, k, is_causal=True, scale=1.0).item(), 6)
        3.0
        >>> round(sdpa_logit_max(q[:, 1:], k[:, 1:], scale=1.0).item(), 6)
        2.0
    """
    for name, t in (("query", query), ("key", key)):
        if not isinstance(t, torch.Tensor) or t.ndim < 2 or not t.is_floating_point():
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"sdpa_logit_max: {name} must be a float tensor (..., n, E), got {got}"
            )
    q, k = query.detach(), key.detach()
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"sdpa_logit_max: query and key widths differ ({q.shape[-1]} vs {k.shape[-1]})"
        )
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    if enable_gqa and q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        if q.shape[-3] % k.shape[-3]:
            raise ValueError(
                f"sdpa_logit_max: {q.shape[-3]} query heads are not a multiple of "
                f"{k.shape[-3]} key heads"
            )
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    length, span = q.shape[-2], k.shape[-2]
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    block = max(1, CHUNK_ENTRIES // max(1, math.prod(lead) * span))
    kt = k.to(work).transpose(-2, -1)
    additive = attn_mask is not None and attn_mask.dtype != torch.bool
    # max(s x) = s max(x) for s > 0: the scale is applied to the maximum, not to every logit,
    # unless an additive mask must be added to the scaled logits first
    late = s > 0 and not additive
    best = torch.full((), -math.inf, dtype=torch.float64, device=q.device)
    where = None if positions is None else positions.to(device=q.device, dtype=torch.long)
    rows_read = length if where is None else int(where.numel())
    for lo in range(0, rows_read, block):
        hi = min(rows_read, lo + block)
        at = None if where is None else where[lo:hi]  # the query positions of this block
        block_q = q[..., lo:hi, :] if at is None else q.index_select(-2, at)
        logits = block_q.to(work) @ kt  # a fresh tensor: masked in place below
        if not late:
            logits.mul_(s)
        keep = None
        if is_causal:
            i = (torch.arange(lo, hi, device=q.device) if at is None else at).unsqueeze(-1)
            keep = torch.arange(span, device=q.device) <= i
        if attn_mask is not None:
            m = attn_mask
            if attn_mask.ndim >= 2 and attn_mask.shape[-2] > 1:
                m = attn_mask[..., lo:hi, :] if at is None else attn_mask.index_select(-2, at)
            if not additive:
                keep = m if keep is None else keep & m
            else:
                logits = logits + m.to(work)
        if keep is not None:
            # as an additive 0 / -inf bias: a broadcast add is 5x cheaper than masked_fill_
            bias = torch.zeros(keep.shape, dtype=work, device=logits.device)
            bias.masked_fill_(~keep, -math.inf)
            if torch.broadcast_shapes(bias.shape, logits.shape) == logits.shape:
                logits.add_(bias)
            else:  # a mask with more leading dimensions than the logits: broadcast up
                logits = logits + bias
        rows = None
        if query_mask is not None:
            kept = query_mask[:, lo:hi] if at is None else query_mask.index_select(1, at)
            rows = kept.to(logits.device)
        top = logit_max(logits, rows)
        best = torch.maximum(best, top * s if late else top)
    return best


def mha_logit_max(
    query: torch.Tensor,
    key: torch.Tensor,
    num_heads: int,
    in_proj_weight: torch.Tensor | None,
    in_proj_bias: torch.Tensor | None,
    *,
    bias_k: torch.Tensor | None = None,
    add_zero_attn: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: torch.Tensor | None = None,
    k_proj_weight: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
    is_causal: bool = False,
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The largest logit of :func:`torch.nn.functional.multi_head_attention_forward` (what
    ``nn.MultiheadAttention`` runs), from its arguments, same meaning: ``query`` ``(L, N, E)``
    (or ``(L, E)``), ``key`` ``(S, N, E)``; the query and key projections; boolean masks mark
    what does *not* take part, float masks are added; ``bias_k`` and ``add_zero_attn`` add a
    key; ``query_mask`` ``(N, L)`` leaves padded query rows out. The heads' queries and keys
    are projected again (one ``E x 2E`` product) and read by
    :func:`sdpa_logit_max` with the scale ``1 / sqrt(E / num_heads)``.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> mha = nn.MultiheadAttention(4, 2, bias=False)
        >>> with torch.no_grad():
        ...     _ = mha.in_proj_weight.copy_(torch.eye(4).repeat(3, 1))
        >>> x = torch.tensor([[[2.0, 0.0, 0.0, 0.0]], [[0.0, 0.0, 3.0, 0.0]]])  # (L=2, N=1, E=4)
        >>> round(mha_logit_max(x, x, 2, mha.in_proj_weight, None).item(), 4)  # 3 * 3 / sqrt(2)
        6.364
    """
    batched = query.dim() == 3
    q_in = query.detach() if batched else query.detach().unsqueeze(1)
    k_in = key.detach() if batched else key.detach().unsqueeze(1)
    length, batch, width = q_in.shape
    if num_heads < 1 or width % num_heads:
        raise ValueError(f"mha_logit_max: width {width} is not a multiple of {num_heads} heads")
    head = width // num_heads
    if use_separate_proj_weight:
        w_q, w_k = q_proj_weight, k_proj_weight
    else:
        if in_proj_weight is None:
            raise ValueError("mha_logit_max: no in_proj_weight and no separate projections")
        w_q, w_k = in_proj_weight[:width], in_proj_weight[width : 2 * width]
    b_q = b_k = None
    if in_proj_bias is not None:
        b_q, b_k = in_proj_bias[:width], in_proj_bias[width : 2 * width]
    q = F.linear(q_in, w_q.detach(), None if b_q is None else b_q.detach())
    q = q.reshape(length, batch * num_heads, head).transpose(0, 1)
    if static_k is not None:
        k = static_k.detach()
    else:
        k = F.linear(k_in, w_k.detach(), None if b_k is None else b_k.detach())
        if bias_k is not None:
            k = torch.cat([k, bias_k.detach().repeat(1, batch, 1)])
        k = k.reshape(k.shape[0], batch * num_heads, head).transpose(0, 1)
    span = k.shape[1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    mask = torch.zeros((1, length, span), dtype=work, device=q.device)
    if attn_mask is not None:
        m = attn_mask if attn_mask.dim() == 3 else attn_mask.unsqueeze(0)
        m = F.pad(m, (0, span - m.shape[-1]))  # a bias_k column: takes part
        mask = mask.masked_fill(m, -math.inf) if m.dtype == torch.bool else mask + m.to(work)
    elif is_causal:
        causal = torch.ones(length, span, dtype=torch.bool, device=q.device).triu(1)
        mask = mask.masked_fill(causal, -math.inf)
    if key_padding_mask is not None:
        pad = key_padding_mask if batched else key_padding_mask.unsqueeze(0)
        pad = F.pad(pad, (0, span - pad.shape[-1]))
        pad = pad.view(batch, 1, 1, span).expand(-1, num_heads, -1, -1).reshape(-1, 1, span)
        mask = mask.masked_fill(pad, -math.inf) if pad.dtype == torch.bool else mask + pad.to(work)
    rows = None
    if query_mask is not None:  # (N, L) -> one row mask per (sample, head), as q is laid out
        rows = query_mask.to(torch.bool).repeat_interleave(num_heads, dim=0)
    best = sdpa_logit_max(q, k, attn_mask=mask, scale=1.0 / math.sqrt(head), query_mask=rows)
    if add_zero_attn:  # a zero key: one more logit, 0
        best = torch.maximum(best, torch.zeros_like(best))
    return best
