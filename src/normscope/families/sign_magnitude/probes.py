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


class Probes:
    """The probes of ``layers`` (Linear paths of ``model``), their ``y`` taken at the inputs of
    ``norms``. ``failed`` is the tracker's record of disabled reads (``"<layer>:probe"``,
    ``"probe forward"``), ``fail(key, what, err)`` disables one and warns once.

    Example::

        probes = Probes(model, ["h.0.mlp.2"], norms, flip_rate=0.01, seed=0, failed={}, fail=f)
        reads = probes.read(lambda: model(probe_batch))   # {"h.0.mlp.2": ProbeRead}
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[str],
        norms: list[nn.Module],
        *,
        flip_rate: float,
        seed: int,
        failed: dict[str, str],
        fail: Callable[[str, str, BaseException], None],
    ) -> None:
        self.model = model
        self.layers = layers
        self.norms = norms
        self.flip_rate = flip_rate
        self.seed = seed
        self.failed = failed
        self.fail = fail

    @torch.no_grad()
    def read(self, forward: Callable[[], Any]) -> dict[str, ProbeRead]:
        """Probe reads (docs/metrics.md §2.3) of every live probe layer, weights restored
        bit-exactly; ``forward`` runs the model on the probe batch."""
        modes = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:
            out: dict[str, ProbeRead] = {}
            live = [n for n in self.layers if f"{n}:probe" not in self.failed]
            if not live:
                return out
            try:
                # One clean pass serves every layer: each probe restores its weight bit-exactly.
                clean = self.norm_inputs(forward)
            except Exception as err:  # noqa: BLE001 - the probe batch itself does not run
                self.fail("probe forward", "the probe forward (so every probe)", err)
                for name in live:
                    self.failed.setdefault(f"{name}:probe", self.failed["probe forward"])
                return out
            for name in live:
                try:
                    out[name] = self.probe_one(name, forward, clean)
                except Exception as err:  # noqa: BLE001 - weights are restored in probe_one
                    self.fail(f"{name}:probe", f"the probe of {name!r}", err)
            return out
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
