"""``DeadDirectionTracker``: the dead-direction family's hooks, accumulators and memory.

Per norm layer two tensors are tapped: its input ``h`` (covariance ``C_h`` for the Schur
quotient, second moment for ``sigma_min`` where the input is a residual point) and its output
(covariance ``C`` for the kernel reads). A residual point that is not a norm input (a post-LN
block output, say) gets a tap of its own. Taps are shared: one accumulator per
``(module, input|output)``. ``max_memory``: :mod:`normscope.families.budget`."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from normscope._common import warn_disabled, warn_rank_zero
from normscope._distributed import read_share
from normscope.families.budget import fit_budget, stream_width
from normscope.families.dead_direction.init_reference import InitReference
from normscope.families.dead_direction.read import finish_report, gather_records, solve_window
from normscope.families.dead_direction.report import DeadDirectionReport
from normscope.families.dead_direction.window import (
    MemoryUpdate,
    ReadMemory,
    ReadRecords,
    ReadWindow,
    covered,
)
from normscope.taps.attention import AttentionLogits, find_attention_modules
from normscope.taps.hooks import Gate, Tap, TapSet
from normscope.taps.norms import NormLayer, discover_norm_layers, find_norm_layers
from normscope.taps.residual import ResidualDiscovery, ResidualLayout, find_residual_points
from normscope.taps.sources import SourceLabels, SourceSplit, resolve_labels

if TYPE_CHECKING:
    from normscope.families.dead_direction.config import DeadDirectionConfig

__all__ = ["DeadDirectionTracker"]

ForwardFn = Callable[[], Any]


def _frozen(tap: Tap) -> Tap:
    return dataclasses.replace(tap, accumulator=copy.copy(tap.accumulator))


class DeadDirectionTracker:
    """Hooks, accumulators, memory and reads of the dead-direction family, for any PyTorch loop.

    It finds the norm layers and residual points of ``model`` (:mod:`normscope.taps`), hooks
    them once (:meth:`attach`), folds rows while its gate is open and, on :meth:`read`, reduces
    across processes and runs every read of docs/metrics.md §1 into a
    :class:`~normscope.families.dead_direction.report.DeadDirectionReport`. The read path
    (:mod:`~normscope.families.dead_direction.read`) returns what it computed; the tracker
    keeps what the read asks it to remember (:meth:`finish`).

    Args:
        config: the options (:class:`~normscope.families.dead_direction.config.DeadDirectionConfig`,
            already checked).
        model: the model (any ``nn.Module``).

    Example::

        tracker = DeadDirectionTracker(DeadDirectionConfig(), model)
        tracker.attach(forward=lambda: model(example_ids))   # discovers residual points
        with tracker.gate.sampling(mask=attention_mask):
            model(input_ids)
        report = tracker.read(step=0)
        report.as_dict()["dd/sigma_min_ratio_min"]
        tracker.detach()
    """

    def __init__(self, config: DeadDirectionConfig, model: nn.Module) -> None:
        self.config = config
        self.model = model
        # live state that starts as configured: the profile is turned off when discovery
        # fails (the family), the per-source reads when max_memory has no room for them
        self.residual = config.residual
        self.sources = config.sources
        self.split: SourceSplit | None = None
        self.source_rule: Any = None  # the SigmaMinRatioRule that classifies; None: default
        self._sources_failed: str | None = None
        self._sources_warned: set[str] = set()
        self.forwards_per_read = 1  # share_rows: the forwards (micro-batches x ranks) of a window
        self.gate = Gate()
        self.taps = TapSet(model, self.gate, seed=config.seed)
        self.norms: list[NormLayer] = find_norm_layers(model, config.layers)
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
        #: the final norm's rows on the discovery forward, until the first read takes them
        self.init_reference: InitReference | None = None
        self.attached = False
        self.last_solves = 0  # jobs this process solved at the last read (a split read: a share)
        #: the open window folds the whole co-moment of every tap (its read computes the
        #: spectral tier) or the diagonals only (the cheap tier): :meth:`open_window`
        self.fold_full = True
        self._window_open = False
        self.rank_warned = False  # the one warning about inputs that do not span
        # the stream reads (docs/metrics.md §1.6): each norm's gamma at the first read (the
        # gain drift's baseline) and each residual point's RMS at the previous read
        self.gain_baselines: dict[str, torch.Tensor] = {}
        self.previous_rms: dict[str, float] = {}
        # the attention-logit read (docs/metrics.md §1.7): its modules now, its hooks at attach
        self.attention_names = find_attention_modules(model, config.attention)
        self.attention_on = config.attention is not None  # asked for: dd/attn_modules_read says 0
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

    def start_discovery(self, mask: torch.Tensor | None = None) -> bool:
        """Arm residual discovery on the next forward the caller runs itself (a training step's
        own forward, :class:`~normscope.taps.residual.ResidualDiscovery`); the following
        :meth:`attach` decides the points from it and registers the taps. The same forward
        gives the final norm's offset share before its update (:class:`InitReference`, its
        ``step`` 0 unless set; ``mask``: the batch's padding mask), logged by the first read.
        False (nothing armed) when ``residual`` is off or the points are known.

        Raises:
            ResidualDiscoveryError: the model has no block stack.
        """
        if not self.residual or self.layout is not None or self.attached:
            return False
        if self._discovery is None:
            self._discovery = ResidualDiscovery(self.model, self.norms).install()
            try:
                self.init_reference = InitReference(self.norms, mask).install()
            except Exception:  # noqa: BLE001 - no reference; discovery goes on
                self._drop_init()
        return True

    def attach(self, forward: ForwardFn | None = None) -> None:
        """Discover residual points (if ``residual``) and register every hook, once.

        After :meth:`start_discovery` and a forward, the points come from that forward and
        ``forward`` is not called."""
        if self.attached:
            return
        if self.layout is None and self._discovery is not None:
            discovery, self._discovery = self._discovery, None
            init, self.init_reference = self.init_reference, None
            if init is not None:
                init.remove()  # first: discovery may fail below
            if self.residual:
                self.layout = discovery.finish()  # removes its hooks first, whatever it finds
            else:
                discovery.remove()
            if init is not None and self.layout is not None:
                self.init_reference = init.settle(self.layout.final_norm, init.step)
        elif self.layout is None:
            self.discover(forward)
        if self.layout is not None and self.config.layers != "auto":
            total = len(discover_norm_layers(self.model, warn=False).norms)
            self.layout = self.layout.found_from(len(self.norms), total)
        if self.config.max_memory is not None:
            self._apply_budget(self.config.max_memory)
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
                        self.config.max_sources,
                    )
                    chain.split = self.split
        if self.sources is not None and self.split is None:
            self._sources_off("the residual profile is not read (no residual points)")
        self._apply_rows()
        if self.attention_names and self.attention is None:
            self.attention = AttentionLogits(self.model, self.attention_names, self.gate)
            self._apply_rows()  # the attention read's query budget
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
        """Share each read's ``rows_per_read`` among ``forwards`` forwards: the
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
        rows = self.config.rows_per_read_at(dim)
        return None if rows is None else -(-rows // self.forwards_per_read)

    def _apply_rows(self) -> None:
        for tap in self.taps.taps.values():
            if hasattr(tap.accumulator, "max_rows"):
                tap.accumulator.max_rows = self.rows_per_forward(tap.dim)
        chain = self.taps.chain
        if chain is not None and chain.taps:
            chain.max_rows = self.rows_per_forward(chain.taps[0].dim)
        if self.attention is not None and self.norms:  # queries: the stream's row budget
            self.attention.max_rows = self.rows_per_forward(self.norms[0].dim)

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
                    f"normscope: max_sources={self.config.max_sources} sources are tracked; rows of "
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
        n_src = self.config.max_sources if self.sources is not None else 0
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
        self._drop_init()
        self.taps.remove()
        if self.attention is not None:
            self.attention.remove()
            self.attention = None
        self.attached = False

    def _drop_init(self) -> None:
        if self.init_reference is not None:
            self.init_reference.remove()
            self.init_reference = None

    def open_window(self, full: bool) -> None:
        """Decide how the window about to open folds its rows: the whole co-moment of every tap
        (``full``: its read computes the spectral tier) or the means and diagonals only (the
        cheap tier: ``O(N d)`` per tap; docs/costs.md, "Tiers"). The family calls it from the
        read schedule before a sampled forward; once the window holds rows (its other
        micro-batches, a deferred read's next steps) the mode stays until :meth:`reset`."""
        if self._window_open:
            return
        self._window_open = True
        self.fold_full = full = bool(full)
        for tap in self.taps.taps.values():
            if hasattr(tap.accumulator, "set_full"):
                tap.accumulator.set_full(full)
        if self.taps.chain is not None:  # the per-source profiles are the spectral tier's
            self.taps.chain.split = self.split if full else None

    def reset(self) -> None:
        """Start a new window (its fold mode is decided again at :meth:`open_window`)."""
        self._window_open = False
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
        self,
        step: int = 0,
        *,
        reduce: bool = True,
        reset: bool = True,
    ) -> DeadDirectionReport:
        """Reduce across processes (``reduce``; every rank must call this at the same step),
        run every read and start a new window (``reset``; ``False`` keeps the window: the
        same accumulators can be read again, as ``benchmarks/read_cost.py`` does). Under
        several processes every rank solves a round-robin share and the records are gathered:
        every rank gets the same full report (:mod:`~normscope.families.dead_direction.read`).
        The read computes the spectral tier iff its window folded full (:meth:`open_window`)."""
        if reduce:
            self.reduce()
        share = read_share() if reduce else (0, 1)
        window = self.take(step, swap=False)
        records = solve_window(window, share)
        parts = gather_records(records) if share[1] > 1 else [records]
        self.last_solves = records.solves
        errors = [p.error for p in parts if p.error is not None]
        if errors:
            self.reset()
            raise RuntimeError(f"the read failed: {errors[0]}")
        report = self.finish(window, parts)
        if reset:
            self.reset()
        return report

    def reduce(self) -> None:
        """The cross-rank reduce of every accumulator (a collective: every rank, the same
        order); then every rank holds the same window."""
        for tap in self.taps.taps.values():  # same order on every rank
            tap.accumulator.reduce_()
        if self.split is not None and self.fold_full:  # not folded on a cheap window
            self.split.reduce_()  # source names agreed across ranks first
        if self.attention is not None:
            self.attention.reduce_()
        if self.init_reference is not None:  # the first read after discovery only
            self.init_reference.reduce_()

    def take(self, step: int, *, swap: bool) -> ReadWindow:
        """Freeze the window (after :meth:`reduce`). ``swap`` (an asynchronous read): every
        accumulator is shallow-copied -- the copy keeps *references* to the window's tensors --
        and the live taps are reset with fresh tensors, so the next window folds into new
        memory while the read holds the old (no ``d x d`` copy); else the window reads the
        live accumulators and the caller resets them after. The window is spectral iff it
        folded full (:meth:`open_window`)."""
        spectral = self.fold_full
        live = list(self.taps.taps.values())
        frozen = {t.key: (_frozen(t) if swap else t) for t in live}
        split = self.split
        sources = None
        if split is not None and split.failed is None and spectral:
            sources = {
                n: ([copy.copy(a) for a in split.accs[n]] if swap else split.accs[n])
                for n in sorted(split.accs)
            }
        norm_taps = {
            name: (frozen[a.key], frozen[b.key]) for name, (a, b) in self.norm_taps.items()
        }
        skip = {
            n.name
            for n in self.norms
            if n.name in self.failed_reads or any(t.failed for t in self.norm_taps[n.name])
        }
        window = ReadWindow(
            step=step,
            norms=list(self.norms),
            norm_taps=norm_taps,
            gammas=self.window_gammas(),
            skip=skip,
            point_taps=[frozen[t.key] for t in self.point_taps],
            sources=sources,
            layout=self.layout,
            profile_on=self.profile_failed is None,
            taps=[frozen[t.key] for t in live],
            failed_taps={f"{t.module_name}:{t.where}": t.failed for t in live if t.failed},
            null_tol=self.config.null_tol,
            placement=self.placement,
            spectral=spectral,
            init=self.init_reference.take() if self.init_reference is not None else None,
        )
        self.init_reference = None  # given once: a key is absent afterwards, never stale
        window.covers = covered(window) if spectral else {}
        if self.attention is not None:  # swapped: the live maxima start over; else reset() does
            window.attention = self.attention.take() if swap else dict(self.attention.maxima)
        elif self.attention_on:
            window.attention = {}  # asked for, no attention module found: the count says 0
        if swap:
            self.reset()
            for old, tap in zip(window.taps, live):
                # reset() must give the live taps new tensors: one zeroed in place would wipe
                # the window the read holds (never silently read zeros)
                old_m, new_m = (
                    old.accumulator.comoment_diagonal(),
                    tap.accumulator.comoment_diagonal(),
                )
                if old_m.data_ptr() == new_m.data_ptr():
                    raise RuntimeError("normscope: an accumulator's reset() reused its tensors")
        return window

    def finish(self, window: ReadWindow, parts: list[ReadRecords]) -> DeadDirectionReport:
        """The report of ``window`` from every rank's records
        (:func:`~normscope.families.dead_direction.read.finish_report`), and what it asks
        this tracker to remember kept (:meth:`apply`)."""
        memory = ReadMemory(
            failed_reads=self.failed_reads,
            profile_failed=self.profile_failed,
            gain_baselines=self.gain_baselines,
            previous_rms=self.previous_rms,
            source_rule=self.source_rule,
            rank_warned=self.rank_warned,
        )
        report, update = finish_report(window, parts, memory)
        self.apply(update)
        return report

    def apply(self, update: MemoryUpdate) -> None:
        """Keep what a read asks to remember; warn once about each layer it disabled."""
        for name, why in update.failed_reads.items():
            self.failed_reads[name] = why
            warn_disabled(f"the read of norm layer {name!r}", why, stacklevel=4)
        if update.profile_failed is not None and self.profile_failed is None:
            self.profile_failed = update.profile_failed
            warn_disabled("the residual sigma_min profile", update.profile_failed, stacklevel=4)
        self.gain_baselines.update(update.gain_baselines)
        self.previous_rms.update(update.previous_rms)
        if update.sources_failed is not None and self.split is not None:
            self.split.failed = self.split.failed or update.sources_failed
            warn_disabled("the per-source reads", update.sources_failed, stacklevel=4)
        if update.rank_note is not None and not self.rank_warned:
            self.rank_warned = True
            warn_rank_zero(f"normscope: {update.rank_note}")

    @property
    def placement(self) -> str:
        """``"post"`` when the residual layout found post-norm blocks (the norms' inputs are
        not the residual stream, so the reads of ``v*`` in them have no premise), else
        ``"pre"`` (also without a layout: the reads are taken as a pre-norm model's)."""
        layout = self.layout
        return "post" if layout is not None and layout.style == "post-norm" else "pre"

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
        # the loaded window goes on in the mode it was folded in (a mixed one, which no
        # tracker saves, goes on full: its diagonal-only taps emptied)
        full = all(getattr(t.accumulator, "full", True) for t in self.taps.taps.values())
        self._window_open = False
        self.open_window(full)

    def memory_bytes(self) -> int:
        split = self.split.memory_bytes() if self.split is not None else 0
        return self.taps.memory_bytes() + split
