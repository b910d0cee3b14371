"""Per-source accumulators for the residual points: which calibration distribution each row
came from, and one float64 :class:`StreamingCovariance` per ``(source, point)``.

A *source* names where a sampled row came from (a data set, a language, a domain). The user
gives ``sources=`` to the tracker (:func:`resolve_labels` reads it on each sampled batch):

* ``fn(batch) -> str``: the whole batch is one source;
* ``fn(batch) -> sequence | tensor``: one label per sample (the batch's first dimension);
* a string: the name of a batch field (a dict key or attribute) holding either of the above.

Labels become names with ``str()`` (integer ids name sources ``"0"``, ``"1"`` ...); a name may
not hold ``/`` (metric keys split on it): it is replaced by ``_``. Rows of a sample are the
tokens of that sample; a tapped tensor whose first dimension is not the batch's is not split
(its rows stay in the pooled read only, :attr:`SourceSplit.unattributed` counts them).

The pooled accumulators are untouched: a source's rows are folded *in addition*, on the same
row subset the :class:`~normscope.taps.hooks.PointChain` drew, so that the Chan merge of every
source's accumulator is the pooled one (up to rounding) and the pooled read stays what it is
without ``sources=``. Cost: one more ``8 d^2`` float64 co-moment per source and point; a fold
per source and point on a sampled forward (per-row labels fold every row with a 0/1 weight:
no host sync, ``S`` times the pooled fold's arithmetic).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from normscope.functional.covariance import StreamingCovariance

__all__ = ["SourceLabels", "SourceSplit", "SourceSpec", "resolve_labels", "source_name"]

SourceSpec = str | Callable[[Any], Any]


def source_name(label: Any) -> str:
    """A label as a source name for metric keys: ``str(label)``, ``/`` and whitespace -> ``_``."""
    if isinstance(label, torch.Tensor):
        label = label.item()
    name = re.sub(r"[/\s]", "_", str(label))
    if not name:
        raise ValueError("sources: a source label is empty")
    return name


@dataclass(frozen=True)
class SourceLabels:
    """The sources of one batch: ``whole`` (every row one source) or ``codes`` (per sample,
    an int64 tensor ``(batch,)`` indexing ``names``)."""

    names: tuple[str, ...]
    whole: str | None = None
    codes: torch.Tensor | None = None

    def row_codes(self, lead: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
        """Codes of the flattened rows of a tensor whose leading shape is ``lead`` (samples
        first); None when the first dimension is not the batch's."""
        if self.codes is None or not lead or lead[0] != self.codes.shape[0]:
            return None
        per_sample = 1
        for n in lead[1:]:
            per_sample *= n
        return self.codes.to(device).repeat_interleave(per_sample)


def _field(batch: Any, name: str) -> Any:
    if isinstance(batch, dict):
        if name not in batch:
            raise KeyError(f"sources={name!r}: the batch has no field {name!r} ({list(batch)})")
        return batch[name]
    if hasattr(batch, name):
        return getattr(batch, name)
    raise KeyError(f"sources={name!r}: the batch ({type(batch).__name__}) has no field {name!r}")


def resolve_labels(spec: SourceSpec, batch: Any) -> SourceLabels:
    """The :class:`SourceLabels` of ``batch`` under ``spec`` (module docstring). A label tensor
    is read to the host once (its distinct values name the sources): sampled batches only."""
    out = _field(batch, spec) if isinstance(spec, str) else spec(batch)
    if isinstance(out, str) or (isinstance(out, torch.Tensor) and out.ndim == 0):
        name = source_name(out)
        return SourceLabels((name,), whole=name)
    if isinstance(out, torch.Tensor):
        if out.ndim != 1:
            raise ValueError(
                f"sources: per-sample labels must be 1-d (one per sample), got {tuple(out.shape)}"
            )
        labels = out.tolist()
    elif isinstance(out, Sequence):
        labels = list(out)
    else:
        raise TypeError(
            "sources: expected a str (the whole batch), or a sequence/tensor of labels per "
            f"sample, got {type(out).__name__}"
        )
    names: list[str] = []
    index: dict[str, int] = {}
    codes = []
    for label in labels:
        name = source_name(label)
        if name not in index:
            index[name] = len(names)
            names.append(name)
        codes.append(index[name])
    if len(names) == 1:
        return SourceLabels((names[0],), whole=names[0])
    return SourceLabels(tuple(names), codes=torch.tensor(codes, dtype=torch.int64))


