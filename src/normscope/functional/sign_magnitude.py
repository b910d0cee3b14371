"""The sign–magnitude reads (METRICS.md §2): plain functions on tensors, float64 inside.

Parameter reads on a weight ``W`` (out x in): :func:`sign_alignment`, :func:`ternary_alignment`,
:func:`ternary_sparsity`, :func:`sign_churn`, bundled by :func:`weight_read`.
Outlier reads on a Linear layer's input second moments: :func:`outlier_amplitudes`.
Probe reads from a perturbation's effect ``dy`` on what a normaliser receives ``y``:
:func:`radial_fraction`, :func:`transverse_energy`, :func:`asymmetry_ratio`,
:func:`quant_transverse_rel`, bundled by :func:`probe_read`; the perturbations
:func:`flip_perturbation`, :func:`matched_magnitude_perturbation`,
:func:`binary_quantization_error`, :func:`ternary_quantization_error`; and the toy-model theory
:func:`asymmetry_theory`.

Log keys (``sm/<module path>/<metric>``): ``sign_alignment``, ``sign_alignment_rowwise``,
``ternary_alignment``, ``ternary_sparsity``, ``sign_churn`` (weights); ``max_leverage``,
``outlier_leverage`` (inputs); ``asymmetry_ratio``, ``radial_fraction_flip``,
``radial_fraction_magnitude``, ``radial_fraction_quant_binary``,
``radial_fraction_quant_ternary``, ``quant_transverse_rel`` (probes). Degenerate input (an
all-zero weight, no rows) gives NaN, never an exception; bad shapes raise ``ValueError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
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


def _matrix(w: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{name}: expected a weight matrix (out, in), got {shape}")
    return w.detach().to(torch.float64)


def _cos2(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float((a * a).sum() * (b * b).sum())
    return float((a * b).sum()) ** 2 / den if den > 0 else math.nan


# --------------------------------------------------------------------- parameter reads
def sign_alignment(w: torch.Tensor, *, rowwise: bool = False) -> float:
    """``cos^2(W, sign W) = (sum |w|)^2 / (numel * sum w^2)`` (Gaussian: ``2/pi``).

    ``rowwise=True``: the mean over rows of the same quantity, which equals the alignment of
    per-row absmean sign quantisation.

    Example::

        >>> round(sign_alignment(torch.ones(3, 4)), 6)
        1.0
    """
    w = _matrix(w, "sign_alignment")
    if w.numel() == 0:
        return math.nan
    if not rowwise:
        sq = float((w * w).sum())
        return float(w.abs().sum()) ** 2 / (w.numel() * sq) if sq > 0 else math.nan
    sq = (w * w).sum(dim=1)
    per_row = w.abs().sum(dim=1) ** 2 / (w.shape[1] * sq)
    per_row = per_row[sq > 0]
    return float(per_row.mean()) if per_row.numel() else math.nan


def ternary_quantize(w: torch.Tensor, eps: float = 1e-8) -> tuple[torch.Tensor, float]:
    """BitNet b1.58 absmean quantiser: ``s = mean|W|``, ``Q = clip(round(W / (s + eps)), -1, 1)``.

    Returns ``(Q, s)`` with ``Q`` in ``{-1, 0, 1}`` (float64) and ``s`` the scale; ``s * Q``
    approximates ``W``."""
    w = _matrix(w, "ternary_quantize")
    s = float(w.abs().mean()) if w.numel() else 0.0
    return torch.clamp(torch.round(w / (s + eps)), -1, 1), s


def binary_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmean binary quantiser: ``B = s_row * sign(W)``, ``s_row = mean_j |W_ij|``."""
    w = _matrix(w, "binary_quantize")
    s_row = w.abs().mean(dim=1, keepdim=True)
    return s_row * torch.sign(w), s_row.squeeze(1)


def ternary_alignment(w: torch.Tensor) -> float:
    """``cos^2(W, Q(W))`` with ``Q`` the absmean ternary quantiser (Gaussian: about 0.787)."""
    q, _ = ternary_quantize(w)
    return _cos2(_matrix(w, "ternary_alignment"), q)


def ternary_sparsity(w: torch.Tensor) -> float:
    """Share of zeros in ``Q(W)`` (Gaussian: about 0.31)."""
    q, _ = ternary_quantize(w)
    return float((q == 0).double().mean()) if q.numel() else math.nan


