"""Mixed and half precision on a CPU: ``bf16-mixed`` and ``bf16-true`` in real fits.

Measured here (LitTiny, d = 16, 8 steps, lr 3e-3):

* ``bf16-mixed``: CPU autocast runs the Linears in bf16 but keeps ``layer_norm`` in float32, and
  the residual adds promote to float32, so every LayerNorm reads and writes float32: the kernel
  is exact as in a float32 fit (``kernel_residual`` 3.1e-15 .. 4.0e-15), ``null_dim`` 1 at the
  default ``null_tol=1e-10``.
* ``bf16-true``: the norms run in bf16. ``kernel_residual`` 1.05e-6 .. 1.23e-6: the floor of
  rounding the output to bf16, which this file predicts from the rows themselves (within 10%).
  At ``null_tol=1e-10`` ``null_dim`` is honestly 0 (and the monitor warns at setup), at
  ``null_tol=1e-4`` it is 1. ``KernelLossRule``'s default 1e-4 sits ~100x above the floor: no
  false alert.
"""

from __future__ import annotations

import pytest
import torch

from normscope import DeadDirectionMonitor
from normscope.functional import StreamingCovariance, kernel_read
from tests.support.fits import fit
from tests.support.tiny_models import LitTiny

EVERY = 4  # reads after steps 1, 4, 8; the last read holds the rows of step 7
LAST_WINDOW = 7


def rounding_floor(y: torch.Tensor, gamma: torch.Tensor) -> float:
    """The ``kernel_residual`` that rounding an exact LayerNorm output to ``y``'s dtype (bf16)
    leaves: each entry moves by a uniform error of variance ``ulp(y_i)^2 / 12`` (``ulp`` =
    ``2^(exponent - 7)``, 8 significant bits), so ``v*^T C v*`` gains ``E[sum_i v_i^2 ulp_i^2
    / 12]``; over the top eigenvalue ``lambda_d`` of the output covariance."""
    y64 = y.reshape(-1, y.shape[-1]).double()
    ulp = torch.exp2(torch.floor(torch.log2(y64.abs().clamp_min(1e-30))) - 7)
    v = 1 / gamma.double()
    v = v / v.norm()
    top = torch.linalg.eigvalsh(torch.cov(y64.T, correction=0))[-1]
    return float(((v**2) * ulp**2 / 12).sum(1).mean() / top)


def test_the_floor_formula_on_a_bare_bf16_layernorm():
    """The prediction, checked against ``kernel_read`` on a bare bf16 ``layer_norm`` at two
    widths (measured: ratios 0.99 and 0.97; 1.01 at d = 256)."""
    torch.manual_seed(0)
    for d in (16, 64):
        gamma = torch.linspace(0.5, 2.0, d).bfloat16()
        y = torch.nn.functional.layer_norm(
            (3 * torch.randn(8192, d) + 1).bfloat16(), (d,), gamma, torch.zeros(d).bfloat16()
        )
        acc = StreamingCovariance(d)
        acc.update(y)
        read = kernel_read(acc.covariance(), gamma.double(), acc.count, declared_kind="layernorm")
        assert read.kernel_residual == pytest.approx(rounding_floor(y, gamma), rel=0.1), d


NORMS = ["model.h.0.ln_1", "model.h.0.ln_2", "model.h.1.ln_1", "model.h.1.ln_2", "model.ln_f"]


def fit_at(precision: str, null_tol: float, *extra: DeadDirectionMonitor):
    torch.manual_seed(0)
    # every row read: the rounding floor is computed from all the rows the hooks saw
    monitor = DeadDirectionMonitor(
        every_n_steps=EVERY, null_tol=null_tol, verbose=False, rows_per_read="all"
    )
    module = LitTiny()
    seen: dict = {}

    def keep(mod, args, out):  # ln_f's rows and gamma in the last read's window
        seen["dtypes"] = (args[0].dtype, out.dtype)
        if module.global_step == LAST_WINDOW:
            seen.setdefault("rows", []).append(out.detach())
            seen["gamma"] = mod.weight.detach().clone()

    module.model.ln_f.register_forward_hook(keep)
    fit(None, module, [monitor, *extra], steps=8, logger=False, precision=precision)
    assert monitor.failure is None and monitor.last_read_step == 8
    return monitor, seen


def _per_norm(metrics: dict[str, float], metric: str) -> list[float]:
    return [v for k, v in metrics.items() if k.startswith("dd/model.") and k.endswith(metric)]


def test_bf16_mixed_keeps_layernorm_in_float32_and_the_kernel_exact():
    monitor, seen = fit_at("bf16-mixed", null_tol=1e-10)
    assert seen["dtypes"] == (torch.float32, torch.float32)
    last = monitor.last_report.as_dict()
    assert max(_per_norm(last, "/kernel_residual")) < 1e-13
    assert set(_per_norm(last, "/null_dim")) == {1.0}
    assert min(_per_norm(last, "/gamma_alignment")) >= 1 - 1e-9
    assert monitor.alerts_fired == []


def test_bf16_true_reads_the_kernel_at_the_rounding_floor():
    """One fit, two monitors on the same rows: the default ``null_tol`` (warned about) and a
    raised one (named, so that the two have distinct checkpoint keys)."""
    raised = DeadDirectionMonitor(
        every_n_steps=EVERY,
        null_tol=1e-4,
        layers=NORMS,
        residual=False,
        verbose=False,
        name="raised",
        rows_per_read="all",
    )
    with pytest.warns(UserWarning, match="bf16-true.*null_tol=1e-4") as caught:
        monitor, seen = fit_at("bf16-true", 1e-10, raised)
    assert sum("null_tol" in str(w.message) for w in caught) == 1  # the default one only
    assert seen["dtypes"] == (torch.bfloat16, torch.bfloat16)
    last = monitor.last_report.as_dict()
    residuals = _per_norm(last, "/kernel_residual")
    assert 1e-7 < min(residuals) and max(residuals) < 1e-5  # not exact, and not lost
    floor = rounding_floor(torch.cat(seen["rows"]), seen["gamma"])
    # the floor is an expectation over the rounding errors; one window's read scatters about
    # it (measured 0.86x on a 2-core AMD EPYC with avx512_bf16, within 10% elsewhere)
    assert last["dd/model.ln_f/kernel_residual"] == pytest.approx(floor, rel=0.2)
    assert set(_per_norm(last, "/null_dim")) == {0.0}  # above tau = 1e-10: honestly no kernel
    assert min(_per_norm(last, "/gamma_alignment")) >= 1 - 1e-5
    assert monitor.alerts_fired == []  # KernelLossRule (1e-4) is far above the floor
    raised_last = raised.last_report.as_dict()
    assert set(_per_norm(raised_last, "/null_dim")) == {1.0}
    assert _per_norm(raised_last, "/kernel_residual") == residuals  # the same rows, same read
