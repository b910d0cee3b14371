"""The sign–magnitude reads on a schedule, independent of any trainer (docs/metrics.md §2).

:class:`SignMagnitudeTracker` watches a model's Linear layers:

* **parameter reads** (every monitored Linear, at each read): sign and ternary alignment,
  ternary sparsity, sign churn since the previous read;
* **outlier reads** (hooks on the same Linears' inputs, folded on sampled steps like the
  dead-direction taps): the per-channel second moment ``E[x_j^2]`` in float64 (``n`` numbers,
  not ``n^2``), from which ``max_leverage`` and ``outlier_leverage`` follow;
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
from normscope.functional.sign_magnitude import (
    OutlierRead,
    ProbeRead,
    WeightRead,
    outlier_amplitudes,
    weight_read,
)
from normscope.monitors.dead_direction import key_path
from normscope.monitors.probes import ProbeReads
from normscope.taps.hooks import Gate, in_backward_recompute
from normscope.taps.norms import find_norm_layers
from normscope.taps.residual import tap_input
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


class _DiagonalMoment:
    """Float64 running sum of ``x_j^2`` per channel and the row count: ``E[x_j^2]``."""

    def __init__(self, dim: int, device: torch.device) -> None:
        self.dim = dim
        self.sum_sq = torch.zeros(dim, dtype=torch.float64, device=device)
        self.n = torch.zeros((), dtype=torch.float64, device=device)

    def update(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, self.dim).to(self.sum_sq.device, torch.float64)
        finite = torch.isfinite(rows.sum(dim=1))
        rows = torch.where(
            finite[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device)
        )
        self.sum_sq += rows.square().sum(dim=0)
        self.n += finite.sum()

    def second_moment_diagonal(self) -> torch.Tensor:
        return self.sum_sq / self.n.clamp_min(1)

    def reset(self) -> None:
        self.sum_sq.zero_()
        self.n.zero_()


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
        self.prev_signs: dict[str, torch.Tensor] = {}
        self._moments: dict[str, _DiagonalMoment] = {}
        self._handles: list[Any] = []
        self.failed: dict[str, str] = {}
        self._norm_modules = [n.module for n in find_norm_layers_or_empty(model)]
        self.attached = False

    # ------------------------------------------------------------------ hooks
    def attach(self) -> None:
        if self.attached:
            return
        for name in self.layers:
            module = self.model.get_submodule(name)
            self._moments[name] = _DiagonalMoment(module.in_features, module.weight.device)
            self._handles.append(
                module.register_forward_pre_hook(self._hook(name), with_kwargs=True)
            )
        self.attached = True

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.gate.open or name in self.failed:
                return None
            self._fold(name, args, kwargs)
            return None

        return hook

    # As in normscope.taps.hooks: under torch.compile the gate check is traced and the float64
    # fold runs eagerly, outside the graph.
    @torch.compiler.disable
    def _fold(self, name: str, args: tuple, kwargs: dict) -> None:
        if in_backward_recompute():
            return
        try:
            x = tap_input(args, kwargs)
            if x is not None:
                moment = self._moments[name]
                if x.shape[-1] != moment.dim:
                    raise ValueError(
                        f"expected an input of width {moment.dim}, got {tuple(x.shape)}"
                    )
                moment.update(x)
        except Exception as err:  # never break the forward
            self._fail(name, f"the outlier tap on the input of {name!r}", err)
            self._moments[name].reset()  # a half-filled window would read as a whole one

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.attached = False

    def reset(self) -> None:
        for moment in self._moments.values():
            moment.reset()

    def reduce_moments(self, group: Any = None) -> None:
        """Sum ``[n, sum x_j^2]`` of every layer over the processes, in one all-reduce (the
        moments are uncentred sums: the exact merge is their sum). A no-op on one process."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return
        moments = [self._moments[name] for name in sorted(self._moments)]  # same order everywhere
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
            moment = self._moments.get(name)
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

    def _fail(self, key: str, what: str, err: BaseException) -> None:
        """Disable one layer's read (``key``) for the rest of the run, warning once."""
        if key in self.failed:
            return
        self.failed[key] = f"{type(err).__name__}: {err}"
        warn_disabled(what, self.failed[key], stacklevel=3)

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

    # -------------------------------------------------------------- plain loops
    def step(self, batch: Any = None, **options: Any) -> Any:
        """A context manager around one optimiser step, as
        :meth:`DeadDirectionTracker.step <normscope.DeadDirectionTracker.step>`: outlier rows
        folded on sampled steps, parameter and probe reads (probe batch: ``probe_batch=``, else
        the first ``batch``) at their end, the alert rules, ``log=``. ``options``: ``log=`` and
        any argument of :class:`~normscope.SignMagnitudeMonitor`, read at the first call.

        Example::

            tracker = SignMagnitudeTracker(model)
            with tracker.step((x, y), every_n_steps=100, log=print) as result:
                ...  # forward, backward, optimizer.step()
        """
        from normscope.callbacks.sign_magnitude import SignMagnitudeMonitor
        from normscope.integrations.loop import tracker_step

        return tracker_step(self, SignMagnitudeMonitor, batch, options)


def find_norm_layers_or_empty(model: nn.Module) -> list:
    try:
        return find_norm_layers(model)
    except ValueError:
        return []
