"""The sign–magnitude reads on a schedule, independent of any trainer (docs/metrics.md §2).

:class:`SignMagnitudeTracker` watches a model's Linear layers:

* **parameter reads** (every monitored Linear, at each read): sign and ternary alignment,
  ternary sparsity, sign churn since the previous read;
* **outlier reads** (taps on the same Linears' inputs, on the shared tap layer
  :class:`~normscope.taps.hooks.TapSet` that the dead-direction family uses, folded on sampled
  steps): the per-channel second moment ``E[x_j^2]`` in float64 (a
  :class:`~normscope.functional.moments.DiagonalMoment`: ``n`` numbers, not ``n^2``), from which
  ``max_leverage`` and ``outlier_leverage`` follow;
* **probe reads** (a few layers, on a fixed probe batch): each perturbation of docs/metrics.md §2.3 is
  applied to the weight in place, the next normaliser's input is captured, and the weight is
  restored **bit-exactly** from a saved copy. Everything runs under ``no_grad`` in eval mode;
  no gradient or optimiser state is touched and the model's train/eval flags are restored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normscope._common import warn_disabled
from normscope.families.checks import key_path
from normscope.families.probes import ProbeReads
from normscope.functional.moments import DiagonalMoment
from normscope.functional.sign_magnitude import (
    OutlierRead,
    ProbeRead,
    WeightRead,
    outlier_amplitudes,
    weight_read,
)
from normscope.taps.hooks import Gate, Tap, TapSet
from normscope.taps.norms import find_norm_layers
from normscope.taps.stacks import longest_stack, same_class_stacks

__all__ = ["SignMagnitudeReport", "SignMagnitudeTracker", "find_block_linears"]

FAMILY = "sm"


def _block_stack(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The longest ``nn.ModuleList`` whose children share one class: the transformer's blocks.

    ModuleList only (an ``nn.Sequential`` stack would change which Linears are monitored), and
    a list of ModuleLists/ModuleDicts still counts (``exclude_children=()``), as it always has."""
    return longest_stack(same_class_stacks(model, kinds=(nn.ModuleList,), exclude_children=()))


def find_block_linears(model: nn.Module) -> list[str]:
    """Paths of every ``nn.Linear`` inside the model's block stack (embeddings and the output
    head excluded); every Linear of the model when there is no block stack."""
    stack = _block_stack(model)
    prefix = f"{stack[0]}." if stack is not None and stack[0] else ""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and (stack is None or name.startswith(prefix))
    ]


def default_probe_layers(linears: Sequence[str], blocks: int = 3) -> list[str]:
    """An attention and an MLP output projection in the first, middle and last block: the
    Linear layers whose output is added to the stream, i.e. what the next norm reads."""
    out_names = ("c_proj", "o_proj", "out_proj", "dense", "down_proj", "fc2", "wo", "dense_4h_to_h")
    by_block: dict[str, list[str]] = {}
    for name in linears:
        parts = name.split(".")
        idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if idx is None:
            continue
        by_block.setdefault(".".join(parts[: idx + 1]), []).append(name)
    keys = list(by_block)
    if not keys:
        return list(linears[:2])
    picks = sorted({0, len(keys) // 2, len(keys) - 1})[:blocks]
    chosen: list[str] = []
    for i in picks:
        layers = by_block[keys[i]]
        is_attn = [any(k in n for k in ("attn", "attention")) for n in layers]
        attn = [n for n, a in zip(layers, is_attn) if a]
        rest = [n for n, a in zip(layers, is_attn) if not a]
        # the output projection of each branch: a known name, else the branch's last Linear
        for group in (attn, rest):
            named = [n for n in group if n.split(".")[-1] in out_names]
            chosen += (named or group)[-1:]
    return chosen


@dataclass(frozen=True)
class SignMagnitudeReport:
    """One read: per Linear its weight read and outlier read; per probe layer its probe read."""

    step: int
    weights: dict[str, WeightRead]
    outliers: dict[str, OutlierRead]
    probes: dict[str, ProbeRead]
    failed: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for group in (self.weights, self.outliers, self.probes):
            for name, read in group.items():
                for metric, value in read.as_dict().items():
                    out[f"{FAMILY}/{key_path(name)}/{metric}"] = float(value)
        summaries = {
            "sign_alignment_mean": [w.sign_alignment for w in self.weights.values()],
            "ternary_alignment_mean": [w.ternary_alignment for w in self.weights.values()],
            "sign_churn_mean": [w.sign_churn for w in self.weights.values()],
            "asymmetry_ratio_mean": [p.asymmetry_ratio for p in self.probes.values()],
            "quant_transverse_rel_mean": [p.quant_transverse_rel for p in self.probes.values()],
        }
        for key, values in summaries.items():
            finite = [v for v in values if math.isfinite(v)]
            out[f"{FAMILY}/{key}"] = sum(finite) / len(finite) if finite else math.nan
        leverages = [
            o.max_leverage for o in self.outliers.values() if math.isfinite(o.max_leverage)
        ]
        out[f"{FAMILY}/max_leverage_max"] = max(leverages) if leverages else math.nan
        # reads no longer taken after a failure (a layer's outlier tap, weight read or probe)
        out[f"{FAMILY}/reads_disabled"] = float(len(self.failed))
        return out


class SignMagnitudeTracker(ProbeReads):
    """Hooks and reads of the sign–magnitude family, for any PyTorch loop.

    Args:
        model: the model.
        layers: ``"auto"`` (every ``nn.Linear`` inside the block stack) or a list of paths.
        probe_layers: Linear paths to probe; default :func:`default_probe_layers`; ``()`` none.
        flip_rate: ``p`` of the flip perturbation.
        seed: seed of the perturbations (the same every read, so reads are comparable).

    Example::

        tracker = SignMagnitudeTracker(model)
        tracker.attach()
        with tracker.gate.sampling():
            model(batch)
        report = tracker.read(step=0, probe=lambda: model(probe_batch))
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: str | Sequence[str] = "auto",
        probe_layers: Sequence[str] | None = None,
        flip_rate: float = 0.01,
        seed: int = 0,
    ) -> None:
        if not 0.0 < flip_rate < 1.0:
            raise ValueError(f"SignMagnitudeTracker: flip_rate must be in (0, 1), got {flip_rate}")
        self.model = model
        linears = dict((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear))
        if layers == "auto":
            names = find_block_linears(model)
        else:
            names = list(layers)
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
        probes = default_probe_layers(names) if probe_layers is None else list(probe_layers)
        bad = [n for n in probes if n not in linears]
        if bad:
            raise ValueError(
                f"SignMagnitudeTracker: probe_layers not Linear layers of "
                f"{type(model).__name__}: {bad}; available: {', '.join(linears) or 'none'}"
            )
        self.probe_layers = probes
        self.flip_rate = flip_rate
        self.seed = seed
        self.gate = Gate()
        # the outlier taps: each monitored Linear's input, folded into a DiagonalMoment
        self.taps = TapSet(model, self.gate, on_fail=self._tap_failed)
        self.prev_signs: dict[str, torch.Tensor] = {}
        self.failed: dict[str, str] = {}
        self._norm_modules = [n.module for n in find_norm_layers_or_empty(model)]
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
        probes = self.probe(probe) if probe is not None and self.probe_layers else {}
        self.reset()
        return SignMagnitudeReport(step, weights, outliers, probes, dict(self.failed))

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


def find_norm_layers_or_empty(model: nn.Module) -> list:
    try:
        return find_norm_layers(model)
    except ValueError:
        return []
