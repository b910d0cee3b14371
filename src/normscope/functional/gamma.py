"""The gamma read of one norm layer (docs/metrics.md §1.1) and the argument checks every read
shares: parameters only, no rows.

A LayerNorm outputs ``y = gamma * z + beta`` with ``sum_i z_i = 0``, so ``v* = gamma^-1 / ||gamma^-1||``
is an exact kernel direction of its output covariance; :func:`gamma_read` computes ``v*`` (undefined
with dead channels, whose ``e_i`` span the kernel instead: :func:`predicted_kernel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["GammaRead", "as_float64", "gamma_read", "gamma_reads", "predicted_kernel"]

_NAN = math.nan


# ------------------------------------------------------------------- argument checks
def _real_tensor(x: object, where: str, what: str, ok: bool, expected: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not ok or x.is_complex():
        got = f"shape {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x)
        raise ValueError(f"{where}: {what} must be a real {expected}, got {got}")
    return as_float64(x)


def as_float64(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached and in float64: ``x`` itself when it already is (no op, no copy; the
    reads never write into what they are given)."""
    if x.requires_grad:
        x = x.detach()
    return x if x.dtype == torch.float64 else x.to(torch.float64)


def square_matrix(matrix: torch.Tensor, where: str, what: str) -> torch.Tensor:
    """``matrix`` as float64 (:func:`as_float64`), or a ValueError saying a square ``(d, d)``
    tensor is expected."""
    ok = isinstance(matrix, torch.Tensor) and matrix.ndim == 2
    ok = ok and matrix.shape[0] == matrix.shape[1] > 0
    return _real_tensor(matrix, where, what, ok, "square (d, d) tensor with d >= 1")


def gamma_vector(gamma: torch.Tensor, where: str) -> torch.Tensor:
    """``gamma`` as float64 (:func:`as_float64`), or a ValueError saying a non-empty ``(d,)``
    tensor is expected."""
    ok = isinstance(gamma, torch.Tensor) and gamma.ndim == 1 and gamma.numel() > 0
    return _real_tensor(gamma, where, "gamma", ok, "non-empty 1-D tensor (d,)")


def row_count(n_rows: int, where: str) -> int:
    """``n_rows`` as an int >= 0 (Python, numpy or 0-d integer tensor), else a ValueError."""
    if isinstance(n_rows, torch.Tensor) and n_rows.ndim == 0 and not n_rows.is_floating_point():
        n_rows = int(n_rows)
    if isinstance(n_rows, bool) or not hasattr(n_rows, "__index__") or int(n_rows) < 0:
        raise ValueError(f"{where}: n_rows must be an int >= 0, got {n_rows!r}")
    return int(n_rows)


# --------------------------------------------------------------------------- §1.1 gamma
@dataclass(frozen=True)
class GammaRead:
    """The gamma read of one norm layer (docs/metrics.md §1.1); parameters only.

    ``gamma_min``/``gamma_max`` are the signed extremes of ``gamma``; ``gamma_spread`` is
    ``std(gamma) / mean(|gamma|)`` with the population std (``ddof = 0``). With a non-finite
    ``gamma`` those three are NaN and ``dead_channels`` counts only the finite entries at or
    below the tolerance. ``dead_index``, ``v_star``, ``dim``, ``reason`` and
    ``dead_centring`` are not in :meth:`as_dict`.

    ``dead_centring`` is ``gamma^-1 / ||gamma^-1||`` when channels sit under the dead tolerance
    without being zero (``v_star`` is None there: the kernel reads use the ``e_i``), so the
    norm-type classifier can still read the centring along it (:attr:`centring_direction`).
    """

    dead_channels: int
    gamma_min: float
    gamma_max: float
    gamma_spread: float
    dead_index: tuple[int, ...]
    v_star: torch.Tensor | None
    reason: str | None
    dim: int
    dead_centring: torch.Tensor | None = None

    @property
    def centring_direction(self) -> torch.Tensor | None:
        """``gamma^-1 / ||gamma^-1||`` whenever every gain is finite and non-zero: ``v_star``,
        or ``dead_centring`` when some gains are under the dead tolerance; else None."""
        return self.v_star if self.v_star is not None else self.dead_centring

    def as_dict(self) -> dict[str, float]:
        return {
            "dead_channels": float(self.dead_channels),
            "gamma_min": self.gamma_min,
            "gamma_max": self.gamma_max,
            "gamma_spread": self.gamma_spread,
        }


