"""What every part of normscope shares: the error base class, the number formatter of every
table and message, and the one "this part is disabled" warning.

Example::

    >>> fmt(0.012345), fmt(float("nan")), fmt(None), fmt(3.0, ".2f")
    ('0.01235', 'nan', 'nan', '3.00')
"""

from __future__ import annotations

import math
import warnings
from typing import Any

__all__ = ["NormscopeError", "fmt", "fmt_bytes", "warn_disabled"]


class NormscopeError(Exception):
    """The base of every error normscope raises on purpose (bad input, nothing to read).

    The concrete errors also derive from the built-in a caller would expect (``ValueError`` for
    a model without norm layers or a path that is no run), so ``except ValueError`` keeps
    working; ``except NormscopeError`` catches all of them.
    """


def fmt(value: Any, spec: str = ".4g") -> str:
    """``value`` formatted with ``spec``; ``"nan"`` for None or NaN (a read that has no value)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    return format(value, spec)


def fmt_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps one or more: ``fmt_bytes(3 << 20)``
    is ``'3.0 MiB'``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def warn_disabled(what: str, reason: str, *, stacklevel: int = 3) -> None:
    """Warn (once per part: the caller remembers) that ``what`` failed with ``reason`` and is
    off for the rest of the run while everything else goes on."""
    warnings.warn(
        f"normscope: {what} failed and is disabled for the rest of the run; the other reads go "
        f"on ({reason})",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )
