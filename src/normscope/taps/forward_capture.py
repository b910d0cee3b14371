"""The model's real training forward, seen once: which module the training step called, with
what -- so that a read can replay it (on a few samples) where the model has no ``forward()`` of
its own.

The usual Lightning wrapper holds a Hugging Face model and calls ``self.model(**batch)`` in
``training_step``; calling the wrapper itself fails (``_forward_unimplemented``). Like residual
discovery (:class:`~normscope.taps.residual.ResidualDiscovery`), a :class:`ForwardCapture`
watches the training step's own forward instead of guessing one: forward pre-hooks on every
module record the first call that runs -- the outermost module the step called, and its
arguments -- and remove themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["CapturedCall", "ForwardCapture", "has_own_forward", "inner_model"]


def has_own_forward(model: nn.Module) -> bool:
    """Whether ``model`` (or the model a ``torch.compile`` wrapper holds) defines ``forward()``:
    a ``LightningModule`` that only has a ``training_step`` does not (``LightningModule.forward`` passes the call on to
    ``nn.Module``'s, which raises ``_forward_unimplemented``).

    Example::

        >>> has_own_forward(nn.Linear(2, 2)), has_own_forward(nn.Module())
        (True, False)
    """
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the model it compiled
    forward = type(model).forward
    return forward is not nn.Module.forward and forward.__qualname__ not in _PASS_THROUGH


#: the ``forward`` of a base class that only hands the call on to ``nn.Module.forward``
_PASS_THROUGH = ("LightningModule.forward",)


def inner_model(model: nn.Module) -> nn.Module:
    """The module a forward of ``model`` should run through: ``model`` itself when it has its
    own ``forward()``, else (the usual wrapper: a ``LightningModule`` holding a Hugging Face
    model as ``self.model`` and calling it in ``training_step``) its direct child with a
    ``forward()`` of its own that holds the most parameters; ``model`` when it has none.

    Example::

        >>> class Wrapper(nn.Module):  # no forward(), like a LightningModule with only a training_step
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.model, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        >>> w = Wrapper()
        >>> inner_model(w) is w.model, inner_model(w.model) is w.model
        (True, True)
    """
    if has_own_forward(model):
        return model
    children = [c for _, c in model.named_children() if has_own_forward(c)]
    if not children:
        return model
    return max(children, key=lambda c: sum(p.numel() for p in c.parameters()))


@dataclass
class CapturedCall:
    """One forward call: the module's path in the model (``""``: the model itself) and the
    arguments it was given (as ``keep`` returned them)."""

    path: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def replay(self, model: nn.Module, convert: Callable[[Any], Any] = lambda x: x) -> Any:
        """Call the same module of ``model`` again with the same arguments (through
        ``convert``: e.g. moved to the model's device)."""
        return model.get_submodule(self.path)(*convert(self.args), **convert(self.kwargs))


class ForwardCapture:
    """Record the next forward call that runs inside ``model``: its outermost module and its
    arguments (passed through ``keep``, e.g. cut to a few samples on the CPU).

    Args:
        model: the model whose modules are watched (a ``LightningModule`` is fine).
        keep: applied to the call's ``args`` tuple and ``kwargs`` dict before they are kept.

    Example::

        capture = ForwardCapture(pl_module).install()
        pl_module.training_step(batch, 0)     # runs self.model(**batch)
        capture.remove()
        capture.call.path                     # "model"
        capture.call.replay(pl_module)        # the same forward again
    """

    def __init__(self, model: nn.Module, keep: Callable[[Any], Any] = lambda x: x) -> None:
        self.model = model
        self.keep = keep
        self.call: CapturedCall | None = None
        self._handles: list[Any] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> ForwardCapture:
        """Register the temporary pre-hooks (once); the next forward is recorded."""
        if not self._handles and self.call is None:
            self._handles = [
                module.register_forward_pre_hook(self._hook(path), with_kwargs=True)
                for path, module in self.model.named_modules()
            ]
        return self

    def _hook(self, path: str) -> Callable[[nn.Module, tuple, dict], None]:
        def seen(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.call is None:
                self.call = CapturedCall(path, self.keep(args), self.keep(dict(kwargs)))
            self.remove()  # the hooks of this call were listed before it ran: safe here

        return seen

    def remove(self) -> None:
        """Remove the pre-hooks (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
