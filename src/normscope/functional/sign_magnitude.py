"""The sign–magnitude reads (docs/metrics.md §2): plain functions on tensors, float64 inside.

**Parameter reads** on a weight ``W`` (out x in), bundled by :func:`weight_read`:
:func:`sign_alignment` ``cos^2(W, sign W)`` (whole matrix and row by row),
:func:`ternary_alignment` ``cos^2(W, Q(W))`` and :func:`ternary_sparsity` for the BitNet b1.58
absmean quantiser :func:`ternary_quantize`, and :func:`sign_churn` since an earlier read.
The quantisers :func:`ternary_quantize` and :func:`binary_quantize` and their errors
:func:`ternary_quantization_error` and :func:`binary_quantization_error` (two of the probe
perturbations) live here too.

**Outlier reads** on a Linear layer's input: :func:`outlier_amplitudes` from the per-channel
second moments ``E[x_j^2]``.

**Probe reads** (the perturbations' effect at the next normaliser, :func:`probe_read`) are in
:mod:`normscope.functional.perturbation` and re-exported here.

Log keys ``sm/<module path>/<key>``, the ``as_dict`` keys of the read classes:

- :class:`WeightRead`: ``sign_alignment``, ``sign_alignment_rowwise``, ``ternary_alignment``,
  ``ternary_sparsity``, ``sign_churn``;
- :class:`OutlierRead`: ``max_leverage``, ``outlier_leverage``;
- :class:`~normscope.functional.perturbation.ProbeRead`: ``asymmetry_ratio``,
  ``radial_fraction_flip``, ``radial_fraction_magnitude``, ``radial_fraction_quant_binary``,
  ``radial_fraction_quant_ternary``, ``quant_transverse_rel``.

Degenerate input (an all-zero weight, an empty one, no rows) reads NaN and never raises; a wrong
shape raises ``ValueError`` naming the shape expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from normscope.functional.perturbation import (
    PERTURBATIONS,
    ProbeRead,
    as_matrix,
    asymmetry_ratio,
    asymmetry_theory,
    flip_perturbation,
    matched_magnitude_perturbation,
    probe_read,
    quant_transverse_rel,
    radial_fraction,
    transverse_energy,
)

__all__ = [
    "PERTURBATIONS",
    "OutlierRead",
    "ProbeRead",
    "WeightRead",
    "asymmetry_ratio",
    "asymmetry_theory",
    "binary_quantization_error",
    "binary_quantize",
    "flip_perturbation",
    "matched_magnitude_perturbation",
    "outlier_amplitudes",
    "probe_read",
    "quant_transverse_rel",
    "radial_fraction",
    "sign_alignment",
    "sign_churn",
    "ternary_alignment",
    "ternary_quantization_error",
    "ternary_quantize",
    "ternary_sparsity",
    "transverse_energy",
    "weight_read",
]


def _cos2(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(a.square().sum() * b.square().sum())
    return float((a * b).sum()) ** 2 / den if den > 0 else math.nan


# --------------------------------------------------------------------- quantisers
def ternary_quantize(w: torch.Tensor, eps: float = 1e-8) -> tuple[torch.Tensor, float]:
    """BitNet b1.58 absmean quantiser: ``s = mean|W|``, ``Q = clip(round(W / (s + eps)), -1, 1)``.

    Args:
        w: the weight ``(out, in)``.
        eps: keeps the division finite for an all-zero ``W``.

    Returns:
        ``(Q, s)``: ``Q`` in ``{-1, 0, 1}`` (float64, ``w``'s shape and device) and the scale
        ``s`` (0 for an empty ``W``); ``s * Q`` approximates ``W``. ``torch.round`` rounds half
        to even, as numpy does, so an entry at exactly ``s / 2`` maps to 0.

    Example::

        >>> q, s = ternary_quantize(torch.tensor([[0.25, -2.0], [0.75, 1.0]]))
        >>> q, s
        (tensor([[ 0., -1.],
                [ 1.,  1.]], dtype=torch.float64), 1.0)
    """
    w = as_matrix(w, "ternary_quantize")
    s = float(w.abs().mean()) if w.numel() else 0.0
    return torch.clamp(torch.round(w / (s + eps)), -1, 1), s


def binary_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmean sign quantiser: ``B = s_row * sign(W)``, ``s_row = mean_j |W_ij|``.

    ``s_row`` is the least-squares scale of ``sign(W)`` in each row, so the error ``B - W`` is
    orthogonal to ``B`` row by row and ``cos^2(W_i, B_i)`` is the row's sign alignment.

    Args:
        w: the weight ``(out, in)``.

    Returns:
        ``(B, s_row)``: ``B`` float64 of ``w``'s shape, ``s_row`` of shape ``(out,)``.

    Example::

        >>> b, s_row = binary_quantize(torch.tensor([[1.0, -3.0], [0.5, 0.5]]))
        >>> b
        tensor([[ 2.0000, -2.0000],
                [ 0.5000,  0.5000]], dtype=torch.float64)
        >>> s_row
        tensor([2.0000, 0.5000], dtype=torch.float64)
    """
    w = as_matrix(w, "binary_quantize")
    s_row = w.abs().mean(dim=1, keepdim=True)
    return s_row * torch.sign(w), s_row.squeeze(1)


def binary_quantization_error(w: torch.Tensor) -> torch.Tensor:
    """The ``quant_binary`` perturbation ``B(W) - W`` (:func:`binary_quantize`).

    Args:
        w: the weight ``(out, in)``.

    Returns:
        ``dW`` float64 of ``w``'s shape: adding it to ``W`` gives the binarised weight.

    Example::

        >>> binary_quantization_error(torch.tensor([[1.0, -3.0]]))
        tensor([[1., 1.]], dtype=torch.float64)
    """
    b, _ = binary_quantize(w)
    return b - as_matrix(w, "binary_quantization_error")


def ternary_quantization_error(w: torch.Tensor) -> torch.Tensor:
    """The ``quant_ternary`` perturbation ``s Q(W) - W`` (:func:`ternary_quantize`).

    Args:
        w: the weight ``(out, in)``.

    Returns:
        ``dW`` float64 of ``w``'s shape: adding it to ``W`` gives the ternarised weight.

    Example::

        >>> ternary_quantization_error(torch.tensor([[0.25, -2.0], [0.75, 1.0]]))
        tensor([[-0.2500,  1.0000],
                [ 0.2500,  0.0000]], dtype=torch.float64)
    """
    q, s = ternary_quantize(w)
    return s * q - as_matrix(w, "ternary_quantization_error")


# --------------------------------------------------------------------- parameter reads
def sign_alignment(w: torch.Tensor, *, rowwise: bool = False) -> float:
    """``cos^2(W, sign W) = (sum |w|)^2 / (numel * sum w^2)``: how much of ``W``'s direction its
    signs carry (i.i.d. Gaussian: ``2/pi = 0.6366``, the Bussgang constant).

    Args:
        w: the weight ``(out, in)``.
        rowwise: the mean over rows of the same quantity instead, which is the alignment of
            per-row absmean sign quantisation (:func:`binary_quantize`). All-zero rows are left
            out of the mean.

    Returns:
        A number in ``(0, 1]``; NaN for an empty or all-zero ``W``.

    Example::

        >>> sign_alignment(torch.ones(3, 4))
        1.0
        >>> sign_alignment(torch.tensor([[1.0, 3.0], [2.0, 2.0]]), rowwise=True)
        0.9
    """
    w = as_matrix(w, "sign_alignment")
    if w.numel() == 0:
        return math.nan
    if not rowwise:
        sq = float(w.square().sum())
        return float(w.abs().sum()) ** 2 / (w.numel() * sq) if sq > 0 else math.nan
    sq = w.square().sum(dim=1)
    per_row = (w.abs().sum(dim=1) ** 2 / (w.shape[1] * sq))[sq > 0]
    return float(per_row.mean()) if per_row.numel() else math.nan


def ternary_alignment(w: torch.Tensor) -> float:
    """``cos^2(W, Q(W))``, ``Q`` the absmean ternary quantiser (i.i.d. Gaussian: 0.787).

    Args:
        w: the weight ``(out, in)``.

    Returns:
        A number in ``[0, 1]``; NaN for an empty or all-zero ``W``.

    Example::

        >>> round(ternary_alignment(torch.tensor([[0.25, -2.0], [0.75, 1.0]])), 4)
        0.8333
    """
    q, _ = ternary_quantize(w)
    return _cos2(as_matrix(w, "ternary_alignment"), q)


def ternary_sparsity(w: torch.Tensor) -> float:
    """The share of zeros in ``Q(W)`` (i.i.d. Gaussian: ``P(|w| < mean|w| / 2) = 0.31``).

    Args:
        w: the weight ``(out, in)``.

    Returns:
        A number in ``[0, 1]`` (an all-zero ``W`` gives 1); NaN for an empty ``W``.

    Example::

        >>> ternary_sparsity(torch.tensor([[0.25, -2.0], [0.75, 1.0]]))
        0.25
    """
    q, _ = ternary_quantize(w)
    return float((q == 0).double().mean()) if q.numel() else math.nan


def sign_churn(prev_signs: torch.Tensor | None, w: torch.Tensor) -> float:
    """The share of entries whose sign changed since an earlier read.

    Zeros count as a sign of their own: an entry that moves to or from an exact 0 has changed
    (``torch.sign`` gives -1, 0 or 1 and the three are compared as they are). Exact zeros are
    rare in a float weight, common in a pruned or ternary one, where leaving 0 is a change.

    Args:
        prev_signs: ``torch.sign`` of the earlier weight, any dtype (int8 saves memory), or
            ``None`` when there is no earlier read.
        w: the weight now, of the same shape.

    Returns:
        A number in ``[0, 1]``; NaN without ``prev_signs`` or for an empty ``W``.

    Example::

        >>> prev = torch.sign(torch.tensor([[1.0, -1.0], [0.0, 2.0]])).to(torch.int8)
        >>> sign_churn(prev, torch.tensor([[1.0, 1.0], [0.5, 2.0]]))   # -1 -> 1 and 0 -> 1
        0.5
    """
    if prev_signs is None:
        return math.nan
    if not isinstance(prev_signs, torch.Tensor) or tuple(prev_signs.shape) != tuple(w.shape):
        got = tuple(prev_signs.shape) if isinstance(prev_signs, torch.Tensor) else prev_signs
        raise ValueError(
            f"sign_churn: previous signs must be a tensor of the weight's shape {tuple(w.shape)}, "
            f"got {got}"
        )
    if w.numel() == 0:
        return math.nan
    now = torch.sign(w.detach())
    return float((now != prev_signs.to(now.device, now.dtype)).double().mean())


@dataclass(frozen=True)
class WeightRead:
    """docs/metrics.md §2.1 on one weight: the reads of :func:`weight_read`."""

    sign_alignment: float
    sign_alignment_rowwise: float
    ternary_alignment: float
    ternary_sparsity: float
    sign_churn: float

    def as_dict(self) -> dict[str, float]:
        """The reads keyed by their metric names (the last part of the log key)."""
        return {
            "sign_alignment": self.sign_alignment,
            "sign_alignment_rowwise": self.sign_alignment_rowwise,
            "ternary_alignment": self.ternary_alignment,
            "ternary_sparsity": self.ternary_sparsity,
            "sign_churn": self.sign_churn,
        }


def weight_read(w: torch.Tensor, prev_signs: torch.Tensor | None = None) -> WeightRead:
    """Every parameter read of ``W`` (docs/metrics.md §2.1).

    Args:
        w: the weight ``(out, in)``.
        prev_signs: ``torch.sign`` of the weight at the previous read, for ``sign_churn``.

    Returns:
        A :class:`WeightRead`; ``sign_churn`` is NaN without ``prev_signs``.

    Example::

        >>> read = weight_read(torch.ones(2, 2))
        >>> read.sign_alignment, read.ternary_sparsity, read.sign_churn
        (1.0, 0.0, nan)
    """
    return WeightRead(
        sign_alignment(w),
        sign_alignment(w, rowwise=True),
        ternary_alignment(w),
        ternary_sparsity(w),
        sign_churn(prev_signs, w),
    )


# --------------------------------------------------------------------- outlier reads
@dataclass(frozen=True)
class OutlierRead:
    """docs/metrics.md §2.2 on one Linear layer's input: the reads of :func:`outlier_amplitudes`.

    ``top_channels`` holds the indices of the largest ``alpha_j^2``, largest first, for reports;
    it is not a metric and not in :meth:`as_dict`.
    """

    max_leverage: float
    outlier_leverage: float
    top_channels: tuple[int, ...]

    def as_dict(self) -> dict[str, float]:
        """The reads keyed by their metric names (the last part of the log key)."""
        return {"max_leverage": self.max_leverage, "outlier_leverage": self.outlier_leverage}


def outlier_amplitudes(
    second_moment_diagonal: torch.Tensor, *, top_fraction: float = 0.05, keep_top: int = 8
) -> OutlierRead:
    """Outlier leverage of a layer's ``n`` input channels from their second moments.

    ``alpha_j^2 = E[x_j^2] / E||x||^2`` (summing to 1; delocalised inputs give ``1/n`` each). A
    sign flip in input column ``j`` costs about ``n alpha_j^2`` times a delocalised entry's flip.

    Args:
        second_moment_diagonal: ``E[x_j^2]`` per channel, shape ``(n,)`` (any common scale: a
            sum of squares works as well as a mean).
        top_fraction: the share of channels counted as outliers (at least one), in ``(0, 1)``.
        keep_top: how many channel indices to keep in ``top_channels``.

    Returns:
        An :class:`OutlierRead`: ``max_leverage = n max_j alpha_j^2`` (1 when delocalised) and
        ``outlier_leverage`` = the mean of ``n alpha_j^2`` over the top channels divided by the
        mean over the rest (``inf`` when the rest carry nothing, NaN when there is no rest). All
        NaN when ``n = 0`` or the moments hold a negative, NaN or Inf entry or sum to 0.

    Example::

        >>> outlier_amplitudes(torch.ones(100)).max_leverage
        1.0
        >>> m = torch.ones(100); m[7] = 101.0          # channel 7 carries half the energy
        >>> read = outlier_amplitudes(m)
        >>> read.max_leverage, read.outlier_leverage, read.top_channels[:2]
        (50.5, 21.0, (7, 0))
    """
    m = second_moment_diagonal
    if not isinstance(m, torch.Tensor) or m.ndim != 1:
        shape = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
        raise ValueError(
            f"outlier_amplitudes: expected the per-channel second moments E[x_j^2] of shape (n,), "
            f"got {shape}"
        )
    if not 0.0 < top_fraction < 1.0:
        raise ValueError(f"outlier_amplitudes: top_fraction must be in (0, 1), got {top_fraction}")
    m = m.detach().to(torch.float64)
    n = m.numel()
    total = float(m.sum()) if n else 0.0
    if n == 0 or not math.isfinite(total) or total <= 0 or bool((m < 0).any()):
        return OutlierRead(math.nan, math.nan, ())
    lev = n * m / total  # n alpha_j^2
    # stable: equal moments keep channel order, so reports do not reshuffle between reads
    order = torch.argsort(lev, descending=True, stable=True)
    k = max(1, int(math.floor(top_fraction * n)))
    top, rest = lev[order[:k]], lev[order[k:]]
    if rest.numel() == 0:
        ratio = math.nan
    else:
        rest_mean = float(rest.mean())
        ratio = float(top.mean()) / rest_mean if rest_mean > 0 else math.inf
    return OutlierRead(float(lev.max()), ratio, tuple(int(i) for i in order[:keep_top]))
