"""The adapters: one file per kind of loop, each plain calls into the engine.

* :mod:`normscope.adapters.lightning` -- :class:`DeadDirectionMonitor`,
  :class:`SignMagnitudeMonitor` (Lightning ``Callback`` s; also under ``fabric.call``);
* :mod:`normscope.adapters.fabric` -- :func:`watch_fabric` and the ``fabric.call`` path;
* :mod:`normscope.adapters.transformers` -- Hugging Face ``TrainerCallback`` s.

A plain PyTorch loop needs no adapter: :class:`normscope.engine.Monitor` directly.
"""
