"""The dead-direction reads on a schedule, independent of any trainer.

:class:`DeadDirectionTracker` finds a model's norm layers and residual points
(:mod:`normscope.taps`), hooks them once, accumulates rows while its gate is open and, on
:meth:`~DeadDirectionTracker.read`, reduces across processes and runs every read of METRICS.md
§1 into a :class:`DeadDirectionReport`. :func:`normscope.scan_model` and the Lightning
``DeadDirectionMonitor`` are thin drivers of it.

Per norm layer two tensors are tapped: its input ``h`` (covariance ``C_h`` for the Schur quotient,
second moment for ``sigma_min`` where the input is a residual point) and its output (covariance
``C`` for the kernel reads). A residual point that is not a norm input (a post-LN block output, say)
gets a tap of its own. Taps are shared: one accumulator per ``(module, input|output)``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normscope._common import fmt_bytes, warn_disabled
from normscope.functional.cancellation import no_cancellation_margin
from normscope.functional.dead_direction import (
    GammaRead,
    KernelRead,
    SchurRead,
    gamma_read,
    kernel_read,
    schur_quotient,
)
from normscope.functional.profile import SigmaMinProfile, sigma_min_profile
from normscope.taps.hooks import Gate, Tap, TapSet
from normscope.taps.norms import NormLayer, find_norm_layers
from normscope.taps.residual import (
    ResidualDiscovery,
    ResidualLayout,
    ResidualPoint,
    find_residual_points,
)
from normscope.taps.sources import SourceLabels, SourceSpec, SourceSplit, resolve_labels

__all__ = ["DeadDirectionReport", "DeadDirectionTracker", "NormReport", "key_path"]

FAMILY = "dd"
NORM_CLASS_CODE = {"layernorm-like": 1.0, "rmsnorm-like": -1.0, "indeterminate": 0.0}
_COMPILE_WRAPPER = "_orig_mod"  # torch.compile's OptimizedModule holds the model under this name


def key_path(path: str) -> str:
    """A module path as metric keys spell it: without the ``_orig_mod`` segments that
    ``torch.compile(submodule)`` inserts, so a compiled run, an eager run and a scan log the
    same keys.

    Example::

        >>> key_path("model._orig_mod.h.0.ln_1")
        'model.h.0.ln_1'
        >>> key_path("_orig_mod.ln_f/sigma_min")
        'ln_f/sigma_min'
    """
    parts = path.split(".")
    if _COMPILE_WRAPPER not in parts:
        return path
    return ".".join(p for p in parts if p != _COMPILE_WRAPPER)


@dataclass(frozen=True)
class NormReport:
    """Every read of one norm layer (METRICS §1.1–1.3)."""

    name: str
    kind: str
    gamma: GammaRead
    kernel: KernelRead
    schur: SchurRead
    deepening: float
    n_rows: int

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        out.update(self.gamma.as_dict())
        out.update(self.kernel.as_dict())
        out.update(self.schur.as_dict())
        # norm_class as a number (loggers take numbers): +1 layernorm-like, -1 rmsnorm-like,
        # 0 indeterminate, NaN when not read.
        out["norm_class"] = NORM_CLASS_CODE.get(self.kernel.norm_class, math.nan)
        out["deepening"] = self.deepening
        out["n_rows"] = float(self.n_rows)
        return out


@dataclass(frozen=True)
class DeadDirectionReport:
    """One read of a whole model: ``norms`` by module path, the ``profile``, row counts.

    ``as_dict()`` is flat and keyed as the monitor logs (METRICS §3): ``dd/<module path>/<metric>``
    for each norm and residual point, ``dd/<metric>`` for the run-level summaries.
    """

    step: int
    norms: dict[str, NormReport]
    profile: SigmaMinProfile | None
    layout: ResidualLayout | None
    rows_rejected: int
    failed_taps: dict[str, str] = field(default_factory=dict)
    #: per-source depth profiles (``sources=``), by source name; empty without sources
    sources: dict[str, SigmaMinProfile] = field(default_factory=dict)
    #: the rule whose threshold classifies a collapse (``SigmaMinRatioRule()`` if None)
    source_rule: Any = None

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, norm in self.norms.items():
            for metric, value in norm.as_dict().items():
                out[f"{FAMILY}/{key_path(name)}/{metric}"] = float(value)
        if self.profile is not None:
            for key, value in self.profile.as_dict().items():
                out[f"{FAMILY}/{key_path(key)}"] = float(value)
            steps = [p.sigma_min_step for p in self.profile.points[1:]]
            steps = [s for s in steps if math.isfinite(s)]
            out[f"{FAMILY}/sigma_min_step_min"] = min(steps) if steps else math.nan
            # dd/<point>/no_cancellation_margin and dd/no_cancellation_margin_min come with
            # the profile's keys when the margin was measured
        out[f"{FAMILY}/rows_rejected"] = float(self.rows_rejected)
        # the residual points this read covers: 0 says "no sigma_min profile" out loud
        out[f"{FAMILY}/profile_points"] = (
            float(len(self.profile.points)) if self.profile is not None else 0.0
        )
        # layers (norms, residual points, the profile) no longer read after a failure
        out[f"{FAMILY}/reads_disabled"] = float(
            len({key.rsplit(":", 1)[0] for key in self.failed_taps})
        )
        if self.norms:
            aligned = [
                n.kernel.gamma_alignment for n in self.norms.values() if n.kind == "layernorm"
            ]
            aligned = [a for a in aligned if not math.isnan(a)]
            if aligned:
                out[f"{FAMILY}/gamma_alignment_min"] = min(aligned)
        if self.sources:
            from normscope.monitors.sources import collapse_keys, source_reads

            out.update(source_reads(self.sources, key_path))
            out.update(collapse_keys(out, self.source_rule))
        return out

    @property
    def collapses(self) -> list:
        """The classified collapses (:func:`normscope.monitors.sources.classify_collapses`);
        empty without sources."""
        if not self.sources:
            return []
        from normscope.monitors.sources import classify_collapses

        return classify_collapses(self.as_dict(), self.source_rule)

    @property
    def sigma_min_ratio_min(self) -> float:
        return self.profile.sigma_min_ratio_min if self.profile is not None else math.nan


ForwardFn = Callable[[], Any]


class DeadDirectionTracker:
    """Hooks, accumulators and reads for the dead-direction family, for any PyTorch loop.

    Args:
        model: the model (any ``nn.Module``).
        layers: ``"auto"`` (every norm layer found) or a list of norm module paths.
        residual: also track the residual stream's ``sigma_min`` depth profile (found from
            one forward: the ``forward`` of :meth:`attach`, or the caller's own after
            :meth:`start_discovery`).
        max_rows_per_step: rows kept per tapped tensor per forward (seeded uniform subsample).
        max_memory: byte budget for every accumulator (``8 d^2`` per tapped tensor: a norm's
            input and output, each residual point; a point that is a norm's input is shared).
            Over it (checked at :meth:`attach`, once the points are known), the residual profile
            is kept whole if it fits, else read at a stride over depth (first and last point
            kept), and norm layers are read at a stride over depth with what is left (the final
            norm kept when it fits); a warning names what was left out, and
            :meth:`memory_bytes` stays within the budget.
        null_tol: ``tau`` of ``null_dim`` (METRICS §1.2); raise it for bf16 forwards (~1e-4).
        seed: seed of the row subsampling.
        margin: also measure the no-cancellation margin between consecutive residual points
            (:mod:`normscope.functional.cancellation`: one more ``8 d^2`` per point; under
            ``max_memory`` it is kept after the profile and before the norm layers, whole or
            not at all). The residual points always fold the same sampled rows.
        sources: name each sampled row's source (:mod:`normscope.taps.sources`): ``fn(batch)
            -> str`` (the whole batch), ``fn(batch) -> labels`` (a sequence or tensor, one per
            sample) or a batch field name. Each source gets its own float64 accumulator per
            residual point (the pooled read is unchanged) and its own profile
            (``dd.<source>/<point>/<metric>``), and collapses are classified intrinsic /
            distribution-dependent (:mod:`normscope.monitors.sources`). Label a batch with
            :meth:`label` (the monitors and :func:`normscope.scan_model` do).
        max_sources: sources tracked (the first seen; ``max_memory`` plans for this many:
            ``8 d^2`` per source and point, after the margin, before the norm layers, whole or
            not at all). Rows of later sources stay in the pooled read only (a warning).

    Example::

        tracker = DeadDirectionTracker(model)
        tracker.attach(forward=lambda: model(example_ids))   # discovers residual points
        with tracker.gate.sampling(mask=attention_mask):
            model(input_ids)
        report = tracker.read(step=0)
        report.as_dict()["dd/sigma_min_ratio_min"]
        tracker.detach()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: str | Sequence[str] = "auto",
        residual: bool = True,
        max_rows_per_step: int | None = 4096,
        null_tol: float = 1e-10,
        seed: int = 0,
        max_memory: int | None = None,
        margin: bool = True,
        sources: SourceSpec | None = None,
        max_sources: int = 8,
    ) -> None:
        if sources is not None and not (isinstance(sources, str) or callable(sources)):
            raise TypeError(
                "DeadDirectionTracker: sources must be fn(batch) -> str | labels, or a batch "
                f"field name, got {type(sources).__name__}"
            )
        if not isinstance(max_sources, int) or max_sources < 1:
            raise ValueError(f"DeadDirectionTracker: max_sources must be >= 1, got {max_sources}")
        self.sources = sources
        self.max_sources = max_sources
        self.split: SourceSplit | None = None
        self.source_rule: Any = None  # the SigmaMinRatioRule that classifies; None: default
        self._sources_failed: str | None = None
        self._sources_warned: set[str] = set()
        self.model = model
        self.margin = margin
        self.layers = layers
        self.residual = residual
        self.null_tol = null_tol
        self.gate = Gate()
        self.taps = TapSet(model, self.gate, max_rows=max_rows_per_step, seed=seed)
        self.norms: list[NormLayer] = find_norm_layers(model, layers)
        self.max_memory = max_memory
        self.skipped_norms: list[str] = []
        self.skipped_points: list[str] = []
        self.failed_reads: dict[str, str] = {}
        self.layout: ResidualLayout | None = None
        # Delta_gamma's baseline per norm: its Schur complement s and the rows it was read on
        self.baselines: dict[str, float] = {}
        self.baseline_rows: dict[str, int] = {}
        self._norm_taps: dict[str, tuple[Tap, Tap]] = {}
        self._point_taps: list[Tap] = []
        self._gammas: dict[str, torch.Tensor] = {}
        self._width: int | None = None
        self._profile_failed: str | None = None
        self._discovery: ResidualDiscovery | None = None
        self.attached = False

    # ------------------------------------------------------------------ hooks
    def discover(self, forward: ForwardFn | None) -> ResidualLayout | None:
        """Find the residual points with one forward (``forward()``), before any hook is added."""
        if not self.residual:
            return None
        if forward is None:
            raise ValueError(
                "DeadDirectionTracker: residual=True needs an example forward to find the "
                "residual stream (pass forward=lambda: model(batch)), or set residual=False"
            )
        was_training = self.model.training
        self.model.eval()  # dropout would break the exact x + f(x) identity discovery relies on
        try:
            self.layout = find_residual_points(self.model, forward, self.norms)
        finally:
            self.model.train(was_training)
        return self.layout

    def start_discovery(self) -> bool:
        """Arm residual discovery on the next forward the caller runs itself (a training step's
        own forward, :class:`~normscope.taps.residual.ResidualDiscovery`); the following
        :meth:`attach` decides the points from it and registers the taps. False (nothing
        armed) when ``residual`` is off or the points are known.

        Raises:
            ResidualDiscoveryError: the model has no block stack.
        """
        if not self.residual or self.layout is not None or self.attached:
            return False
        if self._discovery is None:
            self._discovery = ResidualDiscovery(self.model, self.norms).install()
        return True

    def attach(self, forward: ForwardFn | None = None) -> None:
        """Discover residual points (if ``residual``) and register every hook, once.

        After :meth:`start_discovery` and a forward, the points come from that forward and
        ``forward`` is not called."""
        if self.attached:
            return
        if self.layout is None and self._discovery is not None:
            discovery, self._discovery = self._discovery, None
            if self.residual:
                self.layout = discovery.finish()  # removes its hooks first, whatever it finds
            else:
                discovery.remove()
        elif self.layout is None:
            self.discover(forward)
        if self.max_memory is not None:
            self._apply_budget(self.max_memory)
        for norm in self.norms:
            self._norm_taps[norm.name] = (
                self.taps.add(norm.name, "input", norm.dim),
                self.taps.add(norm.name, "output", norm.dim),
            )
        if self.layout is not None and self.layout.points:
            width = self._width or _stream_width(self.norms, self.layout)
            self._point_taps = [
                self.taps.add(p.module_name, p.where, width) for p in self.layout.points
            ]
            if len({t.key for t in self._point_taps}) == len(self._point_taps):
                cross = self.margin and len(self._point_taps) > 1
                chain = self.taps.chain_points(self._point_taps, cross=cross)
                if self.sources is not None:
                    self.split = SourceSplit(
                        [t.dim for t in self._point_taps],
                        [t.accumulator.device for t in self._point_taps],
                        self.max_sources,
                    )
                    chain.split = self.split
        if self.sources is not None and self.split is None:
            self._sources_off("the residual profile is not read (no residual points)")
        self.attached = True

    # --------------------------------------------------------------- sources
    def label(self, batch: Any) -> SourceLabels | None:
        """The sources of ``batch`` (``sources=``), ready for ``gate.sampling(sources=...)`` or
        ``gate.sources``; their accumulators are created here, outside the forward. None
        without ``sources=`` or once the per-source reads are off. Never raises: a labelling
        failure warns once and turns the per-source reads off (the pooled reads go on)."""
        if self.sources is None or self._sources_failed is not None:
            return None
        try:
            labels = resolve_labels(self.sources, batch)
        except Exception as err:  # noqa: BLE001 - the per-source reads only
            self._sources_off(f"labelling a batch failed ({type(err).__name__}: {err})")
            return None
        if self.split is not None:
            self.split.ensure(labels.names)
            new = sorted(self.split.dropped - self._sources_warned)
            if new:
                self._sources_warned.update(new)
                warnings.warn(
                    f"normscope: max_sources={self.max_sources} sources are tracked; rows of "
                    f"{', '.join(new)} stay in the pooled read only",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return labels

    def _sources_off(self, why: str) -> None:
        if self._sources_failed is None:
            self._sources_failed = why
            warnings.warn(
                f"normscope: the per-source reads are off; the pooled reads go on ({why})",
                RuntimeWarning,
                stacklevel=3,
            )

    def _apply_budget(self, budget: int) -> None:
        """Fit the taps in ``budget`` bytes (:func:`_plan_budget`); warn naming what is left
        out. Runs once, at :meth:`attach`, after the residual points are known."""
        points = self.layout.points if self.layout is not None else ()
        width = _stream_width(self.norms, self.layout) if points else 0
        self._width = width or None
        links = self.margin and len(points) > 1
        n_src = self.max_sources if self.sources is not None and points else 0
        full = _tap_cost(self.norms, points, width, links, n_src)
        total_norms = len(self.norms)
        norms, kept, links_kept, src_kept = _plan_budget(
            self.norms, points, width, budget, links, n_src
        )
        self.margin = links_kept
        if n_src and not src_kept:
            self.sources = None
            self._sources_failed = "max_memory"
        if (
            len(norms) == len(self.norms)
            and len(kept) == len(points)
            and links_kept == links
            and src_kept == n_src
        ):
            return
        self.skipped_norms = [n.name for n in self.norms if n not in norms]
        kept_names = {p.name for p in kept}
        self.skipped_points = [p.name for p in points if p.name not in kept_names]
        self.norms = norms
        if self.layout is not None:
            note = (
                f"max_memory: the residual profile reads {len(kept)} of {len(points)} points"
                if self.skipped_points
                else None
            )
            notes = self.layout.notes + ((note,) if note else ())
            self.layout = dataclasses.replace(self.layout, points=tuple(kept), notes=notes)

        def names(items: list[str]) -> str:
            return ", ".join(items[:8]) + (" ..." if len(items) > 8 else "") if items else "none"

        warnings.warn(
            f"normscope: the accumulators of all {total_norms} norm "
            f"layers and {len(points)} residual points need {_fmt_bytes(full)}, over "
            f"max_memory={_fmt_bytes(budget)}; reading {len(norms)} of {total_norms} norm layers "
            f"and {len(kept)} of {len(points)} residual points, at a stride over depth "
            f"({_fmt_bytes(_tap_cost(norms, kept, width, links_kept, src_kept))}); left out: "
            f"norm layers {names(self.skipped_norms)}; residual points "
            f"{names(self.skipped_points)}"
            + ("; the no-cancellation margin (not read)" if links and not links_kept else "")
            + (
                f"; the per-source reads (max_sources={n_src}: not read)"
                if n_src and not src_kept
                else ""
            ),
            RuntimeWarning,
            stacklevel=3,
        )

    def detach(self) -> None:
        """Remove every hook (reads of what was accumulated stay possible)."""
        if self._discovery is not None:
            self._discovery.remove()
            self._discovery = None
        self.taps.remove()
        self.attached = False

    def reset(self) -> None:
        """Start a new window."""
        self.taps.reset()
        self._gammas = {}

    def snapshot_gammas(self) -> None:
        """Keep the gammas the window's forwards run with. A training step updates gamma
        *after* its forward: read at the end of the step, the new gamma would not match the
        rows (the exact kernel belongs to the gamma that produced them). Call it before the
        window's first forward; :meth:`read` falls back to the live gamma without it."""
        if not self._gammas:
            self._gammas = {norm.name: norm.gamma() for norm in self.norms}

    # ------------------------------------------------------------------ reads
    def min_rows(self) -> torch.Tensor:
        """Smallest row count over the live taps, as a device tensor (for a deferral decision)."""
        counts = [t.accumulator.count_tensor for t in self.taps.taps.values() if t.failed is None]
        if not counts:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack([c.to(counts[0].device) for c in counts]).min()

    def read(
        self, step: int = 0, *, reduce: bool = True, reset: bool = True
    ) -> DeadDirectionReport:
        """Reduce across processes (every rank must call this at the same step), run every read,
        and start a new window (``reset``)."""
        if reduce:
            for tap in self.taps.taps.values():  # same order on every rank
                tap.accumulator.reduce_()
            # every rank holds the same cross-moments (a local failure only stops reading them)
            for acc in self.taps.chain.cross if self.taps.chain is not None else ():
                acc.reduce_()
            if self.split is not None:
                self.split.reduce_()  # source names agreed across ranks first
        norms: dict[str, NormReport] = {}
        for norm in self.norms:
            tap_in, tap_out = self._norm_taps[norm.name]
            if norm.name in self.failed_reads or tap_in.failed or tap_out.failed:
                continue  # disabled: its own warning said why; the other layers are read
            try:
                norms[norm.name] = self._read_norm(norm)
            except Exception as err:  # noqa: BLE001 - one layer's failure is that layer's only
                self.failed_reads[norm.name] = f"{type(err).__name__}: {err}"
                _warn_disabled(
                    f"the read of norm layer {norm.name!r}", self.failed_reads[norm.name]
                )
        profile = None
        if self._profile_failed is None:
            try:
                profile = self._read_profile()
            except Exception as err:  # noqa: BLE001
                self._profile_failed = f"{type(err).__name__}: {err}"
                _warn_disabled("the residual sigma_min profile", self._profile_failed)
        rejected = sum(t.accumulator.rows_rejected for t in self.taps.taps.values())
        failed = {
            f"{t.module_name}:{t.where}": t.failed for t in self.taps.taps.values() if t.failed
        }
        failed.update({f"{name}:read": why for name, why in self.failed_reads.items()})
        if self._profile_failed is not None:
            failed["profile:read"] = self._profile_failed
        report = DeadDirectionReport(step, norms, profile, self.layout, rejected, failed)
        if self.split is not None and self.split.failed is None and profile is not None:
            try:
                report = dataclasses.replace(
                    report, sources=self._read_sources(), source_rule=self.source_rule
                )
            except Exception as err:  # noqa: BLE001 - the per-source reads only
                self.split.failed = f"{type(err).__name__}: {err}"
                _warn_disabled("the per-source reads", self.split.failed)
        if reset:
            self.reset()
        return report

    def _read_norm(self, norm: NormLayer) -> NormReport:
        tap_in, tap_out = self._norm_taps[norm.name]
        g = gamma_read(self._gammas[norm.name] if norm.name in self._gammas else norm.gamma())
        n_out = tap_out.accumulator.count
        n_in = tap_in.accumulator.count
        kernel = kernel_read(
            tap_out.accumulator.covariance(),
            g,
            n_out,
            null_tol=self.null_tol,
            declared_kind=norm.kind,
        )
        base = None
        if norm.name in self.baselines:
            rows = self.baseline_rows.get(norm.name, n_in)
            base = SchurRead(math.nan, self.baselines[norm.name], None, rows)
        cov_in = tap_in.accumulator.covariance()
        schur = schur_quotient(cov_in, g, n_in, declared_kind=norm.kind, baseline=base)
        if base is None and math.isfinite(schur.schur_complement):
            # METRICS §1.3: the run's first read (scan: the random-init twin's) is the baseline
            self.baselines[norm.name] = schur.schur_complement
            self.baseline_rows[norm.name] = n_in
            schur = schur_quotient(cov_in, g, n_in, declared_kind=norm.kind, baseline=schur)
        return NormReport(norm.name, norm.kind, g, kernel, schur, schur.deepening, n_out)

    def _read_profile(self) -> SigmaMinProfile | None:
        if self.layout is None or not self._point_taps:
            return None
        points = self.layout.points
        moments = [t.accumulator.second_moment() for t in self._point_taps]
        profile = sigma_min_profile(
            [p.name for p in points],
            moments,
            [t.accumulator.count for t in self._point_taps],
            [p.sublayer for p in points],
        )
        cross = self._cross()
        if len(cross) != len(points) - 1:
            return profile
        margins = [math.nan]  # p_0: nothing before it
        for k, acc in enumerate(cross, start=1):
            margins.append(no_cancellation_margin(acc.moment(), moments[k - 1], acc.count)[0])
        return dataclasses.replace(profile, no_cancellation_margin=tuple(margins))

    def _read_sources(self) -> dict[str, SigmaMinProfile]:
        """One profile per source, on its own rows (NaN with ``insufficient_rows`` below
        ``2 d`` rows at a point)."""
        assert self.split is not None and self.layout is not None
        points = self.layout.points
        out: dict[str, SigmaMinProfile] = {}
        for name in sorted(self.split.accs):
            accs = self.split.accs[name]
            out[name] = sigma_min_profile(
                [p.name for p in points],
                [a.second_moment() for a in accs],
                [a.count for a in accs],
                [p.sublayer for p in points],
            )
        return out

    def _cross(self) -> list:
        chain = self.taps.chain
        if chain is None or chain.cross_failed is not None:
            return []
        return chain.cross

    # -------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Baselines and the open window's accumulators."""
        return {
            "baselines": dict(self.baselines),
            "baseline_rows": dict(self.baseline_rows),
            "taps": {
                f"{k[0]}|{k[1]}": t.accumulator.state_dict() for k, t in self.taps.taps.items()
            },
            "cross": [acc.state_dict() for acc in self._cross()],
            **({"sources": self.split.state_dict()} if self.split is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # without baseline_rows the state is version 1's: its baselines are another quantity
        has_rows = "baseline_rows" in state
        self.baselines = dict(state.get("baselines", {})) if has_rows else {}
        self.baseline_rows = {k: int(v) for k, v in state.get("baseline_rows", {}).items()}
        for key, acc_state in state.get("taps", {}).items():
            name, where = key.rsplit("|", 1)
            tap = self.taps.taps.get((name, where))
            if tap is not None and int(acc_state["dim"]) == tap.dim:
                tap.accumulator.load_state_dict(acc_state)
        cross, saved = self._cross(), state.get("cross", [])
        if len(saved) == len(cross):
            for acc, acc_state in zip(cross, saved):
                if int(acc_state["dim"]) == acc.dim:
                    acc.load_state_dict(acc_state)
        if self.split is not None and "sources" in state:
            self.split.load_state_dict(state["sources"])

    def memory_bytes(self) -> int:
        split = self.split.memory_bytes() if self.split is not None else 0
        return self.taps.memory_bytes() + split

    # -------------------------------------------------------------- plain loops
    def step(self, batch: Any = None, **options: Any) -> Any:
        """A context manager around one optimiser step of a loop you wrote: on entry it opens
        the window when the step is sampled (gammas snapshotted first, ``attention_mask`` of a
        dict ``batch`` applied, residual points discovered on the first call with ``batch``);
        on exit it reads on schedule, evaluates the alert rules, logs, and puts the report
        (``None`` on a step without a read) and the alerts fired on the yielded
        :class:`~normscope.integrations.StepResult`.

        ``options`` (read at the first call, kept after): ``log=`` (a callable such as
        ``wandb.log``, a logger object, or a list of them) and any argument of
        :class:`~normscope.DeadDirectionMonitor` (``every_n_steps``, ``rules``,
        ``stop_on_alert``, ``alerts`` (default ``("log",)``), ``log_per_layer`` ...); the
        tracker's own layers, residual and row settings stay as built. One engine: the same
        schedule and reads as the Lightning monitor (:class:`~normscope.integrations.Watch`).

        Example::

            tracker = DeadDirectionTracker(model)
            for x, y in loader:
                with tracker.step((x, y), every_n_steps=50, log=wandb.log) as result:
                    _, loss = model(x, y)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if result.alerts:
                    print(result.alerts[0].message)
        """
        from normscope.callbacks.dead_direction import DeadDirectionMonitor
        from normscope.integrations.loop import tracker_step

        return tracker_step(self, DeadDirectionMonitor, batch, options)


def _warn_disabled(what: str, reason: str) -> None:
    warn_disabled(what, reason, stacklevel=3)


def _stream_width(norms: Sequence[NormLayer], layout: ResidualLayout) -> int:
    by_name = {n.name: n.dim for n in norms}
    for point in layout.points:
        if point.module_name in by_name:
            return by_name[point.module_name]
    if layout.final_norm in by_name:
        return by_name[layout.final_norm]
    return max(by_name.values())


_fmt_bytes = fmt_bytes


def _tap_cost(
    norms: Sequence[NormLayer],
    points: Sequence[ResidualPoint],
    width: int,
    links: bool = False,
    sources: int = 0,
) -> int:
    """Bytes of the co-moments of every distinct tap (``8 d^2`` each; a point that is a norm's
    input shares that norm's input tap), with ``links`` the cross-moments between
    consecutive points (``8 d^2`` each), and ``sources`` accumulators per point."""
    keys: dict[tuple[str, str], int] = {}
    for n in norms:
        keys[(n.name, "input")] = keys[(n.name, "output")] = n.dim
    for p in points:
        keys.setdefault((p.module_name, p.where), width)
    cross = 8 * width * width * (len(points) - 1) if links and len(points) > 1 else 0
    per_source = 8 * width * width * len(points) * sources
    return sum(8 * d * d for d in keys.values()) + cross + per_source


def _thin_points(points: Sequence[ResidualPoint], kept: Sequence[int]) -> list[ResidualPoint]:
    """The points at indices ``kept``; a point whose predecessor was left out is relabelled
    with what now lies before it (one sublayer kind, else ``"block"``)."""
    out: list[ResidualPoint] = []
    prev = None
    for i in kept:
        p = points[i]
        if prev is not None and i - prev > 1:
            kinds = {q.sublayer for q in points[prev + 1 : i + 1]}
            p = dataclasses.replace(p, sublayer=kinds.pop() if len(kinds) == 1 else "block")
        out.append(p)
        prev = i
    return out


def _plan_budget(
    norms: list[NormLayer],
    points: Sequence[ResidualPoint],
    width: int,
    budget: int,
    links: bool = False,
    sources: int = 0,
) -> tuple[list[NormLayer], list[ResidualPoint], bool, int]:
    """What fits in ``budget`` bytes: the residual profile first (the collapse alarm; at a
    stride over depth, first and last point kept, when it alone is over), then (``links``) the
    cross-moments between its kept points if they all fit, then norm layers at the smallest
    stride over depth that fits in what is left (the final norm kept when it fits). Returns the
    norms, the points, whether the cross-moments are kept and the sources planned for (the
    ``sources`` per-source accumulators at every kept point come after the cross-moments and
    before the norm layers, all or none).
    """
    if _tap_cost(norms, points, width, links, sources) <= budget:
        return norms, list(points), links, sources
    kept_points: list[ResidualPoint] = list(points)
    if _tap_cost([], points, width) > budget:
        kept_points = []
        for stride in range(2, len(points)):
            idx = list(range(0, len(points), stride))
            if idx[-1] != len(points) - 1:
                idx.append(len(points) - 1)
            if _tap_cost([], [points[i] for i in idx], width) <= budget:
                kept_points = _thin_points(points, idx)
                break
        if not kept_points and len(points) >= 2:
            ends = _thin_points(points, [0, len(points) - 1])
            kept_points = ends if _tap_cost([], ends, width) <= budget else []
    links = links and len(kept_points) > 1 and _tap_cost([], kept_points, width, True) <= budget
    if sources and _tap_cost([], kept_points, width, links, sources) > budget:
        sources = 0
    chosen: list[NormLayer] = []
    for stride in range(1, len(norms) + 1):
        candidate = norms[::stride]
        if norms[-1] not in candidate:
            candidate = [*candidate[:-1], norms[-1]] if len(candidate) > 1 else [norms[-1]]
        if _tap_cost(candidate, kept_points, width, links, sources) <= budget:
            chosen = candidate
            break
    return chosen, kept_points, links, sources
