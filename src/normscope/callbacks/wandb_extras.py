"""What a W&B run gets beyond scalars: how run-level keys summarise, the bottom of each
spectrum, the depth profile -- at a cadence that does not flood the run's media.

**Summaries** (:func:`define_summaries`, once per run, at the first read): W&B's summary of a
key is its last value unless ``define_metric`` says otherwise. The run-level keys that are
minima or maxima over layers summarise as the run's minimum or maximum (:data:`SUMMARIES`:
``dd/sigma_min_ratio_min`` -> ``min``, ``dd/rows_rejected`` -> ``max`` ...), so the run table
and the sweep view show the worst read of the run, not the last one; their step axis is
``trainer/global_step`` (Lightning's).

**Charts** (:func:`log_wandb_extras`): the table of each norm's bottom eigenvalues
(``dd/spectrum_bottom``) and the line chart of the sigma_min ratio against depth
(``dd/sigma_min_profile``) are media: two per call. They are logged at the first read and then
every ``every``-th read (``DeadDirectionMonitor.charts_every_n_reads``, 10), not at every read.

**Workspace layout.** Every key keeps its ``dd/`` or ``sm/`` prefix (a named monitor's
``dd[name]/``: :mod:`normscope.monitors.names`), so W&B's default workspace puts each family --
each monitor -- in one section; the run-level keys (``dd/<metric>``) are the ones to
pin. For a deep model pass ``log_per_layer=k`` to the monitor (the ``k`` worst layers and every
run-level key; :mod:`normscope.integrations.layers`), and filter panels by metric with a regex
in the workspace search (``dd/.*/sigma_min_ratio``, ``dd/.*/kernel_residual``).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from normscope.monitors.dead_direction import DeadDirectionReport, key_path
from normscope.monitors.names import named_key, parse_family

__all__ = ["SUMMARIES", "define_summaries", "log_wandb_extras"]

#: run-level key -> W&B summary ("min" / "max" over the run)
SUMMARIES: dict[str, str] = {
    "dd/sigma_min_ratio_min": "min",
    "dd/sigma_min_step_min": "min",
    "dd/gamma_alignment_min": "min",
    "dd/rows_rejected": "max",
    "dd/reads_disabled": "max",
    "sm/max_leverage_max": "max",
    "sm/sign_churn_mean": "max",
    "sm/reads_disabled": "max",
}

_STEP = "trainer/global_step"
# (run id, family head) pairs whose summaries are defined: per family, so that a second
# monitor in the same run (an sm next to a dd, a dd[fast] next to a dd) gets its own
_DEFINED: set[tuple[str, str]] = set()
# (run id, family head) -> that family's smallest sigma_min_ratio_min so far
_RUN_MIN: dict[tuple[str, str], float] = {}


def _run_key(run: Any) -> str:
    return str(getattr(run, "id", None) or id(run))


def _wandb_run_of(logger: Any) -> tuple[Any, str | None]:
    """The W&B run a logger writes to and its step key: a Lightning ``WandbLogger``
    (``trainer/global_step``), or a plain-loop ``log=`` of ``wandb.log`` / ``run.log`` (W&B's
    own step); ``(None, None)`` for anything else. Never imports wandb itself."""
    from lightning.pytorch.loggers import WandbLogger

    if isinstance(logger, WandbLogger):
        return logger.experiment, _STEP
    fn = getattr(logger, "fn", None)  # normscope.integrations.CallableLogger
    if fn is None or not (getattr(fn, "__module__", "") or "").startswith("wandb"):
        return None, None
    owner = getattr(fn, "__self__", None)
    if owner is not None and hasattr(owner, "define_metric"):
        return owner, None  # run.log
    wandb = sys.modules.get("wandb")
    return (getattr(wandb, "run", None), None) if wandb is not None else (None, None)


def define_summaries(logger: Any, metrics: dict[str, float]) -> None:
    """``define_metric`` for the run-level keys of :data:`SUMMARIES`, once per W&B run and
    family (``dd``, ``sm``, a named monitor's ``dd[fast]``: ``dd[fast]/sigma_min_ratio_min``
    summarises as a minimum too), on a Lightning ``WandbLogger``'s run or the run of a
    plain-loop ``log=wandb.log`` (a no-op for other loggers)."""
    run, step_metric = _wandb_run_of(logger)
    if run is None:
        return
    key = _run_key(run)
    for head in sorted({k.split("/", 1)[0] for k in metrics}):
        family, name, source = parse_family(head)
        if family is None or source is not None or (key, head) in _DEFINED:
            continue
        for metric, summary in SUMMARIES.items():
            if metric.split("/", 1)[0] != family:
                continue
            metric = named_key(metric, name)
            if step_metric is None:
                run.define_metric(metric, summary=summary)
            else:
                run.define_metric(metric, step_metric=step_metric, summary=summary)
        _DEFINED.add((key, head))


def _charts_due(reads: int | None, every: int) -> bool:
    return reads is None or every <= 1 or (reads - 1) % every == 0


def log_wandb_extras(
    trainer: Any,
    report: DeadDirectionReport,
    step: int,
    *,
    reads: int | None = None,
    every: int = 10,
    name: str | None = None,
) -> None:
    """For each attached ``WandbLogger``: ``dd/worst_point`` in the summary (the point of the
    run's smallest ratio so far), and, at the first read and every ``every``-th one (``reads``
    counts from 1; ``None``: now), a table of each norm's bottom eigenvalues
    (``dd/spectrum_bottom``) and a line chart of the sigma_min ratio against depth
    (``dd/sigma_min_profile``) with the ratio-1 floor drawn as a second series. A named
    monitor's (``name``) go under ``dd[name]/...``, its own worst point too."""
    from lightning.pytorch.loggers import WandbLogger

    runs = [lg.experiment for lg in trainer.loggers if isinstance(lg, WandbLogger)]
    if not runs:
        return
    profile = report.profile
    for run in runs:
        ratio = profile.sigma_min_ratio_min if profile is not None else math.nan
        key = (_run_key(run), named_key("dd/", name)[:-1])
        if math.isfinite(ratio) and ratio < _RUN_MIN.get(key, math.inf):
            _RUN_MIN[key] = ratio
            run.summary[named_key("dd/worst_point", name)] = key_path(profile.worst_point or "")
            run.summary[named_key("dd/worst_point_step", name)] = step
    if not _charts_due(reads, every):
        return
    import wandb

    payload: dict[str, Any] = {}
    spectrum = wandb.Table(columns=["layer", "k", "eigenvalue_over_top"])
    for layer, norm in report.norms.items():
        for k, value in enumerate(norm.kernel.bottom_eigenvalues):
            spectrum.add_data(layer, k + 1, float(value))
    payload[named_key("dd/spectrum_bottom", name)] = spectrum
    if profile is not None:
        xs = list(range(len(profile.points)))
        ratios = [
            p.sigma_min_ratio if math.isfinite(p.sigma_min_ratio) else None for p in profile.points
        ]
        payload[named_key("dd/sigma_min_profile", name)] = wandb.plot.line_series(
            xs=xs,
            ys=[[r if r is not None else float("nan") for r in ratios], [1.0] * len(xs)],
            keys=["sigma_min_ratio", "floor (1.0)"],
            title=f"sigma_min ratio against depth (step {step})",
            xname="residual point (depth)",
        )
    for run in runs:
        run.log({**payload, _STEP: step})
