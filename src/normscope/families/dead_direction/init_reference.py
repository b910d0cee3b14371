"""The final norm's offset share on the forward residual discovery watches: the model before
its first update, the reference of ``RepresentationCollapseRule(objective="embedding")``
(docs/alerts.md, "The objective").

Residual discovery (:class:`~normscope.taps.residual.ResidualDiscovery`) watches the first
training forward untapped: the taps exist only once it has decided the layout, so the first
read is a step later, and one optimiser step can be enough to collapse an embedding. That
forward runs through the final norm anyway. :class:`InitReference` folds every norm layer's
output rows during it (which norm is the final one is known only when discovery finishes)
into the read path's own accumulator, a diagonal-only
:class:`~normscope.functional.covariance.StreamingCovariance` (row count, mean, the centred
co-moment's diagonal: ``O(N d)`` once; the padding mask honoured, NaN/Inf rows dropped and
counted), keeps the final norm's and gives its offset share at the first read after
discovery: the keys ``final_out_offset_share_init``, ``final_out_rows_init`` and
``final_out_init_step`` (logged as ``dd/...``), the same
:func:`~normscope.functional.stream.offset_share` as ``dd/final_out_offset_share``.

Example::

    ref = InitReference(tracker.norms, mask=attention_mask).install()
    model(**batch)                       # the forward discovery watches
    ref = ref.settle(layout.final_norm, step=0)   # hooks removed; None: nothing to give
    ref.take()["final_out_offset_share_init"]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from einops import rearrange
from torch import nn

from normscope._distributed import any_rank
from normscope.functional.covariance import StreamingCovariance
from normscope.functional.stream import offset_share
from normscope.taps.hooks import InertCopy, in_backward_recompute, tap_output
from normscope.taps.norms import NormLayer

__all__ = ["INIT_KEYS", "InitReference"]

#: the keys the first read after discovery logs (without ``dd/``): the share, its rows, the step
INIT_KEYS = ("final_out_offset_share_init", "final_out_rows_init", "final_out_init_step")

# rows folded per update: a float64 copy of at most 2**22 entries (32 MiB) at a time, whatever
# the batch (the whole forward's rows are read, not a row budget)
_CHUNK = 1 << 22


class InitReference:
    """Temporary forward hooks on norm layers that fold their output rows during one forward
    (the discovery step's), then the final norm's offset share at the first read.

    The hooks only observe: they never change a tensor and never raise into the forward (a
    failure leaves that norm without a reference); rows an activation-checkpoint recompute
    folds again in the backward are skipped. Every rank of a distributed run holds one
    (discovery runs on each): :meth:`reduce_` merges them at the first read's reduce.

    Args:
        norms: the norm layers to hook (the tracker's).
        mask: the batch's padding mask ``(batch, tokens)`` (non-zero keeps a row); applied
            where a norm's output is laid out ``(batch, tokens, d)``. ``None``: every row.
    """

    def __init__(self, norms: Sequence[NormLayer], mask: torch.Tensor | None = None) -> None:
        self.norms = list(norms)
        self.mask = mask
        self.accs: dict[str, StreamingCovariance] = {}
        self.failed: dict[str, str] = {}  # norm name -> why its hook failed
        self.final: str | None = None
        self.step = 0
        self._handles: list[Any] = []

    def install(self) -> InitReference:
        """Register the hooks (one per norm; idempotent)."""
        if self._handles:
            return self
        for norm in self.norms:
            self.accs[norm.name] = StreamingCovariance(
                norm.dim, device=_device(norm.module), full=False
            )
            self._handles.append(norm.module.register_forward_hook(_Fold(self, norm.name)))
        return self

    def remove(self) -> None:
        """Remove the hooks (idempotent); the folded rows stay."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def fold(self, name: str, output: object) -> None:
        """Fold one forward's output of norm ``name`` (the hook's body; never raises)."""
        if in_backward_recompute() or name in self.failed:
            return
        try:
            acc = self.accs[name]
            x = tap_output(output)
            if x is None or x.shape[-1] != acc.dim:
                shape = None if x is None else tuple(x.shape)
                raise ValueError(f"expected an output of width {acc.dim}, got {shape}")
            mask = self.mask
            if mask is not None and tuple(mask.shape) != tuple(x.shape[:-1]):
                mask = None  # not laid out (batch, tokens, d): no padding to skip
            if x.device != acc.device:
                acc.to(x.device)
            rows = rearrange(x.detach(), "... d -> (...) d")
            keep = None if mask is None else rearrange(mask.detach(), "... -> (...)")
            chunk = max(1, _CHUNK // acc.dim)
            for start in range(0, rows.shape[0], chunk):
                part = None if keep is None else keep[start : start + chunk]
                acc.update(rows[start : start + chunk], mask=part)
        except Exception as err:  # noqa: BLE001 - a monitor never breaks the forward
            self.failed[name] = f"{type(err).__name__}: {err}"

    def settle(self, final_norm: str | None, step: int = 0) -> InitReference | None:
        """Remove the hooks and keep the final norm's rows (``step``: the optimiser steps done
        before the forward). None when the final norm is unknown or was not hooked."""
        self.remove()
        if final_norm is None or final_norm not in self.accs:
            return None
        self.final, self.step = final_norm, int(step)
        self.accs = {final_norm: self.accs[final_norm]}
        return self

    def reduce_(self) -> None:
        """Merge every rank's rows, and whether any rank's hook failed (two collectives:
        every rank calls it at the same read, as the taps' reduce)."""
        assert self.final is not None
        acc = self.accs[self.final]
        if any_rank(self.final in self.failed, acc.device):
            self.failed.setdefault(self.final, "the hook failed on another rank")
        acc.reduce_()

    def take(self) -> dict[str, float] | None:
        """:data:`INIT_KEYS` with their values (one host sync), or None: no final norm, a
        failed hook, no rows, or a share that is not finite."""
        if self.final is None or self.final in self.failed:
            return None
        acc = self.accs[self.final]
        n = acc.count
        if n == 0:
            return None
        # the read path's own offset share (stream.stream_reads): population variances
        share = offset_share(acc.mean, acc.comoment_diagonal() / n, n)
        if not math.isfinite(share):
            return None
        return dict(zip(INIT_KEYS, (share, float(n), float(self.step))))


class _Fold(InertCopy):
    """One norm's hook. It pickles and deep-copies as a no-op (:class:`InertCopy`), so a model
    copied or saved during the discovery step is never read."""

    __slots__ = ("ref", "name")

    def __init__(self, ref: InitReference, name: str) -> None:
        self.ref, self.name = ref, name

    def __call__(self, module: nn.Module, args: tuple, output: object) -> None:
        self.ref.fold(self.name, output)


def _device(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")
