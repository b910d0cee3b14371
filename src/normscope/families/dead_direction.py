"""The dead-direction reads on a schedule, independent of any trainer.

:class:`DeadDirectionTracker` finds a model's norm layers and residual points
(:mod:`normscope.taps`), hooks them once, accumulates rows while its gate is open and, on
:meth:`~DeadDirectionTracker.read`, reduces across processes and runs every read of
docs/metrics.md §1 into a :class:`DeadDirectionReport` (:func:`normscope.scan_model` and the
Lightning ``DeadDirectionMonitor`` drive it). Reports: :mod:`.dead_direction_report`; reads:
:mod:`.dead_direction_read`; ``max_memory``: :mod:`.budget` (their names import from here too).

Per norm layer two tensors are tapped: its input ``h`` (covariance ``C_h`` for the Schur quotient,
second moment for ``sigma_min`` where the input is a residual point) and its output (covariance
``C`` for the kernel reads). A residual point that is not a norm input (a post-LN block output, say)
gets a tap of its own. Taps are shared: one accumulator per ``(module, input|output)``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from normscope.families.budget import fit_budget, stream_width
from normscope.families.dead_direction_read import (
    finish_report,
    gather_records,
    read_norm,
    read_share,
    reduce_taps,
    solve_window,
    take_window,
)
from normscope.families.dead_direction_report import DeadDirectionReport, NormReport, key_path
from normscope.taps.hooks import Gate, Tap, TapSet
from normscope.taps.norms import NormLayer, discover_norm_layers, find_norm_layers
from normscope.taps.residual import ResidualDiscovery, ResidualLayout, find_residual_points
from normscope.taps.sources import SourceLabels, SourceSpec, SourceSplit, resolve_labels

__all__ = ["DeadDirectionReport", "DeadDirectionTracker", "NormReport", "key_path"]


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
        null_tol: ``tau`` of ``null_dim`` (docs/metrics.md §1.2); raise it for bf16 forwards (~1e-4).
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
            distribution-dependent (:mod:`normscope.alerts.sources`). Label a batch with
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
        self.norm_taps: dict[str, tuple[Tap, Tap]] = {}
        self.point_taps: list[Tap] = []
        self._gammas: dict[str, torch.Tensor] = {}
        self._width: int | None = None
        self.profile_failed: str | None = None
        self._discovery: ResidualDiscovery | None = None
        self.attached = False
        self.last_solves = 0  # jobs this process solved at the last read (a split read: a share)

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
        if self.layout is not None and self.layers != "auto":
            total = len(discover_norm_layers(self.model, warn=False).norms)
            self.layout = self.layout.found_from(len(self.norms), total)
        if self.max_memory is not None:
            self._apply_budget(self.max_memory)
        for norm in self.norms:
            self.norm_taps[norm.name] = (
                self.taps.add(norm.name, "input", norm.dim),
                self.taps.add(norm.name, "output", norm.dim),
            )
        if self.layout is not None and self.layout.points:
            width = self._width or stream_width(self.norms, self.layout)
            self.point_taps = [
                self.taps.add(p.module_name, p.where, width) for p in self.layout.points
            ]
            if len({t.key for t in self.point_taps}) == len(self.point_taps):
                cross = self.margin and len(self.point_taps) > 1
                chain = self.taps.chain_points(self.point_taps, cross=cross)
                if self.sources is not None:
                    self.split = SourceSplit(
                        [t.dim for t in self.point_taps],
                        [t.accumulator.device for t in self.point_taps],
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
        """Fit the taps in ``budget`` bytes (:func:`~normscope.families.budget.fit_budget`);
        warn naming what is left out. Runs once, at :meth:`attach`, after the residual points
        are known."""
        n_src = self.max_sources if self.sources is not None else 0
        fit = fit_budget(self.norms, self.layout, budget, margin=self.margin, sources=n_src)
        self._width = fit.width or None
        self.margin = fit.margin
        if fit.sources_dropped:
            self.sources = None
            self._sources_failed = "max_memory"
        if fit.warning is None:
            return
        self.skipped_norms, self.skipped_points = fit.skipped_norms, fit.skipped_points
        self.norms, self.layout = fit.norms, fit.layout
        warnings.warn(fit.warning, RuntimeWarning, stacklevel=3)

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
        """Reduce across processes (``reduce``; every rank must call this at the same step),
        run every read and start a new window (``reset``; ``False`` keeps the window: the
        same accumulators can be read again, as ``benchmarks/read_cost.py`` does). Under several processes every rank solves a
        round-robin share and the records are gathered: every rank gets the same full report
        (:mod:`normscope.families.dead_direction_read`, the one read path)."""
        if reduce:
            reduce_taps(self)
        share = read_share() if reduce else (0, 1)
        window = take_window(self, step, swap=False)
        records = solve_window(self, window, share)
        parts = gather_records(records) if share[1] > 1 else [records]
        self.last_solves = records.solves
        errors = [p.error for p in parts if p.error is not None]
        if errors:
            self.reset()
            raise RuntimeError(f"the read failed: {errors[0]}")
        report = finish_report(self, window, parts)
        if reset:
            self.reset()
        return report

    def read_norm(
        self, norm: NormLayer, tap_in: Tap, tap_out: Tap, gamma: torch.Tensor
    ) -> NormReport:
        """One norm layer's reads from its taps with the window's ``gamma`` (Delta_gamma
        against this tracker's baseline, which the first read sets)."""
        return read_norm(
            norm, tap_in, tap_out, gamma, self.null_tol, self.baselines, self.baseline_rows
        )

    def window_gammas(self) -> dict[str, torch.Tensor]:
        """The gammas of the window's forwards (:meth:`snapshot_gammas`), else the live ones."""
        return {n.name: self._gammas[n.name] if n.name in self._gammas else n.gamma() for n in self.norms}

    def cross_moments(self) -> list:
        """The cross-moments between consecutive residual points (empty without a chain or
        once they failed)."""
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
            "cross": [acc.state_dict() for acc in self.cross_moments()],
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
        cross, saved = self.cross_moments(), state.get("cross", [])
        if len(saved) == len(cross):
            for acc, acc_state in zip(cross, saved):
                if int(acc_state["dim"]) == acc.dim:
                    acc.load_state_dict(acc_state)
        if self.split is not None and "sources" in state:
            self.split.load_state_dict(state["sources"])

    def memory_bytes(self) -> int:
        split = self.split.memory_bytes() if self.split is not None else 0
        return self.taps.memory_bytes() + split
