"""``normscope scan MODEL``: every dead-direction read of a checkpoint, against its random-init
twin, printed as a table and written as ``report.md``, ``report.html``, ``report.json`` and PNG
plots.

The engine is :func:`normscope.scan_model`. With ``--baseline random-init`` (the default) the
twin -- the same architecture at random init, seeded -- is scanned first on the same batches,
and its Schur quotients are the baseline of ``deepening = R_twin / R_checkpoint``
(docs/metrics.md §1.3); its ``sigma_min`` profile is drawn beside the checkpoint's.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import normscope
from normscope.alerts import Alert, default_dead_direction_rules
from normscope.cli import plots, render
from normscope.cli.data import TokenData, make_batches
from normscope.cli.errors import CLIError
from normscope.cli.loading import LoadedModel, load_model
from normscope.cli.options import DEFAULT_TOKENS
from normscope.monitors.dead_direction import DeadDirectionReport
from normscope.monitors.scan import scan_model
from normscope.taps.norms import NormDiscoveryError, find_norm_layers

__all__ = ["default_alerts", "format_scan_table", "run", "scan_result", "write_scan_outputs"]

PLOTS = {
    "sigma_min_profile.png": "sigma_min ratio against depth",
    "alignment.png": "gamma_alignment and kernel_residual per layer",
    "spectrum.png": "bottom of each norm's eigen-spectrum",
    "gamma.png": "gamma distributions",
}


def run(args: argparse.Namespace) -> int:
    for name in ("tokens", "seq_len", "batch_size", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    render.out_dir(args.out, create=False)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, ValueError) as err:
        raise CLIError(f"--device {args.device}: not usable here ({err})") from err
    loaded = load_model(args.model, trust_remote_code=args.trust_remote_code, device=device)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            width = max(n.dim for n in find_norm_layers(loaded.model))
    except NormDiscoveryError as err:
        raise CLIError(f"{args.model}: nothing to scan: {err}") from err
    notes = list(loaded.notes) + [str(w.message) for w in caught]
    tokens = args.tokens or max(DEFAULT_TOKENS, 4 * width)
    seq_len = min(args.seq_len, loaded.max_positions or args.seq_len)
    specs = data_sources(args.data)
    per_source: list[tuple[str, TokenData]] = []
    for name, path in specs:
        part = make_batches(
            loaded.tokenizer,
            path,
            tokens=tokens,
            seq_len=seq_len,
            batch_size=args.batch_size,
            as_dict=loaded.as_dict,
            device=device,
        )
        if part.tokens < tokens:
            what = f"source {name!r}: " if name is not None else ""
            notes.append(f"{what}the text ran out at {part.tokens} tokens (asked for {tokens})")
        per_source.append((name, part))
    data, sources = _combine(per_source)
    if data.tokens < 2 * width:
        notes.append(
            f"{data.tokens} tokens < 2 d = {2 * width}: reads need at least 2 d rows and come "
            f"out NaN (insufficient_rows); pass --tokens {4 * width} or more"
        )
    twin_report = None
    if args.baseline == "random-init":
        twin = loaded.make_twin(args.seed).to(device=device, dtype=torch.float32).eval()
        twin_report = _scan(twin, data.batches, "random-init twin", notes, args.max_memory)
        del twin
    report = _scan(
        loaded.model,
        data.batches,
        "checkpoint",
        notes,
        args.max_memory,
        baseline=twin_report,
        sources=sources,
    )
    result = scan_result(loaded, report, twin_report, data, args, notes)
    if sources is not None:
        result["data"]["sources"] = [
            {"name": n, "source": part.source, "tokens": part.tokens, "windows": part.windows}
            for n, part in per_source
        ]
    out = render.out_dir(args.out)
    gammas = _gammas(loaded.model, list(report.norms))
    write_scan_outputs(result, gammas, out)
    if args.json:
        print(render.to_json(result))
    else:
        print(format_scan_table(result))
        for note in result["notes"]:
            print(f"note: {note}")
        print(f"wrote {', '.join(result['files'])} to {out}/")
    return 0


# ------------------------------------------------------------------------------ the data
def data_sources(data: Sequence[str] | str | None) -> list[tuple[str | None, str | None]]:
    """``--data`` values as ``(source name, path)``: one plain path (or none) is one unnamed
    source (the scan of old); several, or any ``NAME=PATH``, are named sources (a plain path
    named by its file or folder name).

    Example::

        >>> data_sources(["code=src", "prose=docs/a.txt"])
        [('code', 'src'), ('prose', 'docs/a.txt')]
        >>> data_sources(None)
        [(None, None)]
    """
    if data is None:
        return [(None, None)]
    items = [data] if isinstance(data, str) else list(data)
    named = len(items) > 1 or any(_split_name(i)[0] is not None for i in items)
    if not named:
        return [(None, items[0])]
    out: list[tuple[str | None, str | None]] = []
    for item in items:
        name, path = _split_name(item)
        name = name if name is not None else (Path(path).name or path)
        if "/" in name or not name:
            raise CLIError(f"--data {item}: a source name may not hold '/' (write NAME=PATH)")
        if any(name == n for n, _ in out):
            raise CLIError(f"--data: source name {name!r} given twice (write NAME=PATH)")
        out.append((name, path))
    return out


def _split_name(item: str) -> tuple[str | None, str]:
    name, sep, path = item.partition("=")
    if sep and name and not Path(item).exists() and "/" not in name:
        return name, path
    return None, item


def _combine(parts: list[tuple[str | None, TokenData]]) -> tuple[TokenData, Any]:
    """One :class:`TokenData` of every source's batches, and the ``sources=`` function that
    names each batch's source (None for one unnamed source)."""
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1], None
    names: dict[int, str] = {}
    batches: list[Any] = []
    for name, part in parts:
        for batch in part.batches:
            names[id(batch)] = str(name)
            batches.append(batch)
    data = TokenData(
        batches,
        sum(p.tokens for _, p in parts),
        sum(p.windows for _, p in parts),
        max(p.seq_len for _, p in parts),
        "; ".join(f"{name}: {p.source}" for name, p in parts),
    )
    return data, lambda batch: names[id(batch)]


