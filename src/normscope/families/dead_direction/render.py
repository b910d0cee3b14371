"""Plain-text renderings of a dead-direction read: one line per read, a table, an end-of-run
summary."""

from __future__ import annotations

import math
from collections.abc import Sequence

from normscope._common import fmt
from normscope.alerts import Alert
from normscope.families.dead_direction.report import DeadDirectionReport
from normscope.taps.paths import key_path

__all__ = ["format_read_line", "format_summary", "format_table"]

_f = fmt


def format_read_line(report: DeadDirectionReport, fired: Sequence[Alert] = ()) -> str:
    """``normscope step 50 | sigma_min_ratio_min 0.97 at h.2.ln_2 (attn) | ...`` in one line."""
    parts = [f"normscope step {report.step}"]
    profile = report.profile
    if profile is not None:
        worst = profile.worst_point
        sub = next((p.sublayer for p in profile.points if p.name == worst), None)
        where = f" at {key_path(worst)} ({sub or 'block'})" if worst else ""
        if profile.reason == "post_norm":  # LayerNorm outputs: no ratio means anything there
            parts.append("sigma_min_ratio_min not read (post_norm)")
        else:
            ratio = format(profile.sigma_min_ratio_min, ".4g")
            parts.append(f"sigma_min_ratio_min {ratio}{where}")
    if not report.spectral:
        parts.append("cheap read")
    ln = [n for n in report.norms.values() if n.kind == "layernorm" and n.gamma.dead_channels == 0]
    if (
        ln and report.spectral
    ):  # the headline, as dd/gamma_alignment_min: each LayerNorm's kernel_alignment
        parts.append(
            f"gamma_alignment_min {format(min(n.kernel.kernel_alignment for n in ln), '.6f')}"
        )
    deltas = [n.delta_gamma for n in report.norms.values() if math.isfinite(n.delta_gamma)]
    if deltas:
        parts.append(f"Delta_gamma max {format(max(deltas), '.4g')}")
    if report.sources:
        per = ", ".join(
            f"{name} {format(p.sigma_min_ratio_min, '.4g')}" for name, p in report.sources.items()
        )
        collapses = report.collapses
        verdict = (
            f"; {collapses[0].kind} collapse at {key_path(collapses[0].point)}" if collapses else ""
        )
        parts.append(f"by source: {per}{verdict}")
    if report.rows_rejected:
        parts.append(f"rows_rejected {report.rows_rejected}")
    if report.failed_taps:
        off = sorted({key.rsplit(":", 1)[0] for key in report.failed_taps})
        parts.append(f"disabled after a failure: {', '.join(off)}")
    if fired:
        parts.append(f"ALERTS {len(fired)}: " + "; ".join(a.message for a in fired))
    return " | ".join(parts)


def format_table(report: DeadDirectionReport) -> str:
    """One row per norm layer, then the sigma_min profile."""
    lines = [
        f"{'norm layer':<36} {'kind':<9} {'class':<15} {'align':>9} {'kernel_res':>10} "
        f"{'null':>4} {'dead':>4} {'Delta_g':>8} {'control':>7}",
    ]
    for name, n in report.norms.items():
        lines.append(
            f"{name[-36:]:<36} {n.kind:<9} {n.kernel.norm_class:<15} "
            f"{_f(n.kernel.gamma_alignment, '.6f'):>9} {_f(n.kernel.kernel_residual, '.1e'):>10} "
            f"{n.kernel.null_dim:>4} {n.gamma.dead_channels:>4} {_f(n.delta_gamma, '.3f'):>8} "
            f"{_f(n.depth.control_delta_gamma if n.depth else math.nan, '.3f'):>7}"
        )
    if report.profile is not None:
        lines.append("")
        lines.append(
            f"{'residual point':<40} {'sublayer':<8} {'sigma_min':>10} {'ratio':>7} {'step':>7}"
        )
        for p in report.profile.points:
            lines.append(
                f"{p.name[-40:]:<40} {p.sublayer or '-':<8} {_f(p.sigma_min, '.4g'):>10} "
                f"{_f(p.sigma_min_ratio, '.3f'):>7} {_f(p.sigma_min_step, '.3f'):>7}"
            )
    return "\n".join(lines)


def format_summary(report: DeadDirectionReport, reads: int, alerts: Sequence[Alert]) -> str:
    """The end-of-fit summary: the last read as a table and every alert of the run."""
    head = (
        f"normscope summary: {reads} reads, {len(alerts)} alert(s); last read at step {report.step}"
    )
    # every alert, with its step and remedy, follows from the engine (alerts.format_alerts)
    return "\n".join([head, format_table(report)])
