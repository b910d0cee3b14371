"""Weight perturbations and what a normaliser does with their effect (docs/metrics.md §2.3).

A probe perturbs a weight ``W`` whose output reaches a normaliser, and compares ``y``, the clean
``(N, d)`` rows the normaliser receives, with ``y + dy``, what it receives with the perturbed
weight (an exact finite difference, not a derivative). An RMSNorm's Frechet derivative is
``(sqrt(d) / ||y||)(I - y_hat y_hat^T)`` times the gain: it removes the **radial** part of
``dy`` (along ``y_hat = y / ||y||``) and passes the **transverse** part on. So:

- :func:`radial_fraction` ``= sum <y_hat, dy>^2 / sum ||dy||^2``, the share the norm absorbs;
- :func:`transverse_energy` ``= sum ||dy||^2 - sum <y_hat, dy>^2``, what it passes on;
- :func:`asymmetry_ratio` ``= transverse_energy(flip) / transverse_energy(magnitude)``, with the
  toy-model theory :func:`asymmetry_theory` ``c(p)``;
- :func:`quant_transverse_rel` ``= transverse_energy(quant_ternary) / sum ||y||^2``.

Rows with ``||y|| = 0`` have no direction: they are left out of every sum. The perturbations
are :func:`flip_perturbation` (seeded by a ``torch.Generator``) and
:func:`matched_magnitude_perturbation`; the quantisation errors live beside their quantisers in
:mod:`normscope.functional.sign_magnitude`. :func:`probe_read` bundles the reads as a
:class:`ProbeRead`, whose :meth:`~ProbeRead.as_dict` keys are the log keys
``sm/<module path>/<key>``: ``asymmetry_ratio``, ``radial_fraction_flip``,
``radial_fraction_magnitude``, ``radial_fraction_quant_binary``,
``radial_fraction_quant_ternary``, ``quant_transverse_rel``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "PERTURBATIONS",
    "ProbeRead",
    "asymmetry_ratio",
    "asymmetry_theory",
    "flip_perturbation",
    "matched_magnitude_perturbation",
    "probe_read",
    "quant_transverse_rel",
    "radial_fraction",
    "transverse_energy",
]

PERTURBATIONS = ("flip", "magnitude", "quant_binary", "quant_ternary")
"""The perturbation names :func:`probe_read` accepts (docs/metrics.md §2.3)."""


def as_matrix(w: torch.Tensor, name: str) -> torch.Tensor:
    """``w`` detached as a float64 ``(out, in)`` matrix; ``ValueError`` for any other shape."""
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{name}: expected a weight matrix (out, in), got {shape}")
    return w.detach().to(torch.float64)


# --------------------------------------------------------------------- perturbations
def flip_perturbation(
    w: torch.Tensor, p: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The ``flip(p)`` perturbation: each entry of ``W`` negated independently with probability p.

    Args:
        w: the weight ``(out, in)``.
        p: the flip probability, in ``[0, 1]``.
        generator: draws the flip mask (one uniform per entry, row-major, on the generator's
            device); the same seed gives the same mask. ``None`` uses torch's global generator.

    Returns:
        ``dW`` (float64, on ``w``'s device): ``-2 W`` on flipped entries, 0 elsewhere, so that
        ``W + dW`` is ``W`` with those signs flipped.

    Example::

        >>> w = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
        >>> flip_perturbation(w, 1.0, torch.Generator().manual_seed(0))
        tensor([[-2.,  4.],
                [-6., -8.]], dtype=torch.float64)
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"flip_perturbation: p must be in [0, 1], got {p}")
    w = as_matrix(w, "flip_perturbation")
    gen_device = generator.device if generator is not None else w.device
    mask = torch.rand(w.shape, generator=generator, device=gen_device, dtype=torch.float64) < p
    return torch.where(mask.to(w.device), -2.0 * w, torch.zeros_like(w))


def matched_magnitude_perturbation(w: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The ``magnitude`` perturbation: ``delta * sign(W)``, sign-preserving, norm-matched.

    Args:
        w: the weight ``(out, in)``.
        reference: the perturbation to match (usually the flip's ``dW``); only its Frobenius norm
            is used.

    Returns:
        ``dW = delta * sign(W)`` (float64) with the one constant ``delta >= 0`` that makes
        ``||dW||_F = ||reference||_F``. Entries with ``W = 0`` get 0 (``sign 0 = 0``); an all-zero
        ``W`` gives an all-zero ``dW``.

    Example::

        >>> w = torch.tensor([[0.5, -2.0], [3.0, 0.0]])
        >>> matched_magnitude_perturbation(w, torch.tensor([3.0, 4.0]))   # ||ref|| = 5, 3 signs
        tensor([[ 2.8868, -2.8868],
                [ 2.8868,  0.0000]], dtype=torch.float64)
    """
    w = as_matrix(w, "matched_magnitude_perturbation")
    s = torch.sign(w)
    norm_s = float(s.norm())
    if norm_s == 0:
        return torch.zeros_like(w)
    return s * (float(reference.detach().to(torch.float64).norm()) / norm_s)


