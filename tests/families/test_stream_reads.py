"""The stream reads of a whole model (docs/metrics.md §1.6), as ``scan_model`` and the monitor
log them: each residual point's offset share, RMS and RMS growth, each norm's output offset share
and gain drift, the final norm's RankMe, the share of non-finite rows. Real tiny models, a real
Lightning ``Trainer``; numbers against numpy on the rows the hooks saw."""

from __future__ import annotations

import math

import lightning as L
import numpy as np
import pytest
import torch

from normscope import DeadDirectionMonitor, scan_model
from tests.support.fits import MemoryLogger
from tests.support.tiny_models import DecayedGains, LitTiny, TinyLM, cpu_trainer, token_loader

NORMS = ("h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f")


def _share(x: np.ndarray) -> float:
    return float(np.sum(x.mean(0) ** 2) / np.mean(np.sum(x**2, axis=1)))


def _rankme(x: np.ndarray) -> float:
    s = np.linalg.svd(x, compute_uv=False)
    s = s[s**2 >= 1e-10 * s.max() ** 2]  # the read's definition: eigenvalues under 1e-10 are 0
    p = s / s.sum()
    p = p[p > 0]
    return math.exp(-np.sum(p * np.log(p)))


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_scan_stream_reads_equal_numpy_on_the_hooked_rows(norm):
    torch.manual_seed(0)
    model = TinyLM(norm=norm)
    batches = [x for x, _ in token_loader(n=64)]
    inputs: dict[str, list] = {n: [] for n in NORMS}
    outputs: list[torch.Tensor] = []
    # hooked before the scan's own: the rows of the scan's forwards themselves (its discovery
    # forward comes first and is not folded: dropped below)
    hooks = [
        model.get_submodule(n).register_forward_pre_hook(
            lambda m, a, n=n: inputs[n].append(a[0].detach().reshape(-1, a[0].shape[-1]))
        )
        for n in NORMS
    ]
    hooks.append(
        model.ln_f.register_forward_hook(
            lambda m, a, out: outputs.append(out.detach().reshape(-1, out.shape[-1]))
        )
    )
    got = scan_model(model, batches).as_dict()
    for h in hooks:
        h.remove()
    extra = len(outputs) - len(batches)
    assert extra in (0, 1)  # the residual discovery's forward, if any
    inputs = {n: rows[extra:] for n, rows in inputs.items()}
    outputs = outputs[extra:]
    # float64 accumulators of float32 rows against numpy in float64 on the same rows: equal to
    # float64 rounding (1e-10 relative; RankMe through eigenvalues against an SVD, 1e-8)
    for n in NORMS:
        x = torch.cat(inputs[n]).double().numpy()
        assert got[f"dd/{n}/offset_share"] == pytest.approx(_share(x), rel=1e-10), n
        assert got[f"dd/{n}/rms"] == pytest.approx(math.sqrt(np.mean(x**2)), rel=1e-10), n
        assert f"dd/{n}/rms_growth" not in got  # the first read has no previous one
        assert got[f"dd/{n}/gamma_scale"] == 1.0 and got[f"dd/{n}/gamma_crossed"] == 0.0
    y = torch.cat(outputs).double().numpy()
    assert got["dd/ln_f/out_offset_share"] == pytest.approx(_share(y), rel=1e-10)
    assert got["dd/ln_f/rankme"] == pytest.approx(_rankme(y), rel=1e-8)
    assert got["dd/ln_f/rankme_centred"] == pytest.approx(_rankme(y - y.mean(0)), rel=1e-8)
    assert got["dd/final_rankme"] == got["dd/ln_f/rankme"]
    assert got["dd/final_offset_share"] == got["dd/ln_f/offset_share"]
    assert got["dd/offset_share_max"] == max(got[f"dd/{n}/offset_share"] for n in NORMS)
    assert got["dd/final_rows_per_dim"] == y.shape[0] / y.shape[1]
    assert got["dd/nonfinite_share"] == 0.0


def test_trainer_logs_gain_drift_and_rms_growth_against_numpy():
    torch.manual_seed(0)
    module = DecayedGains(gain_wd=30.0)
    logger = MemoryLogger()
    monitor = DeadDirectionMonitor(every_n_steps=5, verbose=False)
    trainer = cpu_trainer(21, [monitor], logger=logger, log_every_n_steps=5)
    trainer.fit(module, train_dataloaders=token_loader(n=512))
    reads = logger.calls_with("dd/gamma_scale_min")
    assert [s for s, _ in reads] == [2, 5, 10, 15, 20]
    # the baseline: the gains the monitor saw at its first batch, before that step's update
    base = module.gains[0]
    for log_step, m in reads:
        now = module.gains[log_step - 1]  # the window's gains, before its step's update
        for n in (f"model.{n}" for n in NORMS):
            a, a0 = now[n].numpy(), base[n].numpy()
            # 16 gains: torch.median is the lower of the two middle values
            lower = np.sort(np.abs(a))[7] / np.sort(np.abs(a0))[7]
            assert m[f"dd/{n}/gamma_scale"] == pytest.approx(lower, rel=1e-12), (log_step, n)
            flipped = np.mean(np.sign(a) != np.sign(a0))
            assert m[f"dd/{n}/gamma_crossed"] == pytest.approx(flipped, abs=0)
    scales = [m["dd/gamma_scale_min"] for _, m in reads]
    assert all(b < a for a, b in zip([1.0, *scales], scales))  # the first read: one step
    assert scales[-1] < 0.5  # lr x wd = 0.09 a step: 19 steps take the gains under half
    for (_, prev), (_, m) in zip(reads, reads[1:]):
        for n in (f"model.{n}" for n in NORMS):
            want = m[f"dd/{n}/rms"] / prev[f"dd/{n}/rms"]
            assert m[f"dd/{n}/rms_growth"] == pytest.approx(want, rel=1e-14)
    assert "dd/rms_growth_max" not in reads[0][1]  # no previous read


class NaNFrom(LitTiny):
    """The embedding's output turns NaN from optimiser step ``at`` on."""

    def __init__(self, at: int) -> None:
        super().__init__(lr=1e-3)
        self.at = at

        def poison(module, args, out):
            return out * math.nan if self.global_step >= self.at else out

        self.model.wte.register_forward_hook(poison)


def test_trainer_logs_the_share_of_nonfinite_rows():
    torch.manual_seed(0)
    logger = MemoryLogger()
    monitor = DeadDirectionMonitor(every_n_steps=10, verbose=False)
    trainer: L.Trainer = cpu_trainer(25, [monitor], logger=logger, log_every_n_steps=10)
    trainer.fit(NaNFrom(at=13), train_dataloaders=token_loader(n=1024))
    reads = {s: m for s, m in logger.calls_with("dd/gamma_scale_min")}
    assert reads[10]["dd/nonfinite_share"] == 0.0
    # every row of the step-19 window is NaN: rejected, none kept
    assert reads[20]["dd/nonfinite_share"] == 1.0
    assert math.isnan(reads[20]["dd/final_rankme"])
    assert math.isnan(float(trainer.callback_metrics["dd/offset_share_max"]))
