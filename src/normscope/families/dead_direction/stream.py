"""The stream and attention reads of a window (docs/metrics.md §1.6, §1.7): offsets, RMS and
its growth, gain drifts, RankMe, the non-finite share, the attention logits' maxima. Keyed as
logged without ``dd/``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from normscope.families.dead_direction.window import ReadWindow
from normscope.functional.stream import (
    effective_rank,
    gain_drifts,
    nonfinite_share,
    stream_scales,
)

__all__ = ["attention_reads", "stream_keys", "stream_reads"]


def stream_reads(window: ReadWindow) -> dict[str, float]:
    """The window's stream reads that need its accumulators (docs/metrics.md §1.6), keyed as
    logged without ``dd/``: each residual point's ``offset_share`` and ``rms``, each norm
    layer's ``out_offset_share`` (of its output), and the final norm's output ``rankme`` (of
    its second moment, as Garrido et al.) and ``rankme_centred`` (of its covariance)."""
    out: dict[str, float] = {}
    # every point's and norm output's (mean, diag C, N), read together (stream_scales: one
    # stacked reduction, one copy to the host)
    names: list[tuple[str, str | None]] = []  # (prefix, the rms key's prefix or None)
    accs: list[Any] = []
    points = window.layout.points if window.layout is not None else ()
    if window.profile_on and len(points) == len(window.point_taps):
        for point, tap in zip(points, window.point_taps):
            names.append((f"{point.name}/offset_share", f"{point.name}/rms"))
            accs.append(tap.accumulator)
    for norm in window.norms:
        if norm.name in window.skip:
            continue
        names.append((f"{norm.name}/out_offset_share", None))
        accs.append(window.norm_taps[norm.name][1].accumulator)
    if accs:
        counts = [acc.count for acc in accs]
        shares, rms = stream_scales([acc.mean for acc in accs], _variances(accs), counts)
        for (share_key, rms_key), share, scale in zip(names, shares, rms):
            out[share_key] = share
            if rms_key is not None:
                out[rms_key] = scale
    final = window.layout.final_norm if window.layout is not None else None
    if final is not None and final in window.norm_taps and final not in window.skip:
        acc = window.norm_taps[final][1].accumulator
        if window.spectral:  # RankMe: two eigvalsh, the spectral tier's
            out[f"{final}/rankme"] = effective_rank(acc.second_moment(), acc.count)
            out[f"{final}/rankme_centred"] = effective_rank(acc.covariance(), acc.count)
        out["final_rows_per_dim"] = acc.count / acc.dim
    return out


def attention_reads(maxima: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """The attention-logit keys of a window (docs/metrics.md §1.7), without ``dd/``: each
    module's ``<module>/max_logit`` (NaN: it ran no readable attention in the window),
    ``attn_logit_max`` (the largest; NaN when none was read) and ``attn_modules_read``. One host
    transfer for all modules. No module: only the count, 0."""
    if not maxima:
        return {"attn_modules_read": 0.0}
    names = list(maxima)
    read = [n for n in names if maxima[n] is not None]
    values = dict.fromkeys(names, math.nan)
    if read:
        device = maxima[read[0]].device
        host = torch.stack([maxima[n].to(device, torch.float64) for n in read]).cpu().tolist()
        values.update({n: (v if v > -math.inf else math.nan) for n, v in zip(read, host)})
    out = {f"{n}/max_logit": v for n, v in values.items()}
    seen = [v for v in values.values() if not math.isnan(v)]
    out["attn_logit_max"] = max(seen) if seen else math.nan
    out["attn_modules_read"] = float(len(seen))
    return out


def _variances(accs: Sequence[Any]) -> list[torch.Tensor]:
    """Each accumulator's per-channel variance ``diag(M) / max(N, 1)`` (its
    ``comoment_diagonal()``: a cheap window folds no more), the divisions as one op per group
    of equal widths (the count tensors stacked, no host sync)."""
    diagonals = [acc.comoment_diagonal() for acc in accs]
    out: list[torch.Tensor] = list(diagonals)
    groups: dict[tuple, list[int]] = {}
    for i, (diag, acc) in enumerate(zip(diagonals, accs)):
        key = (diag.shape, diag.device, acc.count_tensor.device)
        groups.setdefault(key, []).append(i)
    for idx in groups.values():
        n = torch.stack([accs[i].count_tensor for i in idx]).clamp_min(1)
        var = torch.stack([diagonals[i] for i in idx]) / n[:, None].to(diagonals[idx[0]].device)
        for i, row in zip(idx, var.unbind(0)):
            out[i] = row
    return out


def stream_keys(
    window: ReadWindow,
    solved: dict[str, float],
    gain_baselines: Mapping[str, torch.Tensor],
    previous_rms: Mapping[str, float],
) -> tuple[dict[str, float], dict[str, torch.Tensor], dict[str, float]]:
    """Every stream read of a window (docs/metrics.md §1.6): ``solved`` (:func:`stream_reads`)
    with the reads that compare with the tracker's memory (``gain_baselines``, each point's
    ``previous_rms``), and the run-level summaries. Returns ``(keys, baselines, rms)``: the
    keys, the gain baselines this first read of a norm sets and each point's RMS to keep for
    the next read (the caller stores both). The first read after residual discovery also
    holds the window's ``init`` keys (``final_out_offset_share_init``...)."""
    out = dict(solved)
    baselines: dict[str, torch.Tensor] = {}
    read: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for norm in window.norms:
        gamma = window.gammas.get(norm.name)
        if not isinstance(gamma, torch.Tensor) or gamma.ndim != 1 or gamma.numel() == 0:
            continue
        base = gain_baselines.get(norm.name, baselines.get(norm.name))
        if base is None:  # set at attach; else by this first read
            base = baselines[norm.name] = gamma.detach().to(torch.float64).clone()
        if base.shape != gamma.shape:
            continue
        read.append((norm.name, gamma, base))
    drifts = gain_drifts([r[1] for r in read], [r[2] for r in read])  # one batch, one copy
    for (name, _, _), (scale, crossed) in zip(read, drifts):
        out[f"{name}/gamma_scale"] = scale
        out[f"{name}/gamma_crossed"] = crossed
    points = window.layout.points if window.layout is not None else ()
    kept: dict[str, float] = {}
    for point in points:
        rms = out.get(f"{point.name}/rms", math.nan)
        before = kept.get(point.name, previous_rms.get(point.name, math.nan))
        if before > 0:  # no previous read: no key (a NaN would say a read failed)
            out[f"{point.name}/rms_growth"] = rms / before
        if math.isfinite(rms):
            kept[point.name] = rms
    shares = [
        nonfinite_share(t.accumulator.rows_rejected, t.accumulator.count)
        for t in window.taps
        if t.failed is None and hasattr(t.accumulator, "rows_rejected")
    ]
    out["nonfinite_share"] = max(shares, default=0.0)

    def extreme(metric: str, pick: Any) -> float:
        found = [v for k, v in out.items() if k.endswith(f"/{metric}") and math.isfinite(v)]
        return pick(found) if found else math.nan

    out["offset_share_max"] = extreme("offset_share", max)
    if any(k.endswith("/rms_growth") for k in out):  # none at the first read
        out["rms_growth_max"] = extreme("rms_growth", max)
    out["gamma_scale_min"] = extreme("gamma_scale", min)
    out["gamma_scale_max"] = extreme("gamma_scale", max)
    out["gamma_crossed_max"] = extreme("gamma_crossed", max)
    if points:
        last = points[-1].name
        out["final_offset_share"] = out.get(f"{last}/offset_share", math.nan)
    final = window.layout.final_norm if window.layout is not None else None
    if final is not None:
        out["final_out_offset_share"] = out.get(f"{final}/out_offset_share", math.nan)
        if window.spectral:
            out["final_rankme"] = out.get(f"{final}/rankme", math.nan)
            out["final_rankme_centred"] = out.get(f"{final}/rankme_centred", math.nan)
    if window.init:  # the first read after discovery: the final norm before the first update
        out.update(window.init)
    return out, baselines, kept
