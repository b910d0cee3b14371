"""The sign–magnitude family as the engine drives it (:class:`normscope.engine.Family`): its
rules, the probe batch, the outlier taps' gate and the read.

Example::

    from normscope.engine import Monitor
    monitor = Monitor(SignMagnitudeConfig(probe_samples=4).build(), every_n_steps=100)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from normscope._common import ConfigurationError
from normscope.alerts import AlertRule, OutlierRule, SignChurnSpikeRule
from normscope.families.sign_magnitude.report import SignMagnitudeReport
from normscope.families.sign_magnitude.tracker import SignMagnitudeTracker
from normscope.taps.forward_capture import ForwardCapture, has_own_forward, inner_model
from normscope.taps.hooks import call_model, compiled, eager_forwards

if TYPE_CHECKING:
    from normscope.families.sign_magnitude.config import SignMagnitudeConfig

__all__ = ["SignMagnitudeFamily", "slice_batch", "to_device"]


def slice_batch(batch: Any, n: int) -> Any:
    """The first ``n`` samples of every tensor in ``batch`` (dicts, tuples, lists walked); a
    0-dim tensor (the Trainer's ``num_items_in_batch``) and every non-tensor value are left as
    they are.

    Example::

        >>> batch = {"input_ids": torch.zeros(4, 3), "num_items_in_batch": torch.tensor(9)}
        >>> cut = slice_batch(batch, 2)
        >>> tuple(cut["input_ids"].shape), cut["num_items_in_batch"].item()
        ((2, 3), 9)
    """
    if isinstance(batch, torch.Tensor):
        return batch[:n] if batch.ndim > 0 else batch
    if isinstance(batch, dict):
        return {k: slice_batch(v, n) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_batch(v, n) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor moved to ``device`` (dicts, tuples, lists walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


class SignMagnitudeFamily:
    """The sign–magnitude reads for the engine, as ``config`` says (build it with
    :meth:`SignMagnitudeConfig.build <normscope.families.SignMagnitudeConfig.build>`)."""

    prefix = "sm"
    kind = "SignMagnitudeMonitor"
    supports_async = False  # the probes run forwards of the model: on the training thread
    charts_every_n_reads = 0
    fsdp2 = False  # its weight and probe reads take whole nn.Linear weights (docs/integrations.md)

    def __init__(self, config: SignMagnitudeConfig) -> None:
        self.config = config
        self.rules: list[AlertRule] = []
        if config.max_leverage_alert is not None:
            self.rules.append(OutlierRule(config.max_leverage_alert))
        if config.churn_spike_factor is not None:
            self.rules.append(SignChurnSpikeRule(config.churn_spike_factor, config.min_churn))
        self.probe_batch = config.probe_batch  # the first training batch's cut when None
        self.tracker: SignMagnitudeTracker | None = None
        self.model: nn.Module | None = None
        self._saved: dict[str, Any] | None = None
        # a model with no forward() of its own (the Lightning wrapper calling self.model(...)):
        # the probes replay the call its training step made, seen at the first batch
        self.capture: ForwardCapture | None = None

    @property
    def layers(self) -> str | list[str]:
        """The configured ``layers`` (``"auto"`` or the paths)."""
        return self.config.layers

    # ------------------------------------------------------------ set-up
    def check_loop(self, precision: str) -> None:
        return None

    def build(self, model: nn.Module) -> None:
        try:
            self.tracker = SignMagnitudeTracker(model, self.config)
        except ValueError as err:
            raise ConfigurationError(f"{self.kind}: {err}") from err
        self.model = model
        if self._saved is not None:
            self.tracker.load_state_dict(self._saved)
            self._saved = None

    @property
    def attached(self) -> bool:
        return self.tracker is not None and self.tracker.attached

    def first_batch(self, model: nn.Module, batch: Any) -> tuple[bool, bool]:
        """Attach the taps; on a model with no ``forward()`` of its own, also watch this
        batch's training forward for the call the probes will replay."""
        assert self.tracker is not None
        self.tracker.attach()
        is_compiled = compiled(model)
        if self.config.example_forward is None and not has_own_forward(model) and not is_compiled:
            n = self.config.probe_samples
            self.capture = ForwardCapture(model, lambda v: to_device(slice_batch(v, n), "cpu"))
            self.capture.install()
        return False, is_compiled

    def finish_discovery(self) -> None:
        return None

    def detach(self) -> None:
        if self.tracker is not None:
            self.tracker.gate.open = False
            self.tracker.detach()
        if self.capture is not None:
            self.capture.remove()

    # ------------------------------------------------------------ the window
    def open(self, batch: Any) -> None:
        assert self.tracker is not None
        self.tracker.gate.open = True

    def share_rows(self, forwards: int) -> None:
        """No row budget: the sign–magnitude taps keep a diagonal moment of every row."""
        return None

    def see(self, batch: Any) -> None:
        """Every batch: the first one becomes the probe batch (cut, on the CPU) unless given."""
        if self.probe_batch is None and batch is not None:
            self.probe_batch = to_device(slice_batch(batch, self.config.probe_samples), "cpu")

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.gate.open = False
        if self.capture is not None:
            self.capture.remove()

    def rows(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float64)

    def rows_needed(self, rules: Sequence[Any]) -> int:
        return 0

    def rejected(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float64)

    # ------------------------------------------------------------ the read
    def read(self, step: int, *, distributed: bool) -> SignMagnitudeReport:
        """Parameter, outlier and probe reads (the moments summed over the ranks first)."""
        tracker = self.tracker
        assert tracker is not None and self.model is not None
        if distributed:
            # The read's one collective, right after the handshake: nothing that could fail on
            # one rank only runs between the two.
            tracker.reduce_moments()
        forward = self._probe_forward()
        probe = None
        if forward is not None and tracker.probe_layers:

            def probe() -> Any:
                # The probe's forwards (perturbed weights, temporary hooks at the norm inputs)
                # run eagerly: on a compiled model they must not add graphs to its cache.
                with eager_forwards():
                    return forward()

        return tracker.read(step, probe=probe)

    def _probe_forward(self) -> Callable[[], Any] | None:
        """The probe forward: ``example_forward`` or the default call on the probe batch; on a
        model with no ``forward()``, the module its training step called (the call replayed,
        or that module given the probe batch when one was passed). ``None``: no probe batch."""
        model = self.model
        assert model is not None
        device = _device(model)
        call = self.capture.call if self.capture is not None else None
        if call is not None and self.config.probe_batch is None:
            return lambda: call.replay(model, lambda v: to_device(v, device))
        if self.probe_batch is None:
            return None
        batch = to_device(self.probe_batch, device)
        if call is not None:
            inner = model.get_submodule(call.path)
            return lambda: call_model(inner, batch)
        if self.config.example_forward is not None:
            return lambda: self.config.example_forward(model, batch)
        target = inner_model(model)  # a wrapper with no forward(): the model it holds (compiled)
        return lambda: call_model(target, batch)

    def metrics(self, report: SignMagnitudeReport) -> dict[str, float]:
        return report.as_dict()

    def read_line(self, report: SignMagnitudeReport, fired: Sequence[Any]) -> str:
        return report.read_line([a.message for a in fired])

    def summary(self, report: SignMagnitudeReport, reads: int, alerts: Sequence[Any]) -> None:
        return None

    def worst_point(self, report: SignMagnitudeReport) -> None:
        return None

    def charts(self, report: SignMagnitudeReport, step: int) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The previous read's signs (int8, for ``sign_churn``)."""
        if self.tracker is None:
            return dict(self._saved or {})
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tracker is not None:
            self.tracker.load_state_dict(state)
        else:
            self._saved = state
