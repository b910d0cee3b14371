"""``scan_model``: the dead-direction reads of a model on a few batches, in plain PyTorch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from normscope.families.dead_direction.config import DeadDirectionConfig
from normscope.families.dead_direction.report import DeadDirectionReport
from normscope.families.dead_direction.tracker import DeadDirectionTracker
from normscope.taps.hooks import batch_mask, call_model
from normscope.taps.sources import resolve_labels

__all__ = ["scan_model"]


@torch.no_grad()
def scan_model(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    layers: str | Sequence[str] = "auto",
    residual: bool = True,
    max_rows_per_batch: int | None = None,
    null_tol: float = 1e-10,
    max_memory: int | None = None,
    sources: Any = None,
) -> DeadDirectionReport:
    """Every dead-direction read of ``model`` on ``batches`` (forward passes only, no grad).

    Args:
        model: any ``nn.Module`` (a Hugging Face model, a model you wrote).
        batches: an iterable of batches: dicts of model keyword arguments (an
            ``attention_mask`` there excludes padding from every accumulator), ``(inputs, ...)``
            tuples, or input tensors.
        layers: ``"auto"`` or a list of norm module paths.
        residual: also read the residual stream's ``sigma_min`` depth profile.
        max_rows_per_batch: rows kept per tapped tensor per batch (``None``: all).
        null_tol: ``tau`` of ``null_dim``.
        max_memory: byte budget for the accumulators (``8 d^2`` per tapped tensor), as the
            monitor's: over it, points and layers are read at a stride over depth and a warning
            names what was left out (those are missing from the report).
        sources: name each batch's (or each sample's) source, as the tracker's ``sources=``:
            ``fn(batch) -> str``, ``fn(batch) -> labels per sample``, or a batch field name.
            The report then holds a profile per source (``report.sources``,
            ``dd.<source>/<point>/<metric>``) and the classification of every collapse
            (``report.collapses``, ``dd/collapse_class``); the pooled keys are unchanged.

    Returns:
        a :class:`DeadDirectionReport`; ``report.as_dict()`` is keyed exactly like the monitor's
        log (``dd/<module path>/<metric>``, ``dd/<metric>``).

    Example::

        >>> from normscope import scan_model
        >>> report = scan_model(model, [{"input_ids": ids, "attention_mask": mask}])  # doctest: +SKIP
        >>> report.norms["transformer.ln_f"].kernel.gamma_alignment  # doctest: +SKIP
        0.99999...
    """
    batches = list(batches)
    if not batches:
        raise ValueError("scan_model: no batches given (pass at least one batch of inputs)")
    was_training = model.training
    model.eval()
    labels: list[Any] = [None] * len(batches)
    if sources is not None:
        labels = [resolve_labels(sources, b) for b in batches]  # a bad spec raises here
    names = {n for lab in labels if lab is not None for n in lab.names}
    config = DeadDirectionConfig(
        layers=layers,
        residual=residual,
        rows_per_read="all" if max_rows_per_batch is None else max_rows_per_batch,
        null_tol=null_tol,
        max_memory=max_memory,
        sources=sources,
        max_sources=max(len(names), 1),
    )
    tracker = DeadDirectionTracker(config, model)
    drop = (sources,) if isinstance(sources, str) else ()  # a label field is no model input
    try:
        tracker.attach(forward=lambda: call_model(model, batches[0], drop))
        for batch, label in zip(batches, labels):
            if label is not None and tracker.split is not None:
                tracker.split.ensure(label.names)
            else:
                label = None
            with tracker.gate.sampling(mask=batch_mask(batch), sources=label):
                call_model(model, batch, drop)
        return tracker.read(step=0, reduce=False)
    finally:
        tracker.detach()
        model.train(was_training)
