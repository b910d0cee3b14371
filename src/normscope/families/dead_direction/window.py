"""What a dead-direction read carries between its steps: the frozen window
(:class:`ReadWindow`), what a solve gave (:class:`ReadRecords`), what the read needs of the
tracker's memory (:class:`ReadMemory`) and what it asks the tracker to remember
(:class:`MemoryUpdate`). The steps themselves: :mod:`~normscope.families.dead_direction.read`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from normscope.families.dead_direction.report import NormReport
from normscope.functional.dead_direction import GammaRead
from normscope.taps.hooks import Tap

__all__ = ["MemoryUpdate", "ReadMemory", "ReadRecords", "ReadWindow", "covered"]


@dataclass
class ReadWindow:
    """What one read needs, frozen by the tracker's
    :meth:`~normscope.families.dead_direction.tracker.DeadDirectionTracker.take`: the taps
    (their accumulators the window's), the gammas the window's forwards used, what was failed
    at that point, and the options the solves read (``null_tol``, ``placement``)."""

    step: int
    norms: list[Any]  # NormLayer, in the tracker's order
    norm_taps: dict[str, tuple[Tap, Tap]]
    gammas: dict[str, torch.Tensor]
    skip: set[str]  # norm layers not read (a failed tap or an earlier failed read)
    point_taps: list[Tap]
    sources: dict[str, list[Any]] | None  # per-source accumulators; None: not read
    layout: Any
    profile_on: bool
    taps: list[Tap]  # every tap (rows_rejected, failed taps)
    failed_taps: dict[str, str]
    null_tol: float = 1e-10  # tau of null_dim (DeadDirectionConfig.null_tol)
    placement: str = "pre"  # "post": post-norm blocks (DeadDirectionTracker.placement)
    #: norm name -> the residual point whose sigma_min that norm's job reads (:func:`covered`)
    covers: dict[str, int] = field(default_factory=dict)
    #: attention module -> its largest logit in the window (None: none read; docs §1.7);
    #: None: no attention read asked for
    attention: dict[str, torch.Tensor | None] | None = None
    #: norm name -> its gamma read, taken for the norm jobs in one batch by ``solve_window``
    gamma_reads: dict[str, GammaRead] = field(default_factory=dict)
    #: the spectral tier is read too (docs/costs.md, "Tiers"); False: the cheap tier only
    spectral: bool = True
    #: the final norm's offset share on the discovery forward, its rows and step: the first
    #: read after discovery only (:mod:`~normscope.families.dead_direction.init_reference`)
    init: dict[str, float] | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the read reads (for ``record_stream`` on a side CUDA stream)."""
        accs = [t.accumulator for t in self.taps]
        for group in (self.sources or {}).values():
            accs.extend(group)
        out = [v for a in accs for v in vars(a).values() if isinstance(v, torch.Tensor)]
        out += [v for v in (self.attention or {}).values() if v is not None]
        return out + list(self.gammas.values())


@dataclass
class ReadRecords:
    """What a solve gave, on the CPU and picklable (gathered across ranks under a share)."""

    norms: dict[str, NormReport] = field(default_factory=dict)
    norm_failures: dict[str, str] = field(default_factory=dict)
    sigmas: dict[int, tuple[float, str | None, int]] = field(default_factory=dict)
    profile_failure: str | None = None
    sources: dict[str, Any] = field(default_factory=dict)
    sources_failure: str | None = None
    stream: dict[str, float] = field(default_factory=dict)  # stream_reads of the window
    solves: int = 0  # jobs this rank solved (tests: each rank solves its share only)
    error: str | None = None  # the solve itself failed: the monitor disables itself


@dataclass(frozen=True)
class ReadMemory:
    """What assembling a read needs of the tracker's memory, passed in as values: the layers
    already disabled, the stream reads' baselines, the rule that classifies collapses and
    whether the note on inputs that do not span was given."""

    failed_reads: Mapping[str, str] = field(default_factory=dict)
    profile_failed: str | None = None
    gain_baselines: Mapping[str, torch.Tensor] = field(default_factory=dict)
    previous_rms: Mapping[str, float] = field(default_factory=dict)
    source_rule: Any = None
    rank_warned: bool = False


@dataclass
class MemoryUpdate:
    """What a read asks the tracker to remember (the tracker applies it and warns, in this
    order): norm layers whose read failed now, the profile's and the per-source reads'
    failure, the gain baselines set by a norm's first read, each point's RMS for the next
    read's growth, and the note on inputs that do not span (given once)."""

    failed_reads: dict[str, str] = field(default_factory=dict)
    profile_failed: str | None = None
    sources_failed: str | None = None
    gain_baselines: dict[str, torch.Tensor] = field(default_factory=dict)
    previous_rms: dict[str, float] = field(default_factory=dict)
    rank_note: str | None = None


def covered(window: ReadWindow) -> dict[str, int]:
    """The residual points whose ``sigma_min`` a norm's job reads (norm name -> point index):
    a point that is a read norm's input (every point of a pre-norm stack) comes from that
    norm's input ``eigh``
    (:func:`~normscope.families.dead_direction.solve.point_from_spectrum`), not from a
    decomposition of its own."""
    if not (window.profile_on and window.layout is not None and window.point_taps):
        return {}
    by_key = {tap.key: k for k, tap in enumerate(window.point_taps)}
    out: dict[str, int] = {}
    for norm in window.norms:
        k = by_key.get(window.norm_taps[norm.name][0].key)
        if norm.name not in window.skip and k is not None and k not in out.values():
            out[norm.name] = k
    return out
