"""What the DDP tests compare a rank's reads with: one process's tracker on the union of the rows."""

from __future__ import annotations

import math
from typing import Any

import pytest

P0_MARGIN = "dd/model.h.0.ln_1/no_cancellation_margin"  # p_0: NaN by definition
AGAINST_BASELINE = ("/delta_gamma", "/deepening")  # NaN when rows are not comparable


def floats(metrics: dict[str, Any]) -> dict[str, float]:
    """A rank's logged metrics as floats (NaN/inf were written to JSON as repr strings)."""
    return {k: float(v) for k, v in metrics.items()}


def assert_reads_equal(reads: list[dict[str, Any]], expected: list[dict[str, float]]) -> None:
    """Every read's keys are the single-process read's, and every number equals it to 1e-10
    (only the order of the float64 sums differs). NaN only where one process reads NaN too, and
    only for p_0's margin (no sublayer before it) and ``delta_gamma`` / ``deepening`` (the
    windows' row counts differ, padding, beyond the rows rule)."""
    assert len(reads) == len(expected)
    for read, want in zip(reads, expected):
        got = floats(read["metrics"])
        assert set(got) == set(want)
        for key, value in want.items():
            if math.isnan(value) and (key == P0_MARGIN or key.endswith(AGAINST_BASELINE)):
                assert math.isnan(got[key]), key
                continue
            assert math.isfinite(value), key
            assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-10), key
