"""The demo and the collapse example, run for real (shortened: 100 steps on the stdlib text).

The alert defaults (tolerance 0.2 below 1, patience 1) were chosen from these runs: the healthy
demo's smallest step ratio over 400 steps was 0.98 (LayerNorm) and 0.996 (RMSNorm); the
cancelling branch takes the step at its sublayer to about 0.4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import collapse_alert  # noqa: E402
import demo  # noqa: E402


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_demo_trains_and_raises_no_alert(tmp_path, norm):
    monitor = demo.main(
        ["--steps", "100", "--every", "25", "--norm", norm, "--out", str(tmp_path), "--no-wandb"]
    )
    assert monitor.reads == 5  # steps 1, 25, 50, 75, 100
    assert monitor.alerts_fired == []
    report = monitor.last_report
    assert report.profile.sigma_min_ratio_min > 1.0
    final = report.norms["model.transformer.ln_f"]
    if norm == "layernorm":
        assert final.kernel.gamma_alignment >= 0.9999
        assert final.kernel.norm_class == "layernorm-like"
    else:
        assert final.kernel.norm_class != "layernorm-like"
    assert (tmp_path / "csv").is_dir()


def test_collapse_example_alerts_at_the_cancelling_sublayer_and_stops(tmp_path):
    monitor = collapse_alert.main(
        [
            "--cancel-at",
            "50",
            "--cancel-layer",
            "2",
            "--steps",
            "150",
            "--every",
            "25",
            "--out",
            str(tmp_path),
            "--no-wandb",
        ]
    )
    assert monitor.alerts_fired, "the cancelling branch must raise an alert"
    first = monitor.alerts_fired[0]
    # block 2's MLP output lands at the input of block 3's first norm
    assert first.point == "model.transformer.h.3.ln_1"
    assert first.sublayer == "mlp"
    # the switch acts from optimiser step 50 on; the read logged at step 50 sampled step 49, so
    # the first read that sees it is the one logged at step 75
    assert first.step == 75
    assert len(monitor.alerts_fired) == 1, "downstream points are not reported again"
    assert first.value < 0.8
    assert monitor.last_read_step == first.step, "stop_on_alert: no read after the alert"
