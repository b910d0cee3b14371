"""The reads of a tracker's taps: a norm layer's (with Delta_gamma's baseline) and the profiles."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from normscope._common import warn_disabled
from normscope.functional.cancellation import no_cancellation_margin
from normscope.functional.dead_direction import SchurRead, gamma_read, kernel_read, schur_quotient
from normscope.functional.profile import SigmaMinProfile, sigma_min_profile
from normscope.monitors.dead_direction_report import DeadDirectionReport, NormReport
from normscope.monitors.read_window import (
    finish_report,
    gather_records,
    solve_window,
    take_window,
)
from normscope.taps.chain import PointChain
from normscope.taps.hooks import Tap
from normscope.taps.norms import NormLayer
from normscope.taps.residual import ResidualLayout
from normscope.taps.sources import SourceSplit

if TYPE_CHECKING:
    from normscope.monitors.dead_direction import DeadDirectionTracker

__all__ = [
    "cross_moments",
    "read_norm",
    "read_profile",
    "read_report",
    "read_share",
    "read_sources",
    "reduce_taps",
]


def read_report(
    tracker: DeadDirectionTracker, step: int, *, reduce: bool, split: bool | None = None
) -> DeadDirectionReport:
    """:meth:`DeadDirectionTracker.read <normscope.monitors.dead_direction.DeadDirectionTracker.read>`
    without the reset: reduce across processes (``reduce``), read every norm layer, the
    profile and the per-source profiles; a read that fails is disabled for the rest of the run
    with a warning while the others go on.

    ``split`` (default: ``reduce`` under more than one process): after the reduce every rank
    holds the same accumulators, so each solves a round-robin share of the layers and points
    and the records are gathered (:mod:`normscope.monitors.read_window`): every rank ends with
    the same full report, the read time falls with the world size."""
    if reduce:
        reduce_taps(tracker)
    share = read_share() if (reduce if split is None else split) else None
    window = take_window(tracker, step, swap=False)
    records = solve_window(tracker, window, share)
    parts = gather_records(records) if share is not None else [records]
    tracker.last_solves = records.solves
    errors = [p.error for p in parts if p.error is not None]
    if errors:
        raise RuntimeError(f"the read failed: {errors[0]}")
    return finish_report(tracker, window, parts)


def reduce_taps(tracker: DeadDirectionTracker) -> None:
    """The cross-rank reduce of every accumulator of ``tracker`` (a collective: every rank, the
    same order); then every rank holds the same window."""
    for tap in tracker.taps.taps.values():  # same order on every rank
        tap.accumulator.reduce_()
    # every rank holds the same cross-moments (a local failure only stops reading them)
    for acc in tracker.taps.chain.cross if tracker.taps.chain is not None else ():
        acc.reduce_()
    if tracker.split is not None:
        tracker.split.reduce_()  # source names agreed across ranks first


def read_share() -> tuple[int, int] | None:
    """``(rank, world)`` of this process under ``torch.distributed`` with more than one
    process, else None (one process reads everything)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def read_norm(
    norm: NormLayer,
    tap_in: Tap,
    tap_out: Tap,
    gamma: torch.Tensor,
    null_tol: float,
    baselines: dict[str, float],
    baseline_rows: dict[str, int],
) -> NormReport:
    """Every read of ``norm`` from its input and output taps, with the window's ``gamma``.
    Delta_gamma's baseline is ``baselines[norm.name]`` (its Schur complement ``s``) on
    ``baseline_rows[norm.name]`` rows; without one, this read becomes it (both dicts updated)."""
    g = gamma_read(gamma)
    n_out = tap_out.accumulator.count
    n_in = tap_in.accumulator.count
    kernel = kernel_read(
        tap_out.accumulator.covariance(),
        g,
        n_out,
        null_tol=null_tol,
        declared_kind=norm.kind,
    )
    base = None
    if norm.name in baselines:
        rows = baseline_rows.get(norm.name, n_in)
        base = SchurRead(math.nan, baselines[norm.name], None, rows)
    cov_in = tap_in.accumulator.covariance()
    schur = schur_quotient(cov_in, g, n_in, declared_kind=norm.kind, baseline=base)
    if base is None and math.isfinite(schur.schur_complement):
        # docs/metrics.md §1.3: the run's first read (scan: the random-init twin's) is the baseline
        baselines[norm.name] = schur.schur_complement
        baseline_rows[norm.name] = n_in
        schur = schur_quotient(cov_in, g, n_in, declared_kind=norm.kind, baseline=schur)
    return NormReport(norm.name, norm.kind, g, kernel, schur, schur.deepening, n_out)


def read_profile(
    layout: ResidualLayout | None, point_taps: list[Tap], cross: list
) -> SigmaMinProfile | None:
    """The residual ``sigma_min`` profile from the points' taps, with the no-cancellation
    margin when ``cross`` holds one cross-moment per pair of consecutive points."""
    if layout is None or not point_taps:
        return None
    points = layout.points
    moments = [t.accumulator.second_moment() for t in point_taps]
    profile = sigma_min_profile(
        [p.name for p in points],
        moments,
        [t.accumulator.count for t in point_taps],
        [p.sublayer for p in points],
    )
    if len(cross) != len(points) - 1:
        return profile
    margins = [math.nan]  # p_0: nothing before it
    for k, acc in enumerate(cross, start=1):
        # lambda_min(S_{k-1}) is p_{k-1}'s sigma_min squared: solved once, for both reads
        before = profile.points[k - 1].sigma_min
        known = before**2 if math.isfinite(before) and before > 0 else None
        margin = no_cancellation_margin(
            acc.moment(), moments[k - 1], acc.count, previous_lambda_min=known
        )
        margins.append(margin[0])
    return dataclasses.replace(profile, no_cancellation_margin=tuple(margins))


def read_sources(split: SourceSplit, layout: ResidualLayout) -> dict[str, SigmaMinProfile]:
    """One profile per source, on its own rows (NaN with ``insufficient_rows`` below
    ``2 d`` rows at a point)."""
    return read_sources_of(split.accs, layout)


def read_sources_of(
    accs_by_source: dict[str, list], layout: ResidualLayout
) -> dict[str, SigmaMinProfile]:
    """:func:`read_sources` of the given per-source accumulators (by source name; a window's,
    or a rank's share of them)."""
    points = layout.points
    out: dict[str, SigmaMinProfile] = {}
    for name in sorted(accs_by_source):
        accs = accs_by_source[name]
        out[name] = sigma_min_profile(
            [p.name for p in points],
            [a.second_moment() for a in accs],
            [a.count for a in accs],
            [p.sublayer for p in points],
        )
    return out


def cross_moments(chain: PointChain | None) -> list:
    """The cross-moments between consecutive residual points of ``chain`` (empty without a
    chain or once they failed)."""
    if chain is None or chain.cross_failed is not None:
        return []
    return chain.cross


def _warn_disabled(what: str, reason: str) -> None:
    # one frame deeper than the tracker's own: the warning names the caller of ``read``
    warn_disabled(what, reason, stacklevel=4)
