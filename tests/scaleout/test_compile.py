"""DeadDirectionMonitor on a ``torch.compile``d model, in real fits, with compiles counted.

What was measured here (torch 2.13, CPU), and what the monitor does about it:

* The hooks are traced: dynamo guards on the gate (``gate.open``) and keeps one graph with the
  gate closed and one with it open; the fold runs eagerly (``torch.compiler.disable``), so the
  open graph breaks at each hooked module. Flipping the gate every read costs no recompile.
* Whichever graph dynamo builds *first* is the one the model's own frames keep: compiled first
  with the gate open, the closed steps after it kept running a graph broken at the hooked
  modules (only the hook frames recompiled on the gate; 14 forward ops compiled in all, against
  36 in the single graph compiled with the gate closed). So on a compiled model the baseline
  window is step 1, not 0: step 0 compiles the whole model into one graph with the hooks in
  place, step 1 adds the open-gate graphs, and nothing compiles after.
* The residual discovery forward runs eagerly (``torch.compiler.set_stance("force_eager")``):
  traced, its identity-comparing hooks made the first step take minutes (killed at 300 s).

The tests count with dynamo's ``eager`` backend: tracing, guards and graph breaks (what decides
recompiles) without AOT autograd or code generation. Measured with the other backends on the same
fits: ``aot_eager`` gave the same counts (1 frame, then 4, then no more) and bit-identical reads;
``inductor`` the same counts and ``kernel_residual`` 2e-15, but its CPU code generation took a
minute on 2 cores.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch._dynamo.testing import CompileCounterWithBackend

from normscope import DeadDirectionMonitor
from normscope.alerts import CallableRule
from tests.support.fits import fit
from tests.support.tiny_models import LitTiny, token_loader

STEPS = 6
EVERY = 3
BACKEND = "eager"


class LitNoLog(LitTiny):
    """``LitTiny`` without ``self.log`` in ``training_step``: Lightning compiles
    ``training_step`` too (``trainer.fit(torch.compile(module))``), and dynamo fails on
    ``self.log`` there in this Lightning / torch pair, with or without normscope."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())


class FrameCount(Callback):
    """Frames dynamo has compiled so far, after each optimiser step."""

    def __init__(self, counter: CompileCounterWithBackend | None) -> None:
        self.counter = counter
        self.after_step: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after_step.append(self.counter.frame_count if self.counter else 0)


def compiled_fit(
    how: str, **monitor_kw
) -> tuple[list[tuple[int, dict[str, float]]], FrameCount, DeadDirectionMonitor]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    reads: list[tuple[int, dict[str, float]]] = []
    monitor = DeadDirectionMonitor(
        every_n_steps=EVERY,
        rows_per_read="all",  # the same rows as the eager fit, whatever each subsample drew
        rules=[CallableRule("record", lambda m, step: reads.append((step, dict(m))))],
        verbose=False,
        **monitor_kw,
    )
    module = LitNoLog(lr=0.0)  # weights fixed: eager and compiled fits see the same rows
    counter = None if how == "eager" else CompileCounterWithBackend(BACKEND)
    model: L.LightningModule = module
    if how == "in place":
        module.model.compile(backend=counter)
    elif how == "submodule":
        module.model = torch.compile(module.model, backend=counter)
    elif how == "lightning":
        model = torch.compile(module, backend=counter)
    frames = FrameCount(counter)
    fit(None, model, [monitor, frames], steps=STEPS, logger=False)
    torch._dynamo.reset()
    assert monitor.failure is None and not monitor.disabled
    return reads, frames, monitor


@pytest.fixture(scope="module")
def eager_reads():
    reads, _, _ = compiled_fit("eager")
    # step 0's forward is residual discovery's (from the training forward): baseline window 1
    assert [s for s, _ in reads] == [2, 3, 6]
    return dict(reads)


