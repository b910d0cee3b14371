"""What every part of normscope shares: the error base class, the number formatter of every
table and message, and the one "this part is disabled" warning.

Example::

    >>> fmt(0.012345), fmt(float("nan")), fmt(None), fmt(3.0, ".2f")
    ('0.01235', 'nan', 'nan', '3.00')
    >>> fmt(float("inf")), fmt(float("inf"), finite=True)
    ('inf', 'nan')
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from typing import Any

__all__ = [
    "ConfigurationError",
    "NormscopeError",
    "disabled_message",
    "fmt",
    "fmt_bytes",
    "is_rank_zero",
    "read_share",
    "say",
    "setup_logger",
    "warn_disabled",
    "warn_rank_zero",
]

#: the package's logger: read lines, summaries, notes at INFO; alerts at WARNING
logger = logging.getLogger("normscope")


class NormscopeError(Exception):
    """The base of every error normscope raises on purpose (bad input, nothing to read).

    The concrete errors also derive from the built-in a caller would expect (``ValueError`` for
    a model without norm layers or a path that is no run), so ``except ValueError`` keeps
    working; ``except NormscopeError`` catches all of them.
    """


class ConfigurationError(NormscopeError, ValueError):
    """A monitor asked for something it cannot do (a bad argument, no norm layer, an unknown
    layer name, a strategy it cannot read): raised before training starts. The Lightning
    adapters raise it as Lightning's ``MisconfigurationException``."""


def is_rank_zero() -> bool:
    """Whether this process is rank zero of ``torch.distributed`` (True without it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True


def read_share() -> tuple[int, int]:
    """``(rank, world)`` of this process under ``torch.distributed``; ``(0, 1)`` alone: the
    share of a read's solves this process takes."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def setup_logger() -> None:
    """Make the ``normscope`` logger print INFO to stderr, unless the application configured
    logging itself (a handler on it or on the root logger)."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def say(message: str) -> None:
    """Tell a person something (a read line, a summary, a note), on rank zero: the ``normscope``
    logger at INFO, which prints to stderr unless the application configured it."""
    if not is_rank_zero():
        return
    setup_logger()
    logger.info(message)


def warn_rank_zero(message: str, stacklevel: int = 3) -> None:
    """``warnings.warn(message)`` (a ``UserWarning``) on rank zero only."""
    if is_rank_zero():
        warnings.warn(message, UserWarning, stacklevel=stacklevel)


def fmt(value: Any, spec: str = ".4g", *, finite: bool = False) -> str:
    """``value`` formatted with ``spec``; ``"nan"`` for None or NaN (a read that has no value),
    and with ``finite=True`` for +-Inf as well (``normscope report``'s tables)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    if finite and isinstance(value, float) and math.isinf(value):
        return "nan"
    return format(value, spec)


def fmt_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps one or more: ``fmt_bytes(3 << 20)``
    is ``'3.0 MiB'``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def disabled_message(what: str, reason: str, goes_on: str = "the other reads go on") -> str:
    """The one text of "this part failed and is off": ``what`` failed, for how long, what still
    runs (``goes_on``) and why (``reason``)."""
    return f"normscope: {what} failed and is disabled for the rest of the run; {goes_on} ({reason})"


def warn_disabled(
    what: str, reason: str, *, goes_on: str = "the other reads go on", stacklevel: int = 3
) -> None:
    """Warn (once per part: the caller remembers) that ``what`` failed with ``reason`` and is
    off for the rest of the run while everything else (``goes_on``) goes on.

    Example::

        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_disabled("the probe of 'h.0.fc'", "ValueError: width 3")
        >>> str(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
        "normscope: the probe of 'h.0.fc' failed and is disabled for the rest of the run; the
        other reads go on (ValueError: width 3)"
    """
    warnings.warn(
        disabled_message(what, reason, goes_on), RuntimeWarning, stacklevel=stacklevel + 1
    )
