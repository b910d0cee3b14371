"""Reads of a tapped stream's own shape and scale, from what an accumulator already holds
(docs/metrics.md §1.6): the offset share, the RMS and its growth, the effective rank (RankMe),
the gain drift against a baseline gamma, the share of non-finite rows.

Every function is pure, works in float64 and returns a float (NaN where the rows cannot answer:
no rows, a non-finite moment). They take the accumulator's parts, not the accumulator: the
``mean`` ``mu`` (``(d,)``), the diagonal of the centred covariance ``C`` or the whole of it, and
the row count ``N`` (:class:`~normscope.functional.covariance.StreamingCovariance`'s ``mean``,
``covariance()``, ``count``).

:func:`stream_scales` and :func:`gain_drifts` are the same reads of many tensors at once (a
model's every residual point, every norm layer): one stacked computation and one copy to the
host per group of equal shapes, the same numbers as one call each (within float64 rounding:
a row of a stacked reduction may sum in another order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from normscope.functional.covariance import host_array
from normscope.functional.eigh import symmetric_eigvalsh
from normscope.functional.gamma import as_float64, gamma_vector, row_count, square_matrix

__all__ = [
    "effective_rank",
    "gain_drift",
    "gain_drifts",
    "nonfinite_share",
    "offset_share",
    "stream_rms",
    "stream_scales",
]

_NAN = math.nan


def _vector(x: torch.Tensor, where: str, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.ndim != 1 or x.numel() == 0 or x.is_complex():
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{where}: {what} must be a real non-empty 1-D tensor (d,), got {got}")
    return as_float64(x)


def _mean_and_variance(
    mean: torch.Tensor, variance: torch.Tensor, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked float64 ``(mu, per-channel variance)``; a ``(d, d)`` covariance gives its
    diagonal."""
    mu = _vector(mean, where, "mean")
    var = variance
    if isinstance(var, torch.Tensor) and var.ndim == 2:
        var = square_matrix(var, where, "variance").diagonal()
    var = _vector(var, where, "variance")
    if var.shape != mu.shape:
        raise ValueError(f"{where}: mean {tuple(mu.shape)} and variance {tuple(var.shape)} differ")
    return mu, var


def offset_share(mean: torch.Tensor, variance: torch.Tensor, n_rows: int) -> float:
    """``||mu||^2 / (||mu||^2 + tr C)``: the share of the mean squared row norm
    ``E||x||^2 = ||mu||^2 + tr C`` that is the mean row, one vector shared by every row.

    ``variance``: the diagonal of the centred covariance ``C`` (``(d,)``), or ``C`` itself.
    0 for rows centred on the origin, 1 when every row is the same vector. NaN without rows or
    with a non-finite moment (or ``E||x||^2 = 0``). With ``N`` rows ``tr C`` is read low by a
    factor ``(N - 1) / N`` (population covariance), so the share is read high by at most
    ``1 / N`` of the spread.

    Example::

        >>> offset_share(torch.tensor([3.0, 0.0]), torch.tensor([1.0, 0.0]), 8)
        0.9
        >>> offset_share(torch.zeros(2), torch.eye(2), 8)
        0.0
        >>> offset_share(torch.zeros(2), torch.zeros(2), 0)
        nan
    """
    where = "offset_share"
    mu, var = _mean_and_variance(mean, variance, where)
    if row_count(n_rows, where) == 0:
        return _NAN
    offset, spread = torch.stack([mu.square().sum(), var.sum()]).tolist()
    return _share(offset, spread)


def _share(offset: float, spread: float) -> float:
    """:func:`offset_share` from ``||mu||^2`` and ``tr C`` on the host."""
    total = offset + spread
    if not (math.isfinite(total) and total > 0):
        return _NAN
    return offset / total


def _rms(offset: float, spread: float, d: int) -> float:
    """:func:`stream_rms` from ``||mu||^2``, ``tr C`` and the width on the host."""
    total = offset + spread
    if not (math.isfinite(total) and total >= 0):
        return _NAN
    return math.sqrt(total / d)


def stream_rms(mean: torch.Tensor, variance: torch.Tensor, n_rows: int) -> float:
    """The rows' root mean square entry ``sqrt((||mu||^2 + tr C) / d)``: the stream's scale.

    The growth of a point's scale between two reads is the ratio of two of these (the second
    over the first). NaN without rows or with a non-finite moment.

    Example::

        >>> stream_rms(torch.tensor([1.0, 1.0]), torch.tensor([3.0, 3.0]), 8)
        2.0
        >>> stream_rms(torch.zeros(2), torch.ones(2), 0)
        nan
    """
    where = "stream_rms"
    mu, var = _mean_and_variance(mean, variance, where)
    if row_count(n_rows, where) == 0:
        return _NAN
    offset, spread = torch.stack([mu.square().sum(), var.sum()]).tolist()
    return _rms(offset, spread, mu.numel())


def _real_vector(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.ndim == 1 and x.numel() > 0 and not x.is_complex()


def stream_scales(
    means: Sequence[torch.Tensor], variances: Sequence[torch.Tensor], n_rows: Sequence[int]
) -> tuple[list[float], list[float]]:
    """:func:`offset_share` and :func:`stream_rms` of many streams at once: ``(shares, rms)``,
    one entry per ``(mean, variance diagonal, row count)``.

    The means and variances of each width are stacked and reduced together, and their sums
    reach the host in one copy per width (not two host syncs per stream). ``variances``: the
    diagonals of the centred covariances (``(d,)`` each; a ``(d, d)`` matrix gives its
    diagonal, as in :func:`offset_share`). Equal to one call of each per stream within float64
    rounding (a stacked reduction may sum a row in another order).

    Example::

        >>> stream_scales([torch.tensor([3.0, 0.0]), torch.zeros(2)],
        ...               [torch.tensor([1.0, 0.0]), torch.ones(2)], [8, 0])
        ([0.9, nan], [2.23606797749979, nan])
    """
    where = "stream_scales"
    if not len(means) == len(variances) == len(n_rows):
        raise ValueError(
            f"{where}: {len(means)} means, {len(variances)} variances and {len(n_rows)} row "
            "counts: one of each per stream"
        )
    mus, vars_ = [], []
    for mean, variance in zip(means, variances):
        if isinstance(variance, torch.Tensor) and variance.ndim == 2:
            variance = square_matrix(variance, where, "variance").diagonal()
        if not (_real_vector(mean) and _real_vector(variance)) or mean.shape != variance.shape:
            _mean_and_variance(mean, variance, where)  # raises the one-stream error
            raise ValueError(f"{where}: mean and variance must have the same shape")
        mus.append(mean)
        vars_.append(variance)
    counts = [row_count(n, where) for n in n_rows]
    shares, rms = [_NAN] * len(mus), [_NAN] * len(mus)
    keys = [(m.shape, m.dtype, m.device, v.dtype, v.device) for m, v in zip(mus, vars_)]
    for idx in _groups_by(keys).values():
        with torch.no_grad():  # no graph for the stacks (nothing here is differentiated)
            mu = torch.stack([mus[i] for i in idx]).to(torch.float64)
            var = torch.stack([vars_[i] for i in idx]).to(mu.device, torch.float64)
        host = torch.stack([mu.square().sum(dim=1), var.sum(dim=1)]).tolist()
        d = mu.shape[1]
        for j, i in enumerate(idx):
            if counts[i] == 0:
                continue
            shares[i] = _share(host[0][j], host[1][j])
            rms[i] = _rms(host[0][j], host[1][j], d)
    return shares, rms


def _groups_by(keys: Sequence[tuple]) -> dict[tuple, list[int]]:
    """Indices by key: the entries that stack together (same shape, dtype, device)."""
    out: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return out


def effective_rank(moment: torch.Tensor, n_rows: int) -> float:
    """RankMe (Garrido et al. 2023): ``exp(-sum_k p_k log p_k)`` with ``p_k = s_k / sum s``,
    ``s_k`` the singular values of the ``N x d`` row matrix, here ``sqrt(N lambda_k)`` from the
    eigenvalues ``lambda_k`` of its second moment ``moment`` (``(d, d)``; ``N`` cancels).

    Between 1 (every row on one line) and ``min(N, d)`` (a flat spectrum). Pass the uncentred
    second moment ``S = C + mu mu^T`` for RankMe as published (a shared offset counts as a
    direction), or the covariance ``C`` for the rank of the spread about the mean (at most
    ``N - 1``). Eigenvalues under ``1e-10 lambda_max`` count as 0: float64 does not resolve
    them (a LayerNorm output's kernel direction reads about ``1e-15 lambda_max``), and their
    square roots would make the read depend on the order of the sums. Caveat: with few rows per dimension the sample spectrum is spread wider than the
    true one (Marchenko-Pastur), which reads the rank low; read it at ``N >= 4 d``.
    NaN under 2 rows or with a non-finite moment.

    Example::

        >>> effective_rank(torch.eye(4), 100)
        4.0
        >>> round(effective_rank(torch.diag(torch.tensor([1.0, 1e-8])), 100), 5)
        1.00102
        >>> effective_rank(torch.diag(torch.tensor([1.0, 1e-12])), 100)  # under 1e-10: 0
        1.0
        >>> effective_rank(torch.eye(4), 1)
        nan
    """
    where = "effective_rank"
    m = square_matrix(moment, where, "moment")
    if row_count(n_rows, where) < 2 or not bool(torch.isfinite(m).all()):
        return _NAN
    # the spectrum on the host in one copy; the rest is O(d) there
    lam = np.maximum(host_array(symmetric_eigvalsh(m)), 0.0)
    lam = np.where(lam < 1e-10 * lam.max(), 0.0, lam)
    s = np.sqrt(lam)
    total = float(s.sum())
    if not (math.isfinite(total) and total > 0):
        return _NAN
    p = s / total
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum()))


