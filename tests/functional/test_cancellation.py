"""The no-cancellation cross-moment and margin (issue 18) against numpy float64 references.

Tolerances: ``M`` is a sum of products of float64 rows in both implementations (different
summation order): 1e-12 relative to its largest entry. The margin is a ratio of two bottom
eigenvalues of well-conditioned matrices: 1e-9 relative.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from normscope.functional import StreamingCovariance
from normscope.functional.cancellation import StreamingCrossMoment, no_cancellation_margin

torch.set_num_threads(1)


def pair(n: int, d: int, seed: int, cancel: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Rows x and x + f(x), f a random linear branch, optionally minus ``cancel`` x P."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) @ (np.eye(d) + 0.3 * rng.standard_normal((d, d)))
    f = 0.2 * x @ rng.standard_normal((d, d)) / math.sqrt(d)
    if cancel:
        q = np.linalg.qr(rng.standard_normal((d, 2)))[0]
        f = f - cancel * x @ (q @ q.T)
    return x, x + f


def numpy_margin(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    n = len(x)
    f = y - x
    m = (x.T @ f + f.T @ x) / n
    s = x.T @ x / n
    return m, np.linalg.eigvalsh(m)[0] / np.linalg.eigvalsh(s)[0]


@pytest.mark.parametrize(("cancel", "seed"), [(0.0, 0), (0.9, 1)])
def test_cross_moment_and_margin_match_numpy(cancel, seed):
    n, d = 512, 12
    x, y = pair(n, d, seed, cancel)
    acc = StreamingCrossMoment(d)
    for chunk in np.array_split(np.arange(n), 3):  # streaming: three batches
        acc.update(torch.from_numpy(x[chunk]), torch.from_numpy(y[chunk]))
    m_ref, margin_ref = numpy_margin(x, y)
    m = acc.moment().numpy()
    assert acc.count == n
    assert np.abs(m - m_ref).max() <= 1e-12 * np.abs(m_ref).max()
    s = StreamingCovariance(d)
    s.update(torch.from_numpy(x))
    margin, reason = no_cancellation_margin(acc.moment(), s.second_moment(), acc.count)
    assert reason is None and margin == pytest.approx(margin_ref, rel=1e-9)
    if cancel:
        assert margin < 0  # x (I - 0.9 P): <x, f> < 0 along P


def test_the_margin_bounds_the_step_on_the_same_rows():
    """S_k = S_{k-1} + M_k + F^T F / N exactly, so lambda_1(S_k) >= lambda_1(S_{k-1}) (1 + margin):
    a margin >= 0 makes a falling sigma_min impossible. Checked where the premise holds
    (f = 0.5 x: margin 1, step^2 >= 2) and where it fails (a cancelling branch)."""
    d = 10
    rng = np.random.default_rng(3)
    x = rng.standard_normal((400, d))
    cases = [(x, 1.5 * x), pair(400, d, 4, cancel=0.95), pair(400, d, 5)]
    for xx, y in cases:
        acc = StreamingCrossMoment(d)
        acc.update(torch.from_numpy(xx), torch.from_numpy(y))
        s_prev, s_next = (a.T @ a / len(a) for a in (xx, y))
        margin, _ = no_cancellation_margin(acc.moment(), torch.from_numpy(s_prev), acc.count)
        f = y - xx
        identity = s_prev + acc.moment().numpy() + f.T @ f / len(f)
        assert np.abs(identity - s_next).max() <= 1e-12 * np.abs(s_next).max()
        step2 = np.linalg.eigvalsh(s_next)[0] / np.linalg.eigvalsh(s_prev)[0]
        assert step2 >= 1 + margin - 1e-12
    # the premise-holding case: f = 0.5 x, M = S, margin exactly 1
    acc = StreamingCrossMoment(d)
    acc.update(torch.from_numpy(x), torch.from_numpy(1.5 * x))
    s = torch.from_numpy(x.T @ x / len(x))
    assert no_cancellation_margin(acc.moment(), s, len(x))[0] == pytest.approx(1.0, rel=1e-12)


def test_masked_and_non_finite_rows_add_nothing():
    n, d = 64, 4
    x, y = pair(n, d, 6)
    x[3, 1] = math.nan
    y[7, 0] = math.inf
    mask = np.ones(n, dtype=bool)
    mask[10:20] = False
    acc = StreamingCrossMoment(d)
    acc.update(
        torch.from_numpy(x).reshape(8, 8, d),
        torch.from_numpy(y).reshape(8, 8, d),
        mask=torch.from_numpy(mask).reshape(8, 8),
    )
    keep = mask.copy()
    keep[[3, 7]] = False
    m_ref, _ = numpy_margin(x[keep], y[keep])
    assert acc.count == int(keep.sum()) == 52
    assert np.abs(acc.moment().numpy() - m_ref).max() <= 1e-12 * np.abs(m_ref).max()


def test_state_round_trip_reduce_noop_and_bad_input():
    x, y = pair(40, 3, 7)
    acc = StreamingCrossMoment(3)
    acc.update(torch.from_numpy(x), torch.from_numpy(y))
    other = StreamingCrossMoment(3)
    other.load_state_dict(acc.state_dict())
    assert torch.equal(other.moment(), acc.moment()) and other.count == 40
    assert acc.reduce_() is acc  # no process group: a no-op
    acc.reset()
    assert acc.count == 0 and bool(torch.isnan(acc.moment()).all())
    with pytest.raises(ValueError, match="must both be"):
        acc.update(torch.zeros(4, 3), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="mask"):
        acc.update(torch.zeros(4, 3), torch.zeros(4, 3), mask=torch.ones(3))
    with pytest.raises(ValueError, match="dim"):
        StreamingCrossMoment(0)
    with pytest.raises(ValueError, match="must match"):
        no_cancellation_margin(torch.eye(3), torch.eye(2), 10)


def test_margin_reasons():
    eye = torch.eye(3, dtype=torch.float64)
    assert no_cancellation_margin(eye, eye, 5)[1] == "insufficient_rows"
    nan = torch.full((3, 3), math.nan, dtype=torch.float64)
    assert no_cancellation_margin(nan, eye, 10)[1] == "non_finite_moment"
    assert no_cancellation_margin(eye, nan, 10)[1] == "previous_point_unavailable"
    assert no_cancellation_margin(eye, 0 * eye, 10)[1] == "previous_point_unavailable"
    assert math.isnan(no_cancellation_margin(eye, 0 * eye, 10)[0])


@pytest.mark.parametrize("d", [12, 1100])
def test_a_known_lambda_min_of_the_previous_point_gives_the_same_margin(d):
    """The profile read passes ``sigma_min(p_{k-1})^2`` instead of solving ``S_{k-1}`` again:
    the margin is the same to 1e-10 (the fast solver's bound at d >= 1024; at small d the dense
    value squared back from its square root, a few ulps); a NaN or non-positive known value is
    not used (the margin solves, and its reasons are unchanged)."""
    from normscope.functional import sigma_min

    n = 3 * d
    rng = np.random.default_rng(5)  # well-conditioned S: lambda_min ~ 0.18 lambda_mean at N = 3d
    x = rng.standard_normal((n, d))
    y = x + 0.2 * x @ rng.standard_normal((d, d)) / math.sqrt(d)
    acc = StreamingCrossMoment(d)
    acc.update(torch.from_numpy(x), torch.from_numpy(y))
    s = StreamingCovariance(d)
    s.update(torch.from_numpy(x))
    alone, why = no_cancellation_margin(acc.moment(), s.second_moment(), acc.count)
    known = sigma_min(s.second_moment(), s.count) ** 2
    reused, why_reused = no_cancellation_margin(
        acc.moment(), s.second_moment(), acc.count, previous_lambda_min=known
    )
    assert why is None and why_reused is None
    assert reused == pytest.approx(alone, rel=1e-10)
    nan_given = no_cancellation_margin(
        acc.moment(), s.second_moment(), acc.count, previous_lambda_min=math.nan
    )
    assert nan_given == (alone, None)