# --------------------------------------------------------------------- probe reads
def _pair(y: torch.Tensor, dy: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    ok = isinstance(y, torch.Tensor) and isinstance(dy, torch.Tensor)
    if not ok or y.shape != dy.shape or y.ndim != 2:
        shapes = [
            tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (y, dy)
        ]
        raise ValueError(
            f"{name}: y and dy must both be (N, d) tensors, got {shapes[0]}, {shapes[1]}"
        )
    return y.detach().to(torch.float64), dy.detach().to(torch.float64)


def _radial_transverse(y: torch.Tensor, dy: torch.Tensor) -> tuple[float, float]:
    """``(sum <y_hat, dy>^2, sum ||dy - <y_hat, dy> y_hat||^2)`` over rows with ``||y|| > 0``;
    NaNs when there is no such row."""
    norms = y.norm(dim=1, keepdim=True)
    keep = norms.squeeze(1) > 0
    if not bool(keep.any()):
        return math.nan, math.nan
    y_hat, d = y[keep] / norms[keep], dy[keep]
    along = (y_hat * d).sum(dim=1, keepdim=True)
    # The transverse part is projected out explicitly rather than taken as total - radial: for a
    # nearly radial dy (the magnitude perturbation in a linear layer) the subtraction cancels.
    return float(along.square().sum()), float((d - along * y_hat).square().sum())


def radial_fraction(y: torch.Tensor, dy: torch.Tensor) -> float:
    """``sum <y_hat, dy>^2 / sum ||dy||^2``: the share of the change a normaliser absorbs.

    Args:
        y: the clean rows the normaliser receives, ``(N, d)``.
        dy: the change a perturbation makes in them, ``(N, d)``.

    Returns:
        A number in ``[0, 1]``; NaN when ``dy`` is 0 or no row of ``y`` is non-zero.

    Example::

        >>> y = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
        >>> radial_fraction(y, torch.tensor([[3.0, 4.0], [0.0, 0.0]]))   # 9 of 25 is radial
        0.36
    """
    radial, transverse = _radial_transverse(*_pair(y, dy, "radial_fraction"))
    total = radial + transverse
    return radial / total if total > 0 else math.nan


def transverse_energy(y: torch.Tensor, dy: torch.Tensor) -> float:
    """``sum ||dy||^2 - sum <y_hat, dy>^2``: the part of the change a normaliser passes on.

    Args:
        y: the clean rows the normaliser receives, ``(N, d)``.
        dy: the change a perturbation makes in them, ``(N, d)``.

    Returns:
        The summed squared transverse component (``>= 0``, in units of ``y`` squared); NaN when
        no row of ``y`` is non-zero.

    Example::

        >>> y = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
        >>> transverse_energy(y, torch.tensor([[3.0, 4.0], [1.0, 5.0]]))   # 4^2 + 1^2
        17.0
    """
    return _radial_transverse(*_pair(y, dy, "transverse_energy"))[1]


def asymmetry_ratio(y: torch.Tensor, dy_flip: torch.Tensor, dy_magnitude: torch.Tensor) -> float:
    """``transverse_energy(flip) / transverse_energy(magnitude)``, the sign-magnitude asymmetry.

    Args:
        y: the clean rows the normaliser receives, ``(N, d)``.
        dy_flip: the change made by :func:`flip_perturbation`, ``(N, d)``.
        dy_magnitude: the change made by the norm-matched
            :func:`matched_magnitude_perturbation`, ``(N, d)``.

    Returns:
        The ratio; the toy-model theory is :func:`asymmetry_theory` ``(p)``. NaN when the
        magnitude change has no transverse energy.

    Example::

        >>> y = torch.tensor([[1.0, 0.0]])
        >>> asymmetry_ratio(y, torch.tensor([[0.0, 3.0]]), torch.tensor([[2.0, 1.0]]))
        9.0
    """
    den = transverse_energy(y, dy_magnitude)
    return transverse_energy(y, dy_flip) / den if den > 0 else math.nan


def quant_transverse_rel(y: torch.Tensor, dy_ternary: torch.Tensor) -> float:
    """``transverse_energy(quant_ternary) / sum ||y||^2``: live "ternary readiness".

    The share of the signal that ternarising the layer would push across the normaliser
    (smaller is better).

    Args:
        y: the clean rows the normaliser receives, ``(N, d)``.
        dy_ternary: the change made by the ternary quantisation error ``s Q(W) - W``.

    Returns:
        The relative transverse energy; NaN when ``y`` is all zero.

    Example::

        >>> y = torch.tensor([[2.0, 0.0]])
        >>> quant_transverse_rel(y, torch.tensor([[-1.0, 1.0]]))   # 1^2 / 2^2
        0.25
    """
    y64, _ = _pair(y, dy_ternary, "quant_transverse_rel")
    signal = float(y64.square().sum())
    return transverse_energy(y, dy_ternary) / signal if signal > 0 else math.nan


def asymmetry_theory(p: float) -> float:
    """The toy-model asymmetry ``c(p) = (1 - p) / (1 - 2/pi) * (1 - 4 sqrt(p) / (3 pi))``.

    For ``RMSNorm(W2 ReLU(W1 x))`` with i.i.d. Gaussian weights and delocalised inputs: the flip
    keeps ``1 - p`` of its energy transverse, the magnitude perturbation ``1 - 2/pi``; the last
    factor is the ReLU saturation of the flip. It tends to ``pi / (pi - 2) = 2.752`` as
    ``p -> 0``. It treats the magnitude perturbation in linear response, so finite-``p``
    measurements sit above it (``benchmarks/RESULTS.md``: +1.5% at ``p = 0.01``).

    Args:
        p: the flip probability, in ``[0, 1]``.

    Returns:
        ``c(p)``.

    Example::

        >>> round(asymmetry_theory(0.0), 4), round(asymmetry_theory(0.01), 4)
        (2.7519, 2.6088)
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"asymmetry_theory: p must be in [0, 1], got {p}")
    return (1 - p) / (1 - 2 / math.pi) * (1 - 4 * math.sqrt(p) / (3 * math.pi))


@dataclass(frozen=True)
class ProbeRead:
    """docs/metrics.md §2.3 on one probed layer: the reads of :func:`probe_read` (NaN where the
    perturbation needed was not run)."""

    asymmetry_ratio: float
    radial_fraction_flip: float
    radial_fraction_magnitude: float
    radial_fraction_quant_binary: float
    radial_fraction_quant_ternary: float
    quant_transverse_rel: float

    def as_dict(self) -> dict[str, float]:
        """The reads keyed by their metric names (the last part of the log key)."""
        return {
            "asymmetry_ratio": self.asymmetry_ratio,
            "radial_fraction_flip": self.radial_fraction_flip,
            "radial_fraction_magnitude": self.radial_fraction_magnitude,
            "radial_fraction_quant_binary": self.radial_fraction_quant_binary,
            "radial_fraction_quant_ternary": self.radial_fraction_quant_ternary,
            "quant_transverse_rel": self.quant_transverse_rel,
        }


def probe_read(y: torch.Tensor, dy_by_perturbation: dict[str, torch.Tensor]) -> ProbeRead:
    """Every probe read of one layer from the clean normaliser input and the perturbations' changes.

    Args:
        y: the clean rows the normaliser receives, ``(N, d)``.
        dy_by_perturbation: the change ``dy`` (``(N, d)``) each perturbation made, keyed by its
            name in :data:`PERTURBATIONS`: ``"flip"``, ``"magnitude"``, ``"quant_binary"``,
            ``"quant_ternary"``. Missing ones make their reads NaN; other names raise.

    Returns:
        A :class:`ProbeRead`: ``radial_fraction_<name>`` of each perturbation,
        ``asymmetry_ratio`` (needs ``flip`` and ``magnitude``) and ``quant_transverse_rel``
        (needs ``quant_ternary``).

    Example::

        >>> y = torch.tensor([[1.0, 0.0]])
        >>> read = probe_read(y, {"flip": torch.tensor([[0.0, 3.0]]),
        ...                       "magnitude": torch.tensor([[2.0, 1.0]])})
        >>> read.asymmetry_ratio, read.radial_fraction_magnitude, read.quant_transverse_rel
        (9.0, 0.8, nan)
    """
    d = dy_by_perturbation
    unknown = sorted(set(d) - set(PERTURBATIONS))
    if unknown:
        raise ValueError(f"probe_read: unknown perturbations {unknown}; accepted: {PERTURBATIONS}")

    def rf(key: str) -> float:
        return radial_fraction(y, d[key]) if key in d else math.nan

    has_pair = "flip" in d and "magnitude" in d
    asym = asymmetry_ratio(y, d["flip"], d["magnitude"]) if has_pair else math.nan
    qtr = quant_transverse_rel(y, d["quant_ternary"]) if "quant_ternary" in d else math.nan
    return ProbeRead(
        asym, rf("flip"), rf("magnitude"), rf("quant_binary"), rf("quant_ternary"), qtr
    )