def gamma_read(gamma: torch.Tensor, *, dead_tol: float = 1e-6) -> GammaRead:
    """Dead channels, the predicted direction ``v*`` and the spread of ``gamma``.

    Args:
        gamma: the norm's effective scale, shape ``(d,)`` (any float dtype; read in float64).
        dead_tol: channel ``i`` is dead when ``|gamma_i| <= dead_tol * max|gamma|``.

    Returns:
        A :class:`GammaRead`; ``v_star`` (float64 ``(d,)``, on ``gamma``'s device) is
        ``gamma^-1 / ||gamma^-1||`` when no channel is dead and ``gamma`` is finite, else None.

    Example::

        >>> import torch
        >>> g = gamma_read(torch.tensor([1.0, 2.0, 0.0, 4.0]))
        >>> g.dead_channels, g.dead_index, g.v_star is None, g.reason
        (1, (2,), True, 'dead_channels')
        >>> gamma_read(torch.tensor([1.0, 1.0])).v_star
        tensor([0.7071, 0.7071], dtype=torch.float64)
    """
    if not (isinstance(dead_tol, (int, float)) and math.isfinite(dead_tol) and dead_tol >= 0):
        raise ValueError(f"gamma_read: dead_tol must be a finite number >= 0, got {dead_tol!r}")
    g = gamma_vector(gamma, "gamma_read")
    d = g.numel()
    mag = g.abs()
    finite = torch.isfinite(g)
    top = mag.max()
    dead_mask = mag <= dead_tol * top
    # every number of the read in one copy to the host (the dead channels' indices only
    # when there are any): [finite, dead count, min, max, std, mean |gamma|]
    stats = torch.stack(
        [finite.all(), dead_mask.sum(), g.min(), g.max(), g.std(correction=0), mag.mean()]
    ).tolist()
    all_finite, n_dead, gmin, gmax, std, mabs = stats
    if not all_finite:
        top = mag[finite].max() if bool(finite.any()) else torch.zeros((), dtype=g.dtype)
        dead = torch.nonzero(finite & (mag <= dead_tol * top)).flatten().tolist()
        return GammaRead(len(dead), _NAN, _NAN, _NAN, tuple(dead), None, "non_finite_gamma", d)
    spread = std / mabs if mabs > 0 else _NAN
    if n_dead:
        dead = tuple(torch.nonzero(dead_mask).flatten().tolist())
        # gains under the tolerance but not zero: the centring along gamma^-1 is still read
        centring = None
        if bool((mag > 0).all()):
            inv = top / g
            centring = inv / torch.linalg.vector_norm(inv)
        return GammaRead(len(dead), gmin, gmax, spread, dead, None, "dead_channels", d, centring)
    # top / gamma lies in [1, 1/dead_tol] in magnitude: no overflow however small gamma is.
    inv = top / g
    return GammaRead(0, gmin, gmax, spread, (), inv / torch.linalg.vector_norm(inv), None, d)


def gamma_reads(gammas: list[torch.Tensor], *, dead_tol: float = 1e-6) -> list[GammaRead]:
    """:func:`gamma_read` of many norm layers at once: gains of the same width, dtype and
    device are stacked and their statistics (extremes, spread, finiteness, dead count) reach
    the host in one copy per group; ``v*`` is formed per layer exactly as :func:`gamma_read`
    forms it (the same float64 vector), and a layer with a dead or non-finite channel is read
    by :func:`gamma_read` itself. The same reads as one call each, ``gamma_spread`` within
    float64 rounding (a row of a stacked reduction may sum in another order).

    Example::

        >>> reads = gamma_reads([torch.tensor([1.0, 2.0, 0.0, 4.0]), torch.ones(4)])
        >>> [r.reason for r in reads], reads[1].gamma_spread
        (['dead_channels', None], 0.0)
    """
    if not (isinstance(dead_tol, (int, float)) and math.isfinite(dead_tol) and dead_tol >= 0):
        raise ValueError(f"gamma_reads: dead_tol must be a finite number >= 0, got {dead_tol!r}")
    gs = [gamma_vector(g, "gamma_reads") for g in gammas]
    out: list[GammaRead | None] = [None] * len(gs)
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(gs):
        groups.setdefault((g.shape, g.device), []).append(i)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = gamma_read(gs[idx[0]], dead_tol=dead_tol)
            continue
        g = torch.stack([gs[i] for i in idx])
        mag = g.abs()
        top = mag.max(dim=1).values
        stats = torch.stack(
            [
                torch.isfinite(g).all(dim=1),
                (mag <= dead_tol * top[:, None]).sum(dim=1),
                g.min(dim=1).values,
                g.max(dim=1).values,
                g.std(dim=1, correction=0),
                mag.mean(dim=1),
            ]
        ).tolist()
        d = g.shape[1]
        for i, top_i, all_finite, n_dead, gmin, gmax, std, mabs in zip(idx, top.unbind(0), *stats):
            if not all_finite or n_dead:  # the rare reads: gamma_read's own path
                out[i] = gamma_read(gs[i], dead_tol=dead_tol)
                continue
            spread = std / mabs if mabs > 0 else _NAN
            inv = top_i / gs[i]  # as gamma_read: the same v*, to the last bit
            out[i] = GammaRead(
                0, gmin, gmax, spread, (), inv / torch.linalg.vector_norm(inv), None, d
            )
    return out  # type: ignore[return-value]


def predicted_kernel(
    gamma_or_read: torch.Tensor | GammaRead, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """The predicted kernel of a LayerNorm's output covariance as an orthonormal basis.

    Args:
        gamma_or_read: ``gamma`` ``(d,)`` or its :class:`GammaRead`.
        device: where the basis goes (default: ``v*``'s device, else the CPU).

    Returns:
        Float64 ``(d, k)``: ``v*`` as one column (``k = 1``) when no channel is dead; the unit
        vectors ``e_i`` of the dead channels (``k = dead_channels``) otherwise; ``(d, 0)`` when
        ``gamma`` is not finite (no prediction).

    Example::

        >>> predicted_kernel(torch.tensor([2.0, 0.0, 1.0])).T
        tensor([[0., 1., 0.]], dtype=torch.float64)
    """
    read = gamma_or_read if isinstance(gamma_or_read, GammaRead) else gamma_read(gamma_or_read)
    if read.v_star is not None:
        out = read.v_star.reshape(-1, 1)
        return out.to(device) if device is not None and out.device != device else out
    eye = torch.eye(read.dim, dtype=torch.float64, device=device)
    if read.reason == "non_finite_gamma":
        return eye[:, :0]
    return eye[:, list(read.dead_index)]


def resolve_gamma(gamma: torch.Tensor | GammaRead, d: int, where: str) -> GammaRead:
    read = gamma if isinstance(gamma, GammaRead) else gamma_read(gamma)
    if read.dim != d:
        raise ValueError(
            f"{where}: gamma has {read.dim} entries, the covariance is {d} x {d}; they must match"
        )
    return read