def sign_churn(prev_signs: torch.Tensor | None, w: torch.Tensor) -> float:
    """Share of entries whose sign changed since ``prev_signs`` (``torch.sign`` of the earlier
    weight). A change to or from an exact zero counts as a change; NaN without ``prev_signs``."""
    if prev_signs is None:
        return math.nan
    if tuple(prev_signs.shape) != tuple(w.shape):
        raise ValueError(
            f"sign_churn: previous signs have shape {tuple(prev_signs.shape)}, weight {tuple(w.shape)}"
        )
    if w.numel() == 0:
        return math.nan
    now = torch.sign(w.detach())
    return float((now != prev_signs.to(now.device, now.dtype)).double().mean())


@dataclass(frozen=True)
class WeightRead:
    """METRICS §2.1 on one weight."""

    sign_alignment: float
    sign_alignment_rowwise: float
    ternary_alignment: float
    ternary_sparsity: float
    sign_churn: float

    def as_dict(self) -> dict[str, float]:
        return {
            "sign_alignment": self.sign_alignment,
            "sign_alignment_rowwise": self.sign_alignment_rowwise,
            "ternary_alignment": self.ternary_alignment,
            "ternary_sparsity": self.ternary_sparsity,
            "sign_churn": self.sign_churn,
        }


def weight_read(w: torch.Tensor, prev_signs: torch.Tensor | None = None) -> WeightRead:
    """Every parameter read of ``W``; ``sign_churn`` against ``prev_signs`` (NaN without)."""
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
    """METRICS §2.2: ``alpha_j^2 = E[x_j^2] / E||x||^2`` over the ``n`` input channels."""

    max_leverage: float
    outlier_leverage: float
    top_channels: tuple[int, ...]  # largest alpha_j^2 first; not in as_dict

    def as_dict(self) -> dict[str, float]:
        return {"max_leverage": self.max_leverage, "outlier_leverage": self.outlier_leverage}


def outlier_amplitudes(
    second_moment_diagonal: torch.Tensor, *, top_fraction: float = 0.05, keep_top: int = 8
) -> OutlierRead:
    """Outlier leverage from the per-channel second moments ``E[x_j^2]`` (shape ``(n,)``).

    ``max_leverage = n max_j alpha_j^2`` (1 for delocalised inputs); ``outlier_leverage`` = the
    mean of ``n alpha_j^2`` over the top ``top_fraction`` of channels (at least one) divided by
    the mean over the rest.

    Example::

        >>> outlier_amplitudes(torch.ones(100)).max_leverage
        1.0
        >>> m = torch.ones(100); m[7] = 101.0          # channel 7 carries half the energy
        >>> outlier_amplitudes(m).max_leverage, outlier_amplitudes(m).top_channels[0]
        (50.5, 7)
    """
    m = second_moment_diagonal.detach().to(torch.float64).reshape(-1)
    n = m.numel()
    total = float(m.sum()) if n else 0.0
    if n == 0 or not math.isfinite(total) or total <= 0:
        return OutlierRead(math.nan, math.nan, ())
    lev = n * m / total
    order = torch.argsort(lev, descending=True)
    k = max(1, int(math.floor(top_fraction * n)))
    top, rest = lev[order[:k]], lev[order[k:]]
    ratio = float(top.mean() / rest.mean()) if rest.numel() and float(rest.mean()) > 0 else math.nan
    return OutlierRead(float(lev.max()), ratio, tuple(int(i) for i in order[:keep_top]))


# --------------------------------------------------------------------- perturbations
def flip_perturbation(
    w: torch.Tensor, p: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``dW`` negating each entry independently with probability ``p`` (``-2 W`` where flipped)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"flip_perturbation: p must be in [0, 1], got {p}")
    w = _matrix(w, "flip_perturbation")
    gen_device = generator.device if generator is not None else w.device
    mask = torch.rand(w.shape, generator=generator, device=gen_device, dtype=torch.float64) < p
    return torch.where(mask.to(w.device), -2.0 * w, torch.zeros_like(w))


