"""The documentation is the repository's own and complete: every link in the README and in
``docs/`` resolves to a file inside the repository, no file points outside it, every key the
monitors log in a real fit is listed in ``docs/monitors.md`` or ``docs/sources.md``, and every
constructor argument and command-line option is named in its page."""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import warnings
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from examples import sources
from normscope import (
    DeadDirectionConfig,
    DeadDirectionMonitor,
    DeadDirectionTracker,
    SignMagnitudeMonitor,
)
from normscope.cli.options import report_arguments, scan_arguments
from normscope.families.sign_magnitude import SignMagnitudeTracker
from tests.support.fits import fit, read_csv
from tests.support.tiny_models import LitTiny

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def tracked_files() -> list[Path]:
    """The repository's files as git lists them (a clean clone: what users get); outside a git
    checkout, every file but the build outputs."""
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        return [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", ".hypothesis", ".pytest_cache", ".ruff_cache", "build"}
        skip |= {"normscope_runs", "normscope_scan", "wandb", "lightning_logs"}
        return [
            p
            for p in ROOT.rglob("*")
            if p.is_file()
            and not skip & set(p.relative_to(ROOT).parts)
            and "__pycache__" not in p.parts
            and ".egg-info" not in str(p)
        ]


def test_every_link_in_the_readme_and_docs_resolves_inside_the_repository():
    checked = 0
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT), (page.name, target, "points outside the repository")
            assert path.exists(), (page.name, target, "no such file")
            checked += 1
    assert checked >= 20  # the README alone links every page of docs/


def test_no_file_of_the_repository_refers_outside_it():
    """The research notes the project grew from live outside the repository; users never see
    them, so nothing may cite them (the definitions are in docs/metrics.md)."""
    outside = re.compile(r"\.\./shared|shared/(docs|seeds)|\b(METRICS|PITFALLS|DESIGN|STYLE)\.md")
    hits = []
    for path in tracked_files():
        if path == Path(__file__).resolve() or path.suffix in (".png", ".safetensors"):
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        hits += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in outside.finditer(text)]
    assert not hits, hits


def backquoted(*pages: str) -> set[str]:
    """Every backquoted span of these pages of docs/ (fenced code blocks left out: their
    triple backquotes would pair the spans wrongly)."""
    spans: set[str] = set()
    for page in pages:
        text = re.sub(r"```.*?```", "", (ROOT / "docs" / page).read_text(), flags=re.S)
        spans |= set(re.findall(r"`([^`]+)`", text))
    return spans


def logged_keys(tmp_path: Path) -> set[str]:
    """The ``dd``/``sm`` keys of two real CSV-logged fits: both monitors on a 2-block LM, and
    ``sources=`` on examples/sources.py's model (the collapse on one source switched on)."""
    dd = DeadDirectionMonitor(every_n_steps=2, verbose=False, alerts=(), overhead_warn=None)
    sm = SignMagnitudeMonitor(every_n_steps=2, verbose=False, alerts=(), overhead_warn=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = read_csv(fit(tmp_path, LitTiny(layers=2), [dd, sm], steps=5))
        per_source = DeadDirectionMonitor(
            every_n_steps=2, verbose=False, alerts=(), sources="source", overhead_warn=None
        )
        second = read_csv(
            fit(
                tmp_path,
                sources.LitSource(cancel_at=2),
                [per_source],
                steps=5,
                loader=DataLoader(sources.Mixture(code_share=0.25), batch_size=32),
                logger=CSVLogger(tmp_path, name="sources"),
            )
        )
    return {k for rows in (first, second) for k in rows[0] if k.startswith(("dd", "sm"))}


def test_every_logged_key_is_documented(tmp_path):
    """A per-layer key ``dd/<module path>/<metric>`` is documented by its metric's name; a
    run-level key (``dd/<metric>``, ``dd.<source>/<metric>``) by itself or its metric's name."""
    names = backquoted("monitors.md", "sources.md")  # a table cell may list several keys
    keys = logged_keys(tmp_path)
    families = {k.split("/")[0] for k in keys}
    assert {"dd", "sm", "dd.code", "dd.prose"} <= families, families  # both fits logged
    missing = []
    for key in sorted(keys):
        family, *path = key.split("/")
        metric = path[-1]
        if not ({key, metric, f"{family.split('.')[0]}/{metric}"} & names):
            missing.append(key)
    assert not missing, missing


def test_every_argument_and_option_is_documented():
    """Each monitor's every constructor argument is named in docs/monitors.md (or
    sources.md), each tracker's in docs/plain-pytorch.md or docs/monitors.md, and each option
    of ``normscope scan`` and ``normscope report`` in docs/cli.md."""

    def names(*pages: str) -> set[str]:  # the words of the spans: `--seq-len T` names seq-len
        return {w.lstrip("-") for span in backquoted(*pages) for w in re.findall(r"[\w-]+", span)}

    missing = []
    for cls, pages in (
        (DeadDirectionMonitor, ("monitors.md", "sources.md")),
        (DeadDirectionConfig, ("monitors.md", "sources.md")),
        (SignMagnitudeMonitor, ("monitors.md",)),
        (DeadDirectionTracker, ("plain-pytorch.md", "monitors.md", "sources.md")),
        (SignMagnitudeTracker, ("plain-pytorch.md", "monitors.md")),
    ):
        documented = names(*pages)
        for arg in inspect.signature(cls.__init__).parameters:
            if arg != "self" and arg not in documented:
                missing.append(f"{cls.__name__}({arg}=)")
    documented = names("cli.md")
    for command, add in (("scan", scan_arguments), ("report", report_arguments)):
        parser = argparse.ArgumentParser()
        add(parser)
        for action in parser._actions:
            flags = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
            if flags and not any(f.lstrip("-") in documented for f in flags):
                missing.append(f"normscope {command} {flags[0]}")
    assert not missing, missing
