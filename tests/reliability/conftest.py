"""Every reliability test runs on one intra-op thread (the root conftest's ``one_thread``): their
tensors are tiny (d = 8..16)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread_here(one_thread: None) -> None:
    pass
