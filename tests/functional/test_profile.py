"""sigma_min and the residual depth profile (docs/metrics.md §1.4) against numpy.

The stream is built by hand, ``x_k = x_{k-1} + f_k(x_{k-1})`` with linear branches
``f(x) = x A``. When ``A + A^T`` is PSD, ``||(I + A) v||^2 = 1 + v^T (A + A^T) v + ||A v||^2 >= 1``
for unit ``v``, so ``sigma_min(X (I + A)) >= sigma_min(X)``: every step is ``>= 1`` (exactly,
not statistically). A branch ``-0.8 x P`` (``P`` a projector) shrinks ``span P`` to 0.2 of
itself: the step there is at most ``0.2 * sigma_max / sigma_min`` of the stream, below 1 for
the well-conditioned rows used here.

Tolerance: 1e-10 relative against ``sqrt(np.linalg.eigvalsh(X^T X / N)[0])``. The accumulator's
``S = C + mu mu^T`` agrees with numpy's ``X^T X / N`` to about 1e-14 relative, and the bottom
eigenvalue of a matrix with condition ~10 inherits that.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from normscope.functional import (
    StreamingCovariance,
    sigma_min,
    sigma_min_profile,
)

torch.set_num_threads(1)
D, N = 32, 256  # N = 8 d rows: the read's 2 d floor with room, well-conditioned rows


def psd_branch(rng: np.random.Generator, scale: float = 0.15) -> np.ndarray:
    """A = S + K, S PSD and K antisymmetric: A + A^T = 2 S is PSD, A is not symmetric."""
    b = rng.standard_normal((D, D)) / math.sqrt(D)
    k = rng.standard_normal((D, D)) / math.sqrt(D)
    return scale * (b @ b.T / D + (k - k.T) / 2)


def stream(cancel_at: int | None = None, layers: int = 6, seed: int = 0):
    """Residual points p_0..p_L of a hand-built stream; optionally one cancelling branch."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, D)) + 0.5 * rng.standard_normal(D)  # a common offset too
    proj_basis = np.linalg.qr(rng.standard_normal((D, 3)))[0]
    projector = proj_basis @ proj_basis.T
    points, branches = [x], []
    for k in range(1, layers + 1):
        f = -0.8 * (x @ projector) if k == cancel_at else x @ psd_branch(rng)
        branches.append((x, f))
        x = x + f
        points.append(x)
    names = [
        "embed",
        *(f"h.{(k - 1) // 2}.{'attn' if k % 2 else 'mlp'}" for k in range(1, layers + 1)),
    ]
    sublayers = [None, *("attn" if k % 2 else "mlp" for k in range(1, layers + 1))]
    return names, points, sublayers, branches


def second_moments(points: list[np.ndarray]) -> list[torch.Tensor]:
    out = []
    for x in points:
        acc = StreamingCovariance(D)
        for chunk in np.array_split(x, 4):
            acc.update(torch.from_numpy(chunk))
        out.append(acc.second_moment())
    return out


def numpy_sigma_min(x: np.ndarray) -> float:
    return math.sqrt(np.linalg.eigvalsh(x.T @ x / len(x))[0])


def read(cancel_at: int | None = None):
    names, points, sublayers, branches = stream(cancel_at)
    prof = sigma_min_profile(names, second_moments(points), [N] * len(points), sublayers)
    return prof, names, points, branches


def test_sigma_min_matches_numpy():
    _, points, _, _ = stream()
    for x, s in zip(points, second_moments(points)):
        assert sigma_min(s, N) == pytest.approx(numpy_sigma_min(x), rel=1e-10)
    assert math.isnan(sigma_min(second_moments(points[:1])[0], 2 * D - 1))


def test_no_cancellation_means_no_ratio_below_one():
    prof, names, points, branches = read()
    assert prof.reason is None
    ref = [numpy_sigma_min(x) for x in points]
    for k, p in enumerate(prof.points):
        assert (p.name, p.depth, p.n_rows) == (names[k], k, N)
        assert p.reason is None
        assert p.sigma_min == pytest.approx(ref[k], rel=1e-10)
        assert p.sigma_min_ratio == pytest.approx(ref[k] / ref[0], rel=1e-10)
        assert p.sigma_min_step == pytest.approx(ref[k] / ref[max(k - 1, 0)], rel=1e-10)
        assert p.sigma_min_ratio >= 1 and p.sigma_min_step >= 1
    assert prof.points[0].sigma_min_ratio == 1.0 and prof.points[0].sigma_min_step == 1.0
    assert prof.points[0].sublayer is None and prof.points[1].sublayer == "attn"
    later = [p.sigma_min_ratio for p in prof.points[1:]]
    assert prof.sigma_min_ratio_min == min(later) and prof.sigma_min_ratio_min > 1
    # the premise: no branch cancels the stream it reads, <x, f(x)> = x S x^T >= 0 row by row
    assert all((np.einsum("nd,nd->n", x, f) >= 0).all() for x, f in branches)


