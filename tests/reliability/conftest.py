"""One intra-op thread for these tests: their tensors are tiny (d = 8..16), and on a loaded
2-core machine two OpenMP threads contend so badly that a 16 x 16 eigensolve or a small matmul
costs milliseconds (a read measured 25x slower with 2 threads than with 1 under load)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
