"""The dead-direction family, whole: the tracker, the one read path, the report, the engine's
glue and the text renderings.

:class:`DeadDirectionTracker` finds a model's norm layers and residual points
(:mod:`normscope.taps`), hooks them once, accumulates rows while its gate is open and, on
:meth:`~DeadDirectionTracker.read`, reduces across processes and runs every read of
docs/metrics.md §1 into a :class:`DeadDirectionReport` (:func:`normscope.scan_model` and the
engine drive it). The sections below, in order: the tracker; the report (:class:`NormReport`,
:class:`DeadDirectionReport`, their keys); the read path (:func:`take_window`,
:func:`solve_window`, :func:`finish_report`); :class:`DeadDirectionFamily`, what the engine
drives; the read line, table and summary. ``max_memory``: :mod:`normscope.families.budget`.

Per norm layer two tensors are tapped: its input ``h`` (covariance ``C_h`` for the Schur quotient,
second moment for ``sigma_min`` where the input is a residual point) and its output (covariance
``C`` for the kernel reads). A residual point that is not a norm input (a post-LN block output, say)
gets a tap of its own. Taps are shared: one accumulator per ``(module, input|output)``."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normscope._common import ConfigurationError, fmt, say, warn_disabled, warn_rank_zero
from normscope.alerts import (
    Alert,
    AlertRule,
    KernelLossRule,
    SigmaMinRatioRule,
    SourceCollapseRule,
    default_dead_direction_rules,
)
from normscope.alerts.rules import classify_collapses, collapse_keys, source_reads
from normscope.families.budget import fit_budget, stream_width
from normscope.functional.covariance import fetch_counts, host_array, on_device
from normscope.functional.dead_direction import (
    GammaRead,
    KernelRead,
    SchurRead,
    gamma_read,
    kernel_read,
)
from normscope.functional.depth import DepthRead, input_reads, secular_bottom
from normscope.functional.gamma import gamma_reads
from normscope.functional.profile import (
    RANK_DEFICIENT,
    RANK_TOL,
    SigmaMinProfile,
    profile_from_sigmas,
    sigma_min_profile,
)
from normscope.functional.stream import (
    effective_rank,
    gain_drifts,
    nonfinite_share,
    stream_scales,
)
from normscope.taps.attention import AttentionLogits, find_attention_modules
from normscope.taps.hooks import (
    Gate,
    Tap,
    TapSet,
    batch_mask,
    call_model,
    compiled,
    eager_forwards,
)
from normscope.taps.norms import NormLayer, discover_norm_layers, find_norm_layers
from normscope.taps.residual import ResidualDiscovery, ResidualLayout, find_residual_points
from normscope.taps.sources import SourceLabels, SourceSpec, SourceSplit, resolve_labels

__all__ = [
    "attention_reads",
    "DeadDirectionFamily",
    "DeadDirectionReport",
    "DeadDirectionTracker",
    "NormReport",
    "ReadRecords",
    "ReadWindow",
    "ROWS_PER_DIM",
    "check_layers",
    "check_rows_per_read",
    "finish_report",
    "format_read_line",
    "format_summary",
    "format_table",
    "gather_records",
    "key_path",
    "point_from_spectrum",
    "point_sigma",
    "profile_from_parts",
    "read_norm",
    "read_share",
    "rank_deficiency_note",
    "read_sources_of",
    "reduce_taps",
    "rows_budget",
    "solve_window",
    "take_window",
]


ForwardFn = Callable[[], Any]

#: rows folded per read window per tapped tensor, by default, in units of its width ``d``:
#: measured, every planted alert of strength 0.8 is still raised at 8 d (9 of 9; 4 of 9 at 4 d,
#: width 128), and the fold costs a quarter of the old 4,096-rows-per-forward default's there
ROWS_PER_DIM = 8


def rows_budget(rows_per_read: int | str | None, dim: int) -> int | None:
    """Rows one tapped tensor of width ``dim`` folds per read window: ``8 dim`` for None,
    the int itself, None (no cap) for ``"all"``.

    Example::

        >>> rows_budget(None, 128), rows_budget(1000, 128), rows_budget("all", 128)
        (1024, 1000, None)
    """
    if rows_per_read is None:
        return ROWS_PER_DIM * dim
    if rows_per_read == "all":
        return None
    return int(rows_per_read)


def check_rows_per_read(rows_per_read: Any, owner: str) -> int | str | None:
    """``rows_per_read`` if valid (None, ``"all"`` or an int >= 1), else ``ValueError``."""
    ok = rows_per_read is None or rows_per_read == "all"
    ok = ok or (
        isinstance(rows_per_read, int) and not isinstance(rows_per_read, bool) and rows_per_read > 0
    )
    if not ok:
        raise ValueError(
            f"{owner}: rows_per_read must be None (8 d rows per read), 'all' or an int >= 1, "
            f"got {rows_per_read!r}"
        )
    return rows_per_read


class DeadDirectionTracker:
    """Hooks, accumulators and reads for the dead-direction family, for any PyTorch loop.

    Args:
        model: the model (any ``nn.Module``).
        layers: ``"auto"`` (every norm layer found) or a list of norm module paths.
        residual: also track the residual stream's ``sigma_min`` depth profile (found from
            one forward: the ``forward`` of :meth:`attach`, or the caller's own after
            :meth:`start_discovery`).
        rows_per_read: rows each tapped tensor folds per read window, a seeded uniform
            subsample (:func:`rows_budget`): ``None`` (default) ``8 d`` (``d`` the tensor's
            width), an int that many, ``"all"`` every row. The budget is shared by the
            window's forwards (:meth:`share_rows`: gradient-accumulation micro-batches and
            ranks, each folding ``ceil(budget / forwards)`` rows of every forward; a tracker
            driven by hand folds the whole budget from each forward). With ``sources=`` a
            source's own profile needs ``4 d`` of its own rows: raise it for minority sources.
        max_memory: byte budget for every accumulator (``8 d^2`` per tapped tensor: a norm's
            input and output, each residual point; a point that is a norm's input is shared).
            Over it (checked at :meth:`attach`, once the points are known), the residual profile
            is kept whole if it fits, else read at a stride over depth (first and last point
            kept), and norm layers are read at a stride over depth with what is left (the final
            norm kept when it fits); a warning names what was left out, and
            :meth:`memory_bytes` stays within the budget.
        null_tol: ``tau`` of ``null_dim`` (docs/metrics.md §1.2); raise it for bf16 forwards (~1e-4).
        seed: seed of the row subsampling.
        sources: name each sampled row's source (:mod:`normscope.taps.sources`): ``fn(batch)
            -> str`` (the whole batch), ``fn(batch) -> labels`` (a sequence or tensor, one per
            sample) or a batch field name. Each source gets its own float64 accumulator per
            residual point (the pooled read is unchanged) and its own profile
            (``dd.<source>/<point>/<metric>``), and collapses are classified intrinsic /
            distribution-dependent (:mod:`normscope.alerts.rules`). Label a batch with
            :meth:`label` (the monitors and :func:`normscope.scan_model` do).
        max_sources: sources tracked (the first seen; ``max_memory`` plans for this many:
            ``8 d^2`` per source and point, after the profile, before the norm layers, whole or
            not at all). Rows of later sources stay in the pooled read only (a warning).
        attention: the attention modules whose largest pre-softmax logit is read
            (docs/metrics.md §1.7, :mod:`normscope.taps.attention`): ``"auto"`` (default;
            every innermost module whose class name contains ``attn`` or ``attention``), a list
            of module paths, or ``None`` (none).

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
        rows_per_read: int | str | None = None,
        null_tol: float = 1e-10,
        seed: int = 0,
        max_memory: int | None = None,
        sources: SourceSpec | None = None,
        max_sources: int = 8,
        attention: str | Sequence[str] | None = "auto",
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
        self.rows_per_read = check_rows_per_read(rows_per_read, "DeadDirectionTracker")
        self.forwards_per_read = 1  # share_rows: the forwards (micro-batches x ranks) of a window
        self.layers = layers
        self.residual = residual
        self.null_tol = null_tol
        self.gate = Gate()
        self.taps = TapSet(model, self.gate, seed=seed)
        self.norms: list[NormLayer] = find_norm_layers(model, layers)
        self.max_memory = max_memory
        self.skipped_norms: list[str] = []
        self.skipped_points: list[str] = []
        self.failed_reads: dict[str, str] = {}
        self.layout: ResidualLayout | None = None
        self.norm_taps: dict[str, tuple[Tap, Tap]] = {}
        self.point_taps: list[Tap] = []
        self._gammas: dict[str, torch.Tensor] = {}
        self._width: int | None = None
        self.profile_failed: str | None = None
        self._discovery: ResidualDiscovery | None = None
        self.attached = False
        self.last_solves = 0  # jobs this process solved at the last read (a split read: a share)
        self.rank_warned = False  # the one warning about inputs that do not span
        # the stream reads (docs/metrics.md §1.6): each norm's gamma at the first read (the
        # gain drift's baseline) and each residual point's RMS at the previous read
        self.gain_baselines: dict[str, torch.Tensor] = {}
        self.previous_rms: dict[str, float] = {}
        # the attention-logit read (docs/metrics.md §1.7): its modules now, its hooks at attach
        self.attention_names = find_attention_modules(model, attention)
        self.attention_on = attention is not None  # asked for: dd/attn_modules_read says 0
        self.attention: AttentionLogits | None = None

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
                chain = self.taps.chain_points(self.point_taps)
                if self.sources is not None:
                    self.split = SourceSplit(
                        [t.dim for t in self.point_taps],
                        [t.accumulator.device for t in self.point_taps],
                        self.max_sources,
                    )
                    chain.split = self.split
        if self.sources is not None and self.split is None:
            self._sources_off("the residual profile is not read (no residual points)")
        self._apply_rows()
        if self.attention_names and self.attention is None:
            self.attention = AttentionLogits(self.model, self.attention_names, self.gate)
        self.attached = True
        self.snapshot_gain_baselines()

    def snapshot_gain_baselines(self) -> None:
        """Keep each norm's gamma as the gain drift's baseline (docs/metrics.md §1.6), once:
        a monitor's first batch, before its update (a gain the first step throws across zero
        is seen by the first read), else :meth:`attach`."""
        for norm in self.norms:
            if norm.name not in self.gain_baselines:
                try:
                    self.gain_baselines[norm.name] = norm.gamma()
                except Exception:  # noqa: BLE001 - the first read sets it instead
                    continue

    # ------------------------------------------------------------------ rows
    def share_rows(self, forwards: int) -> None:
        """Share each read's row budget (``rows_per_read``) among ``forwards`` forwards: the
        micro-batches of one optimiser step times the ranks. Every tap then folds at most
        ``ceil(budget / forwards)`` rows of each forward (a seeded uniform subsample, the
        rows the padding mask keeps first), so a window folds about the budget in all,
        wherever its rows come from. Cheap (no device work); the engine calls it before a
        window's first forward."""
        forwards = max(int(forwards), 1)
        if forwards != self.forwards_per_read:
            self.forwards_per_read = forwards
            self._apply_rows()

    def rows_per_forward(self, dim: int) -> int | None:
        """Rows a tap of width ``dim`` keeps per forward (None: all). The same with or without
        ``sources=`` (the pooled read does not depend on them): a source's own profile decides
        from ``4 d`` of its own rows, so at the default a source with under half the rows reads
        undecided; pass a larger ``rows_per_read`` (or ``"all"``) for per-source verdicts."""
        budget = rows_budget(self.rows_per_read, dim)
        return None if budget is None else -(-budget // self.forwards_per_read)

    def _apply_rows(self) -> None:
        for tap in self.taps.taps.values():
            if hasattr(tap.accumulator, "max_rows"):
                tap.accumulator.max_rows = self.rows_per_forward(tap.dim)
        chain = self.taps.chain
        if chain is not None and chain.taps:
            chain.max_rows = self.rows_per_forward(chain.taps[0].dim)

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
        fit = fit_budget(self.norms, self.layout, budget, sources=n_src)
        self._width = fit.width or None
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
        if self.attention is not None:
            self.attention.remove()
            self.attention = None
        self.attached = False

    def reset(self) -> None:
        """Start a new window."""
        self.taps.reset()
        if self.attention is not None:
            self.attention.take()
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

    def max_rejected(self) -> torch.Tensor:
        """Most NaN/Inf rows dropped by one live tap in this window, as a float64 device tensor
        (no host sync): a window with any is read at once, never deferred for rows."""
        found = [
            t.accumulator.rejected_tensor
            for t in self.taps.taps.values()
            if t.failed is None and hasattr(t.accumulator, "rejected_tensor")
        ]
        if not found:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack([r.to(found[0].device, torch.float64) for r in found]).max()

    def read(
        self, step: int = 0, *, reduce: bool = True, reset: bool = True
    ) -> DeadDirectionReport:
        """Reduce across processes (``reduce``; every rank must call this at the same step),
        run every read and start a new window (``reset``; ``False`` keeps the window: the
        same accumulators can be read again, as ``benchmarks/read_cost.py`` does). Under several processes every rank solves a
        round-robin share and the records are gathered: every rank gets the same full report
        (:mod:`normscope.families.dead_direction`, the one read path)."""
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

    @property
    def placement(self) -> str:
        """``"post"`` when the residual layout found post-norm blocks (the norms' inputs are
        not the residual stream, so the reads of ``v*`` in them have no premise), else
        ``"pre"`` (also without a layout: the reads are taken as a pre-norm model's)."""
        layout = self.layout
        return "post" if layout is not None and layout.style == "post-norm" else "pre"

    def read_norm(
        self, norm: NormLayer, tap_in: Tap, tap_out: Tap, gamma: torch.Tensor | GammaRead
    ) -> NormReport:
        """One norm layer's reads from its taps with the window's ``gamma`` (or its
        :class:`~normscope.functional.gamma.GammaRead`, already taken)."""
        return read_norm(norm, tap_in, tap_out, gamma, self.null_tol, self.placement)

    def window_gammas(self) -> dict[str, torch.Tensor]:
        """The gammas of the window's forwards (:meth:`snapshot_gammas`), else the live ones."""
        return {
            n.name: self._gammas[n.name] if n.name in self._gammas else n.gamma()
            for n in self.norms
        }

    # -------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """The open window's accumulators (and attention-logit maxima) and the stream reads'
        memory (gains at the first batch, each point's last RMS)."""
        return {
            "taps": {
                f"{k[0]}|{k[1]}": t.accumulator.state_dict() for k, t in self.taps.taps.items()
            },
            "gain_baselines": {k: v.detach().cpu() for k, v in self.gain_baselines.items()},
            "previous_rms": dict(self.previous_rms),
            **({"sources": self.split.state_dict()} if self.split is not None else {}),
            **({"attention": self.attention.state_dict()} if self.attention is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gain_baselines.update(
            {
                k: torch.as_tensor(v, dtype=torch.float64)
                for k, v in state.get("gain_baselines", {}).items()
            }
        )
        self.previous_rms.update({k: float(v) for k, v in state.get("previous_rms", {}).items()})
        for key, acc_state in state.get("taps", {}).items():
            name, where = key.rsplit("|", 1)
            tap = self.taps.taps.get((name, where))
            try:
                if tap is not None:
                    tap.accumulator.load_state_dict(acc_state)
            except ValueError:  # another width: refused before anything is loaded
                continue
        if self.split is not None and "sources" in state:
            self.split.load_state_dict(state["sources"])
        if self.attention is not None and "attention" in state:
            self.attention.load_state_dict(state["attention"])

    def memory_bytes(self) -> int:
        split = self.split.memory_bytes() if self.split is not None else 0
        return self.taps.memory_bytes() + split


# ============================================================================
# The records of a dead-direction read (NormReport, DeadDirectionReport) and their metric keys.
# ============================================================================


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
    """Every read of one norm layer (docs/metrics.md §1.1–1.3): ``gamma``, the kernel reads of
    its output, and of its input the Schur quotient (``schur``: ``R`` and ``s``, no baseline)
    and ``v*``'s depth beyond the typical direction with its random-direction control
    (``depth``: ``delta_gamma``, ``delta_gamma_control``...)."""

    name: str
    kind: str
    gamma: GammaRead
    kernel: KernelRead
    schur: SchurRead
    depth: DepthRead
    n_rows: int
    #: the input covariance's ``(eigenvalues, eigenvectors)`` while the read is solved (the
    #: residual point this norm reads takes its ``sigma_min`` from it); dropped before the
    #: report leaves the solve
    spectrum: Any = field(default=None, repr=False, compare=False)

    @property
    def delta_gamma(self) -> float:
        """``1 - 10^-depth``: 0 for a typical direction, -> 1 as ``v*`` sits deeper."""
        return self.depth.delta_gamma

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        out.update(self.gamma.as_dict())
        out.update(self.kernel.as_dict())
        out["kernel_alignment"] = self.kernel.kernel_alignment
        out["schur_quotient"] = self.schur.schur_quotient
        out["schur_complement"] = self.schur.schur_complement
        out.update(self.depth.as_dict())
        # norm_class as a number (loggers take numbers): +1 layernorm-like, -1 rmsnorm-like,
        # 0 indeterminate, NaN when not read.
        out["norm_class"] = NORM_CLASS_CODE.get(self.kernel.norm_class, math.nan)
        out["n_rows"] = float(self.n_rows)
        return out


@dataclass(frozen=True)
class DeadDirectionReport:
    """One read of a whole model: ``norms`` by module path, the ``profile``, row counts.

    ``as_dict()`` is flat and keyed as the monitor logs (docs/metrics.md §3): ``dd/<module path>/<metric>``
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
    #: the stream reads (docs/metrics.md §1.6), keyed as logged without ``dd/``:
    #: ``<point>/offset_share``, ``<norm>/rankme``, ``gamma_scale_min``... (:func:`stream_keys`)
    stream: dict[str, float] = field(default_factory=dict)

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
        out[f"{FAMILY}/rows_rejected"] = float(self.rows_rejected)
        # the residual points this read covers: 0 says "no sigma_min profile" out loud
        out[f"{FAMILY}/profile_points"] = (
            float(len(self.profile.points)) if self.profile is not None else 0.0
        )
        # reads the fast solvers could not verify, answered by the dense eigh instead
        out[f"{FAMILY}/solver_fallbacks"] = float(self.solver_fallbacks)
        # layers (norms, residual points, the profile) no longer read after a failure
        out[f"{FAMILY}/reads_disabled"] = float(
            len({key.rsplit(":", 1)[0] for key in self.failed_taps})
        )
        if self.norms:
            # the headline: each LayerNorm's kernel_alignment (its subspace alignment when the
            # input does not span and the null space is degenerate, else gamma_alignment)
            aligned = [
                n.kernel.kernel_alignment for n in self.norms.values() if n.kind == "layernorm"
            ]
            aligned = [a for a in aligned if not math.isnan(a)]
            if aligned:
                out[f"{FAMILY}/gamma_alignment_min"] = min(aligned)
            deltas = [n.delta_gamma for n in self.norms.values() if math.isfinite(n.delta_gamma)]
            out[f"{FAMILY}/delta_gamma_max"] = max(deltas) if deltas else math.nan
            out[f"{FAMILY}/rank_deficient_inputs"] = float(len(self.rank_deficient_norms))
        if self.profile is not None:
            # 0: the ratios read against p_0; k > 0: the first k points did not span
            out[f"{FAMILY}/profile_anchor_depth"] = float(self.profile.anchor_depth)
        if self.sources:
            out.update(source_reads(self.sources, key_path))
            out.update(collapse_keys(out, self.source_rule))
        for key, value in self.stream.items():
            out[f"{FAMILY}/{key_path(key)}"] = float(value)
        return out

    @property
    def collapses(self) -> list:
        """The classified collapses (:func:`normscope.alerts.rules.classify_collapses`);
        empty without sources."""
        if not self.sources:
            return []
        return classify_collapses(self.as_dict(), self.source_rule)

    @property
    def rank_deficient_norms(self) -> list[str]:
        """The norm layers whose input does not span (``depth.live_dim < d``: a ViT's small
        patches, a vocabulary under ``d``) or whose output's null space is degenerate
        (``null_dim > 1``): their reads are taken on the live subspace."""
        return [
            name
            for name, n in self.norms.items()
            if n.depth.rank_deficient
            or (
                isinstance(n.kernel.null_dim, int)
                and n.kernel.null_dim > 1
                and n.gamma.dead_channels == 0
            )
        ]

    @property
    def solver_fallbacks(self) -> int:
        """Dense fallbacks in this read (:mod:`normscope.functional.solvers`): the norms'
        kernel reads plus the points of the profile and of every source's profile."""
        profiles = ([self.profile] if self.profile is not None else []) + list(
            self.sources.values()
        )
        return sum(getattr(n.kernel, "dense_fallbacks", 0) for n in self.norms.values()) + sum(
            getattr(p, "dense_fallbacks", 0) for p in profiles
        )

    @property
    def sigma_min_ratio_min(self) -> float:
        return self.profile.sigma_min_ratio_min if self.profile is not None else math.nan


# ============================================================================
# One dead-direction read, one path: take the window, solve it, assemble the report.
#
# A read has three parts, the same for every loop, every process count and both schedules:
#
# 1. :func:`take_window` (main thread, after the cross-rank reduce :func:`reduce_taps`) freezes
#    what the read needs. With ``swap=True`` (an asynchronous read) every accumulator is
#    shallow-copied -- the copy keeps *references* to the window's state tensors -- and the live
#    taps are ``reset()``: each allocates fresh zero tensors, so the next window folds into new
#    memory while the read holds the old (a swap, no ``d x d`` copy). With ``swap=False`` the
#    read takes the live accumulators and the caller resets them after.
# 2. :func:`solve_window` runs the float64 solves as a fixed list of jobs (norm layers in the
#    tracker's order, then the residual points' ``sigma_min``, the sources). One
#    process solves them all: share ``(0, 1)``; under DDP every rank holds the same reduced
#    accumulators and solves every ``world``-th job (round robin). It runs anywhere (the worker
#    thread too): no collective, no tracker state.
# 3. :func:`finish_report` (main thread) takes every rank's records (gathered first under a share,
#    :func:`gather_records`), applies the failures they met and assembles the
#    :class:`~normscope.families.dead_direction.DeadDirectionReport`. The profile is
#    built in one place, from each point's solved ``sigma_min`` (:func:`profile_from_parts`).
#
# A synchronous read is these three in a row (:meth:`DeadDirectionTracker.read
# <normscope.families.dead_direction.DeadDirectionTracker.read>`); an asynchronous one runs step 2
# on the engine's worker.
#
# Example::
#
#     window = take_window(tracker, step=10, swap=True)   # the taps start a new window
#     records = solve_window(tracker, window)             # on any thread
#     report = finish_report(tracker, window, [records])
# ============================================================================


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
    sources: dict[str, list[Any]] | None  # per-source accumulators; None: not read
    layout: Any
    profile_on: bool
    taps: list[Tap]  # every tap (rows_rejected, failed taps)
    failed_taps: dict[str, str]
    #: norm name -> the residual point whose sigma_min that norm's job reads (:func:`_covered`)
    covers: dict[str, int] = field(default_factory=dict)
    #: attention module -> its largest logit in the window (None: none read; docs §1.7);
    #: None: no attention read asked for
    attention: dict[str, torch.Tensor | None] | None = None
    #: norm name -> its gamma read, taken for the norm jobs in one batch by :func:`solve_window`
    gamma_reads: dict[str, GammaRead] = field(default_factory=dict)

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


def reduce_taps(tracker: DeadDirectionTracker) -> None:
    """The cross-rank reduce of every accumulator of ``tracker`` (a collective: every rank, the
    same order); then every rank holds the same window."""
    for tap in tracker.taps.taps.values():  # same order on every rank
        tap.accumulator.reduce_()
    if tracker.split is not None:
        tracker.split.reduce_()  # source names agreed across ranks first
    if tracker.attention is not None:
        tracker.attention.reduce_()


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
    split = tracker.split
    sources = None
    if split is not None and split.failed is None:
        sources = {
            n: ([copy.copy(a) for a in split.accs[n]] if swap else split.accs[n])
            for n in sorted(split.accs)
        }
    norm_taps = {name: (frozen[a.key], frozen[b.key]) for name, (a, b) in tracker.norm_taps.items()}
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
        sources=sources,
        layout=tracker.layout,
        profile_on=tracker.profile_failed is None,
        taps=[frozen[t.key] for t in live],
        failed_taps={f"{t.module_name}:{t.where}": t.failed for t in live if t.failed},
    )
    window.covers = _covered(window)
    if tracker.attention is not None:  # swapped: the live maxima start over; else reset() does
        window.attention = tracker.attention.take() if swap else dict(tracker.attention.maxima)
    elif tracker.attention_on:
        window.attention = {}  # asked for, no attention module found: the count says 0
    if swap:
        tracker.reset()
        for old, tap in zip(window.taps, live):
            # reset() must give the live taps new tensors: one zeroed in place would wipe the
            # window the read holds (never silently read zeros)
            if old.accumulator.comoment is tap.accumulator.comoment:
                raise RuntimeError("normscope: an accumulator's reset() reused its tensors")
    return window


# ------------------------------------------------------------------------ the solves
def _covered(window: ReadWindow) -> dict[str, int]:
    """The residual points whose ``sigma_min`` a norm's job reads (norm name -> point index):
    a point that is a read norm's input (every point of a pre-norm stack) comes from that
    norm's input ``eigh`` (:func:`point_from_spectrum`), not from a decomposition of its own."""
    if not (window.profile_on and window.layout is not None and window.point_taps):
        return {}
    by_key = {tap.key: k for k, tap in enumerate(window.point_taps)}
    out: dict[str, int] = {}
    for norm in window.norms:
        k = by_key.get(window.norm_taps[norm.name][0].key)
        if norm.name not in window.skip and k is not None and k not in out.values():
            out[norm.name] = k
    return out


def _jobs(window: ReadWindow) -> list[tuple[str, Any]]:
    jobs: list[tuple[str, Any]] = [("norm", n) for n in window.norms if n.name not in window.skip]
    if window.profile_on and window.layout is not None and window.point_taps:
        covered = set(window.covers.values())
        jobs += [("point", k) for k in range(len(window.point_taps)) if k not in covered]
        jobs += [("source", name) for name in window.sources or {}]
    jobs.append(("stream", None))  # docs/metrics.md §1.6, one job for the whole window
    if window.attention is not None:
        jobs.append(("attention", None))  # docs/metrics.md §1.7
    return jobs


def solve_window(
    tracker: DeadDirectionTracker, window: ReadWindow, share: tuple[int, int] = (0, 1)
) -> ReadRecords:
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
            _solve_job(tracker, window, job, out)
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


def _solve_job(tracker: DeadDirectionTracker, window: ReadWindow, job: tuple, out: ReadRecords):
    kind, what = job
    if kind == "norm":
        _solve_norm(tracker, window, what, out)
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


def _solve_norm(tracker: DeadDirectionTracker, window: ReadWindow, norm: Any, out: ReadRecords):
    tap_in, tap_out = window.norm_taps[norm.name]
    point = window.covers.get(norm.name)
    report = None
    try:
        gamma = window.gamma_reads.get(norm.name, window.gammas[norm.name])
        report = tracker.read_norm(norm, tap_in, tap_out, gamma)
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


def point_from_spectrum(
    accumulator: Any, spectrum: tuple[torch.Tensor, torch.Tensor] | None, *, anchor: bool = True
) -> tuple[float, str | None, int]:
    """A residual point's :func:`point_sigma` from the ``eigh`` of its covariance ``C`` that the
    norm reading it took: ``S = C + mu mu^T``, so ``lambda_1(S)`` is the smallest root of the
    rank-one update's secular equation (:func:`~normscope.functional.depth.rank_one_floor`,
    :func:`~normscope.functional.depth.secular_bottom`)
    and ``||S||_F^2 = sum lambda_i^2 + 2 sum lambda_i z_i^2 + (sum z_i^2)^2`` (``z = U^T mu``)
    for the ``rank_deficient`` flag. Without a spectrum (the norm's input reads had a reason
    first: an RMSNorm, too few rows...) the point's own decomposition answers
    (:func:`point_sigma`)."""
    if spectrum is None:
        return point_sigma(accumulator.second_moment(), accumulator.count, anchor=anchor)
    evals, evecs = spectrum
    host = host_array(torch.stack([evals, evecs.mT @ on_device(accumulator.mean, evecs)]))
    lam, z2 = host[0], host[1] ** 2
    low = secular_bottom(lam, z2)
    reason = None
    if anchor:
        fro2 = float((lam**2).sum() + 2 * (lam * z2).sum() + z2.sum() ** 2)
        if not low > RANK_TOL * math.sqrt(max(fro2, 0.0)):
            reason = RANK_DEFICIENT
    return math.sqrt(max(low, 0.0)), reason, 0


def read_norm(
    norm: NormLayer,
    tap_in: Tap,
    tap_out: Tap,
    gamma: torch.Tensor | GammaRead,
    null_tol: float,
    placement: str = "pre",
) -> NormReport:
    """Every read of ``norm`` from its input and output taps, with the window's ``gamma``: the
    kernel reads of the output covariance, and of the input covariance the Schur quotient and
    ``v*``'s depth with its control (one ``eigh`` for both: :func:`input_reads`;
    docs/metrics.md §1.3). ``placement="post"``
    (a post-norm block: the input is not the residual stream): the input reads are NaN with
    the reason ``post_norm``. ``gamma`` may be its
    :class:`~normscope.functional.gamma.GammaRead` already taken (:func:`solve_window` takes
    every norm's in one batch, :func:`~normscope.functional.gamma.gamma_reads`)."""
    g = gamma if isinstance(gamma, GammaRead) else gamma_read(gamma)
    n_out = tap_out.accumulator.count
    n_in = tap_in.accumulator.count
    kernel = kernel_read(
        tap_out.accumulator.covariance(), g, n_out, null_tol=null_tol, declared_kind=norm.kind
    )
    cov_in = tap_in.accumulator.covariance()
    read = input_reads(cov_in, g, n_in, declared_kind=norm.kind, placement=placement)
    return NormReport(norm.name, norm.kind, g, kernel, read.schur, read.depth, n_out, read.spectrum)


def stream_reads(window: ReadWindow) -> dict[str, float]:
    """The window's stream reads that need its accumulators (docs/metrics.md §1.6), keyed as
    logged without ``dd/``: each residual point's ``offset_share`` and ``rms``, each norm
    layer's ``out_offset_share`` (of its output), and the final norm's output ``rankme`` (of
    its second moment, as Garrido et al.) and ``rankme_centred`` (of its covariance)."""
    out: dict[str, float] = {}
    # every point's and norm output's (mean, diag C, N), read together (stream_scales: one
    # stacked reduction, one copy to the host)
    names: list[tuple[str, str | None]] = []  # (prefix, the rms key's prefix or None)
    accs: list[Any] = []
    points = window.layout.points if window.layout is not None else ()
    if window.profile_on and len(points) == len(window.point_taps):
        for point, tap in zip(points, window.point_taps):
            names.append((f"{point.name}/offset_share", f"{point.name}/rms"))
            accs.append(tap.accumulator)
    for norm in window.norms:
        if norm.name in window.skip:
            continue
        names.append((f"{norm.name}/out_offset_share", None))
        accs.append(window.norm_taps[norm.name][1].accumulator)
    if accs:
        counts = [acc.count for acc in accs]
        shares, rms = stream_scales([acc.mean for acc in accs], _variances(accs), counts)
        for (share_key, rms_key), share, scale in zip(names, shares, rms):
            out[share_key] = share
            if rms_key is not None:
                out[rms_key] = scale
    final = window.layout.final_norm if window.layout is not None else None
    if final is not None and final in window.norm_taps and final not in window.skip:
        acc = window.norm_taps[final][1].accumulator
        out[f"{final}/rankme"] = effective_rank(acc.second_moment(), acc.count)
        out[f"{final}/rankme_centred"] = effective_rank(acc.covariance(), acc.count)
        out["final_rows_per_dim"] = acc.count / acc.dim
    return out


def attention_reads(maxima: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """The attention-logit keys of a window (docs/metrics.md §1.7), without ``dd/``: each
    module's ``<module>/max_logit`` (NaN: it ran no readable attention in the window),
    ``attn_logit_max`` (the largest; NaN when none was read) and ``attn_modules_read``. One host
    transfer for all modules. No module: only the count, 0."""
    if not maxima:
        return {"attn_modules_read": 0.0}
    names = list(maxima)
    read = [n for n in names if maxima[n] is not None]
    values = dict.fromkeys(names, math.nan)
    if read:
        device = maxima[read[0]].device
        host = torch.stack([maxima[n].to(device, torch.float64) for n in read]).cpu().tolist()
        values.update({n: (v if v > -math.inf else math.nan) for n, v in zip(read, host)})
    out = {f"{n}/max_logit": v for n, v in values.items()}
    seen = [v for v in values.values() if not math.isnan(v)]
    out["attn_logit_max"] = max(seen) if seen else math.nan
    out["attn_modules_read"] = float(len(seen))
    return out


def _variances(accs: Sequence[Any]) -> list[torch.Tensor]:
    """Each accumulator's per-channel variance ``diag(M) / max(N, 1)``, the divisions as one
    op per group of equal widths (the count tensors stacked, no host sync)."""
    diagonals = [acc.comoment.diagonal() for acc in accs]
    out: list[torch.Tensor] = list(diagonals)
    groups: dict[tuple, list[int]] = {}
    for i, (diag, acc) in enumerate(zip(diagonals, accs)):
        key = (diag.shape, diag.device, acc.count_tensor.device)
        groups.setdefault(key, []).append(i)
    for idx in groups.values():
        n = torch.stack([accs[i].count_tensor for i in idx]).clamp_min(1)
        var = torch.stack([diagonals[i] for i in idx]) / n[:, None].to(diagonals[idx[0]].device)
        for i, row in zip(idx, var.unbind(0)):
            out[i] = row
    return out


def stream_keys(
    tracker: DeadDirectionTracker, window: ReadWindow, solved: dict[str, float]
) -> dict[str, float]:
    """Every stream read of a window (docs/metrics.md §1.6): ``solved`` (:func:`stream_reads`)
    with the reads that need the tracker's memory, and the run-level summaries. Sets each
    norm's gain baseline at its first read and keeps each point's RMS for the next read."""
    out = dict(solved)
    read: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for norm in window.norms:
        gamma = window.gammas.get(norm.name)
        if not isinstance(gamma, torch.Tensor) or gamma.ndim != 1 or gamma.numel() == 0:
            continue
        base = tracker.gain_baselines.get(norm.name)
        if base is None:  # set at attach; else by this first read
            base = tracker.gain_baselines[norm.name] = gamma.detach().to(torch.float64).clone()
        if base.shape != gamma.shape:
            continue
        read.append((norm.name, gamma, base))
    drifts = gain_drifts([r[1] for r in read], [r[2] for r in read])  # one batch, one copy
    for (name, _, _), (scale, crossed) in zip(read, drifts):
        out[f"{name}/gamma_scale"] = scale
        out[f"{name}/gamma_crossed"] = crossed
    points = window.layout.points if window.layout is not None else ()
    for point in points:
        rms = out.get(f"{point.name}/rms", math.nan)
        before = tracker.previous_rms.get(point.name, math.nan)
        if before > 0:  # no previous read: no key (a NaN would say a read failed)
            out[f"{point.name}/rms_growth"] = rms / before
        if math.isfinite(rms):
            tracker.previous_rms[point.name] = rms
    shares = [
        nonfinite_share(t.accumulator.rows_rejected, t.accumulator.count)
        for t in window.taps
        if t.failed is None and hasattr(t.accumulator, "rows_rejected")
    ]
    out["nonfinite_share"] = max(shares, default=0.0)

    def extreme(metric: str, pick: Any) -> float:
        found = [v for k, v in out.items() if k.endswith(f"/{metric}") and math.isfinite(v)]
        return pick(found) if found else math.nan

    out["offset_share_max"] = extreme("offset_share", max)
    if any(k.endswith("/rms_growth") for k in out):  # none at the first read
        out["rms_growth_max"] = extreme("rms_growth", max)
    out["gamma_scale_min"] = extreme("gamma_scale", min)
    out["gamma_scale_max"] = extreme("gamma_scale", max)
    out["gamma_crossed_max"] = extreme("gamma_crossed", max)
    if points:
        last = points[-1].name
        out["final_offset_share"] = out.get(f"{last}/offset_share", math.nan)
    final = window.layout.final_norm if window.layout is not None else None
    if final is not None:
        out["final_out_offset_share"] = out.get(f"{final}/out_offset_share", math.nan)
        out["final_rankme"] = out.get(f"{final}/rankme", math.nan)
        out["final_rankme_centred"] = out.get(f"{final}/rankme_centred", math.nan)
    return out


def anchors(layout: ResidualLayout | None) -> bool:
    """Whether a profile over ``layout`` anchors past leading points that do not span: yes,
    except on post-norm blocks, whose points are LayerNorm outputs (with ``beta = 0`` they never
    span: the kernel itself), so no point would anchor."""
    return layout is None or layout.style != "post-norm"


def point_sigma(
    second_moment: torch.Tensor, n_rows: int, *, anchor: bool = True
) -> tuple[float, str | None, int]:
    """One point's ``(sigma_min, reason, dense_fallbacks)``, as
    :func:`~normscope.functional.profile.sigma_min_profile` reads it (its own reason:
    ``insufficient_rows``, ``non_finite_second_moment``, ``eigh_failed``, ``rank_deficient``
    (``anchor``: the rows do not span) or None; ``dense_fallbacks``: 1 when the fast solver
    could not verify it).

    Example::

        >>> point_sigma(4 * torch.eye(2), 8)
        (2.0, None, 0)
    """
    profile = sigma_min_profile(["p"], [second_moment], [n_rows], [None], anchor=anchor)
    point = profile.points[0]
    reason = None if point.reason == "first_point_unavailable" else point.reason
    return point.sigma_min, reason, profile.dense_fallbacks


def profile_from_parts(
    points: Sequence[Any],
    sigmas: Sequence[tuple],
    n_rows: Sequence[int],
    dims: Sequence[int],
) -> SigmaMinProfile:
    """The profile of ``points`` (residual points: ``name``, ``sublayer``) from each point's
    :func:`point_sigma`, row count and width (the dense fallbacks summed). The one profile
    builder of the monitor's reads.

    Example::

        >>> from types import SimpleNamespace as P
        >>> parts = [point_sigma(m, 8) for m in (torch.eye(2), 4 * torch.eye(2))]
        >>> points = [P(name="embed", sublayer=None), P(name="h.0", sublayer="block")]
        >>> profile_from_parts(points, parts, [8, 8], [2, 2]).sigma_min_ratio_min
        2.0
    """
    return profile_from_sigmas(
        [p.name for p in points],
        [p.sublayer for p in points],
        [(s[0], s[1]) for s in sigmas],
        n_rows,
        dims,
        dense_fallbacks=sum(s[2] if len(s) > 2 else 0 for s in sigmas),
    )


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
            anchor=anchors(layout),
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
    failures applied to ``tracker`` (each disabled layer warned about once), the profile put
    together (:func:`profile_from_parts`), and the one warning about inputs that do not span
    (:func:`rank_deficiency_note`)."""
    merged = ReadRecords()
    for part in parts:
        merged.norms.update(part.norms)
        merged.norm_failures.update(part.norm_failures)
        merged.sigmas.update(part.sigmas)
        merged.sources.update(part.sources)
        merged.stream.update(part.stream)
        merged.profile_failure = merged.profile_failure or part.profile_failure
        merged.sources_failure = merged.sources_failure or part.sources_failure
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
        profile = profile_from_parts(
            window.layout.points,
            # a point whose job met a failure before it was read: NaN, said (never a KeyError)
            [
                merged.sigmas.get(k, (math.nan, "not_read", 0))
                for k in range(len(window.point_taps))
            ],
            [t.accumulator.count for t in window.point_taps],
            [t.dim for t in window.point_taps],
        )
    rejected = sum(t.accumulator.rows_rejected for t in window.taps)
    failed = dict(window.failed_taps)
    failed.update({f"{name}:read": why for name, why in tracker.failed_reads.items()})
    if tracker.profile_failed is not None:
        failed["profile:read"] = tracker.profile_failed
    stream = stream_keys(tracker, window, merged.stream)
    report = DeadDirectionReport(
        window.step, norms, profile, window.layout, rejected, failed, stream=stream
    )
    split = tracker.split
    if window.sources is not None and profile is not None and split is not None:
        if merged.sources_failure is not None:
            split.failed = split.failed or merged.sources_failure
            _warn_disabled("the per-source reads", merged.sources_failure)
        else:
            srcs = {n: merged.sources[n] for n in sorted(merged.sources)}
            report = dataclasses.replace(report, sources=srcs, source_rule=tracker.source_rule)
    if not tracker.rank_warned:
        why = rank_deficiency_note(report)
        if why is not None:
            tracker.rank_warned = True
            warn_rank_zero(f"normscope: {why}")
    return report


def rank_deficiency_note(report: DeadDirectionReport) -> str | None:
    """What a read says about inputs that do not span (None when everything spans): which
    norm layers are read on their live subspace and where the ``sigma_min`` ratios anchor.
    The monitor warns with it once; ``normscope scan`` prints it.

    Example::

        >>> rank_deficiency_note(DeadDirectionReport(0, {}, None, None, 0)) is None
        True
    """
    parts = []
    names = report.rank_deficient_norms
    if names:
        shown = ", ".join(key_path(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        parts.append(
            f"{len(names)} norm layer(s) see inputs that do not span their width ({shown}): "
            "their reads are taken on the live subspace (dd/<layer>/live_dim < d) and "
            "dd/gamma_alignment_min is their subspace alignment"
        )
    profile = report.profile
    if profile is not None and profile.anchor_depth > 0 and profile.anchor is not None:
        parts.append(
            f"the first {profile.anchor_depth} residual point(s) do not span, so the sigma_min "
            f"ratios are read against {key_path(profile.anchor)} "
            f"(dd/profile_anchor_depth = {profile.anchor_depth})"
        )
    if not parts:
        return None
    return (
        "; ".join(parts) + ". Typical of small ViT patches or a vocabulary smaller than the "
        "width; the reads stay exact on what the data spans."
    )


# ============================================================================
# The dead-direction family as the engine drives it: configuration, rules, the first batch
# (residual discovery), the window's gate and the read.
#
# :class:`DeadDirectionFamily` holds what a :class:`~normscope.DeadDirectionMonitor` was given
# that is not schedule (layers, rows, tolerances, sources, rules), builds its
# :class:`~normscope.DeadDirectionTracker` when the engine sees the model, and answers the engine's
# protocol (:class:`normscope.engine.Family`). It knows no trainer: a Lightning callback, a
# Fabric loop, the Hugging Face ``Trainer`` and a plain loop all reach it through the same engine.
#
# Example::
#
#     from normscope.engine import Monitor
#     monitor = Monitor(DeadDirectionFamily(rows_per_read=1024), every_n_steps=50)
# ============================================================================


# precisions whose forwards run the norm layers themselves in half precision ("-mixed" autocast
# keeps layer_norm in float32: measured kernel_residual ~3e-15 under bf16-mixed on CPU)
_HALF_TRUE = ("bf16-true", "16-true")


def check_layers(
    layers: str | Iterable[str] | None, owner: str, what: str = "layers", none_ok: bool = False
) -> str | list[str] | None:
    """``"auto"`` or a list of module paths (a generator is read once; ``None`` too when
    ``none_ok``), else :class:`~normscope._common.ConfigurationError` naming ``owner`` and the
    argument ``what``."""
    if layers is None and none_ok:
        return None
    paths = None if isinstance(layers, str) or not isinstance(layers, Iterable) else list(layers)
    if layers != "auto" and (paths is None or not all(isinstance(x, str) for x in paths)):
        allowed = (
            "'auto', a list of module paths or None"
            if none_ok
            else ("'auto' or a list of module paths")
        )
        raise ConfigurationError(f"{owner}: {what} must be {allowed}, got {layers!r}")
    return "auto" if paths is None else paths


class DeadDirectionFamily:
    """The dead-direction reads for the engine (arguments: :class:`~normscope.DeadDirectionMonitor`'s,
    less the schedule and delivery ones the engine takes).

    Raises:
        ConfigurationError: a bad argument (at construction), or at :meth:`build` no norm layer
            / an unknown layer name.
    """

    prefix = "dd"
    kind = "DeadDirectionMonitor"
    supports_async = True
    #: W&B: the profile chart and spectrum table at the first read and every this many reads
    charts_every_n_reads: int = 10

    def __init__(
        self,
        layers: str | Sequence[str] = "auto",
        residual: bool = True,
        rows_per_read: int | str | None = None,
        alert_below: float = 1.0,
        tolerance: float = 0.4,
        patience: int = 1,
        warmup_reads: int = 0,
        kernel_residual_alert: float | None = 1e-4,
        null_tol: float = 1e-10,
        max_memory: int | None = None,
        example_forward: Callable[[nn.Module, Any], Any] | None = None,
        seed: int = 0,
        sources: Callable[[Any], Any] | str | None = None,
        max_sources: int = 8,
        attention: str | Sequence[str] | None = "auto",
    ) -> None:
        owner = self.kind
        self.layers = check_layers(layers, owner)
        try:
            check_rows_per_read(rows_per_read, owner)
        except ValueError as err:
            raise ConfigurationError(str(err)) from err
        if max_memory is not None and max_memory <= 0:
            raise ConfigurationError(f"{owner}: max_memory must be > 0 bytes")
        if sources is not None and not (isinstance(sources, str) or callable(sources)):
            raise ConfigurationError(
                f"{owner}: sources must be fn(batch) -> str | labels per sample, or a batch "
                f"field name, got {type(sources).__name__}"
            )
        try:
            self.sigma_rule = SigmaMinRatioRule(alert_below, tolerance, patience, warmup_reads)
        except ValueError as err:
            raise ConfigurationError(f"{owner}: {err}") from err
        self.kernel_rule = KernelLossRule(kernel_residual_alert) if kernel_residual_alert else None
        #: the default rules (sublayers and kinds filled in once the model is attached)
        self.rules: list[AlertRule] = default_dead_direction_rules(
            {},
            {},
            sources=sources is not None,
            sigma_rule=self.sigma_rule,
            kernel_rule=self.kernel_rule,
            kernel=self.kernel_rule is not None,
        )
        self.source_rule: SourceCollapseRule | None = next(
            (r for r in self.rules if isinstance(r, SourceCollapseRule)), None
        )
        self.residual = residual
        self.rows_per_read = rows_per_read
        self.null_tol = null_tol
        self.max_memory = max_memory
        self.example_forward = example_forward
        self.seed = seed
        self.sources = sources
        self.max_sources = max_sources
        self.attention = check_layers(attention, owner, what="attention", none_ok=True)
        self.tracker: DeadDirectionTracker | None = None
        self._discovering = False
        self._saved: dict[str, Any] = {}  # state loaded before the tracker existed

    # ------------------------------------------------------------ set-up
    def check_loop(self, precision: str) -> None:
        if str(precision) in _HALF_TRUE and self.null_tol < 1e-6:
            warn_rank_zero(
                f"normscope: precision={precision!r} runs the norm layers in half precision, so "
                f"a LayerNorm's kernel holds only to the output rounding floor (kernel_residual "
                f"about 1e-6 in bf16, measured), above null_tol={self.null_tol:g}: null_dim will "
                "read 0. Pass null_tol=1e-4 to count it."
            )

    def build(self, model: nn.Module) -> None:
        """Find the norm layers of ``model`` (no hook yet)."""
        try:
            self.tracker = DeadDirectionTracker(
                model,
                layers=self.layers,
                residual=self.residual,
                rows_per_read=self.rows_per_read,
                null_tol=self.null_tol,
                seed=self.seed,
                max_memory=self.max_memory,
                sources=self.sources,
                max_sources=self.max_sources,
                attention=self.attention,
            )
        except (TypeError, ValueError) as err:  # NormDiscoveryError is a ValueError
            raise ConfigurationError(f"{self.kind}: {err}") from err
        self.tracker.source_rule = self.sigma_rule
        self._restore()  # a resumed run's stream baselines, before the first batch sets any
        if self.kernel_rule is not None:
            self.kernel_rule.kinds = {key_path(n.name): n.kind for n in self.tracker.norms}

    @property
    def attached(self) -> bool:
        return self.tracker is not None and self.tracker.attached

    def first_batch(self, model: nn.Module, batch: Any) -> tuple[bool, bool]:
        """At the first batch: arm residual discovery on this batch's own training forward
        (the points are decided at its end, :meth:`finish_discovery`), or -- with
        ``example_forward`` or on a compiled model -- attach now with a forward of the
        family's own. Returns ``(discovering, compiled)``."""
        assert self.tracker is not None
        self.tracker.snapshot_gain_baselines()  # the gains before the first step's update
        is_compiled = compiled(model)
        if self.tracker.residual and self.example_forward is None and not is_compiled:
            try:
                self.tracker.start_discovery()
            except Exception as err:  # noqa: BLE001 - e.g. no block stack: keep the norm reads
                self._profile_off(f"{type(err).__name__}: {err}")
                return False, is_compiled
            self._discovering = True
            return True, is_compiled
        self._attach_with_forward(model, batch)
        return False, is_compiled

    def finish_discovery(self) -> None:
        """At the end of the discovery step: decide the points from its forward, then tap."""
        if not self._discovering:
            return
        self._discovering = False
        assert self.tracker is not None
        try:
            self.tracker.attach()
        except Exception as err:  # noqa: BLE001 - discovery failed: keep the norm reads
            self._profile_off(
                f"the training forward did not show the stream ({type(err).__name__}: {err})"
            )
            return
        self._after_attach()

    def _attach_with_forward(self, model: nn.Module, batch: Any) -> None:
        assert self.tracker is not None
        forward = self.example_forward or call_model
        if self.example_forward is None and isinstance(self.sources, str):
            field = self.sources  # a label field is no model input

            def forward(module: nn.Module, batch: Any) -> Any:
                return call_model(module, batch, (field,))

        try:
            # eager even on a compiled model: dynamo must not trace discovery's identity hooks
            with torch.no_grad(), eager_forwards():
                self.tracker.attach(forward=lambda: forward(model, batch))
        except Exception as err:  # noqa: BLE001 - discovery failed: keep the norm reads
            self._profile_off(f"the discovery forward failed ({type(err).__name__}: {err})")
            return
        self._after_attach()

    def _profile_off(self, why: str) -> None:
        """No residual profile: one warning saying why and what to pass; the norm reads go on
        and every read logs ``dd/profile_points`` = 0."""
        assert self.tracker is not None
        warn_rank_zero(
            f"normscope: residual profile disabled (dd/profile_points = 0: no sigma_min profile, "
            f"so the sigma_min collapse alert is off): {why}. Pass "
            "example_forward=fn(model, batch) running one forward through the transformer "
            "blocks, or residual=False to silence this."
        )
        self.tracker.detach()
        self.tracker.residual = False
        self.tracker.layout = None
        self.tracker.attach()
        self._after_attach()

    def _after_attach(self) -> None:
        """Say what the layout holds (notes as info, a block-boundary fallback as a warning)
        and give the rules the points' sublayers; a post-norm model gets no sigma_min rules."""
        assert self.tracker is not None
        subs = {}
        layout = self.tracker.layout
        if layout is not None:
            subs = {key_path(p.name): p.sublayer for p in layout.points}
            for note in layout.notes:
                if note == layout.fallback:
                    warn_rank_zero(f"normscope: {note}")
                else:
                    say(f"normscope: {note}")
            if layout.style == "post-norm" and self.sigma_rule in self.rules:
                # The no-cancellation bound is a pre-norm statement: on post-LN blocks the
                # profile is logged, but a ratio below 1 is not an alert.
                self.rules.remove(self.sigma_rule)
                if self.source_rule in self.rules:
                    self.rules.remove(self.source_rule)
                say("normscope: post-norm model: sigma_min alerts are off")
        self.sigma_rule.sublayers = subs
        if layout is not None:  # the sublayer modules, so that an alert names what cancels
            self.sigma_rule.modules = {
                key_path(p.name): key_path(p.sublayer_module)
                for p in layout.points
                if p.sublayer_module
            }
        if self.source_rule is not None:
            self.source_rule.sublayers = subs

    def detach(self) -> None:
        if self.tracker is not None:
            self.tracker.gate.open = False
            self.tracker.detach()

    # ------------------------------------------------------------ the window
    def see(self, batch: Any) -> None:
        return None

    def share_rows(self, forwards: int) -> None:
        """The window's forwards (micro-batches x ranks) share the row budget
        (:meth:`DeadDirectionTracker.share_rows`)."""
        if self.tracker is not None:
            self.tracker.share_rows(forwards)

    def open(self, batch: Any) -> None:
        """Open the gate for this micro-batch's forwards (the gammas snapshotted first)."""
        tracker = self.tracker
        assert tracker is not None
        tracker.snapshot_gammas()  # the gammas this window's forwards use
        tracker.gate.mask = batch_mask(batch)
        tracker.gate.sources = tracker.label(batch)
        tracker.gate.open = True

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.gate.open = False
            self.tracker.gate.mask = None
            self.tracker.gate.sources = None

    def rows(self) -> torch.Tensor:
        """The window's smallest row count over the live taps (a device tensor)."""
        assert self.tracker is not None
        return self.tracker.min_rows()

    def rejected(self) -> torch.Tensor:
        """The window's NaN/Inf rows: the most any live tap dropped (a device tensor)."""
        assert self.tracker is not None
        return self.tracker.max_rejected()

    def rows_needed(self, rules: Sequence[Any]) -> int:
        """``min_rows_per_dim * d`` rows when the sigma rule decides, else ``2 d``."""
        assert self.tracker is not None
        per_dim = self.sigma_rule.min_rows_per_dim if self.sigma_rule in rules else 2.0
        width = max((t.dim for t in self.tracker.taps.taps.values()), default=1)
        return math.ceil(per_dim * width)

    # ------------------------------------------------------------ the read
    def take(self, step: int, *, distributed: bool, swap: bool) -> ReadWindow:
        """The read step's main-thread part: the cross-rank reduce, then the window taken
        (``swap``: the taps get fresh accumulators at once)."""
        assert self.tracker is not None
        if distributed:
            reduce_taps(self.tracker)
        return take_window(self.tracker, step, swap=swap)

    def read(self, step: int, *, distributed: bool) -> DeadDirectionReport:
        """A synchronous read: the same take / solve / assemble, waited for at once."""
        assert self.tracker is not None
        return self.tracker.read(step, reduce=distributed)

    def solve(self, window: ReadWindow, share: tuple[int, int]) -> ReadRecords:
        assert self.tracker is not None
        return solve_window(self.tracker, window, share)

    def gather(self, records: ReadRecords | None, error: str | None = None) -> list[ReadRecords]:
        """Every rank's records (a collective); ``None`` with ``error``: a failed rank's part."""
        return gather_records(records if records is not None else ReadRecords(error=error))

    def assemble(self, window: ReadWindow, parts: list[ReadRecords], solves: int) -> Any:
        tracker = self.tracker
        assert tracker is not None
        tracker.last_solves = solves
        return finish_report(tracker, window, parts)

    def reset(self) -> None:
        if self.tracker is not None:
            self.tracker.reset()

    def metrics(self, report: DeadDirectionReport) -> dict[str, float]:
        return report.as_dict()

    def read_line(self, report: DeadDirectionReport, fired: Sequence[Any]) -> str:
        return format_read_line(report, fired)

    def summary(self, report: DeadDirectionReport, reads: int, alerts: Sequence[Any]) -> str:
        return format_summary(report, reads, alerts)

    def worst_point(self, report: DeadDirectionReport) -> tuple[float, str] | None:
        """The run's candidate worst point: ``(ratio, point)`` of this read (W&B summary)."""
        profile = report.profile
        if profile is None or not math.isfinite(profile.sigma_min_ratio_min):
            return None
        return profile.sigma_min_ratio_min, key_path(profile.worst_point or "")

    def charts(self, report: DeadDirectionReport, step: int) -> dict[str, Any]:
        """The W&B media of a read: a table of each norm's bottom eigenvalues and the
        ``sigma_min`` ratio against depth (the engine logs them at the first read and every
        :attr:`charts_every_n_reads`-th)."""
        import wandb

        payload: dict[str, Any] = {}
        spectrum = wandb.Table(columns=["layer", "k", "eigenvalue_over_top"])
        for layer, norm in report.norms.items():
            for k, value in enumerate(norm.kernel.bottom_eigenvalues):
                spectrum.add_data(layer, k + 1, float(value))
        payload["dd/spectrum_bottom"] = spectrum
        profile = report.profile
        if profile is not None:
            xs = list(range(len(profile.points)))
            ratios = [
                p.sigma_min_ratio if math.isfinite(p.sigma_min_ratio) else math.nan
                for p in profile.points
            ]
            payload["dd/sigma_min_profile"] = wandb.plot.line_series(
                xs=xs,
                ys=[ratios, [1.0] * len(xs)],
                keys=["sigma_min_ratio", "floor (1.0)"],
                title=f"sigma_min ratio against depth (step {step})",
                xname="residual point (depth)",
            )
        return payload

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What the stream reads compare with (docs/metrics.md §1.6): each norm's gains at the
        monitor's first batch (the gain drift's baseline, ``d`` floats a norm) and each
        residual point's RMS at the last read (its growth). The dead-direction reads
        themselves stand on their own window (``delta_gamma`` needs no baseline)."""
        tracker = self.tracker
        if tracker is None:
            return dict(self._saved)
        return {
            "gain_baselines": {k: v.detach().cpu() for k, v in tracker.gain_baselines.items()},
            "previous_rms": dict(tracker.previous_rms),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the stream reads' baselines (keys of older checkpoints are ignored)."""
        self._saved = {
            "gain_baselines": {
                str(k): torch.as_tensor(v, dtype=torch.float64)
                for k, v in state.get("gain_baselines", {}).items()
            },
            "previous_rms": {str(k): float(v) for k, v in state.get("previous_rms", {}).items()},
        }
        if self.tracker is not None:
            self._restore()

    def _restore(self) -> None:
        assert self.tracker is not None
        saved = self._saved
        self.tracker.gain_baselines.update(saved.get("gain_baselines", {}))
        self.tracker.previous_rms.update(saved.get("previous_rms", {}))

    def describe(self) -> str:
        """One line on what is read (for a person)."""
        tracker = self.tracker
        if tracker is None:
            return "not built"
        points = len(tracker.layout.points) if tracker.layout is not None else 0
        return (
            f"{len(tracker.norms)} norm layers, {points} residual points, "
            + fmt(tracker.memory_bytes() / 2**20, ".1f")
            + " MiB"
        )


# ============================================================================
# Plain-text renderings of a read: one line per read, a table, an end-of-run summary.
# ============================================================================


_f = fmt


def format_read_line(report: DeadDirectionReport, fired: Sequence[Alert] = ()) -> str:
    """``normscope step 50 | sigma_min_ratio_min 0.97 at h.2.ln_2 (attn) | ...`` in one line."""
    parts = [f"normscope step {report.step}"]
    profile = report.profile
    if profile is not None:
        worst = profile.worst_point
        sub = next((p.sublayer for p in profile.points if p.name == worst), None)
        where = f" at {key_path(worst)} ({sub or 'block'})" if worst else ""
        parts.append(f"sigma_min_ratio_min {format(profile.sigma_min_ratio_min, '.4g')}{where}")
    ln = [n for n in report.norms.values() if n.kind == "layernorm" and n.gamma.dead_channels == 0]
    if ln:  # the headline, as dd/gamma_alignment_min: each LayerNorm's kernel_alignment
        parts.append(
            f"gamma_alignment_min {format(min(n.kernel.kernel_alignment for n in ln), '.6f')}"
        )
    deltas = [n.delta_gamma for n in report.norms.values() if math.isfinite(n.delta_gamma)]
    if deltas:
        parts.append(f"Delta_gamma max {format(max(deltas), '.4g')}")
    if report.sources:
        per = ", ".join(
            f"{name} {format(p.sigma_min_ratio_min, '.4g')}" for name, p in report.sources.items()
        )
        collapses = report.collapses
        verdict = (
            f"; {collapses[0].kind} collapse at {key_path(collapses[0].point)}" if collapses else ""
        )
        parts.append(f"by source: {per}{verdict}")
    if report.rows_rejected:
        parts.append(f"rows_rejected {report.rows_rejected}")
    if report.failed_taps:
        off = sorted({key.rsplit(":", 1)[0] for key in report.failed_taps})
        parts.append(f"disabled after a failure: {', '.join(off)}")
    if fired:
        parts.append(f"ALERTS {len(fired)}: " + "; ".join(a.message for a in fired))
    return " | ".join(parts)


def format_table(report: DeadDirectionReport) -> str:
    """One row per norm layer, then the sigma_min profile."""
    lines = [
        f"{'norm layer':<36} {'kind':<9} {'class':<15} {'align':>9} {'kernel_res':>10} "
        f"{'null':>4} {'dead':>4} {'Delta_g':>8} {'control':>7}",
    ]
    for name, n in report.norms.items():
        lines.append(
            f"{name[-36:]:<36} {n.kind:<9} {n.kernel.norm_class:<15} "
            f"{_f(n.kernel.gamma_alignment, '.6f'):>9} {_f(n.kernel.kernel_residual, '.1e'):>10} "
            f"{n.kernel.null_dim:>4} {n.gamma.dead_channels:>4} {_f(n.delta_gamma, '.3f'):>8} "
            f"{_f(n.depth.control_delta_gamma, '.3f'):>7}"
        )
    if report.profile is not None:
        lines.append("")
        lines.append(
            f"{'residual point':<40} {'sublayer':<8} {'sigma_min':>10} {'ratio':>7} {'step':>7}"
        )
        for p in report.profile.points:
            lines.append(
                f"{p.name[-40:]:<40} {p.sublayer or '-':<8} {_f(p.sigma_min, '.4g'):>10} "
                f"{_f(p.sigma_min_ratio, '.3f'):>7} {_f(p.sigma_min_step, '.3f'):>7}"
            )
    return "\n".join(lines)


def format_summary(report: DeadDirectionReport, reads: int, alerts: Sequence[Alert]) -> str:
    """The end-of-fit summary: the last read as a table and every alert of the run."""
    head = (
        f"normscope summary: {reads} reads, {len(alerts)} alert(s); last read at step {report.step}"
    )
    body = [head, format_table(report)]
    for a in alerts:
        body.append(f"  alert at step {a.step}: {a.message}")
    return "\n".join(body)