# ------------------------------------------------------------------------------ the scans
@contextlib.contextmanager
def _progress(model: nn.Module, total: int, desc: str) -> Iterator[None]:
    """A tqdm bar over the scan's forwards (shown on a terminal only), counted by a forward
    hook on the model itself."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="forward", disable=None, file=sys.stderr, leave=False)
    handle = model.register_forward_hook(lambda *_: bar.update(1))
    try:
        yield
    finally:
        handle.remove()
        bar.close()


def _scan(
    model: nn.Module,
    batches: Sequence[Any],
    what: str,
    notes: list[str],
    max_memory: int | None = None,
    baseline: DeadDirectionReport | None = None,
    sources: Any = None,
) -> DeadDirectionReport:
    try:
        with (
            warnings.catch_warnings(record=True) as caught,
            _progress(model, len(batches) + 1, f"normscope: scanning the {what}"),
        ):
            warnings.simplefilter("always")
            report = scan_model(
                model, batches, baseline=baseline, max_memory=max_memory, sources=sources
            )
    except NormDiscoveryError as err:
        raise CLIError(f"nothing to scan in the {what}: {err}") from err
    except (TypeError, ValueError, RuntimeError, IndexError, KeyError) as err:
        longest = max(_seq_len(b) for b in batches)
        raise CLIError(
            f"the model's forward failed on batches of token ids (seq {longest}) while scanning "
            f"the {what} ({type(err).__name__}: {err}); a model that takes fewer positions "
            "needs a smaller --seq-len"
        ) from err
    for w in caught:  # normscope's own warnings (unknown *Norm* classes...) become notes
        message = str(w.message)
        if message not in notes and ("normscope" in w.filename or "normscope" in message):
            notes.append(message)
    return report


def _seq_len(batch: Any) -> int:
    ids = batch["input_ids"] if isinstance(batch, dict) else batch
    return int(ids.shape[-1])


def _gammas(model: nn.Module, names: list[str]) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {n.name: n.gamma().cpu().numpy() for n in find_norm_layers(model, names)}


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


# ------------------------------------------------------------------------------ the result
def _num(value: Any) -> float | None:
    """A float for JSON: NaN and infinities become None."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


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
                # against the random-init twin; with --baseline none there is nothing to compare
                "delta_gamma": _num(n.schur.delta_gamma) if twin is not None else None,
                "deepening": _num(n.deepening) if twin is not None else None,
                "delta_reason": n.schur.delta_reason if twin is not None else "no_baseline",
                "n_rows": n.n_rows,
                "bottom_eigenvalues": [_num(v) for v in n.kernel.bottom_eigenvalues],
                "reason": n.kernel.reason or n.schur.reason or n.gamma.reason,
                "baseline": None
                if t is None
                else {
                    "gamma_alignment": _num(t.kernel.gamma_alignment),
                    "kernel_residual": _num(t.kernel.kernel_residual),
                    "schur_quotient": _num(t.schur.schur_quotient),
                    "schur_complement": _num(t.schur.schur_complement),
                },
            }
        )
    profile = []
    twin_points = {p.name: p for p in twin.profile.points} if twin and twin.profile else {}
    margins = report.profile.no_cancellation_margin if report.profile is not None else ()
    for p, margin in zip(report.profile.points if report.profile is not None else (), margins):
        tp = twin_points.get(p.name)
        profile.append(
            {
                "name": p.name,
                "depth": p.depth,
                "sublayer": p.sublayer,
                "sigma_min": _num(p.sigma_min),
                "sigma_min_ratio": _num(p.sigma_min_ratio),
                "sigma_min_step": _num(p.sigma_min_step),
                "no_cancellation_margin": _num(margin),
                "n_rows": p.n_rows,
                "reason": p.reason,
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
            "profile": [
                {
                    "name": p.name,
                    "depth": p.depth,
                    "sublayer": p.sublayer,
                    "sigma_min": _num(p.sigma_min),
                    "sigma_min_ratio": _num(p.sigma_min_ratio),
                    "sigma_min_step": _num(p.sigma_min_step),
                    "n_rows": p.n_rows,
                    "reason": p.reason,
                }
                for p in profile.points
            ],
        }
    return out


def write_scan_outputs(result: dict[str, Any], gammas: dict[str, Any], out: Path) -> None:
    """The four PNGs, ``report.md``, ``report.html`` and ``report.json`` into ``out``."""
    model = result["model"]["class"]
    style = (result["layout"] or {}).get("style")
    post = " (post-norm: the bound assumes pre-norm)" if style == "post-norm" else ""
    images = {}
    if result["profile"]:
        images["sigma_min_profile.png"] = plots.plot_profile(
            result["profile"], out / "sigma_min_profile.png",
            title=f"{model}: sigma_min ratio against depth{post}",
        )  # fmt: skip
    images["alignment.png"] = plots.plot_alignment(
        result["norms"], out / "alignment.png", title=f"{model}: the LayerNorm kernel per layer"
    )
    images["spectrum.png"] = plots.plot_spectrum(
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


# ------------------------------------------------------------------------------ the table
def _f(value: Any, spec: str) -> str:
    return "nan" if value is None else format(value, spec)


def format_scan_table(result: dict[str, Any]) -> str:
    """The printed scan: a header, one row per norm layer, the sigma_min depth profile, the
    summary and any alert."""
    m, d, b = result["model"], result["data"], result["baseline"]
    lines = [
        f"normscope scan: {m['class']} ({m['source']}: {m['name']})",
        f"data: {d['tokens']} tokens ({d['windows']} windows of <= {d['seq_len']}) of {d['source']}; "
        f"tokenizer {m['tokenizer']}",
        "baseline: "
        + (f"random-init twin, seed {b['seed']}: {b['how']}" if b["seed"] is not None else "none"),
        "",
    ]
    rows = [
        [
            n["name"], n["kind"], _f(n["gamma_spread"], ".3f"), str(n["dead_channels"]),
            _f(n["gamma_alignment"], ".6f"), _f(n["kernel_residual"], ".1e"), n["norm_class"],
            _f(n["delta_gamma"], ".4f"), _f(n["deepening"], ".3g"),
        ]
        for n in result["norms"]
    ]  # fmt: skip
    head = ["norm layer", "kind", "spread", "dead", "gamma_align", "kernel_res", "norm_class",
            "Delta_g", "deepen"]  # fmt: skip
    lines += render.text_table(head, rows, right=(2, 3, 4, 5, 7, 8))
    if result["profile"]:
        lines.append("")
        rows = [
            [
                p["name"], p["sublayer"] or "-", _f(p["sigma_min"], ".4g"),
                _f(p["sigma_min_ratio"], ".3f"), _f(p["sigma_min_step"], ".3f"),
                _f(p["baseline_ratio"], ".3f"),
            ]
            for p in result["profile"]
        ]  # fmt: skip
        head = ["residual point", "sublayer", "sigma_min", "ratio", "step", "init_ratio"]
        lines += render.text_table(head, rows, right=(2, 3, 4, 5))
    s = result["summary"]
    lines += [
        "",
        f"sigma_min_ratio_min {_f(s['sigma_min_ratio_min'], '.4g')} at {s['worst_point']}; "
        f"sigma_min_step_min {_f(s['sigma_min_step_min'], '.4g')}; "
        f"gamma_alignment_min (LayerNorm) {_f(s['gamma_alignment_min'], '.6f')}",
    ]
    lines += render.source_lines(result)
    if result["alerts"]:
        lines += [f"ALERT {a['rule']}: {a['message']}" for a in result["alerts"]]
    else:
        lines.append("alerts (default rules): none")
    return "\n".join(lines)
