"""The distributed fits of ``tests/support/distributed_fits.py``, run once per test session.

Lightning's DDP launcher re-runs the launching script for rank 1, so the fits live in a script
of their own, run in a subprocess with a timeout: a collective that hangs fails the tests
instead of stalling CI. All fits share one launch of the two processes (start-up is most of the
cost)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.processes import run_module

TIMEOUT_S = 300  # the fits take ~30 s on 2 idle cores; a hang never returns


@pytest.fixture(scope="session")
def distributed_run(tmp_path_factory) -> dict[str, Any]:
    """``{"out": folder, "results": {(fit, rank): dict}}`` of every fit in the script."""
    from tests.support.distributed_fits import FITS

    out = tmp_path_factory.mktemp("distributed")
    # its own process group: on a hang, rank 1 (Lightning's child of rank 0) is killed too
    run_module(
        "tests.support.distributed_fits", out, timeout_s=TIMEOUT_S, what="the distributed fits"
    )
    results = {
        (fit, rank): json.loads((out / f"{fit}_rank{rank}.json").read_text())
        for fit in FITS
        for rank in (0, 1)
    }
    return {"out": out, "results": results}
