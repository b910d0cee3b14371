"""Norm adapters: how a module becomes a :class:`~normscope.taps.norm_layer.NormLayer`.

Built in: ``nn.LayerNorm`` / ``nn.RMSNorm`` by class; any ``*LayerNorm`` / ``*RMSNorm`` class by
evidence (its own forward probed once against ``{layer, RMS} x {w, 1 + w}``; the class source
decides where the probe cannot run). User adapters (:func:`register_norm_adapter`) come first.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from normscope.taps.norm_layer import (
    KINDS,
    NormDiscoveryError,
    NormLayer,
    _no_tensor,
    bias_of,
    full_tensor_float64,
    weight_of,
)

__all__ = ["NormAdapter", "register_norm_adapter", "unregister_norm_adapter"]

_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "variance_eps", "layer_norm_eps")
_DIM_ATTRS = ("normalized_shape", "hidden_size", "dim", "d_model")
_DUCK_NAME = re.compile(r"layer_?norm|rms_?norm", re.IGNORECASE)
_ONE_PLUS_W = re.compile(r"\b1(\.0*)?\s*\+\s*self\.weight|self\.weight\s*\+\s*1(\.0*)?\b")
_CENTRES = re.compile(r"layer_norm\(|var_mean|\.var\(|-\s*[\w.]*mean\b|-\s*mu\b")
_NOT_TRANSFORMER_NORMS = (
    nn.modules.batchnorm._BatchNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)


class NormAdapter(NamedTuple):
    """One :func:`register_norm_adapter` registration (the arguments it was given)."""

    match: type | Callable[[nn.Module], bool]
    kind: str
    gamma: Callable[[nn.Module], torch.Tensor]
    beta: Callable[[nn.Module], torch.Tensor | None] | None
    eps: float | Callable[[nn.Module], float] | None
    dim: int | Callable[[nn.Module], int] | None


# The user's adapters, newest first.
USER_ADAPTERS: list[NormAdapter] = []


def register_norm_adapter(
    match: type | Callable[[nn.Module], bool],
    *,
    kind: str,
    gamma: Callable[[nn.Module], torch.Tensor],
    beta: Callable[[nn.Module], torch.Tensor | None] | None = None,
    eps: float | Callable[[nn.Module], float] | None = None,
    dim: int | Callable[[nn.Module], int] | None = None,
) -> None:
    """Teach :func:`find_norm_layers` a norm class it does not know.

    User adapters take precedence over the built-in ones; the newest registration wins.

    Args:
        match: a class (matched with ``isinstance``) or a predicate ``module -> bool``.
        kind: ``"layernorm"`` or ``"rmsnorm"``.
        gamma: ``module -> tensor``: the *effective* scale ``(d,)`` (resolve conventions such
            as ``1 + w`` here; any dtype, a DTensor is gathered).
        beta: ``module -> tensor or None``: the shift; default none.
        eps: a float or ``module -> float``; default the module's ``eps``-like attribute, or
            ``nan``.
        dim: an int or ``module -> int``; default the size of ``gamma(module)``.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from normscope.taps import find_norm_layers
        >>> class ScaleNorm(nn.Module):                 # y = g * x / ||x||, one scalar g
        ...     def __init__(self, d):
        ...         super().__init__()
        ...         self.d, self.g = d, nn.Parameter(torch.ones(()))
        >>> register_norm_adapter(ScaleNorm, kind="rmsnorm",
        ...                       gamma=lambda m: m.g.expand(m.d) * m.d**0.5)
        >>> find_norm_layers(nn.Sequential(ScaleNorm(4)))[0].kind
        'rmsnorm'
        >>> unregister_norm_adapter(ScaleNorm)
        True
    """
    if kind not in KINDS:
        raise ValueError(f"register_norm_adapter: kind must be one of {KINDS}, got {kind!r}")
    if not (isinstance(match, type) or callable(match)):
        raise TypeError(
            f"register_norm_adapter: match must be a class or a predicate, got {match!r}"
        )
    if not callable(gamma):
        raise TypeError(f"register_norm_adapter: gamma must be callable(module), got {gamma!r}")
    USER_ADAPTERS.insert(0, NormAdapter(match, kind, gamma, beta, eps, dim))


def unregister_norm_adapter(match: type | Callable[[nn.Module], bool]) -> bool:
    """Remove every adapter registered with ``match``; ``True`` if one was removed."""
    before = len(USER_ADAPTERS)
    USER_ADAPTERS[:] = [a for a in USER_ADAPTERS if a.match is not match]
    return len(USER_ADAPTERS) < before


def _matches(match: object, module: nn.Module) -> bool:
    return isinstance(module, match) if isinstance(match, type) else bool(match(module))


def _attr_eps(module: nn.Module) -> float | None:
    for attr in _EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _from_user_adapter(name: str, module: nn.Module, adapter: NormAdapter) -> NormLayer:
    _, kind, gamma, beta, eps, dim = adapter
    try:
        if dim is None:
            dim = full_tensor_float64(gamma(module)).numel()
        elif callable(dim):
            dim = dim(module)
        eps = eps(module) if callable(eps) else eps
    except Exception as exc:  # the user's callable: say which norm it failed on
        raise NormDiscoveryError(f"{name}: the registered norm adapter failed: {exc!r}") from exc
    eps = _attr_eps(module) if eps is None else float(eps)
    eps = math.nan if eps is None else eps
    beta = _no_tensor if beta is None else beta
    return NormLayer(name, module, kind, int(dim), eps, "custom", "adapter", gamma, beta)


def _from_torch_class(name: str, module: nn.Module) -> NormLayer | str:
    shape = tuple(module.normalized_shape)
    if len(shape) != 1:
        return f"normalises over {len(shape)} trailing dimensions {shape}; rows need one"
    kind = "layernorm" if isinstance(module, nn.LayerNorm) else "rmsnorm"
    eps = module.eps
    if eps is None:  # nn.RMSNorm(eps=None) uses finfo(input dtype).eps at run time
        w = weight_of(module)
        eps = torch.finfo(w.dtype if w is not None else torch.float32).eps
    convention = "w" if weight_of(module) is not None else "none"
    return NormLayer(name, module, kind, shape[0], float(eps), convention, "class")


def _probe_kind(module: nn.Module, dim: int, eps: float) -> tuple[str, str] | str | None:
    """Run the module's own forward on a probe batch.

    Returns ``(kind, convention)`` for a clear match, a reason string when the forward ran and
    matches none of the candidates, ``None`` when it could not run or was ambiguous.
    """
    w, b = weight_of(module), bias_of(module)
    ref = w if w is not None else b
    if ref is not None and (hasattr(ref, "full_tensor") or ref.is_meta):
        return None  # a shard or a meta tensor: the forward cannot run here
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else torch.float32
    device = ref.device if ref is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    # An offset of 0.75 makes centring matter: (x - mean)/std and x/rms differ by O(1).
    x = (torch.randn(8, dim, generator=gen, dtype=torch.float64) + 0.75).to(device, dtype)
    try:
        with torch.no_grad():
            y = type(module).forward(module, x)  # not module(x): no hook may fire
    except Exception:
        return None
    if isinstance(y, (tuple, list)):
        y = y[0]
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    y, x64 = y.double().cpu(), x.double().cpu()
    centred = x64 - x64.mean(-1, keepdim=True)
    z = {
        "layernorm": centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps),
        "rmsnorm": x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps),
    }
    shift = 0.0 if b is None else b.detach().double().cpu()
    scales = {"none": 1.0} if w is None else {"w": w.detach().double().cpu()}
    if w is not None:
        scales["1+w"] = 1.0 + scales["w"]
    errors = {}
    for kind, zk in z.items():
        for conv, g in scales.items():
            cand = zk * g + shift
            denom = max(y.norm().item(), cand.norm().item(), 1e-30)
            errors[(kind, conv)] = (y - cand).norm().item() / denom
    ranked = sorted(errors, key=errors.get)
    best, second = errors[ranked[0]], errors[ranked[1]] if len(ranked) > 1 else math.inf
    # A match is exact to the probe dtype's rounding; demand a clear winner over the runner-up.
    tol = max(1e-3, 4 * torch.finfo(dtype).eps)
    if best <= tol and second > 4 * best and second > tol:
        return ranked[0]
    if best > 10 * tol:
        scales_tried = "w or 1 + w" if w is not None else "none"
        return (
            f"its forward matches neither LayerNorm nor RMSNorm (scale {scales_tried}) "
            f"(closest relative error {best:.2g}); register one with register_norm_adapter(...)"
        )
    return None


def _from_source(module: nn.Module) -> tuple[str, str]:
    try:
        src = inspect.getsource(type(module))
    except (OSError, TypeError):
        src = ""
    name = type(module).__name__.lower()
    kind = "rmsnorm" if "rms" in name or not _CENTRES.search(src) else "layernorm"
    if weight_of(module) is None:
        return kind, "none"
    return kind, "1+w" if _ONE_PLUS_W.search(src) else "w"


def _from_duck_type(name: str, module: nn.Module) -> NormLayer | str:
    w = weight_of(module)
    if w is not None and (not isinstance(w, torch.Tensor) or w.dim() != 1):
        return f"its weight is not a 1-D tensor (shape {tuple(getattr(w, 'shape', ()))})"
    dim = w.shape[0] if w is not None else None
    for attr in _DIM_ATTRS if dim is None else ():
        value = getattr(module, attr, None)
        value = value[0] if isinstance(value, (tuple, list)) and len(value) == 1 else value
        if isinstance(value, int) and not isinstance(value, bool):
            dim = value
            break
    if dim is None:
        return (
            "no weight and no width attribute, so its width is unknown; "
            "pass register_norm_adapter(..., dim=...)"
        )
    eps = _attr_eps(module)
    probed = _probe_kind(module, dim, 1e-6 if eps is None else eps)
    if isinstance(probed, str):
        return probed
    if probed is not None:
        kind, convention = probed
        evidence = "probe"
    else:
        kind, convention = _from_source(module)
        evidence = "source"
    eps = math.nan if eps is None else eps
    return NormLayer(name, module, kind, int(dim), eps, convention, evidence)


def understand(name: str, module: nn.Module) -> NormLayer | str | None:
    """A NormLayer, a reason it is a norm we cannot read, or None (not a norm at all)."""
    for adapter in USER_ADAPTERS:
        if _matches(adapter.match, module):
            return _from_user_adapter(name, module, adapter)
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return _from_torch_class(name, module)
    cls = type(module).__name__
    if isinstance(module, _NOT_TRANSFORMER_NORMS):
        return (
            f"{cls} normalises over the batch or channel groups, not per row: "
            "not a transformer norm (ignored)"
        )
    if _DUCK_NAME.search(cls):
        return _from_duck_type(name, module)
    if "norm" in cls.lower():
        return f"no adapter understands {cls}; register one with register_norm_adapter(...)"
    return None