class SourceSplit:
    """One accumulator per ``(source, point)``, created when a source is first seen (at the
    batch, outside the forward), at most ``max_sources`` sources.

    Args:
        dims: each point's width.
        devices: each point's accumulator device.
        max_sources: sources kept; rows of a source beyond it stay in the pooled read only
            (:attr:`dropped` names those sources).
    """

    def __init__(
        self, dims: Sequence[int], devices: Sequence[torch.device], max_sources: int
    ) -> None:
        self.dims = list(dims)
        self.devices = list(devices)
        self.max_sources = max_sources
        self.accs: dict[str, list[StreamingCovariance]] = {}
        self.dropped: set[str] = set()
        self.unattributed = 0  # point folds whose tensor could not be split by sample
        self.failed: str | None = None  # a fold raised: no per-source read from then on

    def ensure(self, names: Sequence[str]) -> None:
        for name in names:
            if name in self.accs or name in self.dropped:
                continue
            if len(self.accs) >= self.max_sources:
                self.dropped.add(name)
                continue
            self.accs[name] = [
                StreamingCovariance(d, device=dev) for d, dev in zip(self.dims, self.devices)
            ]

    def fold(
        self,
        k: int,
        rows: torch.Tensor,
        keep: torch.Tensor | None,
        codes: torch.Tensor | None,
        labels: SourceLabels,
    ) -> None:
        """Fold point ``k``'s rows (already the chain's subset) into each source's accumulator."""
        if labels.whole is not None:
            acc = self.accs.get(labels.whole)
            if acc is not None:
                self._update(acc[k], rows, keep)
            return
        if codes is None:
            self.unattributed += 1
            return
        for code, name in enumerate(labels.names):
            acc = self.accs.get(name)
            if acc is None:
                continue
            mine = codes == code
            self._update(acc[k], rows, mine if keep is None else mine & keep)

    @staticmethod
    def _update(acc: StreamingCovariance, rows: torch.Tensor, mask: torch.Tensor | None) -> None:
        if rows.device != acc.device:
            acc.to(rows.device)
        acc.update(rows, mask=mask)

    def agree(self) -> list[str]:
        """The source names every process holds, sorted, after creating (empty) those a rank
        has not seen: the order :meth:`reduce_` walks. A collective under ``torch.distributed``."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (sorted(self.accs), self.failed))
            union = sorted({n for names, _ in gathered for n in names})
            failed = [why for _, why in gathered if why is not None]
            if failed and self.failed is None:
                self.failed = "on another rank: " + failed[0]
            keep = union[: self.max_sources]
            for name in [n for n in self.accs if n not in keep]:
                del self.accs[name]  # over max_sources across ranks: the same cut on every rank
                self.dropped.add(name)
            self.ensure(keep)
        return sorted(self.accs)

    def reduce_(self) -> None:
        """Exact merge over processes (every rank ends with the same sources and rows)."""
        for name in self.agree():
            for acc in self.accs[name]:
                acc.reduce_()

    def reset(self) -> None:
        for accs in self.accs.values():
            for acc in accs:
                acc.reset()
        self.unattributed = 0

    def memory_bytes(self) -> int:
        return sum(8 * d * d for d in self.dims) * len(self.accs)

    def state_dict(self) -> dict[str, Any]:
        return {name: [a.state_dict() for a in accs] for name, accs in self.accs.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, saved in state.items():
            self.ensure([name])
            accs = self.accs.get(name)
            if accs is None or len(saved) != len(accs):
                continue
            for acc, acc_state in zip(accs, saved):
                try:
                    acc.load_state_dict(acc_state)
                except ValueError:  # another width (checked before anything is loaded): skip it
                    continue