def test_a_cancelling_branch_is_found_where_it_is():
    cancel = 4
    prof, names, points, branches = read(cancel_at=cancel)
    steps = [p.sigma_min_step for p in prof.points]
    assert steps[cancel] < 1
    assert all(s >= 1 for k, s in enumerate(steps) if k != cancel)
    assert prof.worst_point == names[cancel] == "h.1.mlp"
    assert prof.sigma_min_ratio_min == prof.points[cancel].sigma_min_ratio < 1
    ref = [numpy_sigma_min(x) for x in points]
    assert steps[cancel] == pytest.approx(ref[cancel] / ref[cancel - 1], rel=1e-10)
    x, f = branches[cancel - 1]  # the branch that produced p_cancel
    # the premise: <x, -0.8 x P> = -0.8 ||x P||^2 < 0 for every row
    assert (np.einsum("nd,nd->n", x, f) < 0).all()

    flat = prof.as_dict()
    assert flat["sigma_min_ratio_min"] == prof.sigma_min_ratio_min
    assert flat[f"{names[cancel]}/sigma_min_step"] == steps[cancel]
    assert len(flat) == 8 * len(names) + 2  # 4 reads + 4 interval ends; 2 run-level keys
    assert [flat[f"{n}/depth"] for n in names] == list(range(len(names)))  # forward order
    assert {k.rsplit("/", 1)[-1] for k in flat} == {
        "sigma_min",
        "depth",
        "sigma_min_ratio",
        "sigma_min_step",
        "rows_per_dim",
        "sigma_min_ratio_lo",
        "sigma_min_ratio_hi",
        "sigma_min_step_lo",
        "sigma_min_step_hi",
        "sigma_min_ratio_min",
    }


def test_nan_points_and_a_nan_first_point():
    names, points, sublayers, _ = stream()
    moments = second_moments(points)
    rows = [N] * len(points)
    rows[2] = D  # too few rows at p_2: its numbers are NaN, p_3's step too, p_3's ratio is not
    prof = sigma_min_profile(names, moments, rows, sublayers)
    assert prof.points[2].reason == "insufficient_rows" and math.isnan(prof.points[2].sigma_min)
    assert math.isnan(prof.points[3].sigma_min_step)
    assert prof.points[3].reason == "previous_point_unavailable"
    assert math.isfinite(prof.points[3].sigma_min_ratio)
    assert prof.worst_point != names[2] and math.isfinite(prof.sigma_min_ratio_min)

    rows = [N] * len(points)
    rows[0] = 0
    prof = sigma_min_profile(names, moments, rows, sublayers)
    assert prof.reason == "first_point_unavailable" and prof.worst_point is None
    assert math.isnan(prof.sigma_min_ratio_min)
    assert all(math.isnan(p.sigma_min_ratio) for p in prof.points)
    # A step needs only its two neighbours: p_1's is lost with p_0, later ones are still read.
    assert math.isnan(prof.points[1].sigma_min_step)
    assert all(math.isfinite(p.sigma_min_step) and p.sigma_min_step >= 1 for p in prof.points[2:])
    assert prof.points[0].reason == "insufficient_rows"
    assert prof.points[1].reason == "first_point_unavailable"

    bad = [m.clone() for m in moments]
    bad[1][0, 0] = math.nan
    prof = sigma_min_profile(names, bad, [N] * len(points), sublayers)
    assert prof.points[1].reason == "non_finite_second_moment"

    assert sigma_min_profile([], [], [], []).reason == "no_points"
    assert sigma_min_profile(names[:1], moments[:1], [N], [None]).reason == "single_point"


def test_bad_arguments_raise_value_error():
    names, points, sublayers, _ = stream(layers=2)
    moments = second_moments(points)
    with pytest.raises(ValueError, match="one entry per point"):
        sigma_min_profile(names, moments[:-1], [N] * 3, sublayers)
    with pytest.raises(ValueError, match="distinct"):
        sigma_min_profile(["a", "a", "b"], moments, [N] * 3, sublayers)
    with pytest.raises(ValueError, match="square"):
        sigma_min(torch.ones(3, 2), 10)
