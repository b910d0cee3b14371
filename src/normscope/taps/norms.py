"""Finding a model's normalisation layers and reading their effective scale (docs/metrics.md §1.1).

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

import warnings
from collections.abc import Sequence

from torch import nn

from normscope.taps.norm_adapters import (
    USER_ADAPTERS,
    NormAdapter,
    register_norm_adapter,
    understand,
    unregister_norm_adapter,
)
from normscope.taps.norm_layer import (
    KINDS,
    NormDiscovery,
    NormDiscoveryError,
    NormLayer,
    UnrecognisedNorm,
    full_tensor_float64,
)

__all__ = [
    "KINDS",
    "NormAdapter",
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
        found = understand(name, module)
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
    if USER_ADAPTERS:
        looked += f", {len(USER_ADAPTERS)} registered adapter(s)"
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
