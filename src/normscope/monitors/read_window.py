"""One read's window, taken off the taps, and its solves: the whole read, a rank's share of it,
or on a background worker (:mod:`normscope.monitors.read_worker`).

A read has three parts. :func:`take_window` (main thread, after the cross-rank reduce) freezes
what the read needs: every accumulator is shallow-copied (the copy keeps *references* to the
window's state tensors), and with ``swap=True`` the live taps are then ``reset()`` -- each
allocates fresh zero tensors, so the next window folds into new memory while the read holds the
old (a swap, no ``d x d`` copy). :func:`solve_window` runs the float64 eigensolves (anywhere: no
collective, no tracker state but the baselines it updates); with ``share=(rank, world)`` it
solves only every ``world``-th job of a fixed list (norm layers in the tracker's order, then the
residual points' ``sigma_min``, the margins, the sources), round robin. :func:`finish_report`
(main thread) applies the failures the solves met and builds the
:class:`~normscope.monitors.dead_direction_report.DeadDirectionReport`; under a share it takes the
records of every rank, gathered first (:func:`gather_records`).

Example::

    window = take_window(tracker, step=10, swap=True)   # the taps start a new window
    records = solve_window(tracker, window)             # on any thread
    report = finish_report(tracker, window, [records])
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from normscope.functional.cancellation import no_cancellation_margin
from normscope.monitors.dead_direction_report import DeadDirectionReport, NormReport
from normscope.monitors.profile_parts import point_sigma, profile_from_parts
from normscope.taps.hooks import Tap

if TYPE_CHECKING:
    from normscope.monitors.dead_direction import DeadDirectionTracker

__all__ = ["ReadRecords", "ReadWindow", "finish_report", "solve_window", "take_window"]


@dataclass
class ReadWindow:
    """What one read needs, frozen at :func:`take_window`: the taps (their accumulators the
    window's), the gammas the window's forwards used, and what was failed at that point."""

    step: int
    norms: list[Any]  # NormLayer, in the tracker's order
    norm_taps: dict[str, tuple[Tap, Tap]]
    gammas: dict[str, torch.Tensor]
    skip: set[str]  # norm layers not read (a failed tap or an earlier failed read)
    point_taps: list[Tap]
    cross: list[Any]
    sources: dict[str, list[Any]] | None  # per-source accumulators; None: not read
    layout: Any
    profile_on: bool
    taps: list[Tap]  # every tap (rows_rejected, failed taps)
    failed_taps: dict[str, str]
    live: bool = False  # the live taps (a synchronous read): the tracker's own _read_norm reads

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the read reads (for ``record_stream`` on a side CUDA stream)."""
        accs = [t.accumulator for t in self.taps] + list(self.cross)
        for group in (self.sources or {}).values():
            accs.extend(group)
        out = [v for a in accs for v in vars(a).values() if isinstance(v, torch.Tensor)]
        return out + list(self.gammas.values())


@dataclass
class ReadRecords:
    """What a solve gave, on the CPU and picklable (gathered across ranks under a share)."""

    norms: dict[str, NormReport] = field(default_factory=dict)
    norm_failures: dict[str, str] = field(default_factory=dict)
    baselines: dict[str, tuple[float, int]] = field(default_factory=dict)  # set by this read
    sigmas: dict[int, tuple[float, str | None, int]] = field(default_factory=dict)
    margins: dict[int, float] = field(default_factory=dict)
    profile: Any = None  # the whole profile (no share)
    profile_failure: str | None = None
    sources: dict[str, Any] = field(default_factory=dict)
    sources_failure: str | None = None
    solves: int = 0  # jobs this rank solved (tests: each rank solves its share only)
    error: str | None = None  # the solve itself failed: the monitor disables itself


def _frozen(tap: Tap) -> Tap:
    return dataclasses.replace(tap, accumulator=copy.copy(tap.accumulator))


def take_window(tracker: DeadDirectionTracker, step: int, *, swap: bool) -> ReadWindow:
    """Freeze the window of ``tracker`` (after its reduce). ``swap``: the live accumulators are
    reset (fresh tensors) and the read keeps the old ones; else the window reads the live ones
    (the synchronous read, which resets after)."""
    live = list(tracker.taps.taps.values())
    frozen = {t.key: (_frozen(t) if swap else t) for t in live}
    cross = list(tracker._cross())
    cross = [copy.copy(a) for a in cross] if swap else cross
    split = tracker.split
    sources = None
    if split is not None and split.failed is None:
        sources = {
            n: ([copy.copy(a) for a in split.accs[n]] if swap else split.accs[n])
            for n in sorted(split.accs)
        }
    gammas = {
        n.name: tracker._gammas[n.name] if n.name in tracker._gammas else n.gamma()
        for n in tracker.norms
    }
    norm_taps = {
        name: (frozen[a.key], frozen[b.key]) for name, (a, b) in tracker._norm_taps.items()
    }
    skip = {
        n.name
        for n in tracker.norms
        if n.name in tracker.failed_reads or any(t.failed for t in tracker._norm_taps[n.name])
    }
    window = ReadWindow(
        step=step,
        norms=list(tracker.norms),
        norm_taps=norm_taps,
        gammas=gammas,
        skip=skip,
        point_taps=[frozen[t.key] for t in tracker._point_taps],
        cross=cross,
        sources=sources,
        layout=tracker.layout,
        profile_on=tracker._profile_failed is None,
        taps=[frozen[t.key] for t in live],
        failed_taps={f"{t.module_name}:{t.where}": t.failed for t in live if t.failed},
        live=not swap,
    )
    if swap:
        tracker.reset()
        _check_swapped(window, live)
    return window


def _check_swapped(window: ReadWindow, live: list[Tap]) -> None:
    """``reset()`` must give the live taps new tensors; one that zeroed in place would wipe the
    window the read holds: copy it then (never silently read zeros)."""
    for old, tap in zip(window.taps, live):
        if old.accumulator.comoment is tap.accumulator.comoment:
            raise RuntimeError("normscope: an accumulator's reset() reused its tensors in place")


def _jobs(tracker: DeadDirectionTracker, window: ReadWindow) -> list[tuple[str, Any]]:
    jobs: list[tuple[str, Any]] = [("norm", n) for n in window.norms if n.name not in window.skip]
    if window.profile_on and window.layout is not None and window.point_taps:
        jobs += [("point", k) for k in range(len(window.point_taps))]
        if len(window.cross) == len(window.point_taps) - 1:
            jobs += [("margin", k) for k in range(1, len(window.point_taps))]
        jobs += [("source", name) for name in window.sources or {}]
    return jobs


def solve_window(
    tracker: DeadDirectionTracker,
    window: ReadWindow,
    share: tuple[int, int] | None = None,
) -> ReadRecords:
    """The eigensolves of ``window``: all of them (``share=None``, the read of one process),
    or rank ``share[0]``'s round-robin share of ``share[1]``. Never raises: a layer's failure is
    recorded for :func:`finish_report`, anything else in :attr:`ReadRecords.error`. Touches no
    tracker state but ``baselines`` / ``baseline_rows`` (Delta_gamma's first read)."""
    out = ReadRecords()
    try:
        if share is None:
            _solve_all(tracker, window, out)
        else:
            rank, world = share
            for i, job in enumerate(_jobs(tracker, window)):
                if i % world == rank:
                    _solve_job(tracker, window, job, out)
    except Exception as err:  # noqa: BLE001 - the monitor decides (fail-open)
        out.error = f"{type(err).__name__}: {err}"
    return out


def _read_norm(tracker: DeadDirectionTracker, window: ReadWindow, norm: Any, out: ReadRecords):
    from normscope.monitors.dead_direction_read import read_norm

    had = norm.name in tracker.baselines
    tap_in, tap_out = window.norm_taps[norm.name]
    try:
        if window.live:  # the same taps and gamma: the tracker's read (an extension point)
            out.norms[norm.name] = tracker._read_norm(norm)
        else:
            out.norms[norm.name] = read_norm(
                norm, tap_in, tap_out, window.gammas[norm.name], tracker.null_tol,
                tracker.baselines, tracker.baseline_rows,
            )  # fmt: skip
    except Exception as err:  # noqa: BLE001 - one layer's failure is that layer's only
        out.norm_failures[norm.name] = f"{type(err).__name__}: {err}"
        return
    if not had and norm.name in tracker.baselines:
        out.baselines[norm.name] = (tracker.baselines[norm.name], tracker.baseline_rows[norm.name])
    out.solves += 1


def _solve_all(tracker: DeadDirectionTracker, window: ReadWindow, out: ReadRecords) -> None:
    from normscope.monitors.dead_direction_read import read_profile, read_sources_of

    for norm in window.norms:
        if norm.name not in window.skip:
            _read_norm(tracker, window, norm, out)
    if window.profile_on:
        try:
            out.profile = read_profile(window.layout, window.point_taps, window.cross)
        except Exception as err:  # noqa: BLE001
            out.profile_failure = f"{type(err).__name__}: {err}"
    if window.sources is not None and out.profile is not None:
        try:
            out.sources = read_sources_of(window.sources, window.layout)
        except Exception as err:  # noqa: BLE001 - the per-source reads only
            out.sources_failure = f"{type(err).__name__}: {err}"


def _solve_job(tracker: DeadDirectionTracker, window: ReadWindow, job: tuple, out: ReadRecords):
    from normscope.monitors.dead_direction_read import read_sources_of

    kind, what = job
    if kind == "norm":
        _read_norm(tracker, window, what, out)
        return
    out.solves += 1
    try:
        if kind == "point":
            acc = window.point_taps[what].accumulator
            out.sigmas[what] = point_sigma(acc.second_moment(), acc.count)
        elif kind == "margin":
            acc, prev = window.cross[what - 1], window.point_taps[what - 1].accumulator
            out.margins[what] = no_cancellation_margin(acc.moment(), prev.second_moment(),
                                                       acc.count)[0]  # fmt: skip
        elif kind == "source":
            assert window.sources is not None
            part = {what: window.sources[what]}
            out.sources.update(read_sources_of(part, window.layout))
    except Exception as err:  # noqa: BLE001
        why = f"{type(err).__name__}: {err}"
        if kind == "source":
            out.sources_failure = out.sources_failure or why
        else:
            out.profile_failure = out.profile_failure or why


def gather_records(records: ReadRecords) -> list[ReadRecords]:
    """Every rank's records, in rank order (``all_gather_object``: a collective; call it on the
    main thread, at the same point on every rank). One process: ``[records]``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [records]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _on_cpu(records))
    return gathered


def _on_cpu(records: ReadRecords) -> ReadRecords:
    """The records with every tensor of the norm reports (gamma's ``v_star``) on the CPU: a
    pickled CUDA tensor would be unpickled onto the sender's device."""
    norms = {}
    for name, report in records.norms.items():
        v = report.gamma.v_star
        if isinstance(v, torch.Tensor) and v.device.type != "cpu":
            report = dataclasses.replace(
                report, gamma=dataclasses.replace(report.gamma, v_star=v.cpu())
            )
        norms[name] = report
    return dataclasses.replace(records, norms=norms)


def finish_report(
    tracker: DeadDirectionTracker, window: ReadWindow, parts: list[ReadRecords]
) -> DeadDirectionReport:
    """The report of ``window`` from every rank's records (one record without a share): the
    failures applied to ``tracker`` (each disabled layer warned about once, as the synchronous
    read does), the baselines other ranks set merged in, the profile put together."""
    from normscope.monitors.dead_direction_read import _warn_disabled

    merged = ReadRecords()
    for part in parts:
        merged.norms.update(part.norms)
        merged.norm_failures.update(part.norm_failures)
        merged.baselines.update(part.baselines)
        merged.sigmas.update(part.sigmas)
        merged.margins.update(part.margins)
        merged.sources.update(part.sources)
        merged.profile = merged.profile or part.profile
        merged.profile_failure = merged.profile_failure or part.profile_failure
        merged.sources_failure = merged.sources_failure or part.sources_failure
    for name, (s, rows) in merged.baselines.items():
        tracker.baselines.setdefault(name, s)
        tracker.baseline_rows.setdefault(name, rows)
    norms: dict[str, NormReport] = {}
    for norm in window.norms:  # the tracker's order, whoever solved it
        if norm.name in merged.norm_failures:
            tracker.failed_reads[norm.name] = merged.norm_failures[norm.name]
            _warn_disabled(f"the read of norm layer {norm.name!r}", merged.norm_failures[norm.name])
        elif norm.name in merged.norms:
            norms[norm.name] = merged.norms[norm.name]
    profile = merged.profile
    if len(parts) > 1 and window.profile_on and merged.profile_failure is None:
        profile = _shared_profile(window, merged)
    if merged.profile_failure is not None and tracker._profile_failed is None:
        tracker._profile_failed = merged.profile_failure
        profile = None
        _warn_disabled("the residual sigma_min profile", merged.profile_failure)
    rejected = sum(t.accumulator.rows_rejected for t in window.taps)
    failed = dict(window.failed_taps)
    failed.update({f"{name}:read": why for name, why in tracker.failed_reads.items()})
    if tracker._profile_failed is not None:
        failed["profile:read"] = tracker._profile_failed
    report = DeadDirectionReport(window.step, norms, profile, window.layout, rejected, failed)
    split = tracker.split
    if window.sources is not None and profile is not None and split is not None:
        if merged.sources_failure is not None:
            split.failed = split.failed or merged.sources_failure
            _warn_disabled("the per-source reads", merged.sources_failure)
        else:
            srcs = {n: merged.sources[n] for n in sorted(merged.sources)}
            report = dataclasses.replace(report, sources=srcs, source_rule=tracker.source_rule)
    return report


def _shared_profile(window: ReadWindow, merged: ReadRecords) -> Any:
    if window.layout is None or not window.point_taps:
        return None
    margins = None
    if len(window.cross) == len(window.point_taps) - 1:
        margins = [merged.margins[k] for k in range(1, len(window.point_taps))]
    return profile_from_parts(
        window.layout.points,
        [merged.sigmas[k] for k in range(len(window.point_taps))],
        [t.accumulator.count for t in window.point_taps],
        [t.dim for t in window.point_taps],
        margins,
    )
