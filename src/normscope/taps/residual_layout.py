"""The records of residual discovery: its error, one stream point, and a model's layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from normscope._common import NormscopeError

__all__ = ["ResidualDiscoveryError", "ResidualLayout", "ResidualPoint"]

_FOUND_FROM = "found from the "


class ResidualDiscoveryError(NormscopeError, ValueError):
    """No block stack, or a forward pass that does not run one in sequence."""


@dataclass(frozen=True)
class ResidualPoint:
    """One point of the residual stream.

    Args:
        name: stable label for metric keys: the path of the module whose input it is, or
            ``"<block path>.output"``.
        module_name: path of the module to hook.
        where: ``"input"`` (forward pre-hook, :func:`~normscope.taps.hooks.tap_input`) or ``"output"`` (forward hook,
            :func:`~normscope.taps.hooks.tap_output`).
        sublayer: what lies between the previous point and this one: ``"attn"``, ``"mlp"`` or
            ``"block"``; ``None`` for ``p_0``.
        depth: ``0 .. L``.
        readers: every norm whose input is this tensor (two for a GPT-NeoX parallel block).
        sublayer_module: the module whose output the step into this point added (the sublayer
            itself, ``h.2.mlp``: what an alert names); None for ``p_0`` and when discovery
            could not match the step to one module.
    """

    name: str
    module_name: str
    where: str
    sublayer: str | None
    depth: int
    readers: tuple[str, ...] = ()
    sublayer_module: str | None = None


@dataclass(frozen=True)
class ResidualLayout:
    """The residual points of a model and how they were found.

    Args:
        points: ``p_0 .. p_L`` in forward order.
        style: see :mod:`normscope.taps.residual` (``"pre-norm"``, ``"sandwich"``, ``"parallel"``,
            ``"post-norm"``, ``"other"``, ``"mixed"``).
        blocks: block module paths, in order.
        final_norm: path of the norm after the stack, if one reads the last block's output.
        notes: plain statements a report should show (post-norm caveat, branch norms...).
        branch_norms: norms inside blocks that read a branch, not the stream.
        fallback: why the points are the block boundaries although norms read the stream (a
            sublayer could not be told apart, e.g. ``x + x @ A + attn(ln(x))``: the matmul is no
            module); ``None`` when each sublayer was found. Also the first of ``notes``.
    """

    points: tuple[ResidualPoint, ...]
    style: str
    blocks: tuple[str, ...]
    final_norm: str | None
    notes: tuple[str, ...]
    branch_norms: tuple[str, ...] = ()
    fallback: str | None = None

    def found_from(self, listed: int, total: int) -> ResidualLayout:
        """This layout, with a note when it was found from ``listed`` of the model's ``total``
        norm layers (``layers=[...]``): the points and the style notes then know only those.
        Once: a layout that has the note already is returned as it is (a tracker hooked again)."""
        if listed >= total or any(n.startswith(_FOUND_FROM) for n in self.notes):
            return self
        note = (
            f"{_FOUND_FROM}{listed} listed norm layers of the model's {total} (layers=): a "
            "block none of whose norms is listed is read at its boundary, and the other notes "
            "speak of the listed norms only"
        )
        return dataclasses.replace(self, notes=(*self.notes, note))
