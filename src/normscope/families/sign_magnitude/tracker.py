"""The sign–magnitude reads of a model, for any PyTorch loop (docs/metrics.md §2).

:class:`SignMagnitudeTracker` watches a model's Linear layers:

* **parameter reads** (every monitored Linear, at each read): sign and ternary alignment,
  ternary sparsity, sign churn since the previous read;
* **outlier reads** (taps on the same Linears' inputs, on the shared tap layer
  :class:`~normscope.taps.hooks.TapSet`, folded on sampled steps): the per-channel second moment
  ``E[x_j^2]`` in float64 (a :class:`~normscope.functional.moments.DiagonalMoment`: ``n``
  numbers, not ``n^2``), from which ``max_leverage`` and ``outlier_leverage`` follow;
* **probe reads** (a few layers, on a fixed probe batch): :mod:`.probes`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from normscope._common import warn_disabled
from normscope.families.sign_magnitude.layers import (
    default_probe_layers,
    find_block_linears,
    find_norm_layers_or_empty,
)
from normscope.families.sign_magnitude.probes import Probes
from normscope.families.sign_magnitude.report import SignMagnitudeReport
from normscope.functional.moments import DiagonalMoment
from normscope.functional.sign_magnitude import (
    OutlierRead,
    ProbeRead,
    WeightRead,
    outlier_amplitudes,
    weight_read,
)
from normscope.taps.hooks import Gate, Tap, TapSet

if TYPE_CHECKING:
    from normscope.families.sign_magnitude.config import SignMagnitudeConfig

__all__ = ["SignMagnitudeTracker"]


class SignMagnitudeTracker:
    """Hooks and reads of the sign–magnitude family, for any PyTorch loop.

    Args:
        model: the model.
        config: a :class:`~normscope.families.SignMagnitudeConfig` (its ``layers``,
            ``probe_layers``, ``flip_rate`` and ``seed``; the rest is the family's).

    Raises:
        ValueError: a path of ``layers`` or ``probe_layers`` that is not a Linear of ``model``,
            or no Linear found.

    Example::

        tracker = SignMagnitudeTracker(model, SignMagnitudeConfig())
        tracker.attach()
        with tracker.gate.sampling():
            model(batch)
        report = tracker.read(step=0, probe=lambda: model(probe_batch))
    """

    def __init__(self, model: nn.Module, config: SignMagnitudeConfig) -> None:
        self.model = model
        self.config = config
        linears = dict((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear))
        if config.layers == "auto":
            names = find_block_linears(model)
        else:
            names = list(config.layers)
            unknown = [n for n in names if n not in linears]
            if unknown:
                raise ValueError(
                    f"SignMagnitudeTracker: not Linear layers of {type(model).__name__}: {unknown}; "
                    f"available: {', '.join(linears) or 'none'}"
                )
        if not names:
            raise ValueError(
                f"SignMagnitudeTracker: no nn.Linear layer found in {type(model).__name__}; "
                "pass layers=[...]"
            )
        self.layers = names
        given = config.probe_layers
        probes = default_probe_layers(names) if given is None else list(given)
        bad = [n for n in probes if n not in linears]
        if bad:
            raise ValueError(
                f"SignMagnitudeTracker: probe_layers not Linear layers of "
                f"{type(model).__name__}: {bad}; available: {', '.join(linears) or 'none'}"
            )
        self.probe_layers = probes
        self.gate = Gate()
        # the outlier taps: each monitored Linear's input, folded into a DiagonalMoment
        self.taps = TapSet(model, self.gate, on_fail=self._tap_failed)
        self.prev_signs: dict[str, torch.Tensor] = {}
        self.failed: dict[str, str] = {}
        self.probes = Probes(
            model,
            [n.module for n in find_norm_layers_or_empty(model)],
            flip_rate=config.flip_rate,
            seed=config.seed,
        )
        self.attached = False

    # ------------------------------------------------------------------ hooks
    def attach(self) -> None:
        """Register the outlier taps (the input of every monitored Linear), once."""
        if self.attached:
            return
        for name in self.layers:
            module = self.model.get_submodule(name)
            self.taps.add(name, "input", module.in_features, make=DiagonalMoment)
        self.attached = True

    def _moment(self, name: str) -> DiagonalMoment | None:
        tap = self.taps.taps.get((name, "input"))
        return tap.accumulator if tap is not None else None

    def _tap_failed(self, tap: Tap, reason: str) -> None:
        # the shared tap layer has disabled the tap and reset its window; the warning is ours
        self._fail(tap.module_name, f"the outlier tap on the input of {tap.module_name!r}", reason)

    def detach(self) -> None:
        self.taps.remove()
        self.attached = False

    def reset(self) -> None:
        self.taps.reset()

    def reduce_moments(self, group: Any = None) -> None:
        """Sum ``[n, sum x_j^2]`` of every layer over the processes, in one all-reduce (the
        moments are uncentred sums: the exact merge is their sum). A no-op on one process."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return
        taps = sorted(self.taps.taps.values(), key=lambda t: t.module_name)  # one order everywhere
        moments = [t.accumulator for t in taps]
        if not moments:
            return
        flat = torch.cat([torch.cat([m.n.reshape(1), m.sum_sq]) for m in moments])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        at = 0
        for m in moments:
            m.n.copy_(flat[at])
            m.sum_sq.copy_(flat[at + 1 : at + 1 + m.dim])
            at += 1 + m.dim

    # ------------------------------------------------------------------ reads
    def read(
        self, step: int = 0, *, probe: Callable[[], Any] | None = None, reduce: bool = False
    ) -> SignMagnitudeReport:
        """Parameter and outlier reads of every monitored Linear; probe reads when ``probe`` (a
        zero-argument forward on the probe batch) is given. Starts a new outlier window.

        ``reduce``: first sum every layer's outlier moments over the processes of the default
        group, in one all-reduce (every rank must call it at the same step), so that the
        outlier reads cover every rank's rows; weights are replicated, probes local."""
        if reduce:
            self.reduce_moments()
        weights: dict[str, WeightRead] = {}
        outliers: dict[str, OutlierRead] = {}
        for name in self.layers:
            if f"{name}:weight" not in self.failed:
                try:
                    w = self.model.get_submodule(name).weight.detach()
                    weights[name] = weight_read(w, self.prev_signs.get(name))
                    self.prev_signs[name] = torch.sign(w).to(torch.int8)
                except Exception as err:  # noqa: BLE001 - that layer only
                    self._fail(f"{name}:weight", f"the weight read of {name!r}", err)
            moment = self._moment(name)
            if name in self.failed or moment is None:
                continue
            try:
                if float(moment.n) > 0:
                    outliers[name] = outlier_amplitudes(moment.second_moment_diagonal())
            except Exception as err:  # noqa: BLE001
                self._fail(name, f"the outlier read of {name!r}", err)
        probes = self._probe(probe) if probe is not None and self.probe_layers else {}
        self.reset()
        return SignMagnitudeReport(step, weights, outliers, probes, dict(self.failed))

    def _probe(self, forward: Callable[[], Any]) -> dict[str, ProbeRead]:
        """The probe reads of the layers still probed; each failure disables its probe (a
        failing probe forward: every probe)."""
        live = [n for n in self.probe_layers if f"{n}:probe" not in self.failed]
        reads, failures = self.probes.read(live, forward)
        for key, what, err in failures:
            self._fail(key, what, err)
            if key == "probe forward":
                for name in live:
                    self.failed.setdefault(f"{name}:probe", self.failed[key])
        return reads

    def _fail(self, key: str, what: str, err: BaseException | str) -> None:
        """Disable one layer's read (``key``) for the rest of the run, warning once. A layer
        whose outlier read failed stops folding too."""
        if key in self.failed:
            return
        reason = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        self.failed[key] = reason
        tap = self.taps.taps.get((key, "input"))
        if tap is not None and tap.failed is None:
            tap.failed = reason
        warn_disabled(what, reason, stacklevel=3)

    # -------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """The previous read's signs (for ``sign_churn``), int8."""
        return {"prev_signs": {k: v.cpu() for k, v in self.prev_signs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, signs in state.get("prev_signs", {}).items():
            if name in self.layers:
                w = self.model.get_submodule(name).weight
                if tuple(signs.shape) == tuple(w.shape):
                    self.prev_signs[name] = signs.to(w.device)
