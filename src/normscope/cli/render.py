"""Text, Markdown, HTML and JSON renderings of a scan or a run report.

``report.html`` is self-contained: the PNGs are embedded as base64 ``data:`` URIs and the style
is inline, so the one file can be mailed or attached to an issue. ``report.md`` links the PNGs
next to it.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from normscope._common import fmt
from normscope.cli.errors import CLIError

__all__ = [
    "html_page",
    "md_table",
    "out_dir",
    "profile_rows",
    "run_html",
    "scan_html",
    "scan_markdown",
    "source_lines",
    "summary_line",
    "text_table",
    "to_json",
]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
td.l { text-align: left; }
.alert { color: #b00; font-weight: bold; } .note { color: #555; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0 1.5em; }
code { background: #f3f3f3; padding: 0 3px; }
"""


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def to_json(result: Mapping[str, Any]) -> str:
    """Strict JSON (NaN and infinities as null), indented."""
    return json.dumps(_clean(dict(result)), indent=2, allow_nan=False)


def text_table(
    head: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> list[str]:
    """Aligned plain-text columns (``right`` lists the right-aligned ones).

    Example::

        >>> text_table(["a", "b"], [["x", "1.5"]], right=(1,))
        ['a   b', 'x 1.5']
    """
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return " ".join(parts).rstrip()

    return [line(head), *(line(r) for r in rows)]


def md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A GitHub Markdown table."""
    esc = [[str(c).replace("|", "\\|") for c in r] for r in rows]
    return [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
        *("| " + " | ".join(r) + " |" for r in esc),
    ]


def _html_table(
    head: Sequence[str], rows: Sequence[Sequence[Any]], left: Sequence[int] = (0,)
) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = []
    for r in rows:
        tds = "".join(
            f"<td{' class=l' if i in left else ''}>{html.escape(str(c))}</td>"
            for i, c in enumerate(r)
        )
        body.append(f"<tr>{tds}</tr>")
    return f"<table><tr>{cells}</tr>{''.join(body)}</table>"


def _img(path: str | Path, caption: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<h3>{html.escape(caption)}</h3><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'


def html_page(title: str, sections: Sequence[str]) -> str:
    """A whole HTML document around ``sections`` (already HTML)."""
    return (
        f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n" + "\n".join(sections) + "\n</body></html>\n"
    )


def out_dir(path: str | Path, create: bool = True) -> Path:
    """The output folder, created unless ``create`` is False (``CLIError`` when it is a file
    or cannot be created): checked before a long scan, created after it."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out}: exists and is not a folder")
    if not create:
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CLIError(f"--out {out}: cannot create the folder ({err})") from err
    return out


_f = fmt


