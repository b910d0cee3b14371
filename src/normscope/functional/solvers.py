"""Fast exact extreme eigenpairs of a symmetric positive semi-definite float64 matrix.

The reads need a few numbers of a ``d x d`` covariance, never its whole spectrum: the largest
eigenvalue, the bottom ``m`` eigenpairs (every eigenvalue under a null threshold among them)
and one constrained bottom eigenvalue (the live floor). They come from

* :func:`lambda_max` -- Lanczos on ``C`` (matrix-vector products, full reorthogonalisation);
* :class:`ShiftedCholesky` -- ONE Cholesky factor of ``C + s I`` (``s = 16 d eps lambda_max``
  so that exact zeros factor; retried larger), exact zero columns set apart (their pairs
  ``(0, e_i)`` are exact), solves by two ``solve_triangular`` (``cholesky_solve`` was 12x
  slower on one vector); with a basis ``P`` also the solve restricted to ``P``'s complement
  (the bordered system: ``k`` extra solves, once);
* :func:`bottom_eigh` -- block shift-invert Lanczos on that factor, full reorthogonalisation.
  A block of ``b`` finds an eigenvalue repeated up to ``b`` times; a cluster as large as the
  block is answered by a doubled block (up to ``MAX_BLOCK``), then by "not converged".
  ``null_dim`` is counted on the verified Ritz values, with the next value above the
  threshold verified too: an inertia count (``ldl_factor`` of ``C - tI``) measured as a
  second factorisation as dear as the Cholesky (23.5 against 20.6 ms at d = 1024).

The pairs are a Rayleigh-Ritz of ``C`` itself on the Krylov space (the shift and the solves'
rounding only shape the space), each checked by its true residual ``r = ||C u - theta u||``:
``r <= 1e-13 lambda_max`` where its vector is read (the bottom one, the null space),
``min(r, r^2 / gap) <= 1e-12 lambda_max`` where only its value is. An unverified result says
so (``converged=False``): the caller falls back to the dense route and counts it. Everything
stays on the matrix's device; the only host syncs are the convergence checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FAST_MIN_DIM", "SOLVERS", "BottomEigs", "ShiftedCholesky", "bottom_eigh"]
__all__ += ["check_solver", "lambda_max", "use_fast"]

#: below this width the dense solvers can be as fast or faster (crossover measured on a
#: lambda_i ~ i^-2 spectrum between d = 768 and 1024; benchmarks/RESULTS.md, "Fast solvers")
FAST_MIN_DIM = 1024
#: true-residual tolerance / lambda_max of the pairs whose vectors are read (the bottom one,
#: the null space: a vector is off by at most residual / gap; attained ~1e-15)
TIGHT_TOL = 1e-13
#: error bound ``min(r, r^2 / gap)`` of the other values, relative to lambda_max (the reads
#: give them over lambda_max: 1e-12 is a hundredth of their 1e-10 rounding floor)
VALUE_TOL = 1e-12
MAX_BLOCK = 32
#: Krylov blocks per block size at least (test spectra: 15-45), and the share of the width
#: the space may reach beyond (a lambda_i ~ i^-2 tail: 140 vectors at d = 448)
MAX_ITER, KRYLOV_SHARE = 60, 0.5
#: the solvers a read may take: "fast" (these) or "dense" (one full eigh)
SOLVERS = ("fast", "dense")
_EPS = torch.finfo(torch.float64).eps


def check_solver(solver: str, where: str) -> None:
    """Raise ``ValueError`` unless ``solver`` is one of :data:`SOLVERS`."""
    if solver not in SOLVERS:
        raise ValueError(f"{where}: solver must be one of {SOLVERS}, got {solver!r}")


def use_fast(solver: str, d: int, want: int = 1) -> bool:
    """Whether a read of width ``d`` wanting ``want`` bottom pairs takes the fast route:
    ``solver == "fast"``, ``d >= FAST_MIN_DIM`` and ``want < d / 4`` (a quarter of the
    spectrum and more is a full spectrum: one dense eigh is cheaper).

    Example::

        >>> use_fast("fast", 2048, 8), use_fast("fast", 64, 8), use_fast("dense", 2048, 8)
        (True, False, False)
    """
    return solver == "fast" and d >= FAST_MIN_DIM and 4 * want < d


def _start(d: int, b: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(d, b, generator=g, dtype=torch.float64, device=device)


def lambda_max(
    c: torch.Tensor, *, tol: float = 1e-12, max_iter: int = 300, seed: int = 0
) -> tuple[float, bool]:
    """The largest eigenvalue of a symmetric PSD ``c`` by Lanczos (full reorthogonalisation).

    Stops when the Ritz value's error bound ``min(r, r^2 / gap)`` is ``<= tol * theta``
    (``r`` the Ritz residual, ``gap`` to the next Ritz value), checked again with the Ritz
    vector's true residual (one more product). Returns ``(value, converged)``: the
    vector's Rayleigh quotient.

    Example::

        >>> import torch
        >>> value, ok = lambda_max(torch.diag(torch.arange(1.0, 301.0, dtype=torch.float64)))
        >>> round(value, 9), ok
        (300.0, True)
    """
    d = c.shape[0]
    steps = min(max_iter, d)
    basis = torch.zeros(steps + 1, d, dtype=torch.float64, device=c.device)  # rows: contiguous
    v = _start(d, 1, c.device, seed)[:, 0]
    basis[0] = v / torch.linalg.vector_norm(v)
    alphas, betas = [], []  # the tridiagonal T, kept on the device until a check
    theta = 0.0
    for j in range(steps):
        w = c @ basis[j]
        alphas.append(basis[j] @ w)
        vj = basis[: j + 1]
        w = w - (vj @ w) @ vj
        w = w - (vj @ w) @ vj
        beta = torch.linalg.vector_norm(w)
        betas.append(beta)
        basis[j + 1] = w / beta.clamp_min(1e-300)
        if j + 1 < steps and (j + 1 < 8 or (j + 1) % 4):
            continue
        a = torch.stack(alphas).cpu()
        bt = torch.stack(betas).cpu()
        t = torch.diag(a) + torch.diag(bt[:-1], 1) + torch.diag(bt[:-1], -1)
        ev, y = torch.linalg.eigh(t)
        theta = float(ev[-1])
        r = abs(float(bt[-1] * y[-1, -1]))
        gap = float(ev[-1] - ev[-2]) if ev.numel() > 1 else math.inf
        if theta <= 0:
            return theta, bool(r == 0)
        if min(r, r * r / max(gap, 1e-300)) <= tol * theta or j + 1 == d:
            u = y[:, -1].to(c.device) @ basis[: j + 1]  # the true residual: a lost
            cu = c @ u  # orthogonality (a near-invariant space) shows here
            theta = float(u @ cu / (u @ u))
            r = float(torch.linalg.vector_norm(cu - theta * u) / torch.linalg.vector_norm(u))
            return theta, min(r, r * r / max(gap, 1e-300)) <= 10 * tol * theta
    return theta, False


class ShiftedCholesky:
    """One Cholesky factor of ``C + s I`` and its solves.

    Exactly zero columns are set apart (``zero``: exact pairs ``(0, e_i)``). ``s = 16 d eps
    lambda_max``, then 1e3 and 1e6 times that; ``ok`` is False when none factors.

    Example::

        >>> import torch
        >>> c = torch.diag(torch.tensor([0.0, 1.0, 4.0], dtype=torch.float64))
        >>> f = ShiftedCholesky(c, 4.0)
        >>> x = f.solve(torch.ones(3, 1, dtype=torch.float64))[1:, 0]
        >>> f.ok, f.zero.tolist(), [round(v, 9) for v in x.tolist()]
        (True, [0], [1.0, 0.25])
    """

    def __init__(self, c: torch.Tensor, lam_max: float) -> None:
        d = c.shape[0]
        self.d, self.lam_max, self.c = d, lam_max, c
        zero_mask = torch.diagonal(c) == 0
        if bool(zero_mask.any()):  # a PSD matrix's zero diagonal entry: check the column
            zero_mask &= (c == 0).all(dim=0)
        self.zero = torch.nonzero(zero_mask).flatten()
        self.live = torch.nonzero(~zero_mask).flatten()
        self.c_live = c if self.zero.numel() == 0 else c[self.live][:, self.live]
        self.ok, self.shift = False, 16 * max(d, 1) * _EPS * max(lam_max, 1e-300)
        for _ in range(3):
            a = self.c_live.clone()
            a.diagonal().add_(self.shift)
            chol, info = torch.linalg.cholesky_ex(a)
            if int(info) == 0:
                self.chol, self.ok = chol, True
                break
            self.shift *= 1e3

    def solve_live(self, b: torch.Tensor) -> torch.Tensor:
        """``(C_live + s I)^-1 b`` for ``b`` on the live coordinates."""
        y = torch.linalg.solve_triangular(self.chol, b, upper=False)
        return torch.linalg.solve_triangular(self.chol.T, y, upper=True)

    def solve(self, b: torch.Tensor) -> torch.Tensor:
        """``(C + s I)^-1 b`` for a ``(d, r)`` block."""
        if self.zero.numel() == 0:
            return self.solve_live(b)
        out = b / self.shift
        out[self.live] = self.solve_live(b[self.live])
        return out

    def restricted(self, p: torch.Tensor):
        """``A = C + s I`` solved on the complement of an orthonormal ``P`` (the bordered system):
        ``x = A^-1 b - Z (P^T Z)^-1 Z^T b``, ``Z = A^-1 P``; ``x`` is orthogonal to ``P``."""
        z = self.solve(p)
        g = (p.T @ z + z.T @ p) * 0.5

        def apply(b: torch.Tensor) -> torch.Tensor:
            x = self.solve(b) - z @ torch.linalg.solve(g, z.T @ b)
            return x - p @ (p.T @ x)

        return apply


@dataclass(frozen=True)
class BottomEigs:
    """The bottom eigenpairs of ``C`` (ascending, on its device) and how they were verified:
    at least ``want`` and, with ``null_tol``, every eigenvalue ``<= null_tol * lambda_max`` and
    the next one (``null_dim`` counted with a verified gap). ``residual``: the largest
    ``||C u - theta u|| / lambda_max``; ``converged`` False: use the dense route (``reason``)."""

    values: torch.Tensor
    vectors: torch.Tensor
    null_dim: int | None
    converged: bool
    residual: float
    iterations: int
    block: int
    reason: str | None = None


def bottom_eigh(
    c: torch.Tensor, want: int, lam_max: float, *, factor: ShiftedCholesky | None = None,
    null_tol: float | None = None, constraint: torch.Tensor | None = None, vectors: int = 1,
    block: int = 2, max_iter: int | None = None, tight: float = TIGHT_TOL,
    value_tol: float = VALUE_TOL, value_rtol: float = 0.0, start: torch.Tensor | None = None,
    seed: int = 0,
) -> BottomEigs:  # fmt: skip
    """The ``want`` smallest eigenpairs of a symmetric PSD ``c`` by block shift-invert Lanczos.

    Args:
        c: ``(d, d)`` float64, symmetric; ``want``: how many bottom pairs (at least 1).
        lam_max: ``c``'s largest eigenvalue (:func:`lambda_max`); scales the shift and tolerances.
        factor: a :class:`ShiftedCholesky` of ``c`` to reuse (made here when None).
        null_tol: also every eigenvalue ``<= null_tol * lam_max`` and one more (``null_dim``).
        constraint: an orthonormal ``(d, k)`` ``P``: the bottom of ``C`` on its complement.
        vectors: bottom pairs whose vectors are read (held to ``tight``, as the null pairs);
            the others are held to ``min(r, r^2 / gap) <= value_tol lam_max + value_rtol theta``.
        block: the first block size, doubled (to ``MAX_BLOCK``) while a cluster fills it.
        max_iter: Krylov blocks at most (None: ``MAX_ITER`` or ``KRYLOV_SHARE d / block``).
        start: a first block ``(d, block)`` (a warm start); random when None.

    Example::

        >>> import torch
        >>> x = torch.randn(600, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> x[:, :3] = 0.0                                 # three exact zeros
        >>> x[:, 3] = x[:, 4] + x[:, 5]                    # one more, not a zero column
        >>> c = x.T @ x / 600
        >>> lam, _ = lambda_max(c)
        >>> out = bottom_eigh(c, 8, lam, null_tol=1e-10)
        >>> out.converged, out.null_dim
        (True, 4)
        >>> dense = torch.linalg.eigvalsh(c)[:8]
        >>> bool(((out.values[:8] - dense).abs() <= 1e-12 * lam).all())
        True
    """
    d = c.shape[0]
    f = factor if factor is not None else ShiftedCholesky(c, lam_max)
    if not f.ok:
        return BottomEigs(c[0, :0], c[:, :0], None, False, math.inf, 0, block, "cholesky_failed")
    if constraint is not None and constraint.shape[1] > 0:
        p = constraint
        op = f.restricted(p)
        zero = torch.zeros(0, dtype=torch.long, device=c.device)
        dim, mat = d - p.shape[1], c

        def project(x: torch.Tensor) -> torch.Tensor:
            return x - p @ (p.T @ x)
    else:
        p = None
        op, zero, dim, mat = f.solve_live, f.zero, f.live.numel(), f.c_live

        def project(x: torch.Tensor) -> torch.Tensor:
            return x

    n_zero = zero.numel()
    threshold = null_tol * lam_max if null_tol is not None else -math.inf
    want_live = max(want - n_zero, 1)
    # a repeated eigenvalue matters where vectors are read or eigenvalues counted; a value
    # alone (vectors=0, no null_tol) is found by one vector whatever its multiplicity
    counted = vectors > 0 or null_tol is not None or want > 1
    iters, b = 0, block
    while True:
        it_max = max(MAX_ITER, int(KRYLOV_SHARE * dim / b)) if max_iter is None else max_iter
        res = _krylov(
            mat, op, project, dim, want_live, max(vectors - n_zero, 0), threshold, b, it_max, tight,
            lambda th: value_tol * lam_max + value_rtol * abs(th), lam_max,
            start if start is not None and start.shape[1] == b else _start(mat.shape[0], b, c.device, seed),
            f.shift,
        )  # fmt: skip
        vals, vecs, ok, resid, it, cluster = res
        iters += it
        if not ok or not counted or cluster < b or b >= MAX_BLOCK or b >= dim:
            break
        b = min(2 * b, MAX_BLOCK)
    reason = None if ok else "not_converged"
    if ok and counted and cluster >= b and b < dim:
        ok, reason = False, "cluster_fills_block"
    if n_zero:
        full = torch.zeros(d, vecs.shape[1], dtype=torch.float64, device=c.device)
        full[f.live] = vecs
        ez = torch.zeros(d, n_zero, dtype=torch.float64, device=c.device)
        ez[zero, torch.arange(n_zero, device=c.device)] = 1.0
        vals = torch.cat([torch.zeros(n_zero, dtype=torch.float64, device=c.device), vals])
        vecs = torch.cat([ez, full], dim=1)
        order = torch.argsort(vals.clamp_min(0.0), stable=True)  # ties: exact zeros first
        vals, vecs = vals[order], vecs[:, order]
    null_dim = int((vals <= threshold).sum()) if null_tol is not None else None
    return BottomEigs(vals, vecs, null_dim, ok, resid, iters, b, reason)


def _krylov(
    mat, op, project, dim, want, vectors, threshold, b, max_iter, tight, value_tol, lam_max, x0,
    shift,
):  # fmt: skip
    """Block Lanczos on ``op`` (``(mat + s I)^-1``), Rayleigh-Ritz on ``mat`` itself (the solves'
    rounding, large along a near-null direction, never enters a number). Pair ``i`` passes
    when its true residual ``r_i <= tight * lam_max`` (the first ``vectors`` and those under
    ``threshold``: their vectors are read), else when ``min(r_i, r_i^2 / gap_i) <=
    value_tol(theta_i)``. Returns ``(values, vectors, ok, residual, blocks, cluster)``,
    ``cluster`` the largest group of values within ``1e-10 lam_max`` of one another."""
    n_live, dev, b = mat.shape[0], mat.device, min(b, dim)
    blocks = max(1, min(max_iter, math.ceil(dim / b)))
    # the basis as rows (contiguous: V^T C and the reorthogonalisation are row-major GEMMs)
    rows = torch.zeros(b * (blocks + 1), n_live, dtype=torch.float64, device=dev)
    crows = torch.zeros_like(rows)  # (C V)^T, filled at the checks
    rows[:b] = torch.linalg.qr(project(x0[:, :b])).Q.T
    n, done, checked = b, 0, 0
    theta, u, worst = rows[0, :0], rows[:0].T, math.inf
    first = max(2, math.ceil((want + 1) / b))
    # values alone (no vectors read, nothing counted): the Ritz values of T = V^T op V come
    # free from the orthogonalisation; C is applied only to verify a pair (one product)
    cheap = vectors == 0 and not math.isfinite(threshold)
    h = torch.zeros(rows.shape[0], rows.shape[0], dtype=torch.float64, device=dev) if cheap else None  # fmt: skip
    for j in range(blocks):
        w = project(op(rows[n - b : n].T)).T
        v = rows[:n]
        w = w - (c1 := w @ v.T) @ v  # classical Gram-Schmidt, twice
        w = w - (c2 := w @ v.T) @ v
        q, r1 = torch.linalg.qr(w.T)
        q = q.T - (q.T @ v.T) @ v  # a near-invariant space leaves noise in w: keep q orthogonal
        q, r2 = torch.linalg.qr(q.T)
        rows[n : n + b] = q.T
        if cheap:
            h[:n, n - b : n], h[n : n + b, n - b : n] = (c1 + c2).T, r2 @ r1
        n += b
        last = j + 1 == blocks or n >= dim
        if not last and (j + 1 < first or n < 1.1 * checked):
            continue
        checked = n
        m = min(n, dim) if not cheap else n - b
        if cheap:
            mu, y = torch.linalg.eigh((h[:m, :m] + h[:m, :m].T) * 0.5)
            mu, y = mu.flip(0), y.flip(1)[:, : min(want + 1, m)]
            est = torch.linalg.vector_norm(h[m : m + b, m - b : m] @ y[m - b :], dim=0)
            k = y.shape[1]  # Ritz values of C and C-residual bounds ||A|| r / mu from the estimates
            th, rs = (1 / mu[:k] - shift).tolist(), (lam_max * est / mu[:k]).tolist()
            if not _accept(th, rs, min(want, m), 0, tight, value_tol, lam_max) and not last:
                continue
            u = y.T @ (v := rows[:m])
            cu = project((u @ mat).T).T
        else:
            crows[done:m] = project((rows[done:m] @ mat).T).T
            done = m
            v, cv = rows[:m], crows[:m]
            t = v @ cv.T
            ev, y = torch.linalg.eigh((t + t.T) * 0.5)
        below = int((ev <= threshold).sum()) if not cheap and math.isfinite(threshold) else 0
        count = min(max(want, below + 1), m)
        extra = min(count + 1, m)
        if cheap:
            order = torch.argsort(theta := (u * cu).sum(1))
            theta, u, cu = theta[order], u[order], cu[order]
        else:
            yt = y[:, :extra].T
            theta, u, cu = ev[:extra], yt @ v, yt @ cv
        resid = torch.linalg.vector_norm(cu - theta[:, None] * u, dim=1)
        th, rs = theta.cpu().tolist(), resid.cpu().tolist()
        ok = _accept(th, rs, count, max(vectors, below), tight, value_tol, lam_max)
        theta, u = theta[:count], u[:count].T
        worst = max(rs[:count]) / lam_max
        if ok and (below < count or m >= dim):
            return theta, u, True, worst, j + 1, _cluster(theta, 1e-10 * lam_max)
        if last:
            break
    return theta, u, False, worst, blocks, 0


def _accept(theta, resid, count, n_tight, tight, value_tol, lam_max) -> bool:
    """Whether the first ``count`` Ritz pairs pass (``_krylov``'s rule; ``count + 1`` given)."""
    for i in range(count):
        r = resid[i]
        if i < n_tight:
            if r > tight * lam_max:
                return False
            continue
        # the gap to the neighbours less their residuals; none above: the linear bound alone
        gap = theta[i + 1] - theta[i] - resid[i + 1] if i + 1 < len(theta) else 0.0
        if i > 0:
            gap = min(gap, theta[i] - theta[i - 1] - resid[i - 1])
        if (min(r, r * r / gap) if gap > 0 else r) > value_tol(theta[i]):
            return False
    return True


def _cluster(values: torch.Tensor, width: float) -> int:
    """The largest number of (sorted) values within ``width`` of one of them."""
    v = values.reshape(-1, 1).cpu()
    return int(((v.T - v).abs() <= width).sum(dim=1).max()) if v.numel() else 0
