"""One dead-direction read, one path: take the window, solve it, assemble the report.

A read has three parts, the same for every loop, every process count and both schedules:

1. :func:`take_window` (main thread, after the cross-rank reduce :func:`reduce_taps`) freezes
   what the read needs. With ``swap=True`` (an asynchronous read) every accumulator is
   shallow-copied -- the copy keeps *references* to the window's state tensors -- and the live
   taps are ``reset()``: each allocates fresh zero tensors, so the next window folds into new
   memory while the read holds the old (a swap, no ``d x d`` copy). With ``swap=False`` the
   read takes the live accumulators and the caller resets them after.
2. :func:`solve_window` runs the float64 solves as a fixed list of jobs (norm layers in the
   tracker's order, then the residual points' ``sigma_min``, the margins, the sources). One
   process solves them all: share ``(0, 1)``; under DDP every rank holds the same reduced
   accumulators and solves every ``world``-th job (round robin). It runs anywhere (the worker
   thread too): no collective, no tracker state but the baselines it sets.
3. :func:`finish_report` (main thread) takes every rank's records (gathered first under a share,
   :func:`gather_records`), applies the failures they met and assembles the
   :class:`~normscope.families.dead_direction_report.DeadDirectionReport`. The profile is
   built in one place, from each point's solved ``sigma_min`` (:func:`profile_from_parts`).

A synchronous read is these three in a row (:meth:`DeadDirectionTracker.read
<normscope.families.dead_direction.DeadDirectionTracker.read>`); an asynchronous one runs step 2
on the engine's worker.

Example::

    window = take_window(tracker, step=10, swap=True)   # the taps start a new window
    records = solve_window(tracker, window)             # on any thread
    report = finish_report(tracker, window, [records])
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from normscope._common import warn_disabled
from normscope.functional.cancellation import no_cancellation_margin
from normscope.functional.dead_direction import SchurRead, gamma_read, kernel_read, schur_quotient
from normscope.functional.profile import SigmaMinProfile, profile_from_sigmas, sigma_min_profile
from normscope.families.dead_direction_report import DeadDirectionReport, NormReport
from normscope.taps.hooks import Tap
from normscope.taps.norms import NormLayer
from normscope.taps.residual import ResidualLayout

if TYPE_CHECKING:
    from normscope.families.dead_direction import DeadDirectionTracker

__all__ = [
    "ReadRecords",
    "ReadWindow",
    "finish_report",
    "gather_records",
    "point_sigma",
    "profile_from_parts",
    "read_norm",
    "read_share",
    "read_sources_of",
    "reduce_taps",
    "solve_window",
    "take_window",
]


# ------------------------------------------------------------------------ the window
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
    profile_failure: str | None = None
    sources: dict[str, Any] = field(default_factory=dict)
    sources_failure: str | None = None
    solves: int = 0  # jobs this rank solved (tests: each rank solves its share only)
    error: str | None = None  # the solve itself failed: the monitor disables itself


def reduce_taps(tracker: DeadDirectionTracker) -> None:
    """The cross-rank reduce of every accumulator of ``tracker`` (a collective: every rank, the
    same order); then every rank holds the same window."""
    for tap in tracker.taps.taps.values():  # same order on every rank
        tap.accumulator.reduce_()
    for acc in tracker.cross_moments():
        acc.reduce_()
    if tracker.split is not None:
        tracker.split.reduce_()  # source names agreed across ranks first


def read_share() -> tuple[int, int]:
    """``(rank, world)`` of this process under ``torch.distributed``; ``(0, 1)`` alone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _frozen(tap: Tap) -> Tap:
    return dataclasses.replace(tap, accumulator=copy.copy(tap.accumulator))


