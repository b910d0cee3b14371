"""What one read of the demo GPT runs, counted with ``torch.profiler`` (a count, not a time:
deterministic for a given model and torch build).

The demo GPT of ``examples/nanogpt.py`` (4 blocks, width 128, LayerNorm: 9 norm layers, 9
residual points, every point a norm's input) read once by a default
:class:`~normscope.DeadDirectionTracker` after one sampled forward.

* **Every decomposition earns its place**: one factorisation per matrix a key is read from:
  a norm's output covariance and its input covariance (whose eigenpairs also give the point's
  second-moment ``sigma_min``, by the secular equation), so 2 per norm layer, plus the final
  norm output's two RankMe spectra; none of a 1 x 1 matrix; ``live_floor`` from the output covariance's own
  ``eigh`` (the secular equation), not from a second decomposition.
* **Small ops**: the aten ops the read dispatches (top level: ops nested inside another aten
  op, such as ``aten::to``'s copy, are not counted again). Measured 1,431 at width 128 on
  torch 2.13 CPU (4,104 with the nested ones), from 1,665 before the secular floor and the
  one-op covariance; 1,368 with issue 33's input read (one ``eigh`` per norm input for
  ``delta_gamma``, the Schur quotient and the point's ``sigma_min``); 2,070 with issue 32's
  stream reads, which read each point and norm on its own (268 ``item`` calls: host syncs on a
  GPU; 5,550 with the nested ops). 790 with the batched stream reads (issue 35, 2026-12-07,
  torch 2.13 CPU; 2,940 with the nested ones): every point's and norm output's offset share
  and RMS in one stacked reduction, every norm's gain drift and gamma statistics in one batch,
  the row counts fetched once per read, each per-layer read's numbers copied to the host once
  (``tolist``) instead of one ``float()`` each; no top-level ``item`` is left (the 40 nested
  ``item`` / ``_local_scalar_dense`` are the 20 ``bool`` finiteness checks and the 20
  factorisations' own error checks). The same logged values (bitwise, RankMe within 1e-15).
  798 with the attention-logit read of issue 32 (its 4 modules' maxima stacked and copied
  once). Issue 35's ~500 would need the per-layer decompositions batched across layers (not
  done). 942 since the accumulators are ``torchmetrics.Metric`` s (issue 40): the window's
  reset goes through ``Metric.reset``, a ``detach`` + ``clone`` + ``to`` of each state's
  default (a few bytes each) for every tap -- 72 ``detach`` and 72 ``clone`` of the 942; no
  host sync and no decomposition added.
  The bound guards against growth (about 5% over the measured count).
"""

from __future__ import annotations

import collections

import torch
from examples.nanogpt import GPT, GPTConfig

from normscope import DeadDirectionConfig, DeadDirectionTracker

torch.set_num_threads(1)

FACTORISATIONS = ("aten::linalg_eigh", "aten::linalg_eigvalsh", "aten::linalg_cholesky_ex")
FACTORISATIONS += ("aten::linalg_qr", "aten::linalg_svd", "aten::linalg_svdvals")
TOP_LEVEL_BOUND = 990


def read_ops() -> tuple[collections.Counter, int, int]:
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    x = torch.randint(0, 256, (32, 64))
    tracker = DeadDirectionTracker(DeadDirectionConfig(), model)
    with torch.no_grad():
        tracker.attach(forward=lambda: model(x))
        for _ in range(2):  # the first read sets the baselines; count the second
            with tracker.gate.sampling():
                model(x)
            if _ == 0:
                tracker.read(0)
        with torch.profiler.profile() as prof:
            report = tracker.read(1)
    tracker.detach()
    assert len(report.norms) == 9 and len(report.profile.points) == 9
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return collections.Counter(e.name for e in top), len(top), len(report.norms)


def test_one_read_of_the_demo_counts_its_ops_and_decompositions():
    ops, n_top, n_norms = read_ops()
    factorisations = sum(ops[name] for name in FACTORISATIONS)
    # one eigh per norm output and one per norm input (delta_gamma, the Schur quotient and the
    # point's sigma_min from it); RankMe's eigvalsh of the final norm's output moments
    assert 2 * n_norms <= factorisations <= 2 * n_norms + 2, dict(ops)
    # one eigh per norm output: kernel_read's, whose eigenpairs also give live_floor
    assert ops["aten::linalg_eigh"] <= 2 * n_norms
    assert ops["aten::linalg_qr"] == 0  # the old live floor's complement basis
    assert n_top <= TOP_LEVEL_BOUND, (n_top, ops.most_common(15))
    # host syncs: the reads copy their numbers to the host in batches (tolist), never one
    # float() / .item() per number
    assert ops["aten::item"] == 0, ops.most_common(15)
