"""The fold kernel of :class:`~normscope.functional.StreamingCovariance`: rows to a centred batch.

Two halves, both measured in ``benchmarks/covariance_throughput.py`` (``benchmarks/RESULTS.md``):

* :func:`centre_rows` -- float32 (or any float) rows to the batch's row count, mean and centred,
  weighted float64 rows in a few cheap passes: one cast into a buffer (on the CPU a per-thread
  scratch of up to ``SCRATCH_MAX_BYTES``, reused: a fresh 64 MiB buffer costs ~40 ms of page
  faults per update, ~15% of the fold at d = 1024), a row sum (NaN/Inf test), ``nan_to_num_`` +
  a 0/1 weight multiply (drops bad and masked rows: much cheaper than a broadcast
  ``masked_fill_``), the column sum (these in cache-sized chunks for d <= 512), and the
  centring as one ``addcmul_``. No host sync.
* :func:`add_gram_` -- ``M += X^T X`` of the centred rows, with about half the flops of the
  full GEMM, since ``M`` is symmetric. torch has no ``syrk``. Three ways, picked by
  :func:`fold_plan`:

  - ``"panels"`` (the default from d = 128 on the CPU, d = 1024 on CUDA): the ``d`` columns
    cut into panels of ``p``; panel ``i`` adds ``X_i^T X[:, i p:]`` into its row of blocks,
    right of and on the diagonal: ``d / p`` GEMMs (row panels: fewer, wider calls than one per
    block; measured faster than a recursive split), ``(1 + p / d) / 2`` of the flops, no host
    sync. The blocks left of the diagonal are left stale; :func:`mirror_upper_` copies them
    from the upper ones when the matrix is read.
  - ``"syrk"`` (CPU, opt-in): numpy's ``X.T @ X`` on the same buffer, which numpy sends to
    BLAS ``dsyrk`` (one triangle, mirrored by numpy): 1.0x of the float64 GEMM rate on half
    the flops with ``OPENBLAS_NUM_THREADS=1``, but its threads are numpy's BLAS pool, not
    ``torch.set_num_threads``: with OpenBLAS's default pool beside torch's it ran 10x *slower*
    than the GEMM (2 shared cores), so it is never picked automatically.
  - ``"gemm"``: the full ``addmm_`` (small ``d``, where one call is faster).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["FOLD_MODES", "add_gram_", "centre_rows", "chunk_rows", "fold_plan", "mirror_upper_"]

FOLD_MODES = ("auto", "gemm", "panels", "syrk")
# The largest CPU row buffer kept between updates (one per thread; larger ones are allocated
# per update). The old fold allocated the same buffer afresh: the peak is unchanged.
SCRATCH_MAX_BYTES = 256 * 2**20
_scratch = threading.local()


def _row_buffer(shape: torch.Size, device: torch.device) -> torch.Tensor:
    size = shape[0] * shape[1]
    if device.type != "cpu" or 8 * size > SCRATCH_MAX_BYTES:
        return torch.empty(shape, dtype=torch.float64, device=device)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < size:
        buf = _scratch.buf = torch.empty(size, dtype=torch.float64)
    return buf[:size].view(shape)


def fold_plan(dim: int, device: torch.device, mode: str = "auto") -> tuple[str, int]:
    """``(kind, panel width)`` of the product for width ``dim`` on ``device``.

    ``"auto"``: CPU, panels of the CPU-measured widths, 64 up to d = 256, 128 up to 1024, 256
    above (fewer than two panels, d < 128: the full GEMM). CUDA (not measured here:
    ``benchmarks/gpu_suite.py`` reports it), panels of ``max(256, d / 16)`` from d = 1024, the
    full GEMM below. ``"panels"`` asked for explicitly uses the CPU widths on any device.

    Example::

        >>> fold_plan(512, torch.device("cpu")), fold_plan(512, torch.device("cpu"), "syrk")
        (('panels', 128), ('syrk', 0))
        >>> fold_plan(4096, torch.device("cuda")), fold_plan(100, torch.device("cpu"))
        (('panels', 256), ('gemm', 0))
    """
    if mode not in FOLD_MODES:
        raise ValueError(f"fold must be one of {FOLD_MODES}, got {mode!r}")
    if mode == "auto":
        if device.type == "cpu":
            mode = "panels"
        elif dim >= 1024:
            return "panels", max(256, dim // 16)
        else:
            mode = "gemm"
    if mode == "syrk" and device.type != "cpu":
        raise ValueError("fold='syrk' runs numpy's BLAS: CPU accumulators only")
    if mode == "panels":
        width = 64 if dim <= 256 else 128 if dim <= 1024 else 256
        return ("panels", width) if 2 * width <= dim else ("gemm", 0)
    return mode, 0


def chunk_rows(dim: int, device: torch.device) -> int | None:
    """Rows per pass-chunk of :func:`centre_rows`, or None for the whole batch at once.

    CPU, d <= 512: 4096 rows, so that a chunk's float64 rows (<= 16 MiB) stay in cache from the
    cast to the column sum. Only the passes are chunked: the mean, centring and product are of
    the whole batch (one Chan merge per update, as before; chunked merges cost up to 2e-13 of
    relative accuracy at means of 1e4). On CUDA and at wider rows: the whole batch.
    """
    return 4096 if device.type == "cpu" and dim <= 512 else None


def centre_rows(
    rows: torch.Tensor, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, n_b, mean_b, rejected_b)``: the rows as a private float64 buffer, centred on their
    weighted mean, bad (NaN/Inf) and masked-out rows zero; their count, mean and bad count.

    ``rows`` (N, d) are on the accumulator's device already; ``keep`` a bool (N,) or None.
    On the CPU ``x`` is this thread's scratch: valid until the next call.
    """
    n, d = rows.shape
    x = _row_buffer(rows.shape, rows.device)
    step = chunk_rows(d, rows.device) or n
    weights, total = [], torch.zeros(d, dtype=torch.float64, device=rows.device)
    for start in range(0, n, step):
        part = x[start : start + step] if step < n else x
        part.copy_(rows[start : start + step] if step < n else rows)
        # A row sum is non-finite iff the row holds a NaN/Inf (or sums past 1e308).
        weight = torch.isfinite(part.sum(dim=1))
        if keep is not None:
            weight &= keep[start : start + step] if step < n else keep
        # Finite everywhere, then x * 0 = 0 exactly on a dropped row and x * 1 = x on a kept one.
        part.nan_to_num_(0.0, 0.0, 0.0).mul_(weight.to(torch.float64)[:, None])
        total += part.sum(dim=0)
        weights.append(weight)
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    # A dropped row that was kept by the mask held a NaN/Inf (masked-out rows are padding).
    rejected = (~weight).sum() if keep is None else (keep & ~weight).sum()
    w = weight.to(torch.float64)
    n_b = w.sum()
    mean_b = total / n_b.clamp_min(1)
    # x - 1 * mean on a kept row, 0 - 0 * mean = 0 on a dropped one: one pass.
    x.addcmul_(w[:, None], mean_b, value=-1.0)
    return x, n_b, mean_b, rejected


