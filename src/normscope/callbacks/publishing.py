"""Publishing a read: loggers, ``callback_metrics``, the alert rules and the sinks."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from normscope._common import disabled_message
from normscope.callbacks.wandb_extras import define_summaries
from normscope.integrations.layers import select_layers
from normscope.monitors.names import named_key, named_metrics

__all__ = ["Publishing"]


def _sink_name(sink: Any) -> str:
    fn = getattr(sink, "fn", None)
    if fn is not None:
        return getattr(fn, "__qualname__", None) or repr(fn)
    return type(sink).__name__


class Publishing:
    """The publishing half of :class:`~normscope.callbacks._base.MonitorCallback` (a mixin it
    inherits): what a read logs and alerts, and the duplicate-name warning."""

    # Supplied by MonitorCallback and its subclasses.
    name: str | None
    label: str
    log_per_layer: str | int
    keep_last: int
    rules: list[Any]
    sinks: list[Any]
    alerts_fired: list[Any]
    _skipped_loggers: set[int]
    _failed_rules: set[int]
    _warn_once: Any

    def _check_names(self, trainer: Trainer) -> None:
        """Warn (once, from the first of them) when another monitor of this class in the
        Trainer has the same name: both would log the same keys, their rows interleaved."""
        same = [
            cb
            for cb in getattr(trainer, "callbacks", [])
            if type(cb) is type(self) and getattr(cb, "name", None) == self.name
        ]
        if len(same) > 1 and same[0] is self:
            family = named_key(
                "dd/" if "DeadDirection" in type(self).__name__ else "sm/", self.name
            )
            rank_zero_warn(
                f"normscope: {len(same)} {self.label}s in this Trainer log the same keys "
                f"({family}...), their reads interleaved; give each its own "
                f"name=... (keys dd[name]/...)"
            )

    def _publish(self, trainer: Trainer, metrics: dict[str, float], step: int) -> list[Any]:
        """Log a read to every logger and ``trainer.callback_metrics``, evaluate the rules,
        and deliver what fired to the sinks (rank zero). Returns the alerts that fired.

        A logger, rule or sink that raises is warned about once and left out from then on
        (loggers: for this monitor's metrics only); the others, and the monitor, go on."""
        monitor = self.label
        # Loggers and callback_metrics get the keys under the monitor's name (dd[name]/...);
        # the rules see the canonical dd/ keys. log_per_layer ranks the canonical keys.
        logged = named_metrics(select_layers(metrics, self.log_per_layer), self.name)
        for lg in trainer.loggers:
            if id(lg) in self._skipped_loggers:
                continue
            try:
                define_summaries(lg, logged)  # W&B: run-level minima summarise as minima
            except Exception as err:  # noqa: BLE001 - the summaries only
                self._warn_once("summaries", f"normscope: W&B define_metric failed ({err})")
            try:
                lg.log_metrics(logged, step=step)
            except Exception as err:  # noqa: BLE001 - that logger only
                self._skipped_loggers.add(id(lg))
                self._warn_once(
                    f"logger:{id(lg)}",
                    f"normscope: logger {type(lg).__name__} failed to log {monitor}'s metrics "
                    f"and is skipped for them from now on; its other metrics and the other "
                    f"loggers are not affected ({type(err).__name__}: {err})",
                )
        device = trainer.strategy.root_device
        trainer.callback_metrics.update(
            {
                k: torch.tensor(v, dtype=torch.float32, device=device)
                for k, v in named_metrics(metrics, self.name).items()
            }
        )
        fired: list[Any] = []
        for rule in self.rules:
            if id(rule) in self._failed_rules:
                continue
            try:
                fired.extend(rule.evaluate(metrics, step))
            except Exception as err:  # noqa: BLE001 - that rule only
                self._failed_rules.add(id(rule))
                self._warn_once(
                    f"rule:{id(rule)}",
                    disabled_message(
                        f"alert rule {getattr(rule, 'name', type(rule).__name__)!r}",
                        f"{type(err).__name__}: {err}",
                        goes_on=f"{monitor} and its other rules go on",
                    ),
                )
        fired = [self._own_alert(a) for a in fired]
        self.alerts_fired.extend(fired)
        self._keep_bounded()
        if trainer.is_global_zero:
            for alert in fired:
                for sink in list(self.sinks):
                    try:
                        sink(alert, trainer)
                    except Exception as err:  # noqa: BLE001 - that sink only
                        self.sinks.remove(sink)
                        self._warn_once(
                            f"sink:{id(sink)}",
                            f"normscope: alert sink {_sink_name(sink)} failed and is removed; "
                            f"{monitor} and its other sinks go on ({type(err).__name__}: {err})",
                        )
        return fired

    def _own_alert(self, alert: Any) -> Any:
        """An alert as this monitor reports it: ``monitor`` set; with a name, its key is the
        logged one (``dd[name]/...``) and its message starts with ``DeadDirectionMonitor[name]:``."""
        if not dataclasses.is_dataclass(alert) or not hasattr(alert, "monitor"):
            return alert
        if self.name is None:
            return dataclasses.replace(alert, monitor=alert.monitor or self.label)
        if alert.monitor is not None:
            return alert  # already named (a restored or re-raised alert)
        return dataclasses.replace(
            alert,
            key=named_key(alert.key, self.name),
            monitor=self.label,
            message=f"{self.label}: {alert.message}",
        )

    def _keep_bounded(self) -> None:
        """Per-read lists keep their last ``keep_last`` entries: a week-long run with a read
        every few steps must not grow the callback (or its checkpoints) without bound."""
        for attr in ("alerts_fired", "history"):
            items = getattr(self, attr, None)
            if isinstance(items, list) and len(items) > self.keep_last:
                del items[: len(items) - self.keep_last]
