"""``SignMagnitudeMonitor``: the sign–magnitude reads as a Lightning callback."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import move_data_to_device
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from normscope.alerts import Alert, AlertRule, OutlierRule, SignChurnSpikeRule
from normscope.callbacks._base import (
    MonitorCallback,
    check_strategy,
    compiled,
    eager_forwards,
    fail_open,
)
from normscope.monitors.scan import call_model
from normscope.monitors.sign_magnitude import SignMagnitudeReport, SignMagnitudeTracker

__all__ = ["SignMagnitudeMonitor"]


def _slice_batch(batch: Any, n: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, dict):
        return {k: _slice_batch(v, n) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice_batch(v, n) for v in batch)
    return batch


class SignMagnitudeMonitor(MonitorCallback):
    r"""Log the sign–magnitude geometry of a model's Linear layers while it trains: sign and
    ternary alignment, sign churn, outlier leverage, and probe-measured asymmetry and ternary
    readiness (docs/metrics.md §2), under ``sm/<module path>/<metric>`` and ``sm/<metric>``.

    Every ``every_n_steps`` optimiser steps (and at the first step): parameter reads on every
    monitored Linear, outlier reads from hooks on their inputs (folded during that step's
    forwards), and probe reads on ``probe_layers`` on a fixed probe batch. A probe perturbs a
    weight in place, runs the probe batch, and restores the weight bit-exactly from a saved
    copy, under ``no_grad`` in eval mode: no gradient, optimiser state or train/eval flag is
    changed.

    Args:
        every_n_steps: optimiser steps between reads (>= 1).
        layers: ``"auto"`` (every ``nn.Linear`` inside the block stack) or a list of paths.
        probe_layers: Linears to probe; ``None``: an attention and an MLP output projection in
            the first, middle and last block; ``()``: no probes.
        probe_batch: the probe batch; ``None``: the first training batch, cached on the CPU.
        probe_samples: samples of the probe batch used (its leading dimension is cut to this).
        flip_rate: ``p`` of the flip perturbation (0.01).
        max_leverage_alert: alert when a layer's ``max_leverage`` exceeds this (``None``: off).
        churn_spike_factor: alert when ``sm/sign_churn_mean`` exceeds this many times its running
            median, and at least ``min_churn`` (``None``: off).
        min_churn: the churn floor of that rule.
        rules: extra rules; alerts: sinks (``"log"``, ``"wandb"``, callables).
        example_forward: ``fn(pl_module, batch)`` for the probe forwards; default as
            ``DeadDirectionMonitor``.
        verbose: print one line per read (rank zero).
        seed: seed of the perturbations.
        overhead_warn: warn once when a read costs more than this fraction of training time
            at ``every_n_steps`` (judged against the mean of the plain steps, after 20 of them),
            naming the cadence that would not; ``None``: never.
        log_per_layer: per-layer keys sent to the loggers: ``"all"``, ``"none"``, or an int
            ``k``: the ``k`` worst layers of each ranking (:mod:`normscope.integrations.layers`)
            and every run-level key. Alert rules still see every layer.
        name: tell this monitor from others in the same fit: its keys read ``sm[name]/...``
            instead of ``sm/...`` and its alerts name it (``SignMagnitudeMonitor[name]: ...``);
            rules still see the ``sm/`` keys. As ``DeadDirectionMonitor(name=...)``.

    Example::

        from normscope import SignMagnitudeMonitor
        trainer = Trainer(callbacks=[SignMagnitudeMonitor(every_n_steps=100)])
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        layers: str | Sequence[str] = "auto",
        probe_layers: Sequence[str] | None = None,
        probe_batch: Any = None,
        probe_samples: int = 8,
        flip_rate: float = 0.01,
        max_leverage_alert: float | None = 100.0,
        churn_spike_factor: float | None = 5.0,
        min_churn: float = 0.01,
        rules: Sequence[AlertRule] = (),
        alerts: Sequence[str | Callable[[Alert], Any]] = ("log", "wandb"),
        example_forward: Callable[[LightningModule, Any], Any] | None = None,
        verbose: bool = True,
        seed: int = 0,
        overhead_warn: float | None = 0.05,
        log_per_layer: str | int = "all",
        name: str | None = None,
    ) -> None:
        self._remember_arguments(SignMagnitudeMonitor.__init__, locals())
        super().__init__(every_n_steps, overhead_warn, name)
        self._keep_shared_arguments(layers, alerts, log_per_layer, example_forward, verbose, seed)
        if not 0.0 < flip_rate < 1.0:
            raise MisconfigurationException(
                f"SignMagnitudeMonitor: flip_rate must be in (0, 1), got {flip_rate}"
            )
        if probe_samples < 1:
            raise MisconfigurationException("SignMagnitudeMonitor: probe_samples must be >= 1")
        self.rules: list[AlertRule] = []
        if max_leverage_alert is not None:
            self.rules.append(OutlierRule(max_leverage_alert))
        if churn_spike_factor is not None:
            self.rules.append(SignChurnSpikeRule(churn_spike_factor, min_churn))
        self.rules.extend(rules)
        self.probe_layers = probe_layers
        self.probe_batch = probe_batch
        self.probe_samples = probe_samples
        self.flip_rate = flip_rate
        self.tracker: SignMagnitudeTracker | None = None
        self.last_report: SignMagnitudeReport | None = None
        self.history: list[tuple[int, dict[str, float]]] = []  # run-level sm/<metric> per read
        self._pending_state: dict[str, Any] | None = None

    def _check_setup(self, trainer: Trainer) -> None:
        check_strategy(trainer.strategy, "SignMagnitudeMonitor", fsdp2=False)

    def _build_tracker(self, pl_module: LightningModule) -> None:
        try:
            self.tracker = SignMagnitudeTracker(
                pl_module,
                layers=self.layers,
                probe_layers=self.probe_layers,
                flip_rate=self.flip_rate,
                seed=self.seed,
            )
        except ValueError as err:
            raise MisconfigurationException(f"SignMagnitudeMonitor: {err}") from err
        if self._pending_state is not None:
            self.tracker.load_state_dict(self._pending_state)
            self._pending_state = None

    @fail_open
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.tracker is None:
            return
        if not self.tracker.attached:
            self.tracker.attach()
            if trainer.global_step == 0 and compiled(pl_module):
                self._baseline_step = 1  # the first compiled forward must see the gate closed
        if self.probe_batch is None:
            self.probe_batch = move_data_to_device(_slice_batch(batch, self.probe_samples), "cpu")
        self._step_at_batch_start = trainer.global_step
        self.tracker.gate.open = self._in_window(trainer.global_step)

    @fail_open
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.tracker is None:
            return
        self.tracker.gate.open = False
        completed = self._step_at_batch_start
        if trainer.global_step == completed:
            return
        if not self._in_window(completed):
            self._clock(plain=True)
            return
        _, peers_failed = self._peers_failed(trainer, torch.zeros((), dtype=torch.float64))
        if peers_failed:
            return
        started = time.perf_counter()
        self._read(trainer, pl_module)
        self._judge_cost(time.perf_counter() - started)
        self._clock(plain=False)

    def _read(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self.tracker is not None
        if trainer.world_size > 1:
            # The read's one collective, right after the handshake: nothing that could fail on
            # one rank only runs between the two.
            self.tracker.reduce_moments()
        step = trainer.global_step
        forward = self.example_forward or call_model
        probe = None
        if self.probe_batch is not None and self.tracker.probe_layers:
            batch = move_data_to_device(self.probe_batch, _device(pl_module))

            def probe() -> Any:
                # The probe's forwards (perturbed weights, temporary hooks at the norm inputs)
                # run eagerly: on a compiled model they must not add graphs to its cache.
                with eager_forwards():
                    return forward(pl_module, batch)

        report = self.tracker.read(step, probe=probe)
        self.reads += 1
        self.last_report = report
        metrics = report.as_dict()
        self.history.append((step, {k: v for k, v in metrics.items() if k.count("/") == 1}))
        fired = self._publish(trainer, metrics, step)
        if self.verbose and trainer.is_global_zero:
            line = _read_line(step, metrics, fired)
            if self.name:
                line = line.replace("normscope sm", f"normscope sm[{self.name}]", 1)
            rank_zero_info(line)

    def state_dict(self) -> dict[str, Any]:
        """Counters, alert state and the previous read's signs (int8, for ``sign_churn``)."""
        return {
            "reads": self.reads,
            "rules": self._rule_states(),
            "tracker": self.tracker.state_dict() if self.tracker is not None else {},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reads = int(state_dict.get("reads", 0))
        self._load_rule_states(state_dict.get("rules", []))
        if self.tracker is not None:
            self.tracker.load_state_dict(state_dict.get("tracker", {}))
        else:
            self._pending_state = state_dict.get("tracker", {})


def _device(module: torch.nn.Module) -> torch.device:
    """A LightningModule's device; a plain module's (Fabric, plain loops): its parameters'."""
    device = getattr(module, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(module.parameters()).device


def _read_line(step: int, metrics: dict[str, float], fired: Sequence[Alert]) -> str:
    def f(key: str) -> str:
        v = metrics.get(f"sm/{key}", math.nan)
        return "nan" if not math.isfinite(v) else f"{v:.4g}"

    line = (
        f"normscope sm step {step} | sign_alignment {f('sign_alignment_mean')} | ternary_alignment "
        f"{f('ternary_alignment_mean')} | sign_churn {f('sign_churn_mean')} | max_leverage "
        f"{f('max_leverage_max')} | asymmetry_ratio {f('asymmetry_ratio_mean')} | "
        f"quant_transverse_rel {f('quant_transverse_rel_mean')}"
    )
    if fired:
        line += f" | ALERTS {len(fired)}: " + "; ".join(a.message for a in fired)
    return line
