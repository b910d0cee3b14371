"""Fail-open: a monitor must never crash or stall training. A failure in one of its phases
(``begin``, ``end``, ``finish``) warns once, disables the monitor (hooks removed) and training
goes on; a disabled monitor only takes part in what its peers still expect of it (the one
handshake or vote of :class:`~normscope.engine.ranks.RankAgreement`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from normscope._common import ConfigurationError

__all__ = ["fail_open"]


def fail_open(phase: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a monitor's ``phase`` method: while disabled, or when it raises anything but a
    :class:`ConfigurationError`, the monitor keeps in step with its peers
    (``_keep_in_step(phase, *args)``) and the method returns the step's result (``end``) or
    None; a failure first disables the monitor (``_disable(reason)``: one warning)."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.disabled:
                self._keep_in_step(phase, *args)
                return self._result if phase == "end" else None
            try:
                return method(self, *args, **kwargs)
            except ConfigurationError:
                raise
            except Exception as err:  # noqa: BLE001 - fail-open is the contract
                self._disable(f"{method.__name__}: {type(err).__name__}: {err}")
                self._keep_in_step(phase, *args)
                return self._result if phase == "end" else None

        return guarded

    return wrap
