"""The final norm's offset share on the discovery forward (``InitReference``): the model before
its first update, logged once by the first read after residual discovery
(``dd/final_out_offset_share_init``, ``dd/final_out_rows_init``, ``dd/final_out_init_step``),
the reference of ``RepresentationCollapseRule(objective="embedding")``."""

from __future__ import annotations

import warnings

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

from normscope import DeadDirectionMonitor
from normscope.alerts import RepresentationCollapseRule
from normscope.families.dead_direction.init_reference import InitReference
from normscope.taps import find_norm_layers
from tests.support import loops
from tests.support.fits import MemoryLogger, fit

SHARE, ROWS, STEP = (
    "dd/final_out_offset_share_init",
    "dd/final_out_rows_init",
    "dd/final_out_init_step",
)


class LitCaptured(L.LightningModule):
    """The tiny GPT-2 of ``tests/support/loops.py`` (no cancelling branch) with a hook of the
    test's own on ``ln_f`` that keeps its outputs of the first training forward only."""

    def __init__(self) -> None:
        super().__init__()
        self.model = loops.gpt2(cancel=False)
        self.first: list[torch.Tensor] = []
        self.forwards = 0
        self.model.transformer.ln_f.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if self.forwards == 0:
            self.first.append(out.detach().clone())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.forwards += 1
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=loops.LR)


def _reference_hooks(model: nn.Module) -> int:
    return sum(
        type(h).__module__ == InitReference.__module__
        for m in model.modules()
        for h in m._forward_hooks.values()
    )


def _reference(outputs: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """``||mean||^2 / mean(||x||^2)`` of the real rows, in numpy float64."""
    rows = outputs.double().numpy().reshape(-1, outputs.shape[-1])[mask.numpy().reshape(-1) != 0]
    mean = rows.mean(axis=0)
    return float(mean @ mean / np.mean(np.sum(rows * rows, axis=1))), rows.shape[0]


def test_the_first_read_logs_the_final_norms_share_on_the_discovery_forward(tmp_path, one_thread):
    torch.manual_seed(0)
    module = LitCaptured()
    logger = MemoryLogger()
    monitor = DeadDirectionMonitor(
        every_n_steps=2,
        verbose=False,
        alerts=(),
        overhead_warn=None,
        rows_per_read="all",
        objective="embedding",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(tmp_path, module, monitor, steps=6, loader=loops.loader(), logger=logger)
    reads = logger.calls_with("dd/final_out_offset_share")
    assert [s for s, _ in reads] == [2, 4, 6]
    first = reads[0][1]
    assert {SHARE, ROWS, STEP} <= first.keys()
    assert all(SHARE not in m and ROWS not in m and STEP not in m for _, m in reads[1:])
    # the test's own capture of the same forward: the last two samples end in 4 padded tokens
    (outputs,) = module.first
    share, rows = _reference(outputs, loops.Samples().mask)
    assert rows == loops.BATCH * loops.SEQ - 8 and first[ROWS] == rows and first[STEP] == 0.0
    # 1e-10 relative: the monitor merges the rows' mean and centred diagonal by Chan's update,
    # numpy sums them raw; the two orders of float64 summation agree to ~1e-15 here
    assert abs(first[SHARE] - share) <= 1e-10 * share
    # the first step changed the model: the first read's own share is another number
    assert abs(first["dd/final_out_offset_share"] - share) > 1e-6
    assert _reference_hooks(module) == 0  # removed when discovery finished
    # the embedding rule took it as its reference (clearly spread: 0.026 from 136 rows)
    (rule,) = [r for r in monitor.rules if isinstance(r, RepresentationCollapseRule)]
    assert rule.spread_seen == (0, pytest.approx(1 - share, rel=1e-10)) and rule.seen_at_init


def test_the_reference_hooks_fold_masked_finite_rows_and_go_away():
    model = loops.gpt2(cancel=False)
    norms = find_norm_layers(model)
    before = {n.name: len(n.module._forward_hooks) for n in norms}
    ids = loops.Samples().ids
    mask = torch.ones_like(ids)
    mask[0] = 0  # the first sample is padding
    ref = InitReference(norms, mask=mask).install()
    captured: list[torch.Tensor] = []
    handle = model.transformer.ln_f.register_forward_hook(lambda m, a, o: captured.append(o))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    handle.remove()
    # a NaN row folded by hand is dropped and counted
    bad = torch.full((1, model.config.n_embd), float("nan"))
    ref.fold("transformer.ln_f", bad)
    settled = ref.settle("transformer.ln_f", step=3)
    assert settled is ref and {n.name: len(n.module._forward_hooks) for n in norms} == before
    assert _reference_hooks(model) == 0
    assert ref.accs["transformer.ln_f"].rows_rejected == 1
    got = ref.take()
    share, rows = _reference(captured[0], mask)
    assert got is not None and got["final_out_rows_init"] == rows == (ids.numel() - ids.shape[1])
    assert abs(got["final_out_offset_share_init"] - share) <= 1e-10 * share
    assert got["final_out_init_step"] == 3.0
    # an unknown final norm, or one whose hook failed: nothing to give
    assert InitReference(norms).install().settle(None) is None
    failing = InitReference(norms).install()
    failing.fold("transformer.ln_f", torch.ones(2, 3))  # not the norm's width
    assert failing.settle("transformer.ln_f") is not None and failing.take() is None
    assert _reference_hooks(model) == 0
