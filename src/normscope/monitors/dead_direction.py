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

from normscope.functional.profile import SigmaMinProfile
from normscope.monitors.budget import _plan_budget, _stream_width, _tap_cost, fit_budget  # noqa: F401
from normscope.monitors.dead_direction_read import (
    cross_moments,
    read_norm,
    read_profile,
    read_report,
    read_sources,
)
from normscope.monitors.dead_direction_report import (  # noqa: F401 - FAMILY, ... re-exported
    FAMILY,
    NORM_CLASS_CODE,
    DeadDirectionReport,
    NormReport,
    key_path,
)
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
        """Fit the taps in ``budget`` bytes (:func:`~normscope.monitors.budget.fit_budget`);
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
        """Reduce across processes (every rank must call this at the same step), run every read,
        and start a new window (``reset``)."""
        report = read_report(self, step, reduce=reduce)
        if reset:
            self.reset()
        return report

    def _read_norm(self, norm: NormLayer) -> NormReport:
        tap_in, tap_out = self._norm_taps[norm.name]
        gamma = self._gammas[norm.name] if norm.name in self._gammas else norm.gamma()
        return read_norm(
            norm, tap_in, tap_out, gamma, self.null_tol, self.baselines, self.baseline_rows
        )

    def _read_profile(self) -> SigmaMinProfile | None:
        return read_profile(self.layout, self._point_taps, self._cross())

    def _read_sources(self) -> dict[str, SigmaMinProfile]:
        """One profile per source (:func:`~normscope.monitors.dead_direction_read.read_sources`)."""
        assert self.split is not None and self.layout is not None
        return read_sources(self.split, self.layout)

    def _cross(self) -> list:
        return cross_moments(self.taps.chain)

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
