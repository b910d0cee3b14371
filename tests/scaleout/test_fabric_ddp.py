"""The dead-direction monitor as a Fabric callback under real DDP (2 CPU processes, gloo): one
short launch of ``tests/support/fabric_ddp.py`` in a subprocess with a timeout (a hung
collective fails the test instead of stalling CI)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from normscope import scan_model
from normscope.runs import read_csv_run
from tests.support import fabric_ddp
from tests.support.loops import gpt2
from tests.support.processes import run_module

TIMEOUT_S = 240


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric_ddp")
    run_module(
        "tests.support.fabric_ddp",
        out,
        timeout_s=TIMEOUT_S,
        what="the Fabric DDP loop",
        HF_HUB_OFFLINE="1",
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return out, ranks


def test_fabric_ddp_reads_cover_both_ranks_rows(ddp_run):
    """Both ranks: the same reads (reduced), the optimiser steps counted through gradient
    accumulation (4 steps of 2 micro-batches: global_step 4, reads after steps 2 and 4: step 0
    is residual discovery's), and
    equal, to rel 1e-10 (only the order of the float64 sums differs), to one process's scan of
    every micro-batch of both ranks with the same weights (learning rate 0)."""
    out, ranks = ddp_run
    for r in ranks:
        assert not r["disabled"], r["failure"]
        assert r["global_step"] == fabric_ddp.STEPS and r["reads"] == 2
        assert r["alerts"] == [2]  # the cancelling branch, on both ranks at the same step
    got = [{k: float(v) for k, v in r["last"].items()} for r in ranks]
    assert got[0].keys() == got[1].keys()
    for key in got[0]:
        assert got[0][key] == got[1][key] or (math.isnan(got[0][key]) and math.isnan(got[1][key]))
    batches = fabric_ddp.micro_batches(0) + fabric_ddp.micro_batches(1)
    model = gpt2()
    with torch.no_grad():
        expected = scan_model(model, batches).as_dict()
    rows = sum(int(b["attention_mask"].sum()) for b in batches)
    assert got[0]["dd/transformer.ln_f/n_rows"] == rows
    for key, value in expected.items():
        if math.isnan(value):
            assert math.isnan(got[0][key]), key
        else:
            assert got[0][key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
    # the final norm's share on the discovery forward (each rank's first micro-batch), summed
    # over the ranks: both ranks hold one process's read of both micro-batches
    first = [{k: float(v) for k, v in r["first"].items()} for r in ranks]
    assert first[0] == first[1] and first[0]["dd/final_out_init_step"] == 0.0
    seen = [fabric_ddp.micro_batches(r)[0] for r in (0, 1)]
    with torch.no_grad():
        init = scan_model(gpt2(), seen).as_dict()
    assert first[0]["dd/final_out_rows_init"] == sum(int(b["attention_mask"].sum()) for b in seen)
    assert first[0]["dd/final_out_offset_share_init"] == pytest.approx(
        init["dd/final_out_offset_share"], rel=1e-10
    )
    assert "dd/final_out_offset_share_init" not in got[0]  # the first read's only
    logged = read_csv_run(out / "fabric_ddp")  # rank 0's Fabric logger
    steps, ratio = logged.series("dd/sigma_min_ratio_min")
    assert steps.tolist() == [2.0, 4.0]
    assert ratio[-1] == got[0]["dd/sigma_min_ratio_min"]
