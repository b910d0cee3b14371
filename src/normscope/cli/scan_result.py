"""The scan as plain data (what ``report.json`` holds, its default alerts) and its files on disk."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import normscope
from normscope.alerts import Alert, default_dead_direction_rules
from normscope.cli import plots, render, spectrum_plots
from normscope.cli.loaded import LoadedModel
from normscope.families.dead_direction.report import DeadDirectionReport

__all__ = ["PLOTS", "default_alerts", "scan_result", "write_scan_outputs"]

PLOTS = {
    "sigma_min_profile.png": "sigma_min ratio against depth",
    "alignment.png": "gamma_alignment and kernel_residual per layer",
    "spectrum.png": "bottom of each norm's eigen-spectrum",
    "gamma.png": "gamma distributions",
}


def default_alerts(report: DeadDirectionReport) -> list[Alert]:
    """The monitor's default rules on the scan's one read (no sigma_min rule on post-norm
    models, whose profile the theory does not cover)."""
    metrics = report.as_dict()
    sublayers = None
    if report.profile is not None and (report.layout is None or report.layout.style != "post-norm"):
        sublayers = {p.name: p.sublayer for p in report.profile.points}
    rules = default_dead_direction_rules(
        {name: n.kind for name, n in report.norms.items()}, sublayers, sources=bool(report.sources)
    )
    return [a for rule in rules for a in rule.evaluate(metrics, 0)]


def _num(value: Any) -> float | None:
    """A float for JSON: NaN and infinities become None."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _point_json(p: Any, **extra: Any) -> dict[str, Any]:
    """One residual point of a profile for ``report.json`` (``extra`` after the ratios)."""
    return {
        "name": p.name,
        "depth": p.depth,
        "sublayer": p.sublayer,
        "sigma_min": _num(p.sigma_min),
        "sigma_min_ratio": _num(p.sigma_min_ratio),
        "sigma_min_step": _num(p.sigma_min_step),
        **extra,
        "n_rows": p.n_rows,
        "reason": p.reason,
    }


def scan_result(
    loaded: LoadedModel,
    report: DeadDirectionReport,
    twin: DeadDirectionReport | None,
    data: Any,
    args: argparse.Namespace,
    notes: list[str],
) -> dict[str, Any]:
    """The scan as plain data: what ``report.json`` holds and every renderer reads."""
    norms = []
    for name, n in report.norms.items():
        t = twin.norms.get(name) if twin is not None else None
        norms.append(
            {
                "name": name,
                "kind": n.kind,
                "dim": n.gamma.dim,
                "gamma_min": _num(n.gamma.gamma_min),
                "gamma_max": _num(n.gamma.gamma_max),
                "gamma_spread": _num(n.gamma.gamma_spread),
                "dead_channels": n.gamma.dead_channels,
                "dead_index": list(n.gamma.dead_index),
                "gamma_alignment": _num(n.kernel.gamma_alignment),
                "kernel_residual": _num(n.kernel.kernel_residual),
                "null_dim": _num(n.kernel.null_dim),
                "subspace_alignment": _num(n.kernel.subspace_alignment),
                "live_floor": _num(n.kernel.live_floor),
                "norm_class": n.kernel.norm_class,
                "kind_mismatch": bool(n.kernel.kind_mismatch),
                "schur_quotient": _num(n.schur.schur_quotient),
                "schur_complement": _num(n.schur.schur_complement),
                # v*'s depth beyond the typical direction and the random-direction control
                "delta_gamma": _num(n.delta_gamma),
                "delta_gamma_control": _num(n.depth.control_delta_gamma),
                "depth": _num(n.depth.depth),
                "depth_sd": _num(n.depth.depth_sd),
                "live_dim": n.depth.live_dim,
                "kernel_alignment": _num(n.kernel.kernel_alignment),
                "delta_reason": n.depth.reason,
                "n_rows": n.n_rows,
                "bottom_eigenvalues": [_num(v) for v in n.kernel.bottom_eigenvalues],
                "reason": n.kernel.reason or n.depth.reason or n.gamma.reason,
                "baseline": None
                if t is None
                else {
                    "gamma_alignment": _num(t.kernel.gamma_alignment),
                    "kernel_residual": _num(t.kernel.kernel_residual),
                    "schur_quotient": _num(t.schur.schur_quotient),
                    "schur_complement": _num(t.schur.schur_complement),
                    "delta_gamma": _num(t.delta_gamma),
                },
            }
        )
    profile = []
    twin_points = {p.name: p for p in twin.profile.points} if twin and twin.profile else {}
    for p in report.profile.points if report.profile is not None else ():
        tp = twin_points.get(p.name)
        profile.append(
            {
                **_point_json(p),
                "baseline_ratio": _num(tp.sigma_min_ratio) if tp else None,
                "baseline_step": _num(tp.sigma_min_step) if tp else None,
            }
        )
    metrics = report.as_dict()
    layout = report.layout
    return {
        "command": "scan",
        "normscope_version": normscope.__version__,
        "model": {
            "name": loaded.name,
            "class": loaded.class_name,
            "source": loaded.source,
            "tokenizer": loaded.tokenizer_name,
        },
        "data": {
            "source": data.source,
            "tokens": data.tokens,
            "windows": data.windows,
            "seq_len": data.seq_len,
            "batches": len(data.batches),
        },
        "baseline": {
            "kind": args.baseline,
            "seed": args.seed if twin is not None else None,
            "how": loaded.twin_how if twin is not None else None,
        },
        "layout": None
        if layout is None
        else {"style": layout.style, "final_norm": layout.final_norm, "notes": list(layout.notes)},
        "norms": norms,
        "profile": profile,
        "summary": {
            "sigma_min_ratio_min": _num(metrics.get("dd/sigma_min_ratio_min")),
            "sigma_min_step_min": _num(metrics.get("dd/sigma_min_step_min")),
            "worst_point": report.profile.worst_point if report.profile is not None else None,
            "gamma_alignment_min": _num(metrics.get("dd/gamma_alignment_min")),
            "rows_rejected": report.rows_rejected,
        },
        "alerts": [a.as_dict() for a in default_alerts(report)],
        "sources": _sources_result(report),
        "collapses": [
            {
                "point": c.point,
                "depth": c.depth,
                "class": c.kind,
                "below": list(c.below),
                "above": list(c.above),
                "undecided": list(c.undecided),
                "pooled_below": c.pooled_below,
                "values": {s: _num(v) for s, v in c.values.items()},
            }
            for c in report.collapses
        ],
        "notes": notes + (list(layout.notes) if layout is not None else []),
        "failed_taps": dict(report.failed_taps),
        "metrics": {k: _num(v) for k, v in metrics.items()},
        "files": [],
    }


