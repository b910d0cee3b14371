"""DiagonalMoment (the sign–magnitude family's accumulator) against numpy's float64 mean of squares.

Tolerance: a float64 sum of N squares is exact to about N ulps (here N <= 10^3: 1e-13); numpy
sums in another order, so the two agree to that, not bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from normscope.functional.moments import DiagonalMoment


def test_streamed_batches_match_numpy_and_nan_rows_are_dropped_and_counted() -> None:
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((4, 25, 6)) * rng.uniform(0.1, 30, 6) for _ in range(5)]
    batches[2][1, 3, 4] = np.nan
    batches[3][0, 0, 0] = np.inf
    acc = DiagonalMoment(6)
    for b in batches:
        acc.update(torch.tensor(b, dtype=torch.float32))
    rows = np.concatenate([b.astype(np.float32).astype(np.float64).reshape(-1, 6) for b in batches])
    rows = rows[np.isfinite(rows).all(1)]
    assert acc.count == 498 and acc.rows_rejected == 2
    np.testing.assert_allclose(acc.second_moment_diagonal().numpy(), (rows**2).mean(0), rtol=1e-13)


def test_mask_skips_padding_and_a_padded_nan_is_not_counted_as_rejected() -> None:
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    x[0, 4, 0] = float("nan")  # in the padding: skipped, not rejected
    x[1, 0, 2] = float("inf")  # a real row: rejected
    acc = DiagonalMoment(3)
    acc.update(x, mask=mask)
    kept = x[mask.bool()]
    kept = kept[torch.isfinite(kept).all(1)]
    assert acc.count == 7 and acc.rows_rejected == 1
    torch.testing.assert_close(acc.second_moment_diagonal(), (kept**2).mean(0), rtol=1e-15, atol=0)


def test_reset_to_empty_and_bad_input() -> None:
    acc = DiagonalMoment(4)
    assert acc.count == 0 and acc.second_moment_diagonal().tolist() == [0.0] * 4  # no row: zeros
    acc.update(torch.ones(3, 4))
    acc.reset()
    assert acc.count == 0 and float(acc.sum_sq.sum()) == 0.0
    assert acc.to("cpu") is acc and acc.memory_bytes() == 8 * 6
    with pytest.raises(ValueError, match="width d=4"):
        acc.update(torch.ones(3, 5))
    with pytest.raises(ValueError, match="mask must have the shape"):
        acc.update(torch.ones(3, 4), mask=torch.ones(2))
    with pytest.raises(ValueError, match="positive int"):
        DiagonalMoment(0)
