"""``normscope scan MODEL``: every dead-direction read of a checkpoint, against its random-init
twin, printed as a table and written as ``report.md``, ``report.html``, ``report.json`` and PNG
plots.

The engine is :func:`normscope.scan_model`. With ``--baseline random-init`` (the default) the
twin -- the same architecture at random init, seeded -- is scanned first on the same batches,
and what it reads is shown beside the checkpoint's: its ``Delta_gamma`` (about 0: nothing dug
in yet) and its ``sigma_min`` profile (docs/metrics.md §1.3-1.4). No read needs it: each
``Delta_gamma`` carries its own random-direction control. Progress goes to stderr: a bar
over the forwards on a terminal, a line per phase over a second (:mod:`normscope.cli.progress`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normscope._common import fmt
from normscope.cli import render
from normscope.cli.data import TokenData, make_batches
from normscope.cli.errors import CLIError
from normscope.cli.loading import load_model
from normscope.cli.options import DEFAULT_TOKENS
from normscope.cli.progress import Phases
from normscope.cli.scan_result import scan_result, write_scan_outputs
from normscope.families.dead_direction.report import DeadDirectionReport, rank_deficiency_note
from normscope.families.scan import scan_model
from normscope.taps.norms import NormDiscoveryError, find_norm_layers

__all__ = ["data_sources", "entry_rank_note", "format_scan_table", "run"]


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
    phases = Phases("scan")
    loaded = load_model(args.model, trust_remote_code=args.trust_remote_code, device=device)
    phases.done(f"loaded {loaded.model.__class__.__name__}")
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
    phases.done(f"tokenised {data.tokens} tokens into {len(data.batches)} batches")
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
        phases.done("scanned the random-init twin")
    report = _scan(
        loaded.model,
        data.batches,
        "checkpoint",
        notes,
        args.max_memory,
        sources=sources,
    )
    phases.done("scanned the checkpoint")
    entry = entry_rank_note(report, data, loaded.tokenizer_name, width)
    if entry:
        notes.append(entry)
    notes.extend(premise_notes(report))
    result = scan_result(loaded, report, twin_report, data, args, notes)
    if sources is not None:
        result["data"]["sources"] = [
            {"name": n, "source": part.source, "tokens": part.tokens, "windows": part.windows}
            for n, part in per_source
        ]
    out = render.out_dir(args.out)
    gammas = _gammas(loaded.model, list(report.norms))
    write_scan_outputs(result, gammas, out)
    phases.done(f"wrote {len(result['files'])} files")
    if args.json:
        print(render.to_json(result))
    else:
        print(format_scan_table(result))
        for note in result["notes"]:
            print(f"note: {note}")
        print(f"wrote {', '.join(result['files'])} to {out}/")
    return 0


def entry_rank_note(
    report: DeadDirectionReport, data: TokenData, tokenizer: str, width: int
) -> str | None:
    """What to say when ``sigma_min(p_0)`` is 0: the stream entry has rank below its width, so
    no cumulative ratio is defined; how many distinct token ids the text gave, and what to
    pass instead (the model's tokenizer, or more varied ``--data``)."""
    profile = report.profile
    points = profile.points if profile is not None else ()
    if not points or points[0].sigma_min != 0:
        return None
    ids = [b["input_ids"] if isinstance(b, dict) else b for b in data.batches]
    distinct = int(torch.unique(torch.cat([i.reshape(-1) for i in ids])).numel())
    anchored = (
        f"the cumulative sigma_min ratios are read against {profile.anchor}, the first point "
        "whose rows span"
        if profile is not None and profile.anchor is not None and profile.anchor_depth > 0
        else "every cumulative sigma_min ratio is undefined (the step ratios are still read)"
    )
    text = (
        f"sigma_min(p_0) = 0 at {points[0].name}: the stream entry has rank below its width "
        f"d = {width}, so {anchored}. The text gave {distinct} distinct token ids"
    )
    if tokenizer.startswith("UTF-8 bytes"):
        return text + (
            " as UTF-8 bytes, because the model came without a tokenizer: pass its tokenizer "
            "(its files in the model directory, or a factory returning (model, tokenizer))"
        )
    return text + f" through {tokenizer}: pass more varied text with --data"


def premise_notes(report: DeadDirectionReport) -> list[str]:
    """What the scan says in words about reads whose premise is absent or partial: a post-norm
    model (``Delta_gamma`` and the Schur reads NaN, reason ``post_norm``; no sigma_min alert)
    and inputs that do not span (:func:`~normscope.families.dead_direction.report.rank_deficiency_note`)."""
    notes = []
    if report.layout is not None and report.layout.style == "post-norm":
        notes.append(
            "post-norm model: each norm's input is a block's sum, not the residual stream, so "
            "Delta_gamma and the Schur reads have no premise and read NaN (reason post_norm); "
            "the kernel reads (gamma_alignment, kernel_residual, norm_class) hold for any "
            "LayerNorm and are read as usual"
        )
    rank = rank_deficiency_note(report)
    if rank is not None:
        notes.append(rank)
    return notes


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
    hook on the model itself. tqdm, of the ``cli`` extra, is imported when a scan runs."""
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
    sources: Any = None,
) -> DeadDirectionReport:
    try:
        with (
            warnings.catch_warnings(record=True) as caught,
            _progress(model, len(batches) + 1, f"normscope: scanning the {what}"),
        ):
            warnings.simplefilter("always")
            report = scan_model(model, batches, max_memory=max_memory, sources=sources)
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


# ------------------------------------------------------------------------------ the table
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
            n["name"], n["kind"], fmt(n["gamma_spread"], ".3f"), str(n["dead_channels"]),
            fmt(n["gamma_alignment"], ".6f"), fmt(n["kernel_residual"], ".1e"), n["norm_class"],
            render.delta_cell(n), fmt(n["delta_gamma_control"], ".4f"),
        ]
        for n in result["norms"]
    ]  # fmt: skip
    head = ["norm layer", "kind", "spread", "dead", "gamma_align", "kernel_res", "norm_class",
            "Delta_g", "control"]  # fmt: skip
    lines += render.text_table(head, rows, right=(2, 3, 4, 5, 7, 8))
    if result["profile"]:
        lines.append("")
        rows = render.profile_rows(result)[1]  # the report's rows, under shorter heads
        head = ["residual point", "sublayer", "sigma_min", "ratio", "step", "init_ratio"]
        lines += render.text_table(head, rows, right=(2, 3, 4, 5))
    lines += ["", render.summary_line(result)]
    lines += render.source_lines(result)
    if result["alerts"]:
        lines += [f"ALERT {a['rule']}: {a['message']}" for a in result["alerts"]]
    else:
        lines.append("alerts (default rules): none")
    return "\n".join(lines)
