"""The checkpoint key's arguments: constructor arguments as texts stable across processes."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["stable_repr"]


#: constructor arguments left out of state_key (see MonitorCallback.state_key)
_UNKEYED = frozenset({"self", "every_n_steps", "layers", "verbose", "overhead_warn", "alerts"})
_PLAIN = (type(None), bool, int, float, str)


def stable_repr(value: Any) -> str:
    """A text of ``value`` that is the same in every process (no memory address): plain values
    by ``repr``; sequences and dicts item by item; functions, methods and classes by their
    qualified name; a tensor by shape and dtype; any other object by its class's qualified name
    and its public plain attributes (a rule's thresholds)."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(stable_repr(v) for v in value)
        return f"[{inner}]"  # a list and a tuple of the same items: one key
    if isinstance(value, dict):
        items = sorted((str(k), stable_repr(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}:{value.dtype}"
    qualname = getattr(value, "__qualname__", None)
    if isinstance(qualname, str):
        return f"{getattr(value, '__module__', None) or ''}.{qualname}".lstrip(".")
    cls = type(value)
    attrs = sorted(
        (k, v)
        for k, v in getattr(value, "__dict__", {}).items()
        if not k.startswith("_") and isinstance(v, _PLAIN)
    )
    inner = ", ".join(f"{k}={v!r}" for k, v in attrs)
    return f"{cls.__module__}.{cls.__qualname__}({inner})"
