"""Finding a model's block stack: containers whose children all share one class.

Shared by the residual-point discovery (:mod:`normscope.taps.residual`), which looks at every
``nn.ModuleList``/``nn.Sequential`` of same-class blocks, and the sign–magnitude family's
:func:`~normscope.families.sign_magnitude.find_block_linears`, which takes the longest
``nn.ModuleList`` of them. Each caller passes its own ``kinds`` and ``exclude_children``.

Example::

    >>> from torch import nn
    >>> from normscope.taps.stacks import longest_stack, same_class_stacks
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.ReLU(), nn.ReLU(), nn.ReLU()]))
    >>> [path for path, _ in same_class_stacks(model)]
    ['1']
    >>> path, stack = longest_stack(same_class_stacks(model, kinds=(nn.ModuleList,)))
    >>> path, len(stack)
    ('1', 3)
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["longest_stack", "same_class_stacks"]


def same_class_stacks(
    model: nn.Module,
    kinds: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.Sequential),
    exclude_children: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict),
) -> list[tuple[str, nn.Module]]:
    """Every non-empty module of one of ``kinds`` whose children all have exactly one class,
    as ``(path, module)`` in :meth:`~torch.nn.Module.named_modules` order.

    A stack whose children's class is a subclass of one of ``exclude_children`` (a list of
    lists, say) is left out; ``exclude_children=()`` keeps it."""
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if not isinstance(module, kinds) or len(module) == 0:
            continue
        children = list(module.children())
        cls = type(children[0])
        if issubclass(cls, exclude_children) or any(type(c) is not cls for c in children):
            continue
        found.append((path, module))
    return found


def longest_stack(
    stacks: Sequence[tuple[str, nn.Module]],
) -> tuple[str, nn.Module] | None:
    """The stack with the most children (the first of equally long ones); ``None`` if none."""
    best: tuple[str, nn.Module] | None = None
    for path, module in stacks:
        if best is None or len(module) > len(best[1]):
            best = (path, module)
    return best
