"""Where a norm sits, and which reads need it to sit before its sublayer (docs/metrics.md §1.3).

Several reads take the norm's *input* to be the residual stream: the depth of ``v*`` in it
(:func:`~normscope.functional.depth.direction_depth`, ``delta_gamma``), the Schur reads
(:func:`~normscope.functional.schur.schur_quotient`), the ``sigma_min`` profile and the
retention pencil between two residual points (:mod:`~normscope.functional.retention`). In a
**pre-norm** block
(``x + f(norm(x))``) that holds; in a **post-norm** block (``norm(x + f(x))``, BERT, the original
Transformer) the norm's input is a sum that never reaches the next block un-normalised, so those
reads have no premise. Given ``placement="post"`` they return NaN with the reason
``"post_norm"`` instead of a number that would look meaningful. The kernel reads (§1.2:
``gamma_alignment``, ``kernel_residual``, the classifier) hold for a LayerNorm anywhere and take
no placement.

Who decides the placement is the caller (the taps find it); these reads only accept it.
"""

from __future__ import annotations

import torch

__all__ = ["PLACEMENTS", "POST_NORM", "check_placement", "input_read_reason"]

PLACEMENTS = ("pre", "post")
POST_NORM = "post_norm"


def check_placement(placement: object, where: str) -> str:
    """``placement`` if it is ``"pre"`` or ``"post"``, else a ``ValueError`` naming ``where``.

    Example::

        >>> check_placement("post", "direction_depth")
        'post'
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"{where}: placement must be one of {PLACEMENTS}, got {placement!r}")
    return placement  # type: ignore[return-value]


def input_read_reason(
    placement: str,
    declared_kind: str | None,
    gamma_reason: str | None,
    n_rows: int,
    covariance: torch.Tensor,
) -> str | None:
    """Why a read of ``v*`` in a norm's input covariance (``schur_quotient``,
    ``direction_depth``) has no value, or None when it has one: ``"post_norm"``,
    ``"no_gamma_kernel"`` (an RMSNorm), the gamma's own reason (``non_finite_gamma``,
    ``dead_channels``), ``"insufficient_rows"`` (``n_rows < 2 d``),
    ``"non_finite_covariance"``, checked in that order.

    Example::

        >>> input_read_reason("pre", "rmsnorm", None, 64, torch.eye(4))
        'no_gamma_kernel'
        >>> input_read_reason("pre", "layernorm", None, 4, torch.eye(4)) is None
        False
    """
    if placement == "post":
        return POST_NORM
    if declared_kind == "rmsnorm":
        return "no_gamma_kernel"
    if gamma_reason is not None:  # non_finite_gamma or dead_channels: no v*
        return gamma_reason
    if n_rows < 2 * covariance.shape[0]:
        return "insufficient_rows"
    if not bool(torch.isfinite(covariance).all()):
        return "non_finite_covariance"
    return None