@pytest.mark.parametrize("how", ["in place", "submodule", "lightning"])
def test_compiled_model_reads_without_recompiling(how, eager_reads):
    """``model.compile()``, ``self.model = torch.compile(self.model)`` and
    ``trainer.fit(torch.compile(module))``: one graph at step 0 (hooks registered, gate closed:
    the discovery forward, a separate eager one on a compiled model, compiled nothing), the
    open-gate graphs at step 1, then no compile for the rest of the fit while the gate keeps
    flipping. The eager fit finds the stream from its step-0 training forward, so its baseline
    window is step 1 too."""
    reads, frames, monitor = compiled_fit(how)
    assert frames.after_step[0] == 1
    assert frames.after_step[1] > 1
    assert frames.after_step[1:] == [frames.after_step[1]] * (STEPS - 1)
    assert [s for s, _ in reads] == [2, 3, 6]  # the baseline window is step 1 when compiled
    for step in (3, 6):
        got = reads[[s for s, _ in reads].index(step)][1]
        # keys as eager spells them, also when the OptimizedModule wrapper ("_orig_mod") is in
        # the module paths (how == "submodule")
        assert not any("_orig_mod" in k for k in got)
        expected = eager_reads[step]
        assert set(got) == set(expected)
        # the attention-logit read cannot see inside a compiled graph: NaN, said by the count
        assert expected["dd/attn_modules_read"] == 2 and got["dd/attn_modules_read"] == 0
        assert math.isnan(got["dd/attn_logit_max"]) and math.isfinite(expected["dd/attn_logit_max"])
        attention = {k for k in expected if k.endswith(("/max_logit", "attn_logit_max"))}
        attention.add("dd/attn_modules_read")
        for key, value in expected.items():
            if key in attention:
                continue
            # the same float32 kernels as eager run them: identical
            assert got[key] == value or (value != value and got[key] != got[key]), key
    assert got["dd/model.ln_f/kernel_residual"] < 1e-12
    assert got["dd/model.ln_f/n_rows"] == 256  # one batch: no row counted twice


def test_both_monitors_on_a_compiled_model_stop_compiling_after_the_first_reads():
    """DeadDirectionMonitor and SignMagnitudeMonitor together on ``model.compile()``: the
    sign-magnitude fold runs outside the graph and its probe forwards run eagerly, so after the
    first two read windows no step compiles anything (12 steps, reads every 3)."""
    from normscope import SignMagnitudeMonitor

    torch._dynamo.reset()
    torch.manual_seed(0)
    module = LitNoLog(lr=1e-3)
    counter = CompileCounterWithBackend(BACKEND)
    module.model.compile(backend=counter)
    dd = DeadDirectionMonitor(every_n_steps=EVERY, verbose=False)
    sm = SignMagnitudeMonitor(every_n_steps=EVERY, verbose=False)
    frames = FrameCount(counter)
    trainer = L.Trainer(
        max_steps=12,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[dd, sm, frames],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, train_dataloaders=token_loader())
    torch._dynamo.reset()
    assert not dd.disabled and not sm.disabled, (dd.failure, sm.failure)
    assert dd.reads == sm.reads == 5  # windows 1 (the compiled baseline), 2, 5, 8, 11
    settled = frames.after_step[3]  # after the windows of steps 1 and 2
    assert frames.after_step[3:] == [settled] * (12 - 3), frames.after_step
    last = sm.last_report.as_dict()
    assert math.isfinite(last["sm/sign_alignment_mean"])


def halves(batch) -> list[str]:
    """Per-sample sources of a ``(x, y)`` batch: even samples ``even``, odd ``odd``."""
    return ["odd" if i % 2 else "even" for i in range(len(batch[0]))]


def test_per_source_reads_on_a_compiled_model():
    """``sources=`` labels each sampled batch outside the forward and folds in the hook's
    eager (compiler-disabled) region: the compiled fit's per-source reads are the eager fit's,
    and nothing compiles after the baseline window."""
    eager, _, _ = compiled_fit("eager", sources=halves, alerts=())
    reads, frames, _ = compiled_fit("in place", sources=halves, alerts=())
    assert frames.after_step[1:] == [frames.after_step[1]] * (STEPS - 1)
    got, expected = dict(reads)[6], dict(eager)[6]
    keys = [k for k in expected if k.startswith(("dd.even/", "dd.odd/"))]
    assert keys and all(k in got for k in keys)
    for key in keys:
        value = expected[key]
        assert got[key] == value or (value != value and got[key] != got[key]), key
    assert got["dd.even/n_rows"] == got["dd.odd/n_rows"] == 128
