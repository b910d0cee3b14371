"""Running a multi-process script of the tests (a DDP launch) in a subprocess with a timeout.

Lightning's and Fabric's DDP launchers re-run the launching script for rank 1, so such fits
live in a module of their own, run here with ``python -m``. The child gets its own process
group: on a hang the whole group (rank 1 included) is killed and the test fails with the end of
its stderr, instead of stalling CI.

The launcher's variables are not passed on: an in-process Lightning fit earlier in the same
pytest run (FSDP on one device, for one) leaves ``LOCAL_RANK``, ``NODE_RANK`` and ``MASTER_*`` in
``os.environ``, and a child that inherits ``LOCAL_RANK`` takes itself for an already-launched
rank, never starts rank 1 and waits for it forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


def run_module(module: str, out: Path, *, timeout_s: float, what: str, **env: str) -> None:
    """``python -m module out`` from the repository root, offline W&B plus ``env``; fails the
    test if it hangs for more than ``timeout_s`` (naming ``what``) or exits non-zero."""
    environ = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    environ.update(WANDB_MODE="offline", WANDB_SILENT="true", **env)
    proc = subprocess.Popen(
        [sys.executable, "-m", module, str(out)],
        cwd=REPO,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"{what} hung (> {timeout_s} s):\n{stderr[-6000:]}")
    assert proc.returncode == 0, stderr[-6000:]