def gain_drift(gamma: torch.Tensor, baseline: torch.Tensor) -> tuple[float, float]:
    """A norm layer's gain against a baseline read of it: ``(scale, crossed)``.

    ``scale`` is ``median |gamma| / median |gamma_0|`` (the lower median of an even count, as
    ``torch.median``; 1: unchanged; a uniform weight decay
    of the gains takes it towards 0; NaN when the baseline's median is 0 or either is
    non-finite). ``crossed`` is the share of the channels whose gain changed sign since the
    baseline (channels with a zero or non-finite gain in either read count as not crossed; NaN
    when none is left). Parameters only: no rows, no row-count caveat.

    Example::

        >>> gain_drift(torch.tensor([0.5, -1.0, 1.5, 2.0]), torch.tensor([1.0, 2.0, 3.0, 4.0]))
        (0.5, 0.25)
        >>> gain_drift(torch.ones(3), torch.zeros(3))
        (nan, nan)
    """
    where = "gain_drift"
    g = gamma_vector(gamma, where)
    g0 = gamma_vector(baseline, where)
    if g.shape != g0.shape:
        raise ValueError(f"{where}: gamma {tuple(g.shape)} and baseline {tuple(g0.shape)} differ")
    return _drifts(g[None], g0.to(g.device)[None])[0]


def gain_drifts(
    gammas: Sequence[torch.Tensor], baselines: Sequence[torch.Tensor]
) -> list[tuple[float, float]]:
    """:func:`gain_drift` of many norm layers at once, one ``(scale, crossed)`` per pair:
    gains of the same shape, dtype and device are stacked, read together and copied to the
    host in one transfer (medians are selections and the counts integers: the same numbers
    as one call each).

    Example::

        >>> gain_drifts([torch.tensor([0.5, -1.0, 1.5, 2.0]), torch.ones(3)],
        ...             [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.zeros(3)])
        [(0.5, 0.25), (nan, nan)]
    """
    where = "gain_drifts"
    if len(gammas) != len(baselines):
        raise ValueError(f"{where}: {len(gammas)} gammas and {len(baselines)} baselines")
    for g, g0 in zip(gammas, baselines):
        if not (_real_vector(g) and _real_vector(g0)):
            gamma_vector(g, where), gamma_vector(g0, where)  # raises the one-layer error
        if g.shape != g0.shape:
            raise ValueError(
                f"{where}: gamma {tuple(g.shape)} and baseline {tuple(g0.shape)} differ"
            )
    out: list[tuple[float, float]] = [(_NAN, _NAN)] * len(gammas)
    keys = [(g.shape, g.dtype, g.device, g0.dtype, g0.device) for g, g0 in zip(gammas, baselines)]
    for idx in _groups_by(keys).values():
        with torch.no_grad():  # gains are parameters: no graph for the stack
            g = torch.stack([gammas[i] for i in idx]).to(torch.float64)
            g0 = torch.stack([baselines[i] for i in idx]).to(g.device, torch.float64)
        for i, drift in zip(idx, _drifts(g, g0)):
            out[i] = drift
    return out


def _drifts(g: torch.Tensor, g0: torch.Tensor) -> list[tuple[float, float]]:
    """Rows of :func:`gain_drift` from float64 ``(k, d)`` gains and baselines (same device):
    one copy to the host."""
    live = torch.isfinite(g) & torch.isfinite(g0) & (g0 != 0) & (g != 0)
    crossed = (g.sign() != g0.sign()) & live
    host = torch.stack(
        [
            g0.abs().median(dim=1).values,
            g.abs().median(dim=1).values,
            live.sum(dim=1).to(torch.float64),
            crossed.sum(dim=1).to(torch.float64),
        ]
    ).tolist()
    out = []
    for base, now, n_live, n_crossed in zip(*host):
        scale = now / base if math.isfinite(now) and math.isfinite(base) and base > 0 else _NAN
        n = int(n_live)
        out.append((scale, float(n_crossed) / n if n else _NAN))
    return out


def nonfinite_share(rejected: int, n_rows: int) -> float:
    """The share of a window's rows that held NaN or Inf: ``rejected / (rejected + N)``, with
    ``N`` the finite rows kept (0 for a window without rows).

    Rows are subsampled before they are tested, so this is a share of the sampled rows.

    Example::

        >>> nonfinite_share(32, 480)
        0.0625
        >>> nonfinite_share(0, 0)
        0.0
    """
    rejected = row_count(rejected, "nonfinite_share")
    n = row_count(n_rows, "nonfinite_share")
    return rejected / (rejected + n) if rejected + n else 0.0