def add_gram_(m: torch.Tensor, x: torch.Tensor, kind: str, panel: int) -> bool:
    """``m += x^T x``; True when only the upper blocks were written (:func:`mirror_upper_`)."""
    d = x.shape[1]
    if kind == "syrk":
        a = x.numpy()
        m.add_(torch.from_numpy(a.T @ a))  # numpy: BLAS dsyrk + its own mirror
        return False
    if kind == "panels" and 0 < panel < d:
        for i0 in range(0, d, panel):
            i1 = min(i0 + panel, d)
            m[i0:i1, i0:].addmm_(x[:, i0:i1].mT, x[:, i0:])
        return True
    m.addmm_(x.mT, x)
    return False


def mirror_upper_(m: torch.Tensor, panel: int) -> None:
    """Copy the blocks right of the diagonal (rows of ``panel``) onto those left of it.

    On a contiguous ``m`` each block and its transposed source are one ``as_strided`` view
    each (three ops a block, not six: a read of the demo mirrors 18 accumulators)."""
    d = m.shape[0]
    flat = m.is_contiguous()
    base = m.storage_offset()
    for i0 in range(0, d - panel, panel):
        i1 = i0 + panel
        if flat:  # m[i1:, i0:i1] and m[i0:i1, i1:].mT: element (r, c) at (i1 + r) d + i0 + c
            dst = m.as_strided((d - i1, panel), (d, 1), base + i1 * d + i0)
            src = m.as_strided((d - i1, panel), (1, d), base + i0 * d + i1)
            dst.copy_(src)
        else:
            m[i1:, i0:i1].copy_(m[i0:i1, i1:].mT)
