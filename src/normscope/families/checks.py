"""Checks and key spellings the families share: a family imports them from here, never from a
sibling family."""

from __future__ import annotations

from collections.abc import Iterable

from normscope._common import ConfigurationError

__all__ = ["check_layers", "key_path"]

_COMPILE_WRAPPER = "_orig_mod"  # torch.compile's OptimizedModule holds the model under this name


def check_layers(
    layers: str | Iterable[str] | None, owner: str, what: str = "layers", none_ok: bool = False
) -> str | list[str] | None:
    """``"auto"`` or a list of module paths (a generator is read once; ``None`` too when
    ``none_ok``), else :class:`~normscope._common.ConfigurationError` naming ``owner`` and the
    argument ``what``.

    Example::

        >>> check_layers(("h.0.ln_1", "ln_f"), "DeadDirectionMonitor")
        ['h.0.ln_1', 'ln_f']
    """
    if layers is None and none_ok:
        return None
    paths = None if isinstance(layers, str) or not isinstance(layers, Iterable) else list(layers)
    if layers != "auto" and (paths is None or not all(isinstance(x, str) for x in paths)):
        allowed = (
            "'auto', a list of module paths or None"
            if none_ok
            else ("'auto' or a list of module paths")
        )
        raise ConfigurationError(f"{owner}: {what} must be {allowed}, got {layers!r}")
    return "auto" if paths is None else paths


def key_path(path: str) -> str:
    """A module path as metric keys spell it: without the ``_orig_mod`` segments that
    ``torch.compile(submodule)`` inserts, so a compiled run, an eager run and a scan log the
    same keys.

    Example::

        >>> key_path("model._orig_mod.h.0.ln_1")
        'model.h.0.ln_1'
        >>> key_path("_orig_mod.ln_f/sigma_min")
        'ln_f/sigma_min'
    """
    parts = path.split(".")
    if _COMPILE_WRAPPER not in parts:
        return path
    return ".".join(p for p in parts if p != _COMPILE_WRAPPER)
