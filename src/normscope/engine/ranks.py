"""The agreement of ranks: what a monitor's processes owe each other so that no collective
ever hangs. One handshake per window end (the global row counts, and whether any rank's
monitor failed), one stop vote per read (``stop_on_alert``), and, on a rank whose monitor
failed, exactly the one handshake, gather or vote its peers still expect, then nothing more.
Alone (no process group) nothing is communicated."""

from __future__ import annotations

from collections.abc import Callable

import torch

from normscope._distributed import any_rank, sum_ranks, world_size

__all__ = ["RankAgreement"]


class RankAgreement:
    """The collectives of one monitor, and what it still owes its peers.

    Example::

        >>> ranks = RankAgreement()
        >>> ranks.window_end(torch.tensor(64.0), torch.tensor(0.0), device="cpu", step=9)
        (64.0, 0.0, False)
    """

    def __init__(self) -> None:
        self.owes_handshake = True  # a failed monitor owes its peers one handshake
        self.handshake_step = -2
        self.stop_decided_step = -2
        self.gather_owed = False  # an asynchronous read in flight: its gather is owed
        self.vote_owed = False  # a read published: its stop vote is owed

    def handshake(
        self,
        rows: torch.Tensor,
        rejected: torch.Tensor,
        *,
        failed: bool,
        device: torch.device | str,
        step: int,
    ) -> tuple[float, float, bool]:
        """The first collective of every window's end, on every rank: the global sums of
        ``rows`` and of the non-finite ``rejected`` rows, and whether any rank's monitor has
        failed."""
        flags = torch.stack(
            [
                rows.to(device=device, dtype=torch.float64).reshape(()),
                rejected.to(device=device, dtype=torch.float64).reshape(()),
                torch.tensor(float(failed), dtype=torch.float64, device=device),
            ]
        )
        total, bad, failures = sum_ranks(flags).tolist()
        self.handshake_step = step
        return total, bad, failures > 0

    def window_end(
        self, rows: torch.Tensor, rejected: torch.Tensor, *, device: torch.device | str, step: int
    ) -> tuple[float, float, bool]:
        """A healthy rank at a window's end: ``(global rows, global non-finite rows, a peer
        failed)``. One process: no collective (one host sync, the window's end)."""
        if world_size() <= 1:
            pair = torch.stack([rows.to(torch.float64), rejected.to(rows.device, torch.float64)])
            total, bad = pair.tolist()
            return total, bad, False
        total, bad, peer_failed = self.handshake(
            rows, rejected, failed=False, device=device, step=step
        )
        if peer_failed:
            self.owes_handshake = False
        return total, bad, peer_failed

    def stop_vote(self, decision: bool, device: torch.device | str, step: int) -> bool:
        """The read's stop decision, reduced with "any" over the ranks."""
        self.stop_decided_step = step
        self.vote_owed = False
        return any_rank(decision, torch.device(device))

    def settle(
        self,
        *,
        step: int,
        device: torch.device | str,
        drop_read: Callable[[], None],
        gather_error: Callable[[], None],
    ) -> bool:
        """A disabled rank at a step end: take part in what its peers still run for the read in
        flight (the gather, with an error record, or the stop vote). True when nothing more is
        owed at this step."""
        if self.gather_owed:
            self.gather_owed = False
            self.owes_handshake = False  # the peers stop reading at this gather
            drop_read()
            gather_error()
            return True
        if self.vote_owed:
            self.stop_vote(False, device, step)
        return False

    def keep_in_step(
        self,
        phase: str,
        step: int | None,
        *,
        completed: int,
        in_window: Callable[[int], bool],
        stop_on_alert: bool,
        device: torch.device | str,
        settle: Callable[[], bool],
    ) -> None:
        """While disabled (and right after a failure), at ``phase`` (``"end"`` with ``step``
        optimiser steps done, or ``"finish"``): the one handshake or vote the peers still
        expect for the optimiser step ``completed``. Never raises."""
        if not self.owes_handshake:
            return
        try:
            if world_size() <= 1:
                self.owes_handshake = False
            elif phase == "finish":
                settle()
            elif phase == "end" and step is not None:
                if step == completed or settle() or not in_window(completed):
                    return
                if self.handshake_step != completed:
                    self.owes_handshake = False
                    zero = torch.zeros((), dtype=torch.float64)
                    self.handshake(zero, zero, failed=True, device=device, step=completed)
                elif stop_on_alert and self.stop_decided_step != completed:
                    # failed after this window's handshake: vote "no" in the read's stop
                    self.stop_vote(False, device, completed)
        except Exception:  # noqa: BLE001 - nothing more a failed monitor can do
            self.owes_handshake = False
