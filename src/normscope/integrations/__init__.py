"""normscope beyond the Lightning ``Trainer``: one engine, thin adapters.

* :class:`Watch` -- any loop you wrote (plain PyTorch, Fabric): say when a step starts and when
  the optimiser stepped; the trackers' ``step()`` context manager is a shortcut to it.
* :mod:`normscope.integrations.fabric` -- ``Fabric(callbacks=[monitor])`` or :func:`watch_fabric`.
* :mod:`normscope.integrations.transformers` -- Hugging Face ``TrainerCallback`` s
  (``DeadDirectionCallback``, ``SignMagnitudeCallback``).

Each drives the same monitor methods the Lightning ``Trainer`` calls, so the reads, alerts and
fail-open guarantees are the same in every loop.
"""

from typing import Any

from normscope.integrations.loop import CallableLogger, LoopView, StepResult, Watch

__all__ = ["CallableLogger", "LoopView", "StepResult", "Watch", "watch_fabric"]


def __getattr__(name: str) -> Any:  # watch_fabric imports lightning.fabric: only when asked for
    if name == "watch_fabric":
        from normscope.integrations.fabric import watch_fabric

        return watch_fabric
    raise AttributeError(f"module 'normscope.integrations' has no attribute {name!r}")
