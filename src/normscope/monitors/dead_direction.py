"""The dead-direction reads on a schedule, independent of any trainer.

:class:`DeadDirectionTracker` finds a model's norm layers and residual points
(:mod:`normscope.taps`), hooks them once, accumulates rows while its gate is open and, on
:meth:`~DeadDirectionTracker.read`, reduces across processes and runs every read of METRICS.md
§1 into a :class:`DeadDirectionReport`. :func:`normscope.scan_model` and the Lightning
``DeadDirectionMonitor`` are thin drivers of it.

Per norm layer two tensors are tapped: its input ``h`` (covariance ``C_h`` for the Schur quotient,
second moment for ``sigma_min`` where the input is a residual point) and its output (covariance
``C`` for the kernel reads). A residual point that is not a norm input (a post-LN block output, say)
gets a tap of its own. Taps are shared: one accumulator per ``(module, input|output)``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normscope.functional.dead_direction import (
    GammaRead,
    KernelRead,
    SchurRead,
    gamma_read,
    kernel_read,
    schur_quotient,
)
from normscope.functional.profile import SigmaMinProfile, sigma_min_profile
from normscope.taps.hooks import Gate, Tap, TapSet
from normscope.taps.norms import NormLayer, find_norm_layers
from normscope.taps.residual import ResidualLayout, find_residual_points

__all__ = ["DeadDirectionReport", "DeadDirectionTracker", "NormReport"]

FAMILY = "dd"
NORM_CLASS_CODE = {"layernorm-like": 1.0, "rmsnorm-like": -1.0, "indeterminate": 0.0}


@dataclass(frozen=True)
class NormReport:
    """Every read of one norm layer (METRICS §1.1–1.3)."""

    name: str
    kind: str
    gamma: GammaRead
    kernel: KernelRead
    schur: SchurRead
    deepening: float
    n_rows: int

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        out.update(self.gamma.as_dict())
        out.update(self.kernel.as_dict())
        out.update(self.schur.as_dict())
        # norm_class as a number (loggers take numbers): +1 layernorm-like, -1 rmsnorm-like,
        # 0 indeterminate, NaN when not read.
        out["norm_class"] = NORM_CLASS_CODE.get(self.kernel.norm_class, math.nan)
        out["deepening"] = self.deepening
        out["n_rows"] = float(self.n_rows)
        return out


@dataclass(frozen=True)
class DeadDirectionReport:
    """One read of a whole model: ``norms`` by module path, the ``profile``, row counts.

    ``as_dict()`` is flat and keyed as the monitor logs (METRICS §3): ``dd/<module path>/<metric>``
    for each norm and residual point, ``dd/<metric>`` for the run-level summaries.
    """

    step: int
    norms: dict[str, NormReport]
    profile: SigmaMinProfile | None
    layout: ResidualLayout | None
    rows_rejected: int
    failed_taps: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, norm in self.norms.items():
            for metric, value in norm.as_dict().items():
                out[f"{FAMILY}/{name}/{metric}"] = float(value)
        if self.profile is not None:
            for key, value in self.profile.as_dict().items():
                out[f"{FAMILY}/{key}"] = float(value)
            steps = [p.sigma_min_step for p in self.profile.points[1:]]
            steps = [s for s in steps if math.isfinite(s)]
            out[f"{FAMILY}/sigma_min_step_min"] = min(steps) if steps else math.nan
        out[f"{FAMILY}/rows_rejected"] = float(self.rows_rejected)
        if self.norms:
            aligned = [
                n.kernel.gamma_alignment for n in self.norms.values() if n.kind == "layernorm"
            ]
            aligned = [a for a in aligned if not math.isnan(a)]
            if aligned:
                out[f"{FAMILY}/gamma_alignment_min"] = min(aligned)
        return out

    @property
    def sigma_min_ratio_min(self) -> float:
        return self.profile.sigma_min_ratio_min if self.profile is not None else math.nan


ForwardFn = Callable[[], Any]


class DeadDirectionTracker:
    """Hooks, accumulators and reads for the dead-direction family, for any PyTorch loop.

    Args:
        model: the model (any ``nn.Module``).
        layers: ``"auto"`` (every norm layer found) or a list of norm module paths.
        residual: also track the residual stream's ``sigma_min`` depth profile (needs one
            discovery forward, see :meth:`attach`).
        max_rows_per_step: rows kept per tapped tensor per forward (seeded uniform subsample).
        max_memory: byte budget for the norm layers' accumulators (``2 x 8 d^2`` per layer: input
            and output); over it, layers are taken at a stride over depth, the last (final norm)
            always kept, and a warning names what was left out.
        null_tol: ``tau`` of ``null_dim`` (METRICS §1.2); raise it for bf16 forwards (~1e-4).
        seed: seed of the row subsampling.

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
    ) -> None:
        self.model = model
        self.layers = layers
        self.residual = residual
        self.null_tol = null_tol
        self.gate = Gate()
        self.taps = TapSet(model, self.gate, max_rows=max_rows_per_step, seed=seed)
        self.norms: list[NormLayer] = find_norm_layers(model, layers)
        self.skipped_norms: list[str] = []
        if max_memory is not None:
            self.norms, self.skipped_norms = _fit_budget(self.norms, max_memory)
        self.layout: ResidualLayout | None = None
        self.baselines: dict[str, float] = {}
        self._norm_taps: dict[str, tuple[Tap, Tap]] = {}
        self._point_taps: list[Tap] = []
        self._gammas: dict[str, torch.Tensor] = {}
        self.attached = False

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

    def attach(self, forward: ForwardFn | None = None) -> None:
        """Discover residual points (if ``residual``) and register every hook, once."""
        if self.attached:
            return
        if self.layout is None:
            self.discover(forward)
        for norm in self.norms:
            self._norm_taps[norm.name] = (
                self.taps.add(norm.name, "input", norm.dim),
                self.taps.add(norm.name, "output", norm.dim),
            )
        if self.layout is not None:
            width = _stream_width(self.norms, self.layout)
            self._point_taps = [
                self.taps.add(p.module_name, p.where, width) for p in self.layout.points
            ]
        self.attached = True

    def detach(self) -> None:
        """Remove every hook (reads of what was accumulated stay possible)."""
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
        if reduce:
            for tap in self.taps.taps.values():  # same order on every rank
                tap.accumulator.reduce_()
        norms = {norm.name: self._read_norm(norm) for norm in self.norms}
        profile = self._read_profile()
        rejected = sum(t.accumulator.rows_rejected for t in self.taps.taps.values())
        failed = {
            f"{t.module_name}:{t.where}": t.failed for t in self.taps.taps.values() if t.failed
        }
        report = DeadDirectionReport(step, norms, profile, self.layout, rejected, failed)
        if reset:
            self.reset()
        return report

    def _read_norm(self, norm: NormLayer) -> NormReport:
        tap_in, tap_out = self._norm_taps[norm.name]
        g = gamma_read(self._gammas[norm.name] if norm.name in self._gammas else norm.gamma())
        n_out = tap_out.accumulator.count
        n_in = tap_in.accumulator.count
        kernel = kernel_read(
            tap_out.accumulator.covariance(),
            g,
            n_out,
            null_tol=self.null_tol,
            declared_kind=norm.kind,
        )
        schur = schur_quotient(tap_in.accumulator.covariance(), g, n_in)
        r_now = schur.schur_quotient
        if norm.name not in self.baselines and math.isfinite(r_now):
            self.baselines[norm.name] = r_now  # METRICS §1.3: the run's first read
        r_base = self.baselines.get(norm.name, math.nan)
        deepening = r_base / r_now if math.isfinite(r_now) and r_now > 0 else math.nan
        return NormReport(norm.name, norm.kind, g, kernel, schur, deepening, n_out)

    def _read_profile(self) -> SigmaMinProfile | None:
        if self.layout is None or not self._point_taps:
            return None
        points = self.layout.points
        return sigma_min_profile(
            [p.name for p in points],
            [t.accumulator.second_moment() for t in self._point_taps],
            [t.accumulator.count for t in self._point_taps],
            [p.sublayer for p in points],
        )

    # -------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Baselines and the open window's accumulators."""
        return {
            "baselines": dict(self.baselines),
            "taps": {
                f"{k[0]}|{k[1]}": t.accumulator.state_dict() for k, t in self.taps.taps.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.baselines = dict(state.get("baselines", {}))
        for key, acc_state in state.get("taps", {}).items():
            name, where = key.rsplit("|", 1)
            tap = self.taps.taps.get((name, where))
            if tap is not None and int(acc_state["dim"]) == tap.dim:
                tap.accumulator.load_state_dict(acc_state)

    def memory_bytes(self) -> int:
        return self.taps.memory_bytes()


def _stream_width(norms: Sequence[NormLayer], layout: ResidualLayout) -> int:
    by_name = {n.name: n.dim for n in norms}
    for point in layout.points:
        if point.module_name in by_name:
            return by_name[point.module_name]
    if layout.final_norm in by_name:
        return by_name[layout.final_norm]
    return max(by_name.values())


def _fit_budget(norms: list[NormLayer], budget: int) -> tuple[list[NormLayer], list[str]]:
    """Take norm layers at the smallest stride over depth that fits ``budget`` bytes."""

    def cost(selected: Sequence[NormLayer]) -> int:
        return sum(2 * 8 * n.dim * n.dim for n in selected)

    if cost(norms) <= budget or not norms:
        return norms, []
    for stride in range(2, len(norms) + 1):
        chosen = norms[::stride]
        if norms[-1] not in chosen:
            chosen = [*chosen[:-1], norms[-1]] if len(chosen) > 1 else [norms[-1]]
        if cost(chosen) <= budget:
            break
    else:
        chosen = [norms[-1]]
    skipped = [n.name for n in norms if n not in chosen]
    warnings.warn(
        f"normscope: accumulators for all {len(norms)} norm layers need {cost(norms) / 2**20:.1f} MiB, "
        f"over max_memory={budget / 2**20:.1f} MiB; reading {len(chosen)} at a stride over depth "
        f"({cost(chosen) / 2**20:.1f} MiB) and leaving out {len(skipped)}: "
        f"{', '.join(skipped[:8])}{' ...' if len(skipped) > 8 else ''}",
        RuntimeWarning,
        stacklevel=3,
    )
    return chosen, skipped