def take_window(tracker: DeadDirectionTracker, step: int, *, swap: bool) -> ReadWindow:
    """Freeze the window of ``tracker`` (after its reduce). ``swap``: the live accumulators are
    reset (fresh tensors) and the read keeps the old ones; else the window reads the live ones
    (the synchronous read, which resets after)."""
    live = list(tracker.taps.taps.values())
    frozen = {t.key: (_frozen(t) if swap else t) for t in live}
    cross = list(tracker.cross_moments())
    cross = [copy.copy(a) for a in cross] if swap else cross
    split = tracker.split
    sources = None
    if split is not None and split.failed is None:
        sources = {
            n: ([copy.copy(a) for a in split.accs[n]] if swap else split.accs[n])
            for n in sorted(split.accs)
        }
    norm_taps = {
        name: (frozen[a.key], frozen[b.key]) for name, (a, b) in tracker.norm_taps.items()
    }
    skip = {
        n.name
        for n in tracker.norms
        if n.name in tracker.failed_reads or any(t.failed for t in tracker.norm_taps[n.name])
    }
    window = ReadWindow(
        step=step,
        norms=list(tracker.norms),
        norm_taps=norm_taps,
        gammas=tracker.window_gammas(),
        skip=skip,
        point_taps=[frozen[t.key] for t in tracker.point_taps],
        cross=cross,
        sources=sources,
        layout=tracker.layout,
        profile_on=tracker.profile_failed is None,
        taps=[frozen[t.key] for t in live],
        failed_taps={f"{t.module_name}:{t.where}": t.failed for t in live if t.failed},
    )
    if swap:
        tracker.reset()
        for old, tap in zip(window.taps, live):
            # reset() must give the live taps new tensors: one zeroed in place would wipe the
            # window the read holds (never silently read zeros)
            if old.accumulator.comoment is tap.accumulator.comoment:
                raise RuntimeError("normscope: an accumulator's reset() reused its tensors")
    return window


# ------------------------------------------------------------------------ the solves
def _jobs(window: ReadWindow) -> list[tuple[str, Any]]:
    jobs: list[tuple[str, Any]] = [("norm", n) for n in window.norms if n.name not in window.skip]
    if window.profile_on and window.layout is not None and window.point_taps:
        jobs += [("point", k) for k in range(len(window.point_taps))]
        if len(window.cross) == len(window.point_taps) - 1:
            jobs += [("margin", k) for k in range(1, len(window.point_taps))]
        jobs += [("source", name) for name in window.sources or {}]
    return jobs


def solve_window(
    tracker: DeadDirectionTracker, window: ReadWindow, share: tuple[int, int] = (0, 1)
) -> ReadRecords:
    """Rank ``share[0]``'s round-robin share of the ``share[1]``-way split solves of ``window``
    (``(0, 1)``: all of them). Never raises: a layer's failure is recorded for
    :func:`finish_report`, anything else in :attr:`ReadRecords.error`. Touches no tracker state
    but ``baselines`` / ``baseline_rows`` (Delta_gamma's first read)."""
    out = ReadRecords()
    rank, world = share
    try:
        for i, job in enumerate(_jobs(window)):
            if i % world == rank:
                _solve_job(tracker, window, job, out)
    except Exception as err:  # noqa: BLE001 - the monitor decides (fail-open)
        out.error = f"{type(err).__name__}: {err}"
    return out


def _solve_job(tracker: DeadDirectionTracker, window: ReadWindow, job: tuple, out: ReadRecords):
    kind, what = job
    if kind == "norm":
        _solve_norm(tracker, window, what, out)
        return
    out.solves += 1
    try:
        if kind == "point":
            acc = window.point_taps[what].accumulator
            out.sigmas[what] = point_sigma(acc.second_moment(), acc.count)
        elif kind == "margin":
            acc, prev = window.cross[what - 1], window.point_taps[what - 1].accumulator
            # lambda_min(S_{k-1}) is p_{k-1}'s sigma_min squared: solved once when this rank has it
            before = out.sigmas.get(what - 1, (math.nan,))[0]
            known = before**2 if math.isfinite(before) and before > 0 else None
            margin = no_cancellation_margin(
                acc.moment(), prev.second_moment(), acc.count, previous_lambda_min=known
            )
            out.margins[what] = margin[0]
        elif kind == "source":
            assert window.sources is not None
            out.sources.update(read_sources_of({what: window.sources[what]}, window.layout))
    except Exception as err:  # noqa: BLE001
        why = f"{type(err).__name__}: {err}"
        if kind == "source":
            out.sources_failure = out.sources_failure or why
        else:
            out.profile_failure = out.profile_failure or why


def _solve_norm(tracker: DeadDirectionTracker, window: ReadWindow, norm: Any, out: ReadRecords):
    had = norm.name in tracker.baselines
    tap_in, tap_out = window.norm_taps[norm.name]
    try:
        out.norms[norm.name] = tracker.read_norm(norm, tap_in, tap_out, window.gammas[norm.name])
    except Exception as err:  # noqa: BLE001 - one layer's failure is that layer's only
        out.norm_failures[norm.name] = f"{type(err).__name__}: {err}"
        return
    if not had and norm.name in tracker.baselines:
        out.baselines[norm.name] = (tracker.baselines[norm.name], tracker.baseline_rows[norm.name])
    out.solves += 1


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
        tap_out.accumulator.covariance(), g, n_out, null_tol=null_tol, declared_kind=norm.kind
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


