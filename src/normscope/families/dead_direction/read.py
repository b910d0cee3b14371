"""One dead-direction read, one path: solve the window, gather, assemble the report.

A read has three steps, the same for every loop, process count and schedule (docs/design.md,
"The path of one read"):

1. the tracker freezes its window (:meth:`DeadDirectionTracker.take
   <normscope.families.dead_direction.tracker.DeadDirectionTracker.take>`, after its reduce);
2. :func:`solve_window` runs the float64 solves as a fixed list of jobs, all of them or one
   rank's round-robin share, on any thread (the engine's worker too): no collective, no
   tracker, only the window;
3. :func:`finish_report` (main thread) takes every rank's records (:func:`gather_records`) and
   the tracker's memory as values (:class:`~normscope.families.dead_direction.window.ReadMemory`)
   and returns the report with the
   :class:`~normscope.families.dead_direction.window.MemoryUpdate` the tracker applies.

Example::

    window = tracker.take(step=10, swap=True)   # the taps start a new window
    records = solve_window(window)              # on any thread
    report = tracker.finish(window, [records])  # finish_report, then the update applied
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from normscope.families.dead_direction.report import (
    DeadDirectionReport,
    NormReport,
    rank_deficiency_note,
)
from normscope.families.dead_direction.solve import (
    anchors,
    point_from_spectrum,
    point_sigma,
    profile_from_parts,
    read_norm,
    read_norm_cheap,
    read_sources_of,
)
from normscope.families.dead_direction.stream import attention_reads, stream_keys, stream_reads
from normscope.families.dead_direction.window import (
    MemoryUpdate,
    ReadMemory,
    ReadRecords,
    ReadWindow,
)
from normscope.functional.covariance import fetch_counts
from normscope.functional.dead_direction import GammaRead
from normscope.functional.gamma import gamma_reads

__all__ = ["finish_report", "gather_records", "solve_window"]


def _jobs(window: ReadWindow) -> list[tuple[str, Any]]:
    jobs: list[tuple[str, Any]] = [("norm", n) for n in window.norms if n.name not in window.skip]
    # the profile's points and the per-source profiles are the spectral tier's
    if window.spectral and window.profile_on and window.layout is not None and window.point_taps:
        covered = set(window.covers.values())
        jobs += [("point", k) for k in range(len(window.point_taps)) if k not in covered]
        jobs += [("source", name) for name in window.sources or {}]
    jobs.append(("stream", None))  # docs/metrics.md §1.6, one job for the whole window
    if window.attention is not None:
        jobs.append(("attention", None))  # docs/metrics.md §1.7
    return jobs


def solve_window(window: ReadWindow, share: tuple[int, int] = (0, 1)) -> ReadRecords:
    """Rank ``share[0]``'s round-robin share of the ``share[1]``-way split solves of ``window``
    (``(0, 1)``: all of them). Never raises: a layer's failure is recorded for
    :func:`finish_report`, anything else in :attr:`ReadRecords.error`. Touches no tracker
    state."""
    out = ReadRecords()
    rank, world = share
    try:
        # every row count and rejected count on the host in one copy (a read asks for them
        # many times: the accumulators keep them until their state changes)
        accs = [t.accumulator for t in window.taps]
        accs += [a for group in (window.sources or {}).values() for a in group]
        fetch_counts(accs)
        jobs = [job for i, job in enumerate(_jobs(window)) if i % world == rank]
        window.gamma_reads = _gamma_reads(window, [job[1] for job in jobs if job[0] == "norm"])
        for job in jobs:
            _solve_job(window, job, out)
    except Exception as err:  # noqa: BLE001 - the monitor decides (fail-open)
        out.error = f"{type(err).__name__}: {err}"
    return out


def _gamma_reads(window: ReadWindow, norms: list[Any]) -> dict[str, GammaRead]:
    """The gamma reads of ``norms`` in one batch (:func:`gamma_reads`: one copy to the host),
    by norm name; a gamma the batch cannot take (not a real 1-D tensor) or a batch that failed
    is left to its norm's job, whose failure is that layer's only."""
    names = [
        n.name
        for n in norms
        if isinstance(g := window.gammas.get(n.name), torch.Tensor)
        and g.ndim == 1
        and g.numel() > 0
        and not g.is_complex()
    ]
    try:
        return dict(zip(names, gamma_reads([window.gammas[n] for n in names])))
    except Exception:  # noqa: BLE001 - each norm's job reads its own gamma again
        return {}


def _solve_job(window: ReadWindow, job: tuple, out: ReadRecords) -> None:
    kind, what = job
    if kind == "norm":
        _solve_norm(window, what, out)
        return
    out.solves += 1
    try:
        if kind == "point":
            acc = window.point_taps[what].accumulator
            anchor = anchors(window.layout)
            out.sigmas[what] = point_sigma(acc.second_moment(), acc.count, anchor=anchor)
        elif kind == "source":
            assert window.sources is not None
            out.sources.update(read_sources_of({what: window.sources[what]}, window.layout))
        elif kind == "stream":
            out.stream.update(stream_reads(window))
        elif kind == "attention":
            out.stream.update(attention_reads(window.attention))
    except Exception as err:  # noqa: BLE001
        why = f"{type(err).__name__}: {err}"
        if kind == "attention":
            out.stream["attn_modules_read"] = 0.0  # said out loud; the other reads stand
        elif kind == "stream":
            out.stream["stream_failed"] = 1.0  # the other reads stand; these are NaN
        elif kind == "source":
            out.sources_failure = out.sources_failure or why
        else:
            out.profile_failure = out.profile_failure or why


def _solve_norm(window: ReadWindow, norm: Any, out: ReadRecords) -> None:
    tap_in, tap_out = window.norm_taps[norm.name]
    if not window.spectral:  # the cheap tier: gamma and the row count, no matrix
        try:
            gamma = window.gamma_reads.get(norm.name, window.gammas[norm.name])
            out.norms[norm.name] = read_norm_cheap(norm, tap_out, gamma)
        except Exception as err:  # noqa: BLE001 - one layer's failure is that layer's only
            out.norm_failures[norm.name] = f"{type(err).__name__}: {err}"
            return
        out.solves += 1
        return
    point = window.covers.get(norm.name)
    report = None
    try:
        gamma = window.gamma_reads.get(norm.name, window.gammas[norm.name])
        report = read_norm(norm, tap_in, tap_out, gamma, window.null_tol, window.placement)
    except Exception as err:  # noqa: BLE001 - one layer's failure is that layer's only
        out.norm_failures[norm.name] = f"{type(err).__name__}: {err}"
    if point is not None:  # the residual point this norm reads: a read of the profile's
        try:
            spectrum = report.spectrum if report is not None else None
            out.sigmas[point] = point_from_spectrum(
                tap_in.accumulator, spectrum, anchor=anchors(window.layout)
            )
        except Exception as err:  # noqa: BLE001 - the profile's failure, not the norm's
            out.profile_failure = out.profile_failure or f"{type(err).__name__}: {err}"
    if report is None:
        return
    out.norms[norm.name] = dataclasses.replace(report, spectrum=None)
    out.solves += 1


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
    """The records with every tensor of the norm reports (gamma's ``v_star`` and
    ``dead_centring``) on the CPU: a pickled CUDA tensor would be unpickled onto the sender's
    device."""
    norms = {}
    for name, report in records.norms.items():
        moved = {
            field: v.cpu()
            for field in ("v_star", "dead_centring")
            if isinstance(v := getattr(report.gamma, field), torch.Tensor)
            and v.device.type != "cpu"
        }
        if moved:
            report = dataclasses.replace(report, gamma=dataclasses.replace(report.gamma, **moved))
        norms[name] = report
    return dataclasses.replace(records, norms=norms)


def finish_report(
    window: ReadWindow, parts: list[ReadRecords], memory: ReadMemory
) -> tuple[DeadDirectionReport, MemoryUpdate]:
    """The report of ``window`` from every rank's records (one record without a share) and
    the tracker's ``memory``, with what the tracker is to remember: the failures met (each
    disabled layer to be warned about once), the stream reads' new baselines, the note on
    inputs that do not span (:func:`~normscope.families.dead_direction.report.rank_deficiency_note`).
    The profile is put together here, in one place (:func:`profile_from_parts`)."""
    merged = ReadRecords()
    for part in parts:
        merged.norms.update(part.norms)
        merged.norm_failures.update(part.norm_failures)
        merged.sigmas.update(part.sigmas)
        merged.sources.update(part.sources)
        merged.stream.update(part.stream)
        merged.profile_failure = merged.profile_failure or part.profile_failure
        merged.sources_failure = merged.sources_failure or part.sources_failure
    update = MemoryUpdate()
    norms: dict[str, NormReport] = {}
    for norm in window.norms:  # the tracker's order, whoever solved it
        if norm.name in merged.norm_failures:
            update.failed_reads[norm.name] = merged.norm_failures[norm.name]
        elif norm.name in merged.norms:
            norms[norm.name] = merged.norms[norm.name]
    profile = None
    profile_failed = memory.profile_failed
    if merged.profile_failure is not None:
        if profile_failed is None:
            profile_failed = update.profile_failed = merged.profile_failure
    elif window.spectral and window.profile_on and window.layout is not None and window.point_taps:
        profile = profile_from_parts(
            window.layout.points,
            # a point whose job met a failure before it was read: NaN, said (never a KeyError)
            [
                merged.sigmas.get(k, (math.nan, "not_read", 0))
                for k in range(len(window.point_taps))
            ],
            [t.accumulator.count for t in window.point_taps],
            [t.dim for t in window.point_taps],
            window.placement,
        )
    rejected = sum(t.accumulator.rows_rejected for t in window.taps)
    failed = dict(window.failed_taps)
    failed_reads = {**memory.failed_reads, **update.failed_reads}
    failed.update({f"{name}:read": why for name, why in failed_reads.items()})
    if profile_failed is not None:
        failed["profile:read"] = profile_failed
    stream, update.gain_baselines, update.previous_rms = stream_keys(
        window, merged.stream, memory.gain_baselines, memory.previous_rms
    )
    report = DeadDirectionReport(
        window.step,
        norms,
        profile,
        window.layout,
        rejected,
        failed,
        stream=stream,
        spectral=window.spectral,
    )
    if window.sources is not None and profile is not None:
        if merged.sources_failure is not None:
            update.sources_failed = merged.sources_failure
        else:
            srcs = {n: merged.sources[n] for n in sorted(merged.sources)}
            report = dataclasses.replace(report, sources=srcs, source_rule=memory.source_rule)
    if not memory.rank_warned and window.spectral:
        update.rank_note = rank_deficiency_note(report)
    return report, update
