"""Finding a model's normalisation layers and reading their effective scale (METRICS.md §1.1).

A norm layer is described by a :class:`NormLayer`: its path, kind (``"layernorm"`` centres
then scales, ``"rmsnorm"`` only scales), width ``d``, ``eps`` and how to read its effective
scale ``gamma`` and shift ``beta`` in float64. Adapters turn modules into ``NormLayer``\\ s:

* ``nn.LayerNorm`` and ``nn.RMSNorm``, by class;
* any class whose name contains ``LayerNorm`` or ``RMSNorm`` (``LlamaRMSNorm``,
  ``T5LayerNorm``, ``GemmaRMSNorm``, ...), by **evidence**: the module's own ``forward`` (called
  directly, so no hook fires) is run once on a fixed probe batch and its output compared with
  the four candidates ``{layer, RMS} x {w, 1 + w}``. That is how ``T5LayerNorm`` comes out an
  RMS norm despite its name, and why Gemma 1/2/3 (and Qwen3-Next, RecurrentGemma, ...) read
  ``gamma = 1 + w`` while Gemma 4's ``Gemma4RMSNorm`` reads ``gamma = w``, without a list of
  class names. Where the probe cannot run (FSDP2 shards, meta tensors) or cannot tell the
  candidates apart, the class source and name decide, and ``NormLayer.evidence`` says so;
* user adapters (:func:`register_norm_adapter`), which take precedence over the built-ins.

Any other module whose class name contains "Norm" (``BatchNorm1d``, ``GroupNorm``, a custom
``WeirdNorm``...) is *reported*, never silently skipped: :func:`discover_norm_layers` returns
it in ``NormDiscovery.unrecognised`` and :func:`find_norm_layers` warns once, naming every
path and class.
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "NormDiscovery",
    "NormDiscoveryError",
    "NormLayer",
    "UnrecognisedNorm",
    "discover_norm_layers",
    "find_norm_layers",
    "full_tensor_float64",
    "register_norm_adapter",
    "unregister_norm_adapter",
]

KINDS = ("layernorm", "rmsnorm")
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


class NormDiscoveryError(ValueError):
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
    return t.detach().to(dtype=torch.float64, copy=True)


def _weight(module: nn.Module) -> torch.Tensor | None:
    return getattr(module, "weight", None)


def _no_tensor(module: nn.Module) -> None:
    return None


def _bias(module: nn.Module) -> torch.Tensor | None:
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
        default=_weight, repr=False, compare=False
    )
    beta_fn: Callable[[nn.Module], torch.Tensor | None] = field(
        default=_bias, repr=False, compare=False
    )

    def gamma(self) -> torch.Tensor:
        """The effective scale, float64 ``(d,)``, a detached copy on the weight's device.

        Ones (on the CPU) when the norm has no affine scale. Gemma's ``1 + w`` is added in
        float64, after the cast, so a bf16 ``w`` loses nothing more than its own rounding.
        """
        raw = self.gamma_fn(self.module)
        if raw is None:
            return torch.ones(self.dim, dtype=torch.float64)
        g = full_tensor_float64(raw).reshape(-1)
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


# A user adapter: (match, kind, gamma, beta, eps, dim), newest first.
_USER_ADAPTERS: list[tuple[object, str, Callable, Callable | None, object, object]] = []


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
    _USER_ADAPTERS.insert(0, (match, kind, gamma, beta, eps, dim))


def unregister_norm_adapter(match: type | Callable[[nn.Module], bool]) -> bool:
    """Remove every adapter registered with ``match``; ``True`` if one was removed."""
    before = len(_USER_ADAPTERS)
    _USER_ADAPTERS[:] = [a for a in _USER_ADAPTERS if a[0] is not match]
    return len(_USER_ADAPTERS) < before


def _matches(match: object, module: nn.Module) -> bool:
    return isinstance(module, match) if isinstance(match, type) else bool(match(module))


def _attr_eps(module: nn.Module) -> float | None:
    for attr in _EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _from_user_adapter(name: str, module: nn.Module, adapter: tuple) -> NormLayer:
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
        w = _weight(module)
        eps = torch.finfo(w.dtype if w is not None else torch.float32).eps
    convention = "w" if _weight(module) is not None else "none"
    return NormLayer(name, module, kind, shape[0], float(eps), convention, "class")


def _probe_kind(module: nn.Module, dim: int, eps: float) -> tuple[str, str] | str | None:
    """Run the module's own forward on a probe batch.

    Returns ``(kind, convention)`` for a clear match, a reason string when the forward ran and
    matches none of the candidates, ``None`` when it could not run or was ambiguous.
    """
    w, b = _weight(module), _bias(module)
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
    if _weight(module) is None:
        return kind, "none"
    return kind, "1+w" if _ONE_PLUS_W.search(src) else "w"


def _from_duck_type(name: str, module: nn.Module) -> NormLayer | str:
    w = _weight(module)
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


def _understand(name: str, module: nn.Module) -> NormLayer | str | None:
    """A NormLayer, a reason it is a norm we cannot read, or None (not a norm at all)."""
    for adapter in _USER_ADAPTERS:
        if _matches(adapter[0], module):
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


def discover_norm_layers(
    model: nn.Module, layers: str | Sequence[str] = "auto", *, warn: bool = True
) -> NormDiscovery:
    """Find the norm layers of ``model`` and everything that looks like one but is not read.

    Args:
        model: any ``nn.Module``; the root itself is never a norm.
        layers: ``"auto"`` for every norm found, or the exact paths to keep (a single path
            may be given as a string).
        warn: in ``"auto"`` mode, ``warnings.warn`` once listing every unrecognised "Norm"
            module by path and class.

    Returns:
        A :class:`NormDiscovery`: the norms (``named_modules()`` order), the unrecognised
        "Norm" modules with reasons, and the wrappers.

    Raises:
        NormDiscoveryError: no norm found, or a name in ``layers`` that is not a norm (the
            message lists the available ones).

    Example::

        >>> from torch import nn
        >>> model = nn.Sequential(nn.LayerNorm(4), nn.BatchNorm1d(4))
        >>> found = discover_norm_layers(model, warn=False)
        >>> [n.name for n in found.norms], [u.class_name for u in found.unrecognised]
        (['0'], ['BatchNorm1d'])
    """
    norms: list[NormLayer] = []
    pending: list[tuple[str, nn.Module, str]] = []
    for name, module in model.named_modules():
        if name == "":
            continue
        found = _understand(name, module)
        if isinstance(found, NormLayer):
            norms.append(found)
        elif isinstance(found, str):
            pending.append((name, module, found))
    known = {id(n.module) for n in norms}
    unrecognised, wrappers = [], []
    for name, module, reason in pending:
        if any(id(m) in known for m in module.modules() if m is not module):
            wrappers.append(name)
        else:
            unrecognised.append(UnrecognisedNorm(name, type(module).__name__, reason))
    if not norms:
        raise NormDiscoveryError(_no_norm_message(model, unrecognised))
    if not (isinstance(layers, str) and layers == "auto"):
        norms = _select(model, norms, unrecognised, [layers] if isinstance(layers, str) else layers)
    elif warn and unrecognised:
        groups: dict[tuple[str, str], list[str]] = {}
        for u in unrecognised:
            groups.setdefault((u.class_name, u.reason), []).append(u.name)
        listing = "; ".join(f"{', '.join(p)} ({c}): {r}" for (c, r), p in groups.items())
        warnings.warn(
            f"normscope: {len(unrecognised)} module(s) of {type(model).__name__} look like norms "
            f"but are not read: {listing}",
            stacklevel=3,
        )
    return NormDiscovery(tuple(norms), tuple(unrecognised), tuple(wrappers))


def _no_norm_message(model: nn.Module, unrecognised: list[UnrecognisedNorm]) -> str:
    looked = "LayerNorm, RMSNorm, *RMSNorm, *LayerNorm"
    if _USER_ADAPTERS:
        looked += f", {len(_USER_ADAPTERS)} registered adapter(s)"
    msg = f"no normalisation layer found in {type(model).__name__} (looked for {looked})"
    if unrecognised:
        msg += "; not understood: " + ", ".join(f"{u.name} ({u.class_name})" for u in unrecognised)
    return msg + "; pass layers=[...] or register_norm_adapter(...)"


def _select(
    model: nn.Module,
    norms: list[NormLayer],
    unrecognised: list[UnrecognisedNorm],
    names: Sequence[str],
) -> list[NormLayer]:
    by_name = {n.name: n for n in norms}
    odd = {u.name: u for u in unrecognised}
    for name in names:
        if name in odd:
            raise NormDiscoveryError(
                f"layer {name!r} is a {odd[name].class_name}: {odd[name].reason}"
            )
        if name not in by_name:
            raise NormDiscoveryError(
                f"layer {name!r} is not a norm layer of {type(model).__name__}; "
                f"available norm layers: {', '.join(by_name)}"
            )
    wanted = set(names)
    return [n for n in norms if n.name in wanted]


def find_norm_layers(model: nn.Module, layers: str | Sequence[str] = "auto") -> list[NormLayer]:
    """The norm layers of ``model`` (see :func:`discover_norm_layers` for the full result).

    In ``"auto"`` mode, modules whose class name contains "Norm" but which no adapter
    understands (``BatchNorm``, ``GroupNorm``, a custom class...) are listed in one warning;
    call :func:`discover_norm_layers` to get them as data.

    Args:
        model: any ``nn.Module``.
        layers: ``"auto"`` (every norm) or the exact paths to keep.

    Returns:
        The :class:`NormLayer` list, in ``named_modules()`` order.

    Raises:
        NormDiscoveryError: no norm found, or an unknown name in ``layers``.

    Example::

        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.RMSNorm(4))
        >>> [(n.name, n.kind) for n in find_norm_layers(m)]
        [('1', 'layernorm'), ('2', 'rmsnorm')]
        >>> try:
        ...     find_norm_layers(m, layers=["5"])
        ... except NormDiscoveryError as err:
        ...     print(err)
        layer '5' is not a norm layer of Sequential; available norm layers: 1, 2
    """
    return list(discover_norm_layers(model, layers).norms)
