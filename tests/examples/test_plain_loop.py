"""``examples/plain_loop.py``, run for real (shortened): the nanoGPT loop with
``monitor.step`` reads on schedule and alerts once the cancelling branch is switched on."""

from __future__ import annotations

import pytest

from examples import plain_loop


@pytest.mark.filterwarnings("ignore:normscope alert")
def test_plain_loop_reads_and_alerts(capsys):
    alerts = plain_loop.main(["--steps", "8", "--every", "4", "--cancel-at", "5"])
    out = capsys.readouterr().out
    # reads after steps 2 (the baseline window is step 1: residual discovery watches step 0's
    # forward), 4 and 8; the branch cancels from step 5
    assert [line.split(":")[0] for line in out.splitlines() if "sigma_min_ratio_min" in line] == [
        "step 2",
        "step 4",
        "step 8",
    ]
    assert alerts and alerts[0].step == 8 and alerts[0].rule == "sigma_min_collapse"
