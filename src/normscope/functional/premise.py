"""Where a norm sits, and which reads need it to sit before its sublayer (docs/metrics.md §1.3).

Several reads take the norm's *input* to be the residual stream: the depth of ``v*`` in it
(:func:`~normscope.functional.depth.direction_depth`, ``delta_gamma``), the Schur reads
(:func:`~normscope.functional.schur.schur_quotient`) and the cancellation reads between two
residual points (:mod:`~normscope.functional.cancellation`). In a **pre-norm** block
(``x + f(norm(x))``) that holds; in a **post-norm** block (``norm(x + f(x))``, BERT, the original
Transformer) the norm's input is a sum that never reaches the next block un-normalised, so those
reads have no premise. Given ``placement="post"`` they return NaN with the reason
``"post_norm"`` instead of a number that would look meaningful. The kernel reads (§1.2:
``gamma_alignment``, ``kernel_residual``, the classifier) hold for a LayerNorm anywhere and take
no placement.

Who decides the placement is the caller (the taps find it); these reads only accept it.
"""

from __future__ import annotations

__all__ = ["PLACEMENTS", "POST_NORM", "check_placement"]

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
