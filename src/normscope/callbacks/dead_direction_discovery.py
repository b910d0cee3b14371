"""Building ``DeadDirectionMonitor``'s tracker and finding the residual stream (attach)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from normscope.callbacks.strategy import compiled, eager_forwards
from normscope.monitors.dead_direction import DeadDirectionTracker, key_path
from normscope.monitors.scan import call_model

if TYPE_CHECKING:
    from normscope.alerts import AlertRule, SigmaMinRatioRule, SourceCollapseRule

__all__ = ["AttachStream"]


class AttachStream:
    """The tracker's construction, residual discovery and attach (a mixin
    :class:`~normscope.DeadDirectionMonitor` inherits): the stream is found from the training
    step's own forward, or from a forward of the monitor's own; a discovery that fails keeps
    the norm reads and turns the profile off, with one warning."""

    # Supplied by DeadDirectionMonitor.
    tracker: DeadDirectionTracker | None
    layers: str | list[str]
    residual: bool
    max_rows_per_step: int | None
    null_tol: float
    seed: int
    max_memory: int | None
    max_sources: int
    kernel_rule: Any
    _baselines: dict[str, float]
    _rows: dict[str, int]
    example_forward: Callable[[LightningModule, Any], Any] | None
    sources: Callable[[Any], Any] | str | None
    rules: list[AlertRule]
    sigma_rule: SigmaMinRatioRule
    source_rule: SourceCollapseRule | None
    _discovering: bool
    _discovery_step: int | None
    _late_window: int | None
    _in_window: Callable[[int], bool]

    def _build_tracker(self, pl_module: LightningModule) -> None:
        try:
            self.tracker = DeadDirectionTracker(
                pl_module,
                layers=self.layers,
                residual=self.residual,
                max_rows_per_step=self.max_rows_per_step,
                null_tol=self.null_tol,
                seed=self.seed,
                max_memory=self.max_memory,
                sources=self.sources,
                max_sources=self.max_sources,
            )
            self.tracker.source_rule = self.sigma_rule
        except (TypeError, ValueError) as err:  # NormDiscoveryError is a ValueError
            raise MisconfigurationException(f"DeadDirectionMonitor: {err}") from err
        self.tracker.baselines.update(self._baselines)
        self.tracker.baseline_rows.update(self._rows)
        if self.kernel_rule is not None:
            self.kernel_rule.kinds = {key_path(n.name): n.kind for n in self.tracker.norms}

    def _separate_discovery(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        """Whether the residual stream is found by a forward of the monitor's own (the old
        way) rather than from the training step's forward: with ``example_forward``, and on a
        compiled model (dynamo must not trace discovery's hooks). Every loop of
        :mod:`normscope.integrations` calls the hooks around its training forwards, so it
        discovers from them as Lightning does: one engine, the same steps."""
        return self.example_forward is not None or compiled(pl_module)

    def _start_discovery(self, trainer: Trainer) -> None:
        """Arm discovery's hooks for the forward ``training_step`` runs on this batch; the
        points are decided at this batch's end (:meth:`_finish_discovery`). That step is
        never read (its forwards ran untapped); when it was a sampled step, the next step is
        read in its place: on a fresh fit the baseline window is step 1, not 0, and a fit
        resumed at a sampled step reads the step after it."""
        assert self.tracker is not None
        try:
            self.tracker.start_discovery()
        except Exception as err:  # noqa: BLE001 - e.g. no block stack: keep the norm reads
            self._profile_off(f"{type(err).__name__}: {err}")
            return
        step = trainer.global_step
        if self._in_window(step):
            self._late_window = step + 1
        self._discovering = True
        self._discovery_step = step

    def _finish_discovery(self) -> None:
        assert self.tracker is not None
        try:
            self.tracker.attach()
        except Exception as err:  # noqa: BLE001 - discovery failed: keep the norm reads
            self._profile_off(
                f"the training forward did not show the stream ({type(err).__name__}: {err})"
            )
            return
        self._after_attach()

    def _profile_off(self, why: str) -> None:
        """No residual profile: one warning saying why and what to pass; the norm reads go
        on, and every read logs ``dd/profile_points`` = 0."""
        assert self.tracker is not None
        rank_zero_warn(
            f"normscope: residual profile disabled (dd/profile_points = 0: no sigma_min profile, "
            f"so the sigma_min collapse alert is off): {why}. Pass "
            "example_forward=fn(pl_module, batch) running one forward through the transformer "
            "blocks, or residual=False to silence this."
        )
        self.tracker.detach()
        self.tracker.residual = False
        self.tracker.layout = None
        self.tracker.attach()
        self._after_attach()

    def _attach(self, pl_module: LightningModule, batch: Any) -> None:
        """Attach with a separate discovery forward of the monitor's own (eager, no grad)."""
        assert self.tracker is not None
        forward = self.example_forward or call_model
        if self.example_forward is None and isinstance(self.sources, str):
            field = self.sources  # a label field is no model input

            def forward(module: LightningModule, batch: Any) -> Any:
                return call_model(module, batch, (field,))

        try:
            # eager even on a compiled model: dynamo must not trace discovery's identity hooks
            with torch.no_grad(), eager_forwards():
                self.tracker.attach(forward=lambda: forward(pl_module, batch))
        except Exception as err:  # noqa: BLE001 - discovery failed: keep the norm reads
            self._profile_off(f"the discovery forward failed ({type(err).__name__}: {err})")
            return
        self._after_attach()

    def _after_attach(self) -> None:
        """Say what the layout holds (notes as info, a block-boundary fallback as one
        warning) and give the rules the points' sublayers."""
        assert self.tracker is not None
        profile_subs = {}
        layout = self.tracker.layout
        if layout is not None:
            profile_subs = {key_path(p.name): p.sublayer for p in layout.points}
            for note in layout.notes:
                if note == layout.fallback:
                    rank_zero_warn(f"normscope: {note}")
                else:
                    rank_zero_info(f"normscope: {note}")
            if layout.style == "post-norm" and self.sigma_rule in self.rules:
                # The no-cancellation bound is a pre-norm statement: on post-LN blocks the
                # profile is logged, but a ratio below 1 is not an alert.
                self.rules.remove(self.sigma_rule)
                if self.source_rule in self.rules:
                    self.rules.remove(self.source_rule)
                rank_zero_info("normscope: post-norm model: sigma_min alerts are off")
        self.sigma_rule.sublayers = profile_subs
        if self.source_rule is not None:
            self.source_rule.sublayers = profile_subs
