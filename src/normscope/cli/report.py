"""``normscope report RUN_DIR``: a finished run's logged normscope metrics as plots over
training steps, alerts marked, with ``report.md``, ``report.html`` and ``report.json``.

The run is read by :func:`normscope.runs.read_run` (Lightning CSVLogger folders, W&B run
folders or files -- offline runs too --, TensorBoard event folders; a Hugging Face
``Trainer``'s ``train/dd/...`` keys at its global step). Rows logged at one step are merged
into one read. The alerts are the run's own (W&B alert records, or the Hugging Face callback's
``dd/alert/<rule>`` keys), else the monitor's default rules re-evaluated over the reads
(:mod:`normscope.cli.run_alerts`); a note says which. The figures are drawn by
:mod:`normscope.cli.run_plots` and :mod:`normscope.cli.norm_plots`; one with nothing to draw is
not written, and a note says why. A timeline (:mod:`normscope.cli.timeline`) says which
run-level reads left their own early band first and how many reads before the first alert and
the loss move; ``timeline.png`` draws it (none on a healthy run: one line says so).

Two things a log may not hold are inferred, and the report says that too: the depth order of
the residual points when the log has no ``dd/<point>/depth`` (``p_0`` is the point whose ratio
and step are exactly 1 at every read; the rest in natural order of their module paths: ``h.2``
before ``h.10``, numbered paths before un-numbered ones such as a final norm), and each norm's
declared kind (from ``norm_class`` and ``kind_mismatch``).

A run that logged the sign–magnitude family only (``sm/...``) gets its reads' table and the
alerts it logged instead (:mod:`normscope.cli.sm_report`).
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from normscope._common import fmt
from normscope.cli import norm_plots, render, run_plots, sm_report
from normscope.cli.errors import CLIError
from normscope.cli.figures import KERNEL_ALERT, KERNEL_ALERT_LABEL
from normscope.cli.norm_plots import kernel_verdict
from normscope.cli.progress import Phases
from normscope.cli.run_alerts import (
    declared_kinds,
    is_post_norm,
    log_sources,
    run_alerts,
    source_classes,
)
from normscope.cli.timeline import Timeline, find_loss, first_movers
from normscope.cli.timeline_plot import plot_timeline
from normscope.engine.keys import canonical_metrics, family_names
from normscope.runs import RunReadError, read_run

__all__ = ["depth_order", "merge_reads", "run", "source_rows", "summary_table"]

_NORM_MARK = "/gamma_alignment"
_POINT_MARK = "/sigma_min_ratio"
_cell = functools.partial(fmt, finite=True)  # the tables: a missing or +-Inf value reads "nan"


def merge_reads(
    history: Sequence[Mapping[str, float]], name: str | None = None
) -> dict[float, dict[str, float]]:
    """The rows holding ``dd/`` keys (and the per-source ``dd.<source>/`` ones), merged by step
    (a logger may split one read across rows: W&B writes the monitor's scalars and its charts
    as two). ``name``: the keys of the monitor of that name instead (``dd[name]/...``), renamed
    to their ``dd/`` form."""
    reads: dict[float, dict[str, float]] = {}
    for row in history:
        ours = {k: v for k, v in canonical_metrics(row, name).items() if k.startswith("dd")}
        if ours:
            reads.setdefault(float(row["step"]), {}).update(ours)
    return dict(sorted(reads.items()))


def _keyed(reads: Mapping[float, Mapping[str, float]], mark: str) -> list[str]:
    found: dict[str, None] = {}
    for values in reads.values():
        for key in values:
            if key.startswith("dd/") and key.endswith(mark) and key.count("/") >= 2:
                found[key[len("dd/") : -len(mark)]] = None
    return list(found)


def _natural(path: str) -> tuple[Any, ...]:
    parts = path.split(".")
    key = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)
    return (not any(p.isdigit() for p in parts), key)


def depth_order(points: Sequence[str], reads: Mapping[float, Mapping[str, float]]) -> list[str]:
    """Residual points in forward order: by their logged ``depth`` when every point has one
    (logs of normscope >= this version), else inferred: ``p_0`` first -- the point whose logged
    ratio and step are 1 at every read --, then natural order of the module paths.

    Example::

        >>> reads = {1.0: {"dd/e/sigma_min_ratio": 1.0, "dd/e/sigma_min_step": 1.0,
        ...                "dd/h.10.ln/sigma_min_ratio": 2.0, "dd/h.2.ln/sigma_min_ratio": 3.0}}
        >>> depth_order(["h.10.ln", "h.2.ln", "e"], reads)
        ['e', 'h.2.ln', 'h.10.ln']
    """

    def is_first(p: str) -> bool:
        values = [
            (r.get(f"dd/{p}/sigma_min_ratio"), r.get(f"dd/{p}/sigma_min_step"))
            for r in reads.values()
        ]
        values = [v for v in values if v[0] is not None and math.isfinite(v[0])]
        return bool(values) and all(a == 1.0 and b in (1.0, None) for a, b in values)

    logged = run_plots.logged_depths(points, reads)
    if logged is not None:
        return sorted(points, key=logged.__getitem__)
    firsts = [p for p in points if is_first(p)]
    first = sorted(firsts, key=_natural)[:1]
    return first + sorted((p for p in points if p not in first), key=_natural)


def source_rows(
    reads: Mapping[float, Mapping[str, float]], sources: Sequence[str]
) -> tuple[list[str], list[list[str]]]:
    """Per read: each source's ``sigma_min_ratio_min`` and rows, and the shallowest collapse's
    class and point (classified from the logged keys, as the monitor does)."""
    head = ["step"] + [f"{s} ratio_min (rows)" for s in sources] + ["collapse", "at"]
    rows = []
    for step, v in reads.items():
        cells = [f"{step:g}"]
        for s in sources:
            rows_s = v.get(f"dd.{s}/n_rows")
            cells.append(
                f"{_cell(v.get(f'dd.{s}/sigma_min_ratio_min'), '.4g')} "
                f"({_cell(rows_s, '.0f') if rows_s is not None else '-'})"
            )
        cells += source_classes(v)
        rows.append(cells)
    return head, rows


_READ_COLUMNS = ("step", "sigma_min_ratio_min", "sigma_min_step_min", "worst point",
                 "gamma_alignment_min")  # fmt: skip


def summary_table(
    reads: Mapping[float, Mapping[str, float]], points: Sequence[str], alert_steps: set[float]
) -> tuple[list[str], list[list[str]]]:
    """The reads table: one row per read (step, the run minima, the worst point after ``p_0``,
    ``gamma_alignment_min``), and an ``alert`` column only when some read is at an alert."""
    marked = any(step in alert_steps for step in reads)
    rows = []
    for step, v in reads.items():
        ratios = {p: v.get(f"dd/{p}/sigma_min_ratio", math.nan) for p in points[1:]}
        ratios = {p: r for p, r in ratios.items() if math.isfinite(r)}
        worst = min(ratios, key=ratios.get) if ratios else "-"
        rows.append(
            [
                f"{step:g}", _cell(v.get("dd/sigma_min_ratio_min"), ".4g"),
                _cell(v.get("dd/sigma_min_step_min"), ".4g"), worst,
                _cell(v.get("dd/gamma_alignment_min"), ".6f"),
            ]
            + (["ALERT" if step in alert_steps else "-"] if marked else [])
        )  # fmt: skip
    return [*_READ_COLUMNS] + (["alert"] if marked else []), rows


def premise_notes(reads: Mapping[float, Mapping[str, float]], points: Sequence[str]) -> list[str]:
    """The report's words on reads whose premise is absent or partial: a post-norm run
    (``Delta_gamma`` NaN, reason ``post_norm``), norm inputs that do not span
    (``dd/rank_deficient_inputs``) and a profile anchored past ``p_0``
    (``dd/profile_anchor_depth``).

    Example::

        >>> premise_notes({10.0: {"dd/profile_anchor_depth": 1.0}}, [])
        ['the first 1 residual point(s) did not span (dd/profile_anchor_depth): the sigma_min ratios are read against the first point that does']
    """
    notes = []
    if is_post_norm(points):
        notes.append(
            "post-norm run: the norms' inputs are not the residual stream, so Delta_gamma and "
            "the Schur reads are NaN (reason post_norm) and no sigma_min alert applies"
        )

    def most(key: str) -> float:
        values = [float(r.get(f"dd/{key}", math.nan)) for r in reads.values()]
        return max((v for v in values if math.isfinite(v)), default=0.0)

    if most("rank_deficient_inputs") > 0:
        notes.append(
            f"up to {most('rank_deficient_inputs'):g} norm layer(s) saw inputs that do not span "
            "their width (dd/rank_deficient_inputs): their reads are taken on the live subspace "
            "and gamma_alignment_min is their subspace alignment"
        )
    if most("profile_anchor_depth") > 0:
        notes.append(
            f"the first {most('profile_anchor_depth'):g} residual point(s) did not span "
            "(dd/profile_anchor_depth): the sigma_min ratios are read against the first point "
            "that does"
        )
    return notes


def _chosen_steps(steps: Sequence[float], alert_steps: Sequence[float], n: int = 5) -> list[float]:
    """First, last, evenly spaced reads and the first read at or after each alert."""
    if not steps:
        return []
    picks = {steps[round(i * (len(steps) - 1) / max(1, n - 1))] for i in range(n)}
    for a in alert_steps:
        later = [s for s in steps if s >= a]
        if later:
            picks.add(later[0])
    return sorted(picks)


def run(args: argparse.Namespace) -> int:
    render.out_dir(args.out, create=False)
    phases = Phases("report")
    try:
        log = read_run(args.run_dir)
    except RunReadError as err:
        raise CLIError(str(err)) from err
    except OSError as err:
        raise CLIError(f"{args.run_dir}: cannot read the run ({err})") from err
    phases.done(f"read the {log.source} run ({len(log.history)} rows)")
    name = getattr(args, "name", None)
    reads = merge_reads(log.history, name)
    names = family_names({k for row in log.history for k in row})
    if not reads and (sm := sm_report.summarise(log, name)) is not None:
        return _report_sign_magnitude(args, sm)
    if not reads:
        wanted = f"dd[{name}]/..." if name else "dd/..."
        found = f"; it holds named monitors: {', '.join(names)} (pass --name NAME)" if names else ""
        raise CLIError(
            f"{args.run_dir}: the {log.source} run holds no normscope metrics (no {wanted} "
            f"keys){found or '; was DeadDirectionMonitor attached?'}"
        )
    norms = sorted(_keyed(reads, _NORM_MARK), key=_natural)
    points = depth_order(_keyed(reads, _POINT_MARK), reads)
    notes = []
    if name:
        notes.append(f"monitor: DeadDirectionMonitor[{name}] (its dd[{name}]/ keys)")
    others = [n for n in names if n != name]
    if name and merge_reads(log.history):
        others.append("the unnamed one (no --name)")
    if others:
        notes.append(
            f"other monitors in this run: {', '.join(others)} (--name NAME reports on one)"
        )
    if log.key_prefix:
        notes.append(
            f"a Hugging Face Trainer run: normscope's keys were logged under "
            f"{log.key_prefix!r} ({log.key_prefix}dd/...) and are read without it; steps are "
            "the Trainer's global step"
        )
    objective = getattr(args, "objective", "tokens")
    alerts, said = run_alerts(log.source, log.alerts, reads, norms, points, name, objective)
    notes.append(said)
    if points and run_plots.logged_depths(points, reads) is None:
        notes.append("depth order of the residual points inferred from their module paths")
    notes.extend(premise_notes(reads, points))
    alert_steps = sorted(
        {a["step"] for a in alerts if isinstance(a["step"], float) and math.isfinite(a["step"])}
    )
    loss_key, loss = find_loss(log.history)
    timeline = first_movers(reads, alert_steps, loss, loss_key=loss_key)
    phases.done(f"the alerts and the timeline of {len(reads)} reads")
    out = render.out_dir(args.out)
    images = _story(timeline, reads, out, Path(args.run_dir).name)
    images |= _plots(reads, norms, points, alerts, alert_steps, out, Path(args.run_dir).name, notes)
    phases.done(f"drew {len(images)} figures")
    head, rows = summary_table(reads, points, set(alert_steps))
    result = {
        "command": "report",
        "run": {"source": log.source, "path": str(log.path)},
        "monitor": name,
        "monitors": names,
        "reads": [
            dict(zip([c.replace(" ", "_") for c in _READ_COLUMNS], r[: len(_READ_COLUMNS)]))
            for r in rows
        ],
        "norms": norms,
        "points": points,
        "alerts": alerts,
        "timeline": timeline.as_dict(),
        "notes": notes,
        "files": [*images, "report.md", "report.html", "report.json"],
    }
    sources = log_sources(reads)
    tables = [("Reads", head, rows)]
    if sources:
        src_head, src_rows = source_rows(reads, sources)
        tables.append(("Per source", src_head, src_rows))
        result["sources"] = sources
        result["source_reads"] = [dict(zip(src_head, r)) for r in src_rows]
    facts = [
        f"run: {log.source} log at {log.path}",
        f"{len(reads)} normscope reads, steps {min(reads):g} to {max(reads):g}; "
        f"{len(norms)} norm layers, {len(points)} residual points",
        *notes,
    ]
    alert_lines = [f"ALERT at step {a['step']:g}: {a['text']}" for a in alerts]
    _write(out, result, facts, alert_lines, images, tables, timeline.lines())
    if args.json:
        print(render.to_json(result))
    else:
        print(f"normscope report: {log.source} run {log.path}")
        print("\n".join(render.text_table(head, rows, right=(0, 1, 2, 4))))
        for heading, t_head, t_rows in tables[1:]:
            print(f"{heading}:")
            print("\n".join(render.text_table(t_head, t_rows, right=(0,))))
        print("\n".join(alert_lines) or "no alert")
        print("\n".join(timeline.lines()))
        for note in notes:
            print(f"note: {note}")
        print(f"wrote {', '.join(result['files'])} to {out}/")
    return 0


def _story(timeline: Timeline, reads, out: Path, name: str) -> dict[str, str]:
    """The timeline figure, unless the run is healthy (its one line says so)."""
    if timeline.healthy:
        return {}
    plot_timeline(timeline, reads, out / "timeline.png", title=f"{name}: the story of the run")
    return {"timeline.png": "the story of the run: the first reads to leave their bands"}


def _plots(reads, norms, points, alerts, alert_steps, out: Path, name: str, notes: list[str]):
    """Write the figures; a figure with nothing to draw is not written, and ``notes`` says
    why. Returns ``{file: caption}`` of the files written."""
    captions: dict[str, str] = {}
    post_norm = is_post_norm(points)
    if points:
        run_plots.plot_sigma_over_steps(
            reads, points, alerts, out / "sigma_min_over_steps.png",
            title=f"{name}: sigma_min ratio over training steps", post_norm=post_norm,
        )  # fmt: skip
        captions["sigma_min_over_steps.png"] = "sigma_min ratio over training steps"
        steps = _chosen_steps(list(reads), alert_steps)
        run_plots.plot_run_profile(
            reads, points, steps, alert_steps, out / "sigma_min_profile.png",
            title=f"{name}: sigma_min ratio against depth at a few steps", post_norm=post_norm,
        )  # fmt: skip
        captions["sigma_min_profile.png"] = "sigma_min ratio against depth"
    else:
        notes.append(
            "sigma_min_over_steps.png, sigma_min_profile.png not written: the run logged no "
            "residual point (dd/<point>/sigma_min_ratio; dd/profile_points 0)"
        )
    if not norms:
        notes.append(
            "alignment.png, gamma.png, schur.png not written: the run logged no norm layer"
        )
        return captions
    kinds = declared_kinds(norms, reads)
    rms_only = bool(kinds) and set(kinds.values()) == {"rmsnorm"}
    no_kernel = "RMSNorms have no kernel, so no Delta_gamma is read" if rms_only else ""
    if post_norm and not no_kernel:
        no_kernel = (
            "a post-norm model: the norms' inputs are not the residual stream, so Delta_gamma "
            "has no premise (NaN, reason post_norm)"
        )
    panels = {
        "alignment.png": ("gamma_alignment and kernel_residual over steps", [
            ("gamma_alignment", "gamma_alignment", False),
            ("kernel_residual", "kernel_residual", True)],
            kernel_verdict(reads, norms, kinds)),
        "gamma.png": ("gamma spread, min and max over steps", [
            ("gamma_spread", "gamma_spread", False), ("gamma_min", "gamma_min", False),
            ("gamma_max", "gamma_max", False)], ""),
        "schur.png": ("Delta_gamma and its random-direction control over steps", [
            ("delta_gamma", "Delta_gamma", False),
            ("delta_gamma_control", "control (random direction)", False)], ""),
    }  # fmt: skip
    lines = {
        "gamma_alignment": [(0.9999, "LayerNorm: 0.9999", "layernorm")],
        "kernel_residual": [(KERNEL_ALERT, f"LayerNorm: {KERNEL_ALERT_LABEL} alert", "layernorm")],
    }
    empty = {
        "delta_gamma": "no finite Delta_gamma in any read: "
        + (no_kernel or "read for pre-norm LayerNorms with a kernel"),
        "delta_gamma_control": "no finite control in any read: "
        + (no_kernel or "read beside Delta_gamma"),
    }
    for file, (caption, spec, verdict) in panels.items():
        written = norm_plots.plot_norm_metrics(
            reads, norms, spec, alerts, out / file, title=f"{name}: {caption}", hlines=lines,
            kinds=kinds, empty=empty, verdict=verdict,
        )  # fmt: skip
        if written is None:
            metrics = ", ".join(m for m, _, _ in spec)
            why = f" ({no_kernel})" if no_kernel and file == "schur.png" else ""
            notes.append(f"{file} not written: no finite {metrics} in any read{why}")
        else:
            captions[file] = caption
    return captions


def _report_sign_magnitude(args: argparse.Namespace, sm: Mapping[str, Any]) -> int:
    """A run with sign–magnitude reads only (:mod:`normscope.cli.sm_report`): the files and
    the table, no figure."""
    out = render.out_dir(args.out)
    result, tables = sm["result"], sm["tables"]
    _write(out, result, sm["facts"], sm["alert_lines"], {}, tables, None)
    if args.json:
        print(render.to_json(result))
        return 0
    print(f"normscope report: {result['run']['source']} run {result['run']['path']}")
    print("\n".join(render.text_table(*tables[0][1:], right=tuple(range(len(tables[0][1]))))))
    print("\n".join(sm["alert_lines"]) or "no alert")
    for note in result["notes"]:
        print(f"note: {note}")
    print(f"wrote {', '.join(result['files'])} to {out}/")
    return 0


def _write(out: Path, result, facts, alert_lines, images, tables, story) -> None:
    """report.md and report.html (``story``: the timeline's lines, None for a run without
    dead-direction reads; no plots heading without images)."""
    md = [f"# normscope report: {result['run']['path']}", ""] + [f"- {f}" for f in facts] + [""]
    md += [f"**{a}**" for a in alert_lines] or ["No alert."]
    if story:
        md += ["", "## Timeline", "", "```", *story, "```"]
    for heading, head, rows in tables:
        md += ["", f"## {heading}", ""] + render.md_table(head, rows)
    if images:
        md += ["", "## Plots", ""]
    for file, caption in images.items():
        md += [f"### {caption}", "", f"![{caption}]({file})", ""]
    (out / "report.md").write_text("\n".join(md), encoding="utf-8")
    page = render.run_html(
        f"normscope report: {Path(result['run']['path']).name}", facts, alert_lines,
        {caption: out / file for file, caption in images.items()}, tables, story or (),
    )  # fmt: skip
    (out / "report.html").write_text(page, encoding="utf-8")
    (out / "report.json").write_text(render.to_json(result) + "\n", encoding="utf-8")
