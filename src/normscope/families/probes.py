"""The probe reads of :class:`~normscope.families.sign_magnitude.SignMagnitudeTracker`
(docs/metrics.md §2.3): each perturbation applied to a weight in place, the input of the first
normaliser it changes captured on a fixed probe batch, the weight restored bit-exactly from a
saved copy. Everything runs under ``no_grad`` in eval mode; train/eval flags are restored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from normscope.functional.sign_magnitude import (
    ProbeRead,
    binary_quantization_error,
    flip_perturbation,
    matched_magnitude_perturbation,
    probe_read,
    ternary_quantization_error,
)
from normscope.taps.residual import tap_input

__all__ = ["ProbeReads"]


class ProbeReads:
    """The probe half of the sign–magnitude tracker, which supplies these attributes."""

    model: nn.Module
    probe_layers: list[str]
    failed: dict[str, str]
    seed: int
    flip_rate: float
    _norm_modules: list[nn.Module]

    def _fail(self, key: str, what: str, err: BaseException) -> None:
        raise NotImplementedError  # the tracker's: disable one read, warn once

    @torch.no_grad()
    def probe(self, forward: Callable[[], Any]) -> dict[str, ProbeRead]:
        """Probe reads (docs/metrics.md §2.3) of every probe layer, weights restored bit-exactly."""
        modes = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:
            out: dict[str, ProbeRead] = {}
            live = [n for n in self.probe_layers if f"{n}:probe" not in self.failed]
            if not live:
                return out
            try:
                # One clean pass serves every layer: each probe restores its weight bit-exactly.
                clean = self._norm_inputs(forward)
            except Exception as err:  # noqa: BLE001 - the probe batch itself does not run
                self._fail("probe forward", "the probe forward (so every probe)", err)
                for name in live:
                    self.failed.setdefault(f"{name}:probe", self.failed["probe forward"])
                return out
            for name in live:
                try:
                    out[name] = self._probe_one(name, forward, clean)
                except Exception as err:  # noqa: BLE001 - weights are restored in _probe_one
                    self._fail(f"{name}:probe", f"the probe of {name!r}", err)
            return out
        finally:
            for module, mode in modes.items():
                module.training = mode

    def _probe_one(
        self, name: str, forward: Callable[[], Any], clean: list[torch.Tensor] | None = None
    ) -> ProbeRead:
        """Perturb ``name``'s weight four ways; ``y`` is the input of the first normaliser whose
        input the perturbation changes -- the next normaliser downstream of the layer, found by
        evidence (it also works for weights a parent module uses directly, such as
        ``nn.MultiheadAttention.out_proj``, whose own forward never runs)."""
        linear = self.model.get_submodule(name)
        if clean is None:
            clean = self._norm_inputs(forward)
        weight = linear.weight
        saved = weight.detach().clone()
        w64 = saved.to(torch.float64)
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        flip = flip_perturbation(w64.cpu(), self.flip_rate, gen).to(w64.device)
        perturbations = {
            "flip": flip,
            "magnitude": matched_magnitude_perturbation(w64, flip),
            "quant_binary": binary_quantization_error(w64),
            "quant_ternary": ternary_quantization_error(w64),
        }
        runs: dict[str, list[torch.Tensor]] = {}
        try:
            for key, dw in perturbations.items():
                weight.copy_((w64 + dw).to(weight.dtype))
                runs[key] = self._norm_inputs(forward)
        finally:
            weight.copy_(saved)  # bit-exact: the saved copy, not a reversed perturbation
        changed = [
            next((i for i, (a, b) in enumerate(zip(clean, run)) if not torch.equal(a, b)), None)
            for run in runs.values()
        ]
        changed = [i for i in changed if i is not None]
        if not changed:
            return probe_read(torch.zeros(0, 1), {})
        at = min(changed)
        y = clean[at]
        return probe_read(y, {k: run[at] - y for k, run in runs.items() if len(run) > at})

    def _norm_inputs(self, forward: Callable[[], Any]) -> list[torch.Tensor]:
        """Run ``forward``; the inputs of every norm layer in the order they ran, as float64
        rows."""
        seen: list[torch.Tensor] = []

        def at_norm(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = tap_input(args, kwargs)
            if x is not None:
                seen.append(x.detach().reshape(-1, x.shape[-1]).to(torch.float64))

        handles = [
            m.register_forward_pre_hook(at_norm, with_kwargs=True) for m in self._norm_modules
        ]
        try:
            forward()
        finally:
            for h in handles:
                h.remove()
        return seen