# ------------------------------------------------------------------------------ scan
def _norm_rows(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["norm layer", "kind", "gamma_spread", "dead_channels", "gamma_alignment",
            "kernel_residual", "norm_class", "Delta_gamma", "control"]  # fmt: skip
    rows = [
        [
            n["name"], n["kind"], _f(n["gamma_spread"], ".3f"),
            str(n["dead_channels"]) + (f" {n['dead_index']}" if n["dead_channels"] else ""),
            _f(n["gamma_alignment"], ".6f"), _f(n["kernel_residual"], ".2e"), n["norm_class"],
            delta_cell(n), _f(n["delta_gamma_control"], ".4f"),
        ]
        for n in result["norms"]
    ]  # fmt: skip
    return head, rows


def delta_cell(norm: Mapping[str, Any]) -> str:
    """A norm's ``Delta_gamma`` for a table: the number, or why there is none
    (``post_norm``, ``no_gamma_kernel``...), never a bare ``nan``.

    Example::

        >>> delta_cell({"delta_gamma": None, "delta_reason": "post_norm"})
        'post_norm'
        >>> delta_cell({"delta_gamma": 0.25, "delta_reason": None})
        '0.2500'
    """
    value = norm.get("delta_gamma")
    if value is None:
        return str(norm.get("delta_reason") or "nan")
    return _f(value, ".4f")


def profile_rows(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The scan's ``sigma_min`` profile table: head and one row per residual point."""
    head = ["residual point", "sublayer", "sigma_min", "sigma_min_ratio", "sigma_min_step",
            "random-init ratio"]  # fmt: skip
    rows = [
        [
            p["name"], p["sublayer"] or "-", _f(p["sigma_min"], ".4g"),
            _ratio_cell(p, "sigma_min_ratio"), _ratio_cell(p, "sigma_min_step"),
            _ratio_cell(p, "baseline_ratio"),
        ]
        for p in result["profile"]
    ]  # fmt: skip
    return head, rows


def _ratio_cell(point: Mapping[str, Any], key: str) -> str:
    """A profile ratio, or ``post_norm`` where a post-norm point has none (never ``nan``)."""
    value = point.get(key)
    if point.get("reason") == "post_norm" and not (
        isinstance(value, (int, float)) and math.isfinite(value)
    ):
        return "post_norm"
    return _f(value, ".3f")


def _scan_facts(result: Mapping[str, Any]) -> list[str]:
    m, d, b = result["model"], result["data"], result["baseline"]
    layout = result["layout"] or {}
    return [
        f"model: {m['class']} ({m['source']}: {m['name']})",
        f"data: {d['tokens']} tokens in {d['windows']} windows of up to {d['seq_len']}, "
        f"from {d['source']}; tokenizer {m['tokenizer']}",
        "baseline: "
        + (f"random-init twin (seed {b['seed']}): {b['how']}" if b["seed"] is not None else "none"),
        f"residual layout: {layout.get('style', 'not read')}",
        summary_line(result),
    ]


def summary_line(result: Mapping[str, Any]) -> str:
    """The scan's one-line summary: the smallest cumulative and step ratios and the worst
    LayerNorm alignment, each in words when it could not be read (never ``nan at None``).

    Example::

        >>> summary_line({"summary": {"sigma_min_ratio_min": None, "worst_point": None,
        ...               "sigma_min_step_min": 1.42, "gamma_alignment_min": None},
        ...               "profile": [{"name": "model.layers.0.input_layernorm",
        ...                            "sigma_min": 0.0}]})
        'sigma_min_ratio_min undefined (sigma_min(p_0) = 0 at model.layers.0.input_layernorm: the stream entry has rank < d); sigma_min_step_min 1.42; no LayerNorm (gamma_alignment_min not read)'
    """
    s, profile = result["summary"], result.get("profile") or []
    ratio = s.get("sigma_min_ratio_min")
    if isinstance(ratio, (int, float)) and math.isfinite(ratio):
        first = f"sigma_min_ratio_min {_f(ratio, '.4g')} at {s['worst_point']}"
    elif not profile:
        first = "no sigma_min profile (no residual point was read)"
    elif profile[0].get("sigma_min") == 0:
        first = (
            f"sigma_min_ratio_min undefined (sigma_min(p_0) = 0 at {profile[0]['name']}: the "
            "stream entry has rank < d)"
        )
    else:
        why = profile[0].get("reason") or "too few rows"
        first = f"sigma_min_ratio_min not read ({why})"
    step = s.get("sigma_min_step_min")
    if isinstance(step, (int, float)) and math.isfinite(step):
        second = f"sigma_min_step_min {_f(step, '.4g')}"
    else:
        second = "sigma_min_step_min not read"
    align = s.get("gamma_alignment_min")
    if isinstance(align, (int, float)) and math.isfinite(align):
        third = f"gamma_alignment_min (LayerNorm) {_f(align, '.6f')}"
    elif any(n.get("kind") == "layernorm" for n in result.get("norms") or []):
        third = "gamma_alignment_min (LayerNorm) not read"
    else:
        third = "no LayerNorm (gamma_alignment_min not read)"
    return f"{first}; {second}; {third}"


def source_lines(result: Mapping[str, Any]) -> list[str]:
    """Per-source summary lines and the classification of each collapse (``sources``), or
    nothing for a scan of one source."""
    sources = result.get("sources") or {}
    if not sources:
        return []
    lines = [""]
    for name, s in sources.items():
        lines.append(
            f"source {name}: {s['n_rows']} rows, sigma_min_ratio_min "
            f"{_f(s['sigma_min_ratio_min'], '.4g')} at {s['worst_point']}"
            + (f" ({s['reason']})" if s["reason"] else "")
        )
    collapses = result.get("collapses") or []
    for c in collapses:
        below = ", ".join(c["below"]) or "none"
        above = ", ".join(c["above"]) or "none"
        undecided = f"; too few rows: {', '.join(c['undecided'])}" if c["undecided"] else ""
        lines.append(
            f"collapse at {c['point']} (depth {c['depth']}): {c['class']}; below in {below}; "
            f"healthy in {above}{undecided}"
        )
    if not collapses:
        lines.append("no collapse in any source")
    return lines


def scan_markdown(result: Mapping[str, Any], images: Mapping[str, str]) -> str:
    """``report.md``: facts, alerts, the two tables, then the plots (``file -> caption``)."""
    lines = [f"# normscope scan: {result['model']['class']}", ""]
    lines += [f"- {fact}" for fact in _scan_facts(result)]
    lines.append("")
    lines += [f"**ALERT** `{a['rule']}`: {a['message']}" for a in result["alerts"]] or [
        "No alert from the default rules."
    ]
    lines += ["", "## Norm layers", ""]
    lines += md_table(*_norm_rows(result))
    if result["profile"]:
        lines += ["", "## sigma_min depth profile", ""]
        lines += md_table(*profile_rows(result))
    if result.get("sources"):
        lines += ["", "## Per source", ""]
        lines += [f"- {line}" for line in source_lines(result) if line]
    if result["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    lines += ["", "## Plots", ""]
    for file, caption in images.items():
        lines += [f"### {caption}", "", f"![{caption}]({file})", ""]
    return "\n".join(lines)


def scan_html(result: Mapping[str, Any], images: Mapping[str, str | Path]) -> str:
    """``report.html``: the same as the Markdown, images embedded (``caption -> path``)."""
    facts = "".join(f"<li>{html.escape(f)}</li>" for f in _scan_facts(result))
    alerts = (
        "".join(
            f"<p class=alert>ALERT {html.escape(a['rule'])}: {html.escape(a['message'])}</p>"
            for a in result["alerts"]
        )
        or "<p>No alert from the default rules.</p>"
    )
    sections = [
        f"<ul>{facts}</ul>",
        alerts,
        "<h2>Norm layers</h2>",
        _html_table(*_norm_rows(result)),
    ]
    if result["profile"]:
        sections += [
            "<h2>sigma_min depth profile</h2>",
            _html_table(*profile_rows(result), left=(0, 1)),
        ]
    if result.get("sources"):
        items = "".join(f"<li>{html.escape(x)}</li>" for x in source_lines(result) if x)
        sections.append(f"<h2>Per source</h2><ul>{items}</ul>")
    if result["notes"]:
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in result["notes"])
        sections.append(f"<h2>Notes</h2><ul class=note>{notes}</ul>")
    sections.append("<h2>Plots</h2>")
    sections += [_img(path, caption) for caption, path in images.items()]
    return html_page(f"normscope scan: {result['model']['class']}", sections)


def run_html(
    title: str,
    facts: Sequence[str],
    alerts: Sequence[str],
    images: Mapping[str, str | Path],
    tables: Sequence[tuple[str, Sequence[str], Sequence[Sequence[Any]]]] = (),
    story: Sequence[str] = (),
) -> str:
    """The run report's HTML (facts, alerts, the timeline's lines ``story``, tables
    ``(heading, head, rows)``, images)."""
    sections = ["<ul>" + "".join(f"<li>{html.escape(f)}</li>" for f in facts) + "</ul>"]
    sections += [f"<p class=alert>{html.escape(a)}</p>" for a in alerts] or ["<p>No alert.</p>"]
    if story:
        sections.append(f"<h2>Timeline</h2><pre>{html.escape(chr(10).join(story))}</pre>")
    for heading, head, rows in tables:
        sections += [f"<h2>{html.escape(heading)}</h2>", _html_table(head, rows)]
    sections.append("<h2>Plots</h2>")
    sections += [_img(path, caption) for caption, path in images.items()]
    return html_page(title, sections)
