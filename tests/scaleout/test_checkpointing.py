"""Activation checkpointing in a real fit: the forwards that ``torch.utils.checkpoint``
recomputes during backward are not folded again (``use_reentrant`` False and True)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from normscope import DeadDirectionMonitor
from normscope.alerts import CallableRule
from tests.support.fits import fit
from tests.support.tiny_models import LitTiny

ROWS_PER_STEP = 16 * 16  # one batch of 16 sequences of 16 tokens


class LitCheckpointed(LitTiny):
    """``LitTiny`` whose blocks run under ``torch.utils.checkpoint`` (None: plainly)."""

    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__(lr=0.0)  # weights fixed: every fit below sees the same rows
        self.use_reentrant = use_reentrant
        self.block_calls = 0
        self.model.h[0].register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        if self.training:
            self.block_calls += 1

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.wte(idx) + m.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in m.h:
            if self.use_reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return m.head(m.ln_f(x))


def checkpointed_fit(
    use_reentrant: bool | None,
) -> tuple[dict[int, dict[str, float]], LitCheckpointed]:
    torch.manual_seed(0)
    reads: dict[int, dict[str, float]] = {}
    monitor = DeadDirectionMonitor(
        every_n_steps=2,
        rows_per_read="all",  # every row counted: a recomputed forward would show
        rules=[CallableRule("record", lambda m, step: reads.update({step: dict(m)}))],
        verbose=False,
    )
    module = LitCheckpointed(use_reentrant)
    fit(None, module, monitor, steps=4, logger=False)
    assert monitor.failure is None and not monitor.disabled
    return reads, module


@pytest.fixture(scope="module")
def plain():
    reads, module = checkpointed_fit(None)
    assert module.block_calls == 4  # one forward per step
    return reads


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_recomputed_forwards_are_not_counted_twice(use_reentrant, plain):
    reads, module = checkpointed_fit(use_reentrant)
    assert module.block_calls == 2 * 4  # the recomputation did run, inside every backward
    # step 0's forward (and its recomputation) is residual discovery's: windows 1 and 3
    assert sorted(reads) == sorted(plain) == [2, 4]
    for step, metrics in reads.items():
        n_rows = {k: v for k, v in metrics.items() if k.endswith("/n_rows")}
        assert n_rows and set(n_rows.values()) == {ROWS_PER_STEP}, n_rows
        # the same rows as without checkpointing, so the same numbers, bit for bit
        assert metrics == plain[step]
