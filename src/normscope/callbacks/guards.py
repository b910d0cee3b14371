"""The fail-open guards: a monitor's failing hook or checkpoint state never breaks the fit."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

if TYPE_CHECKING:
    from normscope.callbacks._base import MonitorCallback

__all__ = ["fail_open"]


def fail_open(
    method: Callable[..., Any], *, reraise: tuple[type[BaseException], ...] = ()
) -> Callable[..., Any]:
    """A monitor must never crash or stall training: on its own failure it warns once,
    removes its hooks, disables itself, and the fit goes on. Exceptions of the ``reraise``
    types propagate (configuration errors at ``setup``)."""
    if getattr(method, "_normscope_guarded", False):
        return method

    @functools.wraps(method)
    def guarded(self: MonitorCallback, *args: Any, **kwargs: Any) -> Any:
        if args and type(args[0]).__name__ == "Fabric" and _is_fabric(args[0]):
            return _via_fabric(self, method.__name__, args, kwargs)  # Fabric(callbacks=[...])
        if self.disabled:
            self._keep_in_step(method.__name__, args)
            return None
        try:
            return method(self, *args, **kwargs)
        except reraise:
            raise
        except Exception as err:  # noqa: BLE001 - fail-open is the contract
            self._disable(f"{method.__name__}: {type(err).__name__}: {err}")
            self._keep_in_step(method.__name__, args)
            return None

    guarded._normscope_guarded = True  # type: ignore[attr-defined]
    return guarded


def _is_fabric(obj: Any) -> bool:
    from normscope.integrations.fabric import is_fabric

    return is_fabric(obj)


def _via_fabric(monitor: MonitorCallback, hook: str, args: tuple, kwargs: dict) -> Any:
    """A hook called by ``fabric.call`` with the ``Fabric`` as the trainer: routed through
    :mod:`normscope.integrations.fabric` (a loop view of the Fabric), fail-open like any hook."""
    from normscope.integrations.fabric import fabric_call

    try:
        return fabric_call(monitor, hook, args, kwargs)
    except MisconfigurationException:
        raise
    except Exception as err:  # noqa: BLE001 - fail-open is the contract
        if not monitor.disabled:
            monitor._disable(f"{hook} (Fabric): {type(err).__name__}: {err}")
        return None


def _guard_state(method: Callable[..., Any]) -> Callable[..., Any]:
    """``state_dict`` / ``load_state_dict`` that never break a checkpoint: on failure, one
    warning; no monitor state in the checkpoint, or a fresh monitor state on resume."""
    if getattr(method, "_normscope_guarded", False):
        return method
    saving = method.__name__ == "state_dict"

    @functools.wraps(method)
    def guarded(self: MonitorCallback, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as err:  # noqa: BLE001
            then = (
                "the checkpoint is saved without the monitor's state (a run resumed from it "
                "starts its baselines afresh)"
                if saving
                else "the monitor starts with a fresh state (baselines from the next read)"
            )
            self._warn_once(
                f"state:{method.__name__}",
                f"normscope: {self.label}.{method.__name__} failed; {then} "
                f"({type(err).__name__}: {err})",
            )
            return {} if saving else None

    guarded._normscope_guarded = True  # type: ignore[attr-defined]
    return guarded


# Every Lightning hook a monitor may define; each is guarded by fail_open.
_HOOKS = frozenset(n for n in dir(Callback) if n.startswith("on_")) | {"setup", "teardown"}
_STATE_HOOKS = frozenset({"state_dict", "load_state_dict"})
