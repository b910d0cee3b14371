"""The residual points as one chain: the same sampled rows at every point, and ``M_k`` between
neighbours (the no-cancellation margin, :mod:`normscope.functional.cancellation`).

``S_k = S_{k-1} + M_k + F_k^T F_k / N`` holds only on the *same* rows, so the points' taps
must not subsample independently. A :class:`PointChain` draws one row subset per forward, at
``p_0`` (seeded), and every later point of that forward keeps the same rows (masks are the
gate's, the same for all points); each point's accumulator then sees at most ``max_rows`` rows
and does not subsample again. With ``cross=True`` it also keeps the subset's rows of ``p_{k-1}``
until ``p_k`` arrives (one point's rows at a time, on sampled forwards only) and folds the pair
into a :class:`StreamingCrossMoment`.

:class:`~normscope.taps.hooks.TapSet` calls :meth:`PointChain.fold` from its hook, instead of
the tap's own ``accumulator.update``, for the taps of the chain.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange

from normscope._common import warn_disabled
from normscope.functional.cancellation import StreamingCrossMoment

__all__ = ["PointChain"]


class PointChain:
    """Same-row folding of the residual point taps, in forward order, and their cross-moments.

    Args:
        taps: the points' :class:`~normscope.taps.hooks.Tap` objects, ``p_0`` first.
        max_rows: rows kept per forward (one seeded subset for every point); None keeps all.
        seed: seed of the subset.
        cross: also accumulate ``M_k`` between consecutive points (``8 d^2`` bytes each).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from normscope.taps.hooks import TapSet
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Identity())
        >>> taps = TapSet(model)
        >>> chain = taps.chain_points([taps.add(n, "input", 4) for n in ("1", "2")], max_rows=8)
        >>> with taps.gate.sampling():
        ...     _ = model(torch.randn(32, 4))
        >>> [t.accumulator.count for t in chain.taps], chain.cross[0].count
        ([8, 8], 8)
    """

    def __init__(
        self,
        taps: Sequence,
        *,
        max_rows: int | None = None,
        seed: int = 0,
        cross: bool = True,
    ) -> None:
        self.taps = list(taps)
        self.index = {t.key: k for k, t in enumerate(self.taps)}
        if len(self.index) != len(self.taps):
            raise ValueError("PointChain: every point needs a tap of its own")
        self.max_rows = max_rows
        self.seed = seed
        self.cross: list[StreamingCrossMoment] = (
            [StreamingCrossMoment(t.dim, t.accumulator.device) for t in self.taps[1:]]
            if cross
            else []
        )
        self.cross_failed: str | None = None
        self.split = None  # normscope.taps.sources.SourceSplit: per-source accumulators
        self._generator: torch.Generator | None = None
        self._forward = 0
        self._pick: torch.Tensor | None = None
        self._pick_rows = -1
        self._broken = False  # this forward's points did not see the same rows
        self._stash: tuple[int, int, torch.Tensor, torch.Tensor | None] | None = None

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self.index

    def fold(self, tap, x: torch.Tensor, mask: torch.Tensor | None, sources=None) -> None:
        """Fold ``x`` (``(..., d)``) into ``tap``'s accumulator on this forward's row subset,
        and the pair ``(p_{k-1}, p_k)`` into ``M_k``. Raises on a bad tensor (the caller
        disables the tap); a failure of the cross-moment alone disables the margins only."""
        k = self.index[tap.key]
        rows = rearrange(x.detach(), "... d -> (...) d")
        keep = (
            rearrange(mask.detach(), "... -> (...)").to(rows.device) != 0
            if mask is not None
            else None
        )
        n = rows.shape[0]
        split = self.split if sources is not None else None
        split = split if split is not None and split.failed is None else None
        codes = (
            sources.row_codes(tuple(x.shape[:-1]), rows.device)
            if split is not None and sources.codes is not None
            else None
        )
        if k == 0:
            self._forward += 1
            self._broken = False
            self._draw(n, rows.device)
        elif n != self._pick_rows:  # another row count than p_0's: not the same tokens
            self._broken = True
            self._draw(n, rows.device)
        if self._pick is not None:
            rows = rows[self._pick]
            keep = keep[self._pick] if keep is not None else None
            codes = codes[self._pick] if codes is not None else None
        if rows.device != tap.accumulator.device:
            tap.accumulator.to(rows.device)
        tap.accumulator.update(rows, mask=keep)
        if split is not None:
            try:
                split.fold(k, rows, keep, codes, sources)
            except Exception as err:  # noqa: BLE001 - the per-source reads only
                split.failed = f"{type(err).__name__}: {err}"
                warn_disabled(
                    "the per-source accumulation",
                    split.failed,
                    goes_on="the pooled reads go on",
                    stacklevel=4,
                )
        if self.cross and self.cross_failed is None:
            try:
                self._fold_cross(k, rows, keep)
            except Exception as err:  # noqa: BLE001 - the margins only; the taps go on
                self._fail_cross(f"{type(err).__name__}: {err}")

    def _draw(self, n: int, device: torch.device) -> None:
        self._pick_rows = n
        if self.max_rows is None or n <= self.max_rows:
            self._pick = None
            return
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        perm = torch.randperm(n, generator=self._generator, device=device)
        self._pick = perm[: self.max_rows]

    def _fold_cross(self, k: int, rows: torch.Tensor, keep: torch.Tensor | None) -> None:
        stash, self._stash = self._stash, None
        if k >= 1 and stash is not None and not self._broken:
            forward, prev_k, prev_rows, prev_keep = stash
            if forward == self._forward and prev_k == k - 1:
                acc = self.cross[k - 1]
                if acc.device != rows.device:
                    acc.to(rows.device)
                both = _and(prev_keep, keep)
                acc.update(prev_rows, rows, mask=both)
        if k + 1 < len(self.taps) and not self._broken:
            # A private copy: the model may edit the stream in place before p_{k+1} is reached.
            self._stash = (self._forward, k, rows.clone(), keep)

    def _fail_cross(self, reason: str) -> None:
        self.cross_failed = reason
        self._stash = None
        warn_disabled(
            "the accumulation of the no-cancellation cross-moments",
            reason,
            goes_on="sigma_min and the other reads go on",
            stacklevel=4,
        )

    def reset(self) -> None:
        """Start a new window (the subset generator keeps its position)."""
        for acc in self.cross:
            acc.reset()
        if self.split is not None:
            self.split.reset()
        self._stash = None

    def memory_bytes(self) -> int:
        """Bytes of the cross-moments (``8 d^2`` each)."""
        return sum(acc.memory_bytes() for acc in self.cross)


def _and(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a & b
