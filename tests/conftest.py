"""The fixtures every folder of the suite may use, and where the shared helpers live.

``tests/`` mirrors ``src/normscope/`` (``functional/``, ``taps/``, ``alerts/``, ``families/``,
``engine/``, ``adapters/``, ``cli/``), plus ``scaleout/`` and ``reliability/``, and
``examples/`` and ``benchmarks/`` for the repository's folders of those names. The helpers are
plain modules in ``tests/support/`` (importable by the processes a test spawns too); no test
module imports another:

* ``tiny_models``: ``TinyLM``, ``LitTiny`` (a pre-norm LM that trains in seconds),
  ``token_loader``, ``cpu_trainer``;
* ``fits``: the one ``fit``, ``read_csv``, ``rows_with``, ``MemoryLogger``,
  ``recorded_warnings``, ``wait_for_summary``;
* ``hf_models``, ``minilm``: real ``transformers`` models, the trained MiniLM's scan;
* ``loops``, ``fabric_ddp``, ``distributed_fits``, ``shards``, ``expected``, ``processes``: the
  five loops and the multi-process fits;
* ``cli``, ``factories``, ``figure_runs``, ``hf_runs``, ``norm_rows``,
  ``reliability_models``: what one folder's tests share.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def wandb_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B writes its run to local files and prints nothing (no account, no network)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test: on a loaded 2-core machine two OpenMP threads contend
    so badly on tiny tensors that a 16 x 16 eigensolve costs milliseconds (a read measured 25x
    slower with 2 threads than with 1 under load)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
