"""The distributed fits of ``tests/scaleout/distributed_fits.py``, run once per test session.

Lightning's DDP launcher re-runs the launching script for rank 1, so the fits live in a script
of their own, run in a subprocess with a timeout: a collective that hangs fails the tests
instead of stalling CI. All fits share one launch of the two processes (start-up is most of the
cost)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # the fits take ~30 s on 2 idle cores; a hang never returns


@pytest.fixture(scope="session")
def distributed_run(tmp_path_factory) -> dict[str, Any]:
    """``{"out": folder, "results": {(fit, rank): dict}}`` of every fit in the script."""
    from tests.scaleout.distributed_fits import FITS

    out = tmp_path_factory.mktemp("distributed")
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    # Its own process group: on a hang, rank 1 (Lightning's child of rank 0) is killed too.
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.scaleout.distributed_fits", str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the distributed fits hung (> {TIMEOUT_S} s):\n{stderr[-6000:]}")
    assert proc.returncode == 0, stderr[-6000:]
    results = {
        (fit, rank): json.loads((out / f"{fit}_rank{rank}.json").read_text())
        for fit in FITS
        for rank in (0, 1)
    }
    return {"out": out, "results": results}
