"""``DeadDirectionFamily``: the dead-direction reads as the engine drives them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from normscope._common import ConfigurationError, fmt, say, warn_rank_zero
from normscope.alerts import (
    AlertRule,
    KernelLossRule,
    SigmaMinRatioRule,
    SourceCollapseRule,
    default_dead_direction_rules,
)
from normscope.families.dead_direction.read import gather_records, solve_window
from normscope.families.dead_direction.render import format_read_line, format_summary
from normscope.families.dead_direction.report import (
    FAMILY,
    KIND,
    DeadDirectionReport,
    cheap_key,
)
from normscope.families.dead_direction.tracker import DeadDirectionTracker
from normscope.families.dead_direction.window import ReadRecords, ReadWindow
from normscope.taps.forward_capture import inner_model
from normscope.taps.hooks import batch_mask, call_model, compiled, eager_forwards
from normscope.taps.paths import key_path

if TYPE_CHECKING:
    from normscope.families.dead_direction.config import DeadDirectionConfig

__all__ = ["DeadDirectionFamily"]

# precisions whose forwards run the norm layers themselves in half precision ("-mixed" autocast
# keeps layer_norm in float32: measured kernel_residual ~3e-15 under bf16-mixed on CPU)
_HALF_TRUE = ("bf16-true", "16-true")


class DeadDirectionFamily:
    """The dead-direction reads as the engine drives them (the protocol of
    :class:`normscope.engine.Family`): the rules, the tracker built when the engine sees the
    model, the first batch (residual discovery), the window's gate, the read and the state. It
    knows no trainer: a Lightning callback, a Fabric loop, the Hugging Face ``Trainer`` and a
    plain loop all reach it through the same engine.

    Args:
        config: the options, already checked
            (:class:`~normscope.families.dead_direction.config.DeadDirectionConfig`;
            ``config.build()`` makes this family).

    Raises:
        ConfigurationError: at :meth:`build`, no norm layer / an unknown layer name.

    Example::

        from normscope.engine import Monitor
        monitor = Monitor.of(DeadDirectionConfig(rows_per_read=1024), model, every_n_steps=50)
    """

    prefix = FAMILY
    kind = KIND
    supports_async = True
    fsdp2 = True  # gammas are read whole in the forward (docs/integrations.md)
    #: W&B: the profile chart and spectrum table at the first read and every this many reads
    charts_every_n_reads: int = 10

    def __init__(self, config: DeadDirectionConfig) -> None:
        self.config = config
        self.sigma_rule = SigmaMinRatioRule(
            config.alert_below, config.tolerance, config.patience, config.warmup_reads
        )
        alert = config.kernel_residual_alert
        self.kernel_rule = KernelLossRule(alert) if alert else None
        #: the default rules (sublayers and kinds filled in once the model is attached)
        self.rules: list[AlertRule] = default_dead_direction_rules(
            {},
            {},
            sources=config.sources is not None,
            sigma_rule=self.sigma_rule,
            kernel_rule=self.kernel_rule,
            kernel=self.kernel_rule is not None,
            objective=config.objective,
        )
        self.source_rule: SourceCollapseRule | None = next(
            (r for r in self.rules if isinstance(r, SourceCollapseRule)), None
        )
        self.tracker: DeadDirectionTracker | None = None
        #: reads taken so far (checkpointed): read ``k`` (from 0) is spectral when
        #: ``k % spectral_every() == 0``, so the first read always is; its window folds full
        self.reads_taken = 0
        self._discovering = False
        #: the optimiser steps done before the discovery forward (the engine sets it when
        #: :meth:`first_batch` arms discovery; 0: a fresh run), the init reference's step
        self.discovery_step = 0
        self._saved: dict[str, Any] = {}  # state loaded before the tracker existed
        #: keep every hook registered between sampled windows (a compiled model, learned at
        #: :meth:`first_batch`); False: they are registered at :meth:`open`, removed at
        #: :meth:`close` (docs/costs.md, "Between sampled steps")
        self.keep_hooks = False
        self._model: nn.Module | None = None  # the model the first batch ran

    # ------------------------------------------------------------ set-up
    def check_loop(self, precision: str) -> None:
        null_tol = self.config.null_tol
        if str(precision) in _HALF_TRUE and null_tol < 1e-6:
            warn_rank_zero(
                f"normscope: precision={precision!r} runs the norm layers in half precision, so "
                f"a LayerNorm's kernel holds only to the output rounding floor (kernel_residual "
                f"about 1e-6 in bf16, measured), above null_tol={null_tol:g}: null_dim will "
                "read 0. Pass null_tol=1e-4 to count it."
            )

    def build(self, model: nn.Module) -> None:
        """Find the norm layers of ``model`` (no hook yet)."""
        try:
            self.tracker = DeadDirectionTracker(self.config, model)
        except (TypeError, ValueError) as err:  # NormDiscoveryError, an unknown attention module
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
        (the points are decided at its end, :meth:`finish_discovery`; the same forward gives
        the final norm's offset share before the update, with the batch's padding mask), or
        -- with ``example_forward`` or on a compiled model -- attach now with a forward of
        the family's own. Returns ``(discovering, compiled)``."""
        assert self.tracker is not None
        self.tracker.snapshot_gain_baselines()  # the gains before the first step's update
        is_compiled = compiled(model)
        self._model = model  # open() looks again: a model compiled after the first batch
        self.keep_hooks = self.keep_hooks or is_compiled
        if self.tracker.residual and self.config.example_forward is None and not is_compiled:
            try:
                self.tracker.start_discovery(mask=batch_mask(batch))
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
        if self.tracker.init_reference is not None:
            self.tracker.init_reference.step = self.discovery_step
        try:
            self.tracker.attach()  # removes the discovery forward's hooks, whatever happens
        except Exception as err:  # noqa: BLE001 - discovery failed: keep the norm reads
            self._profile_off(
                f"the training forward did not show the stream ({type(err).__name__}: {err})"
            )
            return
        self._after_attach()

    def _attach_with_forward(self, model: nn.Module, batch: Any) -> None:
        assert self.tracker is not None
        forward = self.config.example_forward or call_model
        if self.config.example_forward is None and isinstance(self.config.sources, str):
            field = self.config.sources  # a label field is no model input

            def forward(module: nn.Module, batch: Any) -> Any:
                return call_model(module, batch, (field,))

        try:
            # eager even on a compiled model: dynamo must not trace discovery's identity hooks
            # a wrapper without a forward() of its own: through the model it holds
            target = model if self.config.example_forward is not None else inner_model(model)
            with torch.no_grad(), eager_forwards():
                self.tracker.attach(forward=lambda: forward(target, batch))
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
        """Open the gate for this micro-batch's forwards (the gammas snapshotted first). A new
        window's fold is decided here, from the read schedule (:meth:`spectral_next`): the
        whole co-moments for a spectral read, the diagonals for a cheap one."""
        tracker = self.tracker
        assert tracker is not None
        tracker.open_window(self.spectral_next())  # every rank alike: the schedule is a count
        tracker.snapshot_gammas()  # the gammas this window's forwards use
        tracker.gate.mask = batch_mask(batch)
        tracker.gate.sources = tracker.label(batch)
        tracker.gate.open = True
        self._hook()

    def close(self) -> None:
        """Close the gate after a micro-batch's forwards (validation, an exception); on an
        eager model also take the hooks off, until the next :meth:`open`."""
        if self.tracker is not None:
            self.tracker.gate.open = False
            self.tracker.gate.mask = None
            self.tracker.gate.sources = None
            self._unhook()

    # Hooks between sampled windows. On an eager model no hook of this family is registered
    # between them: every hooked module would otherwise take PyTorch's slow call path and run
    # a Python call per hook at every step (measured +0.2% a step on the demo GPT at width
    # 128, docs/costs.md). A window's micro-batches and a deferred read's steps each open
    # and close, so the hooks come back at each open (~40 registrations on sampled steps
    # only); the accumulators and the open window's rows are the taps', not the hooks'.
    # They stay registered (the Gate still checked first in every hook) where removal is
    # unsafe: a compiled model (dynamo guards on the hooks: adding or removing recompiles),
    # and an attention module whose forward is still being read (its forward hook ends the
    # read). Residual discovery's and the init reference's temporary hooks are their own.
    def _hook(self) -> None:
        tracker = self.tracker
        if tracker is None or not tracker.attached:
            return
        if not self.keep_hooks and not tracker.taps.hooked:
            # a model compiled after the first batch keeps them from now on (one recompile)
            self.keep_hooks = self._model is not None and compiled(self._model)
        tracker.taps.hook()
        if tracker.attention is not None:
            tracker.attention.hook()

    def _unhook(self) -> None:
        tracker = self.tracker
        if tracker is None or self.keep_hooks or not tracker.attached:
            return
        if tracker.attention is not None and tracker.attention.hooked:
            if not tracker.attention.unhook():
                return
        if tracker.taps.hooked:
            tracker.taps.unhook()

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
    def spectral_next(self) -> bool:
        """Whether the next read computes the spectral tier (docs/costs.md, "Tiers"): the
        first read and every ``spectral_every``-th after it. Its window folds full
        (:meth:`open`); the read itself computes what its window folded."""
        return self.reads_taken % self.spectral_every() == 0

    def spectral_every(self) -> int:
        """Reads per spectral read: ``config.spectral_every``, ``"auto"`` resolved at the
        widest norm layer (:meth:`DeadDirectionConfig.spectral_every_at`)."""
        width = max((n.dim for n in self.tracker.norms), default=0) if self.tracker else 0
        return self.config.spectral_every_at(width)

    def take(self, step: int, *, distributed: bool, swap: bool) -> ReadWindow:
        """The read step's main-thread part: the cross-rank reduce, then the window taken
        (``swap``: the taps get fresh accumulators at once)."""
        assert self.tracker is not None
        if distributed:
            self.tracker.reduce()
        self.reads_taken += 1
        return self.tracker.take(step, swap=swap)

    def read(self, step: int, *, distributed: bool) -> DeadDirectionReport:
        """A synchronous read: the same take / solve / assemble, waited for at once."""
        assert self.tracker is not None
        self.reads_taken += 1
        return self.tracker.read(step, reduce=distributed)

    def tier_of(self, report: DeadDirectionReport) -> str:
        """``"spectral"`` when ``report`` computed the spectral tier, else ``"cheap"``: the
        engine evaluates only the rules whose ``tier`` the read computed."""
        return "spectral" if report.spectral else "cheap"

    def held_key(self, key: str) -> bool:
        """Whether ``key`` (unnamed, as :meth:`metrics` gives it) is the spectral tier's: on a
        cheap read it is absent from what is logged, and ``callback_metrics`` hold its last
        spectral value (docs/monitors.md, "Cost tiers")."""
        return not cheap_key(key)

    def solve(self, window: ReadWindow, share: tuple[int, int]) -> ReadRecords:
        """The window's solves (this rank's ``share``), on any thread: no tracker state."""
        return solve_window(window, share)

    def gather(self, records: ReadRecords | None, error: str | None = None) -> list[ReadRecords]:
        """Every rank's records (a collective); ``None`` with ``error``: a failed rank's part."""
        return gather_records(records if records is not None else ReadRecords(error=error))

    def assemble(self, window: ReadWindow, parts: list[ReadRecords], solves: int) -> Any:
        tracker = self.tracker
        assert tracker is not None
        tracker.last_solves = solves
        return tracker.finish(window, parts)

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
        if not report.spectral:
            return {}  # a cheap read has no spectrum and no profile
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
            return {**self._saved, "reads_taken": self.reads_taken}
        return {
            "gain_baselines": {k: v.detach().cpu() for k, v in tracker.gain_baselines.items()},
            "previous_rms": dict(tracker.previous_rms),
            "reads_taken": self.reads_taken,  # the tier schedule goes on where it was
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the stream reads' baselines and the tier schedule (keys of older checkpoints
        are ignored)."""
        self.reads_taken = int(state.get("reads_taken", 0))
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
