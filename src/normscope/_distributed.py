"""torch.distributed's default group as every floor sees it: the world, this rank's share of
the solves, and the two collectives the engine uses (a sum, an "any" vote). Alone (no process
group, or a group of one) nothing is communicated."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["any_rank", "distributed", "rank_zero", "read_share", "sum_ranks", "world_size"]


def distributed() -> Any:
    """``torch.distributed`` when a process group is initialised, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    """Processes in torch.distributed's default group (1 without one)."""
    dist = distributed()
    return dist.get_world_size() if dist is not None else 1


def read_share() -> tuple[int, int]:
    """``(rank, world)`` of this process under ``torch.distributed``; ``(0, 1)`` alone."""
    dist = distributed()
    if dist is not None and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_zero() -> bool:
    """Whether this process is rank zero (True alone)."""
    dist = distributed()
    return dist is None or dist.get_rank() == 0


def sum_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks (a new tensor; ``tensor`` itself alone)."""
    dist = distributed()
    if dist is None or dist.get_world_size() == 1:
        return tensor
    out = tensor.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def any_rank(decision: bool, device: torch.device) -> bool:
    """Whether any rank decided yes (one collective; no-op alone)."""
    if world_size() == 1:
        return bool(decision)
    votes = sum_ranks(torch.tensor(float(bool(decision)), dtype=torch.float64, device=device))
    return bool(votes.item() > 0)
