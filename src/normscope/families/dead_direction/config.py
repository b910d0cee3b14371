"""``DeadDirectionConfig``: every option of the dead-direction family, checked once, here.

The Lightning callback, the plain-loop factory (:meth:`normscope.engine.Monitor.of`), the
Fabric and Hugging Face adapters and :func:`~normscope.families.scan.scan_model` all build one;
the family and the tracker read it and check nothing again."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from normscope._common import ConfigurationError
from normscope.alerts import SigmaMinRatioRule
from normscope.alerts.stream import OBJECTIVES
from normscope.families.checks import check_layers
from normscope.families.dead_direction.family import DeadDirectionFamily
from normscope.families.dead_direction.report import KIND

__all__ = [
    "AUTO_FULL_UP_TO",
    "AUTO_SPECTRAL_EVERY",
    "DeadDirectionConfig",
    "ROWS_PER_DIM",
    "SPECTRAL_EVERY",
]

#: every how many reads the spectral tier is computed by default (docs/costs.md, "Tiers")
SPECTRAL_EVERY = "auto"
#: ``spectral_every="auto"``: every read full while the widest norm layer is at most this wide
#: (the test-sized models: a full read there is a few milliseconds), one read in
#: ``AUTO_SPECTRAL_EVERY`` spectral above it (docs/costs.md, "Tiers": why, measured)
AUTO_FULL_UP_TO = 64
AUTO_SPECTRAL_EVERY = 5

#: rows each tapped tensor folds per read by default, in units of its width ``d`` (the figures
#: that chose 8: docs/costs.md, "Rows")
ROWS_PER_DIM = 8


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _frozen(paths: Any) -> Any:
    return tuple(paths) if isinstance(paths, list) else paths


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DeadDirectionConfig:
    """What the dead-direction reads are asked to do (not when: that is the engine's).

    Args:
        layers: ``"auto"`` (every norm layer) or a list of norm module paths.
        residual: also read the residual stream's ``sigma_min`` depth profile.
        rows_per_read: rows each tapped tensor folds per read window, a seeded uniform
            subsample shared by the window's forwards (micro-batches x ranks): ``None``
            (``8 d``), an int, or ``"all"`` (:meth:`rows_per_read_at`).
        alert_below, tolerance, patience, warmup_reads: the
            :class:`~normscope.alerts.SigmaMinRatioRule`'s.
        kernel_residual_alert: a LayerNorm's ``kernel_residual`` alert level (``None``: off).
        null_tol: ``tau`` of ``null_dim`` (docs/metrics.md §1.2); ~1e-4 for bf16 norm forwards.
        max_memory: byte budget for the accumulators (:mod:`normscope.families.budget`).
        example_forward: ``fn(model, batch)`` running one forward for residual discovery.
        seed: seed of the row subsampling.
        sources: name each row's source (:mod:`normscope.taps.sources`): ``fn(batch) -> str``,
            ``fn(batch) -> labels`` or a batch field name.
        max_sources: sources tracked (the first seen).
        attention: modules whose largest pre-softmax logit is read: ``"auto"``, paths or None.
        spectral_every: the spectral tier (the decompositions: the ``sigma_min`` profile, the
            kernel alignments, ``delta_gamma``, RankMe, Schur) is read at the first read and
            every this many reads; the others read the cheap tier only (docs/costs.md,
            "Tiers"). 1: every read is a full read; ``"auto"`` (default): 1 up to width 64,
            5 above (:meth:`spectral_every_at`).
        objective: what the model is trained to do, for the collapse rule: ``"tokens"``
            (default: a language model, causal or masked) or ``"embedding"`` (embeddings
            trained to agree across views: self-supervised, contrastive, siamese), where
            rows converging on one vector is the failure itself
            (:class:`~normscope.alerts.RepresentationCollapseRule`).

    Each is described in docs/monitors.md; a bad one raises ``ConfigurationError`` naming it.

    Example::

        >>> DeadDirectionConfig(rows_per_read=1024).rows_per_read_at(128)
        1024
        >>> DeadDirectionConfig(rows_per_read=0)
        Traceback (most recent call last):
        ...
        normscope._common.ConfigurationError: DeadDirectionMonitor: rows_per_read must be None (8 d rows per read), 'all' or an int >= 1, got 0
    """

    layers: str | Sequence[str] = "auto"
    residual: bool = True
    rows_per_read: int | str | None = None
    alert_below: float = 1.0
    tolerance: float = 0.4
    patience: int = 1
    warmup_reads: int = 0
    kernel_residual_alert: float | None = 1e-4
    null_tol: float = 1e-10
    max_memory: int | None = None
    example_forward: Callable[[nn.Module, Any], Any] | None = None
    seed: int = 0
    sources: Callable[[Any], Any] | str | None = None
    max_sources: int = 8
    attention: str | Sequence[str] | None = "auto"
    spectral_every: int | str = SPECTRAL_EVERY
    objective: str = "tokens"

    def __post_init__(self) -> None:
        layers = check_layers(self.layers, KIND)
        attention = check_layers(self.attention, KIND, what="attention", none_ok=True)
        object.__setattr__(self, "layers", _frozen(layers))
        object.__setattr__(self, "attention", _frozen(attention))
        rows = self.rows_per_read
        if not (rows is None or rows == "all" or (_int(rows) and rows > 0)):
            self._refuse(
                f"rows_per_read must be None (8 d rows per read), 'all' or an int >= 1, got {rows!r}"
            )
        if not isinstance(self.residual, bool):
            self._refuse(f"residual must be True or False, got {self.residual!r}")
        try:  # the rule's own check of its four arguments, run once, here
            SigmaMinRatioRule(self.alert_below, self.tolerance, self.patience, self.warmup_reads)
        except ValueError as err:
            self._refuse(str(err))
        alert = self.kernel_residual_alert
        if alert is not None and not (_real(alert) and alert >= 0):
            self._refuse(f"kernel_residual_alert must be None or a number >= 0, got {alert!r}")
        if not (_real(self.null_tol) and self.null_tol >= 0):
            self._refuse(f"null_tol must be a number >= 0, got {self.null_tol!r}")
        if self.max_memory is not None and not (_real(self.max_memory) and self.max_memory > 0):
            self._refuse("max_memory must be > 0 bytes")
        if self.example_forward is not None and not callable(self.example_forward):
            self._refuse("example_forward must be None or fn(model, batch)")
        if not _int(self.seed):
            self._refuse(f"seed must be an int, got {self.seed!r}")
        if self.sources is not None and not (
            isinstance(self.sources, str) or callable(self.sources)
        ):
            self._refuse(
                "sources must be fn(batch) -> str | labels per sample, or a batch field name, "
                f"got {type(self.sources).__name__}"
            )
        if not _int(self.max_sources) or self.max_sources < 1:
            self._refuse(f"max_sources must be >= 1, got {self.max_sources!r}")
        if self.spectral_every != "auto" and (
            not _int(self.spectral_every) or self.spectral_every < 1
        ):
            self._refuse(
                f"spectral_every must be an int >= 1 or 'auto', got {self.spectral_every!r}"
            )

        if self.objective not in OBJECTIVES:
            self._refuse(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")

    @staticmethod
    def _refuse(why: str) -> None:
        raise ConfigurationError(f"{KIND}: {why}")

    def rows_per_read_at(self, dim: int) -> int | None:
        """Rows one tapped tensor of width ``dim`` folds per read window: ``8 dim`` for None,
        the int itself, None (no cap) for ``"all"``."""
        if self.rows_per_read is None:
            return ROWS_PER_DIM * dim
        if self.rows_per_read == "all":
            return None
        return int(self.rows_per_read)

    def spectral_every_at(self, width: int) -> int:
        """Reads per spectral read for a model whose widest norm layer is ``width``: the int
        itself, or for ``"auto"`` 1 up to :data:`AUTO_FULL_UP_TO`, :data:`AUTO_SPECTRAL_EVERY`
        above.

        Example::

            >>> c = DeadDirectionConfig()
            >>> c.spectral_every_at(64), c.spectral_every_at(128)
            (1, 5)
            >>> DeadDirectionConfig(spectral_every=3).spectral_every_at(4096)
            3
        """
        if self.spectral_every == "auto":
            return 1 if width <= AUTO_FULL_UP_TO else AUTO_SPECTRAL_EVERY
        return int(self.spectral_every)

    def build(self) -> DeadDirectionFamily:
        """The family these options describe, for :class:`~normscope.engine.Monitor`."""
        return DeadDirectionFamily(self)
