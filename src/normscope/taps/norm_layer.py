"""The records of norm discovery: :class:`NormLayer` (one norm layer and how to read its
parameters in float64), :class:`UnrecognisedNorm`, :class:`NormDiscovery`, and the error."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from normscope._common import NormscopeError

__all__ = [
    "KINDS",
    "NormDiscovery",
    "NormDiscoveryError",
    "NormLayer",
    "UnrecognisedNorm",
    "full_tensor_float64",
]

KINDS = ("layernorm", "rmsnorm")


class NormDiscoveryError(NormscopeError, ValueError):
    """No usable norm layer, an unknown layer name, or an adapter that failed."""


def full_tensor_float64(t: torch.Tensor) -> torch.Tensor:
    """A detached float64 copy of ``t``, gathered in full first if it is a DTensor (FSDP2).

    FSDP2 (``fully_shard``) keeps parameters as DTensor shards outside the module's forward;
    ``full_tensor()`` all-gathers them, so under FSDP2 every rank must call this together.

    Example::

        >>> full_tensor_float64(torch.ones(3, dtype=torch.bfloat16)).dtype
        torch.float64
    """
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    with torch.no_grad():  # a copy made outside autograd is detached: one op, no detach()
        return t.to(dtype=torch.float64, copy=True)


def weight_of(module: nn.Module) -> torch.Tensor | None:
    return getattr(module, "weight", None)


def _no_tensor(module: nn.Module) -> None:
    return None


def bias_of(module: nn.Module) -> torch.Tensor | None:
    b = getattr(module, "bias", None)
    return b if isinstance(b, torch.Tensor) else None


@dataclass(frozen=True)
class NormLayer:
    """One normalisation layer and how to read its parameters.

    Args:
        name: the path ``model.named_modules()`` gives it (never ``""``: the root is no norm).
        module: the module itself.
        kind: ``"layernorm"`` (centres, then scales) or ``"rmsnorm"`` (scales only).
        dim: the normalised width ``d``.
        eps: the variance epsilon (``nan`` when the module does not expose one).
        convention: how ``gamma`` relates to the stored weight ``w``: ``"w"``, ``"1+w"``
            (Gemma 1/2/3), ``"none"`` (no affine scale: ``gamma`` is ones) or ``"custom"``
            (a user adapter's ``gamma`` callable).
        evidence: how kind and convention were decided: ``"class"`` (``nn.LayerNorm``,
            ``nn.RMSNorm``), ``"probe"`` (the module's forward on a probe batch), ``"source"``
            (its class source and name, where no probe could run) or ``"adapter"``.
        gamma_fn: ``module -> tensor or None``: the stored weight (``None``: no scale), or, for
            ``convention == "custom"``, the effective scale itself.
        beta_fn: ``module -> tensor or None``: the shift.

    Example::

        >>> from torch import nn
        >>> from normscope.taps import find_norm_layers
        >>> norm = find_norm_layers(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))[0]
        >>> norm.name, norm.kind, norm.dim
        ('1', 'layernorm', 4)
        >>> norm.gamma()
        tensor([1., 1., 1., 1.], dtype=torch.float64)
    """

    name: str
    module: nn.Module
    kind: str
    dim: int
    eps: float
    convention: str = "w"
    evidence: str = "class"
    gamma_fn: Callable[[nn.Module], torch.Tensor | None] = field(
        default=weight_of, repr=False, compare=False
    )
    beta_fn: Callable[[nn.Module], torch.Tensor | None] = field(
        default=bias_of, repr=False, compare=False
    )

    def gamma(self) -> torch.Tensor:
        """The effective scale, float64 ``(d,)``, a detached copy on the weight's device.

        Ones (on the CPU) when the norm has no affine scale. Gemma's ``1 + w`` is added in
        float64, after the cast, so a bf16 ``w`` loses nothing more than its own rounding.
        """
        raw = self.gamma_fn(self.module)
        if raw is None:
            return torch.ones(self.dim, dtype=torch.float64)
        g = full_tensor_float64(raw)
        g = g if g.ndim == 1 else g.reshape(-1)
        if self.convention == "1+w":
            g = 1.0 + g
        if g.shape != (self.dim,):
            raise NormDiscoveryError(
                f"{self.name}: gamma has shape {tuple(g.shape)}, expected ({self.dim},)"
            )
        return g

    def beta(self) -> torch.Tensor | None:
        """The shift, float64 ``(d,)`` detached copy, or ``None`` when the norm has none."""
        raw = self.beta_fn(self.module)
        return None if raw is None else full_tensor_float64(raw).reshape(-1)


@dataclass(frozen=True)
class UnrecognisedNorm:
    """A module whose class name says "Norm" but which no adapter understands."""

    name: str
    class_name: str
    reason: str


@dataclass(frozen=True)
class NormDiscovery:
    """What :func:`discover_norm_layers` found.

    Args:
        norms: the norm layers, in ``named_modules()`` order.
        unrecognised: "Norm"-named modules no adapter understands, with the reason.
        wrappers: "Norm"-named modules that only wrap recognised norms (e.g. a ``PreNorm``
            module holding an ``nn.LayerNorm``): the inner norms are used.
    """

    norms: tuple[NormLayer, ...]
    unrecognised: tuple[UnrecognisedNorm, ...] = ()
    wrappers: tuple[str, ...] = ()
