"""The cross-rank handshake: every rank's monitor stops reading at the same step."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer

__all__ = ["Handshake"]


class Handshake:
    """Ranks in step (a mixin :class:`~normscope.callbacks._base.MonitorCallback` inherits): a
    failed monitor owes its peers one handshake, and a healthy one stops when a peer failed."""

    # Supplied by MonitorCallback.
    _owes_handshake: bool
    _handshake_step: int
    _stop_decided_step: int
    _step_at_batch_start: int
    _in_window: Any
    _disable: Any

    def _handshake(
        self, trainer: Trainer, rows: torch.Tensor, *, failed: bool
    ) -> tuple[float, bool]:
        """The first collective of every window's end, on every rank: the global sum of
        ``rows`` (the dead-direction monitor's deferral decision) and whether any rank's monitor
        has failed. A rank whose monitor failed still makes this one call
        (:meth:`_keep_in_step`); then every rank stops reading together, and no rank waits for
        a collective that will not come."""
        device = trainer.strategy.root_device
        flags = torch.stack(
            [
                rows.to(device=device, dtype=torch.float64).reshape(()),
                torch.tensor(float(failed), dtype=torch.float64, device=device),
            ]
        )
        total, failures = trainer.strategy.reduce(flags, reduce_op="sum").tolist()
        self._handshake_step = self._step_at_batch_start
        return total, failures > 0

    def _keep_in_step(self, hook: str, args: tuple[Any, ...]) -> None:
        """Called for every hook while disabled (and right after a failure): take part in the
        one handshake the peers expect, then nothing more. Never raises."""
        if not self._owes_handshake or not args:
            return
        trainer = args[0]
        try:
            if trainer.world_size <= 1:
                self._owes_handshake = False
            elif hook == "on_train_end":
                self._owe_publish(trainer)  # the peers publish the last read here
            elif hook == "on_train_batch_start":
                self._step_at_batch_start = trainer.global_step
            elif hook == "on_train_batch_end":
                completed = self._step_at_batch_start
                if trainer.global_step == completed or self._owe_publish(trainer):
                    return
                if not self._in_window(completed):
                    return
                if self._handshake_step != completed:
                    self._owes_handshake = False
                    self._handshake(trainer, torch.zeros((), dtype=torch.float64), failed=True)
                elif getattr(self, "stop_on_alert", False) and self._stop_decided_step != completed:
                    # Failed after this window's handshake: the peers still take the read's
                    # stop decision; vote "no" in it, and owe them the next handshake.
                    self._stop_decided_step = completed
                    trainer.strategy.reduce_boolean_decision(False, all=False)
        except Exception:  # noqa: BLE001 - nothing more a failed monitor can do
            self._owes_handshake = False

    def _owe_publish(self, trainer: Trainer) -> bool:
        """What a disabled rank still owes its peers for a read published at this step
        (asynchronous reads: :class:`~normscope.callbacks.async_reads.AsyncReads`); True when
        nothing more is owed at this step. Nothing without asynchronous reads."""
        return False

    def _peers_failed(self, trainer: Trainer, rows: torch.Tensor) -> tuple[float, bool]:
        """The handshake of a healthy rank at a window's end: ``(global rows, stop)``; on
        ``stop`` (a peer's monitor failed) this monitor is disabled too, silently but on rank 0.
        One process: no collective, ``(rows, False)``."""
        if trainer.world_size <= 1:
            return float(rows), False
        total, peer_failed = self._handshake(trainer, rows, failed=False)
        if peer_failed:
            self._owes_handshake = False
            self._disable(
                "the monitor on another rank failed (its warning says why); every rank stops "
                "reading at the same step so that their collectives stay in step",
                warn=trainer.is_global_zero,
            )
        return total, peer_failed