def _sources_result(report: DeadDirectionReport) -> dict[str, Any]:
    """Each source's profile, as the pooled ``profile`` entries (no baseline columns)."""
    out: dict[str, Any] = {}
    for name, profile in report.sources.items():
        out[name] = {
            "sigma_min_ratio_min": _num(profile.sigma_min_ratio_min),
            "worst_point": profile.worst_point,
            "n_rows": profile.points[0].n_rows if profile.points else 0,
            "reason": profile.reason,
            "profile": [_point_json(p) for p in profile.points],
        }
    return out


def write_scan_outputs(result: dict[str, Any], gammas: dict[str, Any], out: Path) -> None:
    """The four PNGs, ``report.md``, ``report.html`` and ``report.json`` into ``out``."""
    model = result["model"]["class"]
    style = (result["layout"] or {}).get("style")
    images = {}
    if result["profile"]:
        images["sigma_min_profile.png"] = plots.plot_profile(
            result["profile"], out / "sigma_min_profile.png",
            title=f"{model}: sigma_min ratio against depth", post_norm=style == "post-norm",
        )  # fmt: skip
    else:
        result["notes"].append(
            "sigma_min_profile.png not written: no residual point was read (no sigma_min profile)"
        )
    images["alignment.png"] = plots.plot_alignment(
        result["norms"],
        out / "alignment.png",
        title=f"{model}: gamma_alignment and kernel_residual per layer",
    )
    images["spectrum.png"] = spectrum_plots.plot_spectrum(
        result["norms"], out / "spectrum.png", title=f"{model}: bottom of each eigen-spectrum"
    )
    dead = {n["name"]: n["dead_index"] for n in result["norms"]}
    images["gamma.png"] = plots.plot_gamma(
        gammas, dead, out / "gamma.png", title=f"{model}: gamma per norm layer"
    )
    result["files"] = [*images, "report.md", "report.html", "report.json"]
    captions = {name: PLOTS[name] for name in images}
    (out / "report.md").write_text(render.scan_markdown(result, captions), encoding="utf-8")
    (out / "report.html").write_text(
        render.scan_html(result, {captions[k]: p for k, p in images.items()}), encoding="utf-8"
    )
    (out / "report.json").write_text(render.to_json(result) + "\n", encoding="utf-8")
