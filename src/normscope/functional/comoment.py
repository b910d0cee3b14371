"""The merge math of the streaming covariance: pure functions over explicit float64 tensors.

docs/metrics.md §0. A state is ``(n, mu, M)``: the row count (a float64 scalar), the mean
``(d,)`` and the centred co-moment ``M = sum (x - mu)(x - mu)^T`` ``(d, d)``, or its diagonal
``(d,)`` alone (a diagonal-only state: every update below keeps the diagonal exactly). Two states merge
exactly by Chan's pairwise update; the states of many processes by :func:`all_reduce_comoment_`
(two ``all_reduce``\\ s, the co-moment summed in place). The stateful side, the
``torchmetrics.Metric`` that holds a state and folds rows into it, is
:class:`~normscope.functional.covariance.StreamingCovariance`.

Example::

    >>> import torch
    >>> f64 = {"dtype": torch.float64}
    >>> n, mean, m = torch.zeros((), **f64), torch.zeros(2, **f64), torch.zeros(2, 2, **f64)
    >>> n = merge_comoment_(n, mean, m, torch.tensor(2.0, **f64), torch.tensor([1.0, 0.0], **f64))
    >>> n = merge_comoment_(n, mean, m, torch.tensor(2.0, **f64), torch.tensor([3.0, 0.0], **f64))
    >>> n.item(), mean.tolist(), m.tolist()    # rows 1, 1, 3, 3 in the first coordinate
    (4.0, [2.0, 0.0], [[4.0, 0.0], [0.0, 0.0]])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_reduce_comoment_", "merge_comoment_"]


def merge_comoment_(
    n_a: torch.Tensor,
    mean_a: torch.Tensor,
    comoment_a: torch.Tensor,
    n_b: torch.Tensor,
    mean_b: torch.Tensor,
    comoment_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fold state ``b`` into state ``a`` (Chan et al. 1979), ``mean_a`` and ``comoment_a`` in
    place; returns the merged count ``n_a + n_b`` (a new tensor). ``comoment_b=None``: ``b``'s
    co-moment is already in ``comoment_a`` (the fold adds a batch's ``X^T X`` first). Exact
    and order-free up to rounding; safe when either side is empty. No host sync::

        delta = mu_b - mu_a;  n = n_a + n_b;  mu = mu_a + delta n_b / n
        M = M_a + M_b + delta delta^T n_a n_b / n
    """
    n = n_a + n_b
    delta = mean_b - mean_a
    share = n_b / n.clamp_min(1)
    if comoment_b is not None:
        comoment_a += comoment_b
    # In-place rank-1 update, the scalar folded into one vector: no d x d temporary.
    _add_outer_(comoment_a, delta, delta * (n_a * share))
    mean_a += delta * share
    return n


def all_reduce_comoment_(
    n: torch.Tensor,
    mean: torch.Tensor,
    comoment: torch.Tensor,
    rejected: torch.Tensor,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge the state of every process of ``group`` exactly: ``comoment`` (whole, both
    triangles) in place, returns the merged ``(n, mean, rejected)`` (new tensors).

    First the global count and mean (one small ``all_reduce`` of ``[n, n mu, rejected]``), then
    each rank re-centres its co-moment on the global mean, ``M_r + n_r (mu_r - mu)(mu_r - mu)^T``
    (rank-1, in place), and the co-moments are summed by one ``all_reduce``: the transient
    memory of one ``d`` vector, whatever the number of ranks. A diagonal-only ``comoment``
    (``(d,)``) sends ``d`` numbers instead of ``d^2``. A collective: every rank of the group
    calls it at the same point. Needs ``torch.distributed`` initialised.
    """
    head = torch.cat([n.reshape(1), n * mean, rejected.to(torch.float64).reshape(1)])
    dist.all_reduce(head, op=dist.ReduceOp.SUM, group=group)
    total = head[0]
    merged_mean = head[1:-1] / total.clamp_min(1)
    delta = mean - merged_mean
    _add_outer_(comoment, delta, delta * n)
    dist.all_reduce(comoment, op=dist.ReduceOp.SUM, group=group)
    return total, merged_mean, head[-1].round().to(torch.int64)


def _add_outer_(m: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> None:
    """``m += u v^T`` in place; on a diagonal-only state (``m`` of shape ``(d,)``) its
    diagonal, ``m += u * v``."""
    if m.ndim == 1:
        m.addcmul_(u, v)
    else:
        m.addr_(u, v)
