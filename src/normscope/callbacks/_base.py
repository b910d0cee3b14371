"""What every normscope callback shares: the read schedule and the fail-open guard."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["MonitorCallback", "fail_open"]


def fail_open(method: Callable[..., Any]) -> Callable[..., Any]:
    """A monitor must never crash or stall training: on its own failure it warns once,
    removes its hooks, disables itself, and the fit goes on."""

    @functools.wraps(method)
    def guarded(self: MonitorCallback, *args: Any, **kwargs: Any) -> Any:
        if self.disabled:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - fail-open is the contract
            self._disable(f"{method.__name__}: {type(err).__name__}: {err}")
            return None

    return guarded


class MonitorCallback(Callback):
    """Schedule: the first optimiser step (the baseline) and every ``every_n_steps``-th one are
    sampled; all gradient-accumulation micro-batches of a sampled step share its window."""

    def __init__(self, every_n_steps: int) -> None:
        if (
            not isinstance(every_n_steps, int)
            or isinstance(every_n_steps, bool)
            or every_n_steps < 1
        ):
            raise MisconfigurationException(
                f"{type(self).__name__}: every_n_steps must be an int >= 1, got {every_n_steps!r}"
            )
        self.every_n_steps = every_n_steps
        self.disabled = False
        self.failure: str | None = None
        self._deferred = 0
        self._step_at_batch_start = -1

    def _in_window(self, step: int) -> bool:
        return step == 0 or (step + 1) % self.every_n_steps == 0 or self._deferred > 0

    def _publish(self, trainer: Trainer, metrics: dict[str, float], step: int) -> list[Any]:
        """Log a read to every logger and ``trainer.callback_metrics``, evaluate the rules,
        and deliver what fired to the sinks (rank zero). Returns the alerts that fired."""
        for lg in trainer.loggers:
            lg.log_metrics(metrics, step=step)
        device = trainer.strategy.root_device
        trainer.callback_metrics.update(
            {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in metrics.items()}
        )
        fired = [a for rule in self.rules for a in rule.evaluate(metrics, step)]
        self.alerts_fired.extend(fired)
        if trainer.is_global_zero:
            for alert in fired:
                for sink in self.sinks:
                    sink(alert, trainer)
        return fired

    def _detach(self) -> None:  # overridden: remove hooks
        return None

    def _disable(self, reason: str) -> None:
        self.disabled = True
        self.failure = reason
        self._detach()
        rank_zero_warn(
            f"normscope: {type(self).__name__} disabled itself after an internal error; training "
            f"continues without it ({reason})"
        )
