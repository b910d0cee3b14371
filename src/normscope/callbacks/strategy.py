"""Strategy and compile helpers: which strategies a monitor reads, and compiled models."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from lightning.pytorch.strategies import (
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    Strategy,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException

__all__ = ["check_strategy", "compiled", "eager_forwards"]

_SINGLE_AND_DDP = "a single device; DDP (DDPStrategy: strategy='ddp', 'ddp_spawn', 'ddp_fork')"
_FSDP2 = (
    "FSDP2 (ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1), with "
    "torch.distributed.fsdp.fully_shard applied in configure_model)"
)
_REFUSED: tuple[tuple[type[Strategy], str], ...] = (
    (
        DeepSpeedStrategy,
        "ZeRO stage 3 partitions every parameter, so a gamma is not whole where the monitor reads "
        "it, and no DeepSpeed stage has been tested with normscope",
    ),
    (
        FSDPStrategy,
        "FSDP1 (FullyShardedDataParallel) keeps each gamma in flat shards outside the forward, "
        "where the monitor reads it (Lightning also runs it on CUDA only, where it is untested)",
    ),
)


def check_strategy(strategy: Strategy, monitor: str, *, fsdp2: bool = True) -> None:
    """Refuse, at ``setup``, a strategy whose parameters the monitor cannot read whole.

    Args:
        strategy: ``trainer.strategy``.
        monitor: the monitor's name, for the message.
        fsdp2: whether the monitor reads FSDP2 (DTensor-sharded) parameters; if not,
            ``ModelParallelStrategy`` is refused too.

    Raises:
        MisconfigurationException: naming the strategy, why, and what is supported.

    Example::

        from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
        check_strategy(DDPStrategy(), "DeadDirectionMonitor")   # passes
        check_strategy(FSDPStrategy(), "DeadDirectionMonitor")  # MisconfigurationException:
        # "DeadDirectionMonitor: FSDPStrategy is not supported: FSDP1 ... Supported: ..."
    """
    refused = list(_REFUSED)
    if not fsdp2:
        refused.append(
            (
                ModelParallelStrategy,
                "its weight and probe reads take whole nn.Linear weights, and FSDP2 / tensor "
                "parallelism shard them as DTensors",
            )
        )
    elif isinstance(strategy, ModelParallelStrategy) and _tensor_parallel_size(strategy) > 1:
        refused.append(
            (
                ModelParallelStrategy,
                "tensor parallelism is untested: the reads reduce over every process, so rows "
                "that tensor-parallel peers share would be counted once per peer",
            )
        )
    supported = f"{_SINGLE_AND_DDP}; {_FSDP2}" if fsdp2 else _SINGLE_AND_DDP
    for cls, why in refused:
        if isinstance(strategy, cls):
            raise MisconfigurationException(
                f"{monitor}: {type(strategy).__name__} is not supported: {why}. Supported: "
                f"{supported}."
            )


def compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a submodule is ``torch.compile``d: Lightning's
    ``trainer.fit(torch.compile(model))``, ``self.model = torch.compile(...)`` (an
    ``OptimizedModule``) or ``module.compile()`` in place.

    Why it matters: dynamo caches the graph of the first compiled forward, and a forward traced
    with the gate open breaks its graph at every hooked module (the fold runs eagerly). Traced
    closed first, the model compiles whole and the open gate adds a second, cached graph for the
    sampled steps only; traced open first, the broken graph is what every step runs. So on a
    compiled model the baseline window is the second optimiser step, not the first."""
    if getattr(module, "_compiler_ctx", None) is not None:
        return True
    optimized = getattr(torch._dynamo, "OptimizedModule", ())
    return any(
        isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


def _tensor_parallel_size(strategy: ModelParallelStrategy) -> int:
    try:
        return int(strategy.device_mesh["tensor_parallel"].size())
    except (RuntimeError, KeyError):  # no mesh yet: the size asked for ("auto": devices per node)
        size = strategy._tensor_parallel_size
        return size if isinstance(size, int) else 2


@contextlib.contextmanager
def eager_forwards() -> Iterator[None]:
    """Run the forwards inside eagerly, even those of a ``torch.compile``d model: the monitor's
    own forwards (the residual discovery forward, whose temporary hooks compare tensor
    identities) must never be traced by dynamo, nor add graphs to the training cache."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    if set_stance is None:  # pragma: no cover - older torch
        with torch._dynamo.config.patch(disable=True):
            yield
        return
    with set_stance("force_eager"):
        yield
