"""Every option of the sign–magnitude family in one frozen object, checked once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from normscope._common import ConfigurationError
from normscope.families.checks import check_layers
from normscope.families.sign_magnitude.family import SignMagnitudeFamily

__all__ = ["SignMagnitudeConfig"]

_OWNER = "SignMagnitudeMonitor"


@dataclass(frozen=True)
class SignMagnitudeConfig:
    """The sign–magnitude family's options (docs/monitors.md, ``SignMagnitudeMonitor``), each
    checked here and nowhere else.

    Args:
        layers: ``"auto"`` (every ``nn.Linear`` inside the block stack) or a list of paths.
        probe_layers: Linear paths to probe; ``None``: an attention and an MLP output projection
            in the first, middle and last block; ``()``: no probes.
        probe_batch: the probe batch; ``None``: the first training batch, cached on the CPU.
        probe_samples: samples of the probe batch used (>= 1).
        flip_rate: ``p`` of the flip perturbation, in (0, 1).
        max_leverage_alert: ``OutlierRule`` threshold (> 1); ``None``: off.
        churn_spike_factor: ``SignChurnSpikeRule`` factor (> 1); ``None``: off.
        min_churn: that rule's churn floor (>= 0).
        example_forward: ``fn(model, batch)`` for the probe forwards; ``None``: the default call.
        seed: seed of the perturbations.

    Raises:
        ConfigurationError: naming the option.

    Example::

        >>> from normscope.families import SignMagnitudeConfig
        >>> family = SignMagnitudeConfig(probe_samples=4).build()
        >>> family.kind, [type(r).__name__ for r in family.rules]
        ('SignMagnitudeMonitor', ['OutlierRule', 'SignChurnSpikeRule'])
    """

    layers: str | Sequence[str] = "auto"
    probe_layers: Sequence[str] | None = None
    probe_batch: Any = None
    probe_samples: int = 8
    flip_rate: float = 0.01
    max_leverage_alert: float | None = 100.0
    churn_spike_factor: float | None = 5.0
    min_churn: float = 0.01
    example_forward: Callable[[nn.Module, Any], Any] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        fix = object.__setattr__  # frozen: the normalised values are set once, here
        fix(self, "layers", check_layers(self.layers, _OWNER))
        fix(self, "probe_layers", _paths_or_none(self.probe_layers, "probe_layers"))
        if not 0.0 < self.flip_rate < 1.0:
            raise ConfigurationError(f"{_OWNER}: flip_rate must be in (0, 1), got {self.flip_rate}")
        if self.probe_samples < 1:
            raise ConfigurationError(f"{_OWNER}: probe_samples must be >= 1")
        for option in ("max_leverage_alert", "churn_spike_factor"):
            value = getattr(self, option)
            if value is not None and not value > 1:
                raise ConfigurationError(f"{_OWNER}: {option} must be > 1 or None, got {value}")
        if not self.min_churn >= 0:
            raise ConfigurationError(f"{_OWNER}: min_churn must be >= 0, got {self.min_churn}")
        if self.example_forward is not None and not callable(self.example_forward):
            raise ConfigurationError(
                f"{_OWNER}: example_forward must be a callable fn(model, batch) or None, got "
                f"{self.example_forward!r}"
            )

    def build(self) -> SignMagnitudeFamily:
        """The family these options describe, for :class:`~normscope.engine.Monitor`."""
        return SignMagnitudeFamily(self)


def _paths_or_none(paths: Iterable[str] | None, what: str) -> list[str] | None:
    """``None`` or a list of module paths (an iterable of strings, read once)."""
    if paths is None:
        return None
    listed = None if isinstance(paths, str) or not isinstance(paths, Iterable) else list(paths)
    if listed is None or not all(isinstance(p, str) for p in listed):
        raise ConfigurationError(
            f"{_OWNER}: {what} must be a list of module paths or None, got {paths!r}"
        )
    return listed
