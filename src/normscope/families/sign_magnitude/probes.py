"""The probe reads of the sign–magnitude family (docs/metrics.md §2.3): each perturbation
applied to a weight in place, the input of the first normaliser it changes captured on a fixed
probe batch, the weight restored bit-exactly from a saved copy. Everything runs under
``no_grad`` in eval mode; train/eval flags are restored."""

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

__all__ = ["Probes"]


#: a probe that failed: its key (``"<layer>:probe"`` or ``"probe forward"``), what it was, why
Failure = tuple[str, str, BaseException]


class Probes:
    """The probes of Linear layers of ``model``, their ``y`` taken at the inputs of ``norms``.

    Example::

        probes = Probes(model, norms, flip_rate=0.01, seed=0)
        reads, failures = probes.read(["h.0.mlp.2"], lambda: model(probe_batch))
    """

    def __init__(
        self, model: nn.Module, norms: list[nn.Module], *, flip_rate: float, seed: int
    ) -> None:
        self.model = model
        self.norms = norms
        self.flip_rate = flip_rate
        self.seed = seed

    @torch.no_grad()
    def read(
        self, layers: list[str], forward: Callable[[], Any]
    ) -> tuple[dict[str, ProbeRead], list[Failure]]:
        """Probe reads (docs/metrics.md §2.3) of ``layers``, weights restored bit-exactly;
        ``forward`` runs the model on the probe batch. Returns the reads and the failures (the
        caller disables those reads); a failing clean forward is one failure,
        ``"probe forward"``, and no read."""
        modes = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:
            out: dict[str, ProbeRead] = {}
            failures: list[Failure] = []
            if not layers:
                return out, failures
            try:
                # One clean pass serves every layer: each probe restores its weight bit-exactly.
                clean = self.norm_inputs(forward)
            except Exception as err:  # noqa: BLE001 - the probe batch itself does not run
                return out, [("probe forward", "the probe forward (so every probe)", err)]
            for name in layers:
                try:
                    out[name] = self.probe_one(name, forward, clean)
                except Exception as err:  # noqa: BLE001 - weights are restored in probe_one
                    failures.append((f"{name}:probe", f"the probe of {name!r}", err))
            return out, failures
        finally:
            for module, mode in modes.items():
                module.training = mode

    def probe_one(
        self, name: str, forward: Callable[[], Any], clean: list[torch.Tensor] | None = None
    ) -> ProbeRead:
        """Perturb ``name``'s weight four ways; ``y`` is the input of the first normaliser whose
        input the perturbation changes -- the next normaliser downstream of the layer, found by
        evidence (it also works for weights a parent module uses directly, such as
        ``nn.MultiheadAttention.out_proj``, whose own forward never runs)."""
        linear = self.model.get_submodule(name)
        if clean is None:
            clean = self.norm_inputs(forward)
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
                runs[key] = self.norm_inputs(forward)
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

    def norm_inputs(self, forward: Callable[[], Any]) -> list[torch.Tensor]:
        """Run ``forward``; the inputs of every norm layer in the order they ran, as float64
        rows."""
        seen: list[torch.Tensor] = []

        def at_norm(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = tap_input(args, kwargs)
            if x is not None:
                seen.append(x.detach().reshape(-1, x.shape[-1]).to(torch.float64))

        handles = [m.register_forward_pre_hook(at_norm, with_kwargs=True) for m in self.norms]
        try:
            forward()
        finally:
            for h in handles:
                h.remove()
        return seen
