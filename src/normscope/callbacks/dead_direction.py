"""``DeadDirectionMonitor``: the dead-direction reads as a Lightning callback."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from normscope.alerts import (
    Alert,
    AlertRule,
    KernelLossRule,
    SigmaMinRatioRule,
    SourceCollapseRule,
    default_dead_direction_rules,
)
from normscope.callbacks._base import (
    MonitorCallback,
    check_strategy,
    compiled,
    fail_open,
)
from normscope.callbacks.async_reads import AsyncReads
from normscope.callbacks.dead_direction_discovery import AttachStream
from normscope.monitors.dead_direction import (
    DeadDirectionReport,
    DeadDirectionTracker,
)
from normscope.monitors.format import format_summary
from normscope.monitors.scan import batch_mask

__all__ = ["DeadDirectionMonitor"]

# Lightning precisions whose forwards run the norm layers themselves in half precision ("-mixed"
# autocast keeps layer_norm in float32: measured kernel_residual ~3e-15 under bf16-mixed on CPU).
_HALF_TRUE = ("bf16-true", "16-true")


class DeadDirectionMonitor(AsyncReads, AttachStream, MonitorCallback):
    r"""Log the dead-direction geometry of every norm layer and the residual stream's
    ``sigma_min`` depth profile while a model trains, and alert when the stream collapses.

    Every ``every_n_steps`` optimiser steps (and once at the first step, the baseline: step 1,
    since step 0's training forward is the one residual discovery watches), the
    hooks fold the rows of that step's training forwards (all gradient-accumulation
    micro-batches) into float64 accumulators; at the end of the step the monitor reduces them
    across processes, runs the reads of docs/metrics.md §1 and logs them to every logger and to
    ``trainer.callback_metrics`` under ``dd/<module path>/<metric>`` and ``dd/<metric>``.
    Between sampled steps the hooks return at once. Sanity-check and validation forwards are
    never sampled.

    Args:
        every_n_steps: optimiser steps between reads (>= 1).
        layers: ``"auto"`` (every norm layer) or a list of norm module paths (as
            ``pl_module.named_modules()`` names them).
        residual: track the residual stream's ``sigma_min`` profile. The stream is found from
            the first training batch's own forward (``training_step``'s, whatever it calls;
            docs/monitors.md, "Finding the residual stream"); that step is not read. When no
            stream is found, one warning says why, and ``dd/profile_points`` reads 0;
            ``residual=False`` silences it.
        max_rows_per_step: rows kept per tapped tensor per forward (seeded uniform subsample).
        alert_below: the ``sigma_min`` ratio floor of the theory (1.0).
        tolerance: how far below ``alert_below`` a ratio's interval may lie before it counts
            (default 0.4, with the sudden-drop floor 0.85 of
            :class:`~normscope.alerts.SigmaMinRatioRule`; measured on the sweeps of
            ``benchmarks/alert_roc.py``: docs/alerts.md).
        patience: consecutive reads below the threshold before an alert.
        warmup_reads: first reads that never alert.
        kernel_residual_alert: alert when a LayerNorm layer's ``kernel_residual`` exceeds this
            (``None`` disables that rule).
        rules: extra :mod:`normscope.alerts` rules (objects with ``evaluate(metrics, step)``).
        alerts: sinks: ``"log"``, ``"wandb"``, or callables ``fn(alert)``.
        stop_on_alert: set ``trainer.should_stop`` when an alert fires (decided across ranks, so
            all stop together).
        null_tol: ``tau`` of ``null_dim``; raise it for half-precision norm forwards (e.g. 1e-4
            under ``precision="bf16-true"``, where the kernel's floor is about 1e-6; a warning at
            setup says so). ``bf16-mixed`` keeps LayerNorm in float32: the default holds.
        max_memory: byte budget for the accumulators (``8 d^2`` per tapped tensor); over it, norm
            layers are taken at a stride over depth (the final norm always kept) and a warning
            says which were left out.
        example_forward: ``fn(pl_module, batch)`` running one forward: residual discovery then
            runs it separately (eager, no grad, eval mode) on the first batch, and step 0 is
            read. A compiled model always gets such a forward; its default: a dict batch as
            keyword arguments, a tuple batch by its first element.
        verbose: print one line per read and a summary at the end of the fit (rank zero).
        seed: seed of the row subsampling.
        overhead_warn: warn once when a read costs more than this fraction of training time
            at ``every_n_steps`` (judged against the mean of the plain steps, after 20 of them),
            naming the cadence that would not; ``None``: never.
        log_per_layer: per-layer keys sent to the loggers: ``"all"``, ``"none"``, or an int
            ``k``: the ``k`` worst layers of each ranking (:mod:`normscope.integrations.layers`)
            and every run-level key. Alert rules still see every layer.
        sources: name each sampled row's source: ``fn(batch) -> str`` (the whole batch one
            source), ``fn(batch) -> labels`` (a sequence or tensor, one per sample) or a batch
            field name. Adds a profile per source (``dd.<source>/<point>/<metric>``), the
            classification of each collapse (``dd/collapse_class``: 1 intrinsic, 2
            distribution-dependent, 3 undetermined, 0 none) and a
            :class:`~normscope.alerts.SourceCollapseRule`; the pooled keys are unchanged.
        max_sources: sources tracked (``max_memory`` plans for this many).
        name: tell this monitor from others in the same fit (several cadences, layer sets or
            thresholds): every key it logs reads ``dd[name]/...`` (``dd[name].<source>/...``)
            instead of ``dd/...``, so each gets its own W&B section; its alerts name it
            (``DeadDirectionMonitor[name]: ...``). Rules still see the ``dd/`` keys. A
            non-empty string without ``/``, brackets or whitespace.
        async_reads: run each read's eigensolves on a background thread (a side CUDA stream on
            a GPU) while training goes on; the read is published at the first optimiser step
            end after it is ready (under DDP: the next one), logged under its own step, and
            alerts and ``stop_on_alert`` act then. ``None``: on under a Lightning ``Trainer``
            on a CUDA device; off on the CPU (no gain measured on a shared 2-core machine), in
            plain loops, Fabric and the Hugging Face ``Trainer``, and under FSDP2
            (docs/monitors.md, "Asynchronous reads"). The numbers are those of a synchronous
            read, bit for bit.

    Raises:
        MisconfigurationException: bad arguments, or (at setup) no norm layer found / an unknown
            layer name / a strategy it cannot read (FSDP1, DeepSpeed: the message says what is
            supported). A module that overrides ``configure_model`` has its layers found at
            ``on_fit_start`` instead, after Lightning has built and sharded them.

    Example::

        from lightning import Trainer
        from normscope import DeadDirectionMonitor

        monitor = DeadDirectionMonitor(every_n_steps=50)
        trainer = Trainer(callbacks=[monitor], max_steps=1000)
        trainer.fit(model, datamodule)
        trainer.callback_metrics["dd/sigma_min_ratio_min"]
    """

    #: W&B: the profile chart and spectrum table at the first read and every this many reads
    charts_every_n_reads: int = 10

    def __init__(
        self,
        every_n_steps: int = 50,
        layers: str | Sequence[str] = "auto",
        residual: bool = True,
        max_rows_per_step: int | None = 4096,
        alert_below: float = 1.0,
        tolerance: float = 0.4,
        patience: int = 1,
        warmup_reads: int = 0,
        kernel_residual_alert: float | None = 1e-4,
        rules: Sequence[AlertRule] = (),
        alerts: Sequence[str | Callable[[Alert], Any]] = ("log", "wandb"),
        stop_on_alert: bool = False,
        null_tol: float = 1e-10,
        max_memory: int | None = None,
        example_forward: Callable[[LightningModule, Any], Any] | None = None,
        verbose: bool = True,
        seed: int = 0,
        overhead_warn: float | None = 0.05,
        log_per_layer: str | int = "all",
        sources: Callable[[Any], Any] | str | None = None,
        max_sources: int = 8,
        name: str | None = None,
        async_reads: bool | None = None,
    ) -> None:
        self._remember_arguments(DeadDirectionMonitor.__init__, locals())
        super().__init__(every_n_steps, overhead_warn, name)
        self._keep_shared_arguments(layers, alerts, log_per_layer, example_forward, verbose, seed)
        if max_rows_per_step is not None and max_rows_per_step < 1:
            raise MisconfigurationException(
                f"DeadDirectionMonitor: max_rows_per_step must be None or >= 1, got {max_rows_per_step}"
            )
        if max_memory is not None and max_memory <= 0:
            raise MisconfigurationException("DeadDirectionMonitor: max_memory must be > 0 bytes")
        try:
            self.sigma_rule = SigmaMinRatioRule(alert_below, tolerance, patience, warmup_reads)
        except ValueError as err:
            raise MisconfigurationException(f"DeadDirectionMonitor: {err}") from err
        self.kernel_rule = KernelLossRule(kernel_residual_alert) if kernel_residual_alert else None
        if sources is not None and not (isinstance(sources, str) or callable(sources)):
            raise MisconfigurationException(
                "DeadDirectionMonitor: sources must be fn(batch) -> str | labels per sample, or "
                f"a batch field name, got {type(sources).__name__}"
            )
        self.sources = sources
        self.max_sources = max_sources
        # sublayers and kinds are filled in once the model is attached (_after_attach)
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
        self.rules.extend(rules)
        self.residual = residual
        self.max_rows_per_step = max_rows_per_step
        self.stop_on_alert = stop_on_alert
        self.null_tol = null_tol
        self.max_memory = max_memory
        self.async_reads = async_reads
        self._init_async()

        self.tracker: DeadDirectionTracker | None = None
        self.last_read_step = -1
        self.last_report: DeadDirectionReport | None = None
        self._baselines: dict[str, float] = {}
        self._rows: dict[str, int] = {}  # the rows each baseline was read on
        self._discovering = False  # discovery's hooks watch this batch's training forward
        self._discovery_step: int | None = None  # the step whose forward discovery watched
        self._late_window: int | None = None  # read in place of the discovery step's window

    # ------------------------------------------------------------ lifecycle
    def _check_setup(self, trainer: Trainer) -> None:
        check_strategy(trainer.strategy, "DeadDirectionMonitor")
        if str(trainer.precision) in _HALF_TRUE and self.null_tol < 1e-6:
            rank_zero_warn(
                f"normscope: precision={trainer.precision!r} runs the norm layers in half "
                f"precision, so a LayerNorm's kernel holds only to the output rounding floor "
                f"(kernel_residual about 1e-6 in bf16, measured), above null_tol="
                f"{self.null_tol:g}: null_dim will read 0. Pass null_tol=1e-4 to count it."
            )

    @fail_open
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        tracker = self.tracker
        if tracker is None:
            return
        if not tracker.attached and not self._discovering:
            if tracker.residual and not self._separate_discovery(trainer, pl_module):
                self._start_discovery(trainer)
            else:
                self._attach(pl_module, batch)
                if trainer.global_step == 0 and compiled(pl_module):
                    self._baseline_step = 1  # the first compiled forward must see the gate closed
        self._step_at_batch_start = trainer.global_step
        if tracker.attached and self._in_window(trainer.global_step):
            tracker.snapshot_gammas()  # the gammas this window's forwards use
            tracker.gate.mask = batch_mask(batch)
            tracker.gate.sources = tracker.label(batch)
            tracker.gate.open = True

    @fail_open
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tracker = self.tracker
        if tracker is None:
            return
        if self._discovering:  # the forward discovery watched has run: decide, then tap
            self._discovering = False
            self._finish_discovery()
        tracker.gate.open = False
        tracker.gate.mask = None
        tracker.gate.sources = None
        completed = self._step_at_batch_start  # the optimiser step these micro-batches belong to
        if trainer.global_step == completed:
            return  # mid accumulation
        published = self._publish_due(trainer)  # async_reads: a read that is ready (DDP: due)
        if self.disabled:
            return  # the published read failed: every rank stopped reading there, together
        if completed == self._discovery_step:
            self._clock(plain=False)
            return  # discovery's step: its forwards ran before the taps existed
        if not self._in_window(completed):
            self._clock(plain=not published)
            return  # not a sampled step
        have, peers_failed = self._peers_failed(trainer, tracker.min_rows())
        if peers_failed:
            return
        if not self._enough_rows(have):
            self._deferred += 1
            self._clock(plain=False)
            return  # keep the window open one more optimiser step
        started = time.perf_counter()
        self._read(trainer)
        if not self._async:  # an asynchronous read is judged at its publish
            self._judge_cost(time.perf_counter() - started)
        self._clock(plain=False)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._publish_due(trainer, wait=True)  # the last read is never lost

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._publish_due(trainer, wait=True)  # plain loops: Watch.close() calls this
        self._stop_worker()
        if self.verbose and self.last_report is not None and trainer.is_global_zero:
            rank_zero_info(
                self._named(format_summary(self.last_report, self.reads, self.alerts_fired))
            )

    def _detach(self) -> None:
        # teardown, on_exception (the read in flight dropped) or disabled: no thread left behind
        self._stop_worker()
        super()._detach()

    # ------------------------------------------------------------ schedule
    def _enough_rows(self, have: float) -> bool:
        assert self.tracker is not None
        # 2 d rows for any read; the sigma_min rule decides from N/d >= min_rows_per_dim only
        per_dim = self.sigma_rule.min_rows_per_dim if self.sigma_rule in self.rules else 2.0
        width = max((t.dim for t in self.tracker.taps.taps.values()), default=1)
        need = math.ceil(per_dim * width)
        # Defer at most every_n_steps optimiser steps, then read whatever there is (NaN + reason).
        return have >= need or self._deferred >= self.every_n_steps

    def _in_window(self, step: int) -> bool:
        if step == self._discovery_step:
            return False
        return step == self._late_window or super()._in_window(step)

    # ------------------------------------------------------------ the read (async_reads.py)
    def _named(self, text: str) -> str:
        """A read line or summary under this monitor's name: ``normscope[fast] step 50 | ...``."""
        return text.replace("normscope", f"normscope[{self.name}]", 1) if self.name else text

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Counters, baselines (for ``deepening``) and alert state. The open window's
        accumulators are not saved (they would add ``8 d^2`` bytes per tap to every checkpoint):
        a run resumed mid-window starts the window again. A read in flight
        (``async_reads``) is waited for and published first; under DDP its solves are waited for
        and it is published at its usual step, so the saved counters and rule states are those
        of the read before it (docs/monitors.md, "Asynchronous reads")."""
        self._wait_in_flight()
        baselines = self.tracker.baselines if self.tracker is not None else self._baselines
        return {
            "reads": self.reads,
            "last_read_step": self.last_read_step,
            "baselines": dict(baselines),
            "baseline_rows": dict(self.tracker.baseline_rows if self.tracker else self._rows),
            "rules": self._rule_states(),
            "alerts_fired": [a.as_dict() for a in self.alerts_fired],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reads = int(state_dict.get("reads", 0))
        self.last_read_step = int(state_dict.get("last_read_step", -1))
        self._baselines = {str(k): float(v) for k, v in state_dict.get("baselines", {}).items()}
        self._rows = {str(k): int(v) for k, v in state_dict.get("baseline_rows", {}).items()}
        if "baseline_rows" not in state_dict:
            # a version 1 checkpoint: its baselines are the old quotient R_q, not the Schur
            # complement Delta_gamma compares; the next read starts a new baseline
            self._baselines = {}
        if self.tracker is not None:
            self.tracker.baselines.update(self._baselines)
            self.tracker.baseline_rows.update(self._rows)
        self._load_rule_states(state_dict.get("rules", []))
        self.alerts_fired = [Alert(**a) for a in state_dict.get("alerts_fired", [])]

    # ------------------------------------------------------------ helpers
    @property
    def sigma_min_ratio_min(self) -> float:
        """The last read's smallest cumulative ratio (NaN before the first read)."""
        return self.last_report.sigma_min_ratio_min if self.last_report is not None else math.nan