def point_sigma(second_moment: torch.Tensor, n_rows: int) -> tuple[float, str | None, int]:
    """One point's ``(sigma_min, reason, dense_fallbacks)``, as
    :func:`~normscope.functional.profile.sigma_min_profile` reads it (its own reason:
    ``insufficient_rows``, ``non_finite_second_moment``, ``eigh_failed`` or None;
    ``dense_fallbacks``: 1 when the fast solver could not verify it).

    Example::

        >>> point_sigma(4 * torch.eye(2), 8)
        (2.0, None, 0)
    """
    profile = sigma_min_profile(["p"], [second_moment], [n_rows], [None])
    point = profile.points[0]
    reason = None if point.reason == "first_point_unavailable" else point.reason
    return point.sigma_min, reason, profile.dense_fallbacks


def profile_from_parts(
    points: Sequence[Any],
    sigmas: Sequence[tuple],
    n_rows: Sequence[int],
    dims: Sequence[int],
    margins: Sequence[float] | None = None,
) -> SigmaMinProfile:
    """The profile of ``points`` (residual points: ``name``, ``sublayer``) from each point's
    :func:`point_sigma`, row count and width (the dense fallbacks summed); ``margins``:
    ``p_1 ... p_L``'s no-cancellation margins (None: not measured). The one profile builder of
    the monitor's reads.

    Example::

        >>> from types import SimpleNamespace as P
        >>> parts = [point_sigma(m, 8) for m in (torch.eye(2), 4 * torch.eye(2))]
        >>> points = [P(name="embed", sublayer=None), P(name="h.0", sublayer="block")]
        >>> profile_from_parts(points, parts, [8, 8], [2, 2]).sigma_min_ratio_min
        2.0
    """
    profile = profile_from_sigmas(
        [p.name for p in points],
        [p.sublayer for p in points],
        [(s[0], s[1]) for s in sigmas],
        n_rows,
        dims,
        dense_fallbacks=sum(s[2] if len(s) > 2 else 0 for s in sigmas),
    )
    if margins is None:
        return profile
    return dataclasses.replace(profile, no_cancellation_margin=(math.nan, *margins))


def read_sources_of(
    accs_by_source: dict[str, list], layout: ResidualLayout
) -> dict[str, SigmaMinProfile]:
    """One profile per source, on its own rows (NaN with ``insufficient_rows`` below ``2 d``
    rows at a point), from the per-source accumulators by source name."""
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


# ------------------------------------------------------------------------ the report
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


def _warn_disabled(what: str, reason: str) -> None:
    warn_disabled(what, reason, stacklevel=4)


def finish_report(
    tracker: DeadDirectionTracker, window: ReadWindow, parts: list[ReadRecords]
) -> DeadDirectionReport:
    """The report of ``window`` from every rank's records (one record without a share): the
    failures applied to ``tracker`` (each disabled layer warned about once), the baselines
    other ranks set merged in, the profile put together (:func:`profile_from_parts`)."""
    merged = ReadRecords()
    for part in parts:
        merged.norms.update(part.norms)
        merged.norm_failures.update(part.norm_failures)
        merged.baselines.update(part.baselines)
        merged.sigmas.update(part.sigmas)
        merged.margins.update(part.margins)
        merged.sources.update(part.sources)
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
    profile = None
    if merged.profile_failure is not None:
        if tracker.profile_failed is None:
            tracker.profile_failed = merged.profile_failure
            _warn_disabled("the residual sigma_min profile", merged.profile_failure)
    elif window.profile_on and window.layout is not None and window.point_taps:
        margins = None
        if len(window.cross) == len(window.point_taps) - 1:
            margins = [merged.margins[k] for k in range(1, len(window.point_taps))]
        profile = profile_from_parts(
            window.layout.points,
            [merged.sigmas[k] for k in range(len(window.point_taps))],
            [t.accumulator.count for t in window.point_taps],
            [t.dim for t in window.point_taps],
            margins,
        )
    rejected = sum(t.accumulator.rows_rejected for t in window.taps)
    failed = dict(window.failed_taps)
    failed.update({f"{name}:read": why for name, why in tracker.failed_reads.items()})
    if tracker.profile_failed is not None:
        failed["profile:read"] = tracker.profile_failed
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
