"""Module paths as metric keys spell them: the same keys for a compiled run, an eager run and a
post hoc scan of one model."""

from __future__ import annotations

__all__ = ["key_path"]

_COMPILE_WRAPPER = "_orig_mod"  # torch.compile's OptimizedModule holds the model under this name


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