def matched_magnitude_perturbation(w: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``delta * sign(W)``, one constant ``delta`` with ``||dW||_F = ||reference||_F``."""
    w = _matrix(w, "matched_magnitude_perturbation")
    s = torch.sign(w)
    norm_s = float(s.norm())
    if norm_s == 0:
        return torch.zeros_like(w)
    return s * (float(reference.detach().to(torch.float64).norm()) / norm_s)


def binary_quantization_error(w: torch.Tensor) -> torch.Tensor:
    """``B(W) - W`` for the per-row absmean binary quantiser."""
    b, _ = binary_quantize(w)
    return b - _matrix(w, "binary_quantization_error")


def ternary_quantization_error(w: torch.Tensor) -> torch.Tensor:
    """``s Q(W) - W`` for the absmean ternary quantiser."""
    q, s = ternary_quantize(w)
    return s * q - _matrix(w, "ternary_quantization_error")


# --------------------------------------------------------------------- probe reads
def _pair(y: torch.Tensor, dy: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if y.shape != dy.shape or y.ndim != 2:
        raise ValueError(
            f"{name}: y and dy must both be (N, d), got {tuple(y.shape)}, {tuple(dy.shape)}"
        )
    return y.detach().to(torch.float64), dy.detach().to(torch.float64)


def _radial_and_total(y: torch.Tensor, dy: torch.Tensor) -> tuple[float, float]:
    norms = y.norm(dim=1, keepdim=True)
    keep = norms.squeeze(1) > 0
    y_hat = y[keep] / norms[keep]
    radial = float(((y_hat * dy[keep]).sum(dim=1) ** 2).sum())
    return radial, float((dy[keep] ** 2).sum())


def radial_fraction(y: torch.Tensor, dy: torch.Tensor) -> float:
    """``sum <y_hat, dy>^2 / sum ||dy||^2``: the share of the change a normaliser removes."""
    radial, total = _radial_and_total(*_pair(y, dy, "radial_fraction"))
    return radial / total if total > 0 else math.nan


def transverse_energy(y: torch.Tensor, dy: torch.Tensor) -> float:
    """``sum ||dy||^2 - sum <y_hat, dy>^2``: the part of the change a normaliser passes on."""
    radial, total = _radial_and_total(*_pair(y, dy, "transverse_energy"))
    return total - radial


def asymmetry_ratio(y: torch.Tensor, dy_flip: torch.Tensor, dy_magnitude: torch.Tensor) -> float:
    """``transverse_energy(flip) / transverse_energy(magnitude)`` (toy theory: ``c(p)``)."""
    den = transverse_energy(y, dy_magnitude)
    return transverse_energy(y, dy_flip) / den if den > 0 else math.nan


def quant_transverse_rel(y: torch.Tensor, dy_ternary: torch.Tensor) -> float:
    """``transverse_energy(quant_ternary) / sum ||y||^2``: ternary readiness (smaller is better)."""
    y64, _ = _pair(y, dy_ternary, "quant_transverse_rel")
    signal = float((y64**2).sum())
    return transverse_energy(y, dy_ternary) / signal if signal > 0 else math.nan


def asymmetry_theory(p: float) -> float:
    """``c(p) = (1 - p) / (1 - 2/pi) * (1 - 4 sqrt(p) / (3 pi))``, tending to ``pi/(pi-2) = 2.752``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"asymmetry_theory: p must be in [0, 1], got {p}")
    return (1 - p) / (1 - 2 / math.pi) * (1 - 4 * math.sqrt(p) / (3 * math.pi))


@dataclass(frozen=True)
class ProbeRead:
    """METRICS §2.3 on one probed layer."""

    asymmetry_ratio: float
    radial_fraction_flip: float
    radial_fraction_magnitude: float
    radial_fraction_quant_binary: float
    radial_fraction_quant_ternary: float
    quant_transverse_rel: float

    def as_dict(self) -> dict[str, float]:
        return {
            "asymmetry_ratio": self.asymmetry_ratio,
            "radial_fraction_flip": self.radial_fraction_flip,
            "radial_fraction_magnitude": self.radial_fraction_magnitude,
            "radial_fraction_quant_binary": self.radial_fraction_quant_binary,
            "radial_fraction_quant_ternary": self.radial_fraction_quant_ternary,
            "quant_transverse_rel": self.quant_transverse_rel,
        }


def probe_read(y: torch.Tensor, dy_by_perturbation: dict[str, torch.Tensor]) -> ProbeRead:
    """Every probe read from the clean normaliser input ``y`` (N, d) and the changes ``dy`` of
    the perturbations ``"flip"``, ``"magnitude"``, ``"quant_binary"``, ``"quant_ternary"``
    (missing ones read NaN)."""
    d = dy_by_perturbation

    def rf(key: str) -> float:
        return radial_fraction(y, d[key]) if key in d else math.nan

    asym = (
        asymmetry_ratio(y, d["flip"], d["magnitude"])
        if "flip" in d and "magnitude" in d
        else math.nan
    )
    qtr = quant_transverse_rel(y, d["quant_ternary"]) if "quant_ternary" in d else math.nan
    return ProbeRead(
        asym, rf("flip"), rf("magnitude"), rf("quant_binary"), rf("quant_ternary"), qtr
    )
