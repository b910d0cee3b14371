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
from normscope.taps.chain import PointChain
from normscope.taps.hooks import Tap
from normscope.taps.norms import NormLayer
from normscope.taps.residual import ResidualLayout
from normscope.taps.sources import SourceSplit

if TYPE_CHECKING:
    from normscope.monitors.dead_direction import DeadDirectionTracker

__all__ = ["cross_moments", "read_norm", "read_profile", "read_report", "read_sources"]


def read_report(tracker: DeadDirectionTracker, step: int, *, reduce: bool) -> DeadDirectionReport:
    """:meth:`DeadDirectionTracker.read <normscope.monitors.dead_direction.DeadDirectionTracker.read>`
    without the reset: reduce across processes (``reduce``), read every norm layer, the
    profile and the per-source profiles; a read that fails is disabled for the rest of the run
    with a warning while the others go on."""
    if reduce:
        for tap in tracker.taps.taps.values():  # same order on every rank
            tap.accumulator.reduce_()
        # every rank holds the same cross-moments (a local failure only stops reading them)
        for acc in tracker.taps.chain.cross if tracker.taps.chain is not None else ():
            acc.reduce_()
        if tracker.split is not None:
            tracker.split.reduce_()  # source names agreed across ranks first
    norms: dict[str, NormReport] = {}
    for norm in tracker.norms:
        tap_in, tap_out = tracker._norm_taps[norm.name]
        if norm.name in tracker.failed_reads or tap_in.failed or tap_out.failed:
            continue  # disabled: its own warning said why; the other layers are read
        try:
            norms[norm.name] = tracker._read_norm(norm)
        except Exception as err:  # noqa: BLE001 - one layer's failure is that layer's only
            tracker.failed_reads[norm.name] = f"{type(err).__name__}: {err}"
            _warn_disabled(f"the read of norm layer {norm.name!r}", tracker.failed_reads[norm.name])
    profile = None
    if tracker._profile_failed is None:
        try:
            profile = tracker._read_profile()
        except Exception as err:  # noqa: BLE001
            tracker._profile_failed = f"{type(err).__name__}: {err}"
            _warn_disabled("the residual sigma_min profile", tracker._profile_failed)
    rejected = sum(t.accumulator.rows_rejected for t in tracker.taps.taps.values())
    failed = {
        f"{t.module_name}:{t.where}": t.failed for t in tracker.taps.taps.values() if t.failed
    }
    failed.update({f"{name}:read": why for name, why in tracker.failed_reads.items()})
    if tracker._profile_failed is not None:
        failed["profile:read"] = tracker._profile_failed
    report = DeadDirectionReport(step, norms, profile, tracker.layout, rejected, failed)
    if tracker.split is not None and tracker.split.failed is None and profile is not None:
        try:
            report = dataclasses.replace(
                report, sources=tracker._read_sources(), source_rule=tracker.source_rule
            )
        except Exception as err:  # noqa: BLE001 - the per-source reads only
            tracker.split.failed = f"{type(err).__name__}: {err}"
            _warn_disabled("the per-source reads", tracker.split.failed)
    return report


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
        margins.append(no_cancellation_margin(acc.moment(), moments[k - 1], acc.count)[0])
    return dataclasses.replace(profile, no_cancellation_margin=tuple(margins))


def read_sources(split: SourceSplit, layout: ResidualLayout) -> dict[str, SigmaMinProfile]:
    """One profile per source, on its own rows (NaN with ``insufficient_rows`` below
    ``2 d`` rows at a point)."""
    points = layout.points
    out: dict[str, SigmaMinProfile] = {}
    for name in sorted(split.accs):
        accs = split.accs[name]
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
