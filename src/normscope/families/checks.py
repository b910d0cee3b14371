"""The option checks the families share: a family imports them from here, never from a sibling
family."""

from __future__ import annotations

from collections.abc import Iterable

from normscope._common import ConfigurationError

__all__ = ["check_layers"]


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
