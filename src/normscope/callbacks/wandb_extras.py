"""What a W&B run gets beyond scalars: summaries, the bottom of each spectrum, the depth profile."""

from __future__ import annotations

import math
from typing import Any

from normscope.monitors.dead_direction import DeadDirectionReport, key_path

__all__ = ["log_wandb_extras"]


def log_wandb_extras(trainer: Any, report: DeadDirectionReport, step: int) -> None:
    """For each attached ``WandbLogger``: run summaries (``dd/sigma_min_ratio_min``,
    ``dd/worst_point``), a table of each norm's bottom eigenvalues (``dd/spectrum_bottom``), and a
    line chart of the sigma_min ratio against depth (``dd/sigma_min_profile``) with the ratio-1
    floor drawn as a second series. Keys stay under ``dd/`` so the default workspace shows
    them in the family's section."""
    from lightning.pytorch.loggers import WandbLogger

    runs = [lg.experiment for lg in trainer.loggers if isinstance(lg, WandbLogger)]
    if not runs:
        return
    import wandb

    payload: dict[str, Any] = {}
    spectrum = wandb.Table(columns=["layer", "k", "eigenvalue_over_top"])
    for name, norm in report.norms.items():
        for k, value in enumerate(norm.kernel.bottom_eigenvalues):
            spectrum.add_data(name, k + 1, float(value))
    payload["dd/spectrum_bottom"] = spectrum
    profile = report.profile
    if profile is not None:
        xs = list(range(len(profile.points)))
        ratios = [
            p.sigma_min_ratio if math.isfinite(p.sigma_min_ratio) else None for p in profile.points
        ]
        payload["dd/sigma_min_profile"] = wandb.plot.line_series(
            xs=xs,
            ys=[[r if r is not None else float("nan") for r in ratios], [1.0] * len(xs)],
            keys=["sigma_min_ratio", "floor (1.0)"],
            title=f"sigma_min ratio against depth (step {step})",
            xname="residual point (depth)",
        )
    for run in runs:
        run.log({**payload, "trainer/global_step": step})
        if profile is not None:
            run.summary["dd/sigma_min_ratio_min"] = profile.sigma_min_ratio_min
            run.summary["dd/worst_point"] = key_path(profile.worst_point or "")
