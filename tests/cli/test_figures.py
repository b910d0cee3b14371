"""Every figure of ``normscope scan`` and ``normscope report``, on five kinds of run
(``tests/support/figure_runs.py``: LayerNorm, RMSNorm, post-norm, rank-deficient, 32 blocks), held
to what a reader needs: nothing blank, nothing drawn against another norm's expectations.

Each figure is caught as it is saved (``Figure.savefig`` is wrapped), so the checks read the
matplotlib objects behind the PNG, and the PNG itself is checked for ink:

* every axes draws data, or says in words why it has none (and its title says more);
* every legend entry names an artist that is drawn (no steps, layers or lines not plotted);
* more than ``LEGEND_MAX`` lines get a depth colour scale and the worst three named;
* LayerNorm's 0.9999 and 1e-4 lines only where a LayerNorm is drawn; no alert threshold on a
  post-norm profile; a profile without defined ratios says ``sigma_min(p_0) = 0``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.axes import Axes
from matplotlib.collections import Collection, LineCollection, PathCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.text import Annotation

from normscope.cli.figures import LEGEND_KEY, LEGEND_MAX
from tests.support import figure_runs
from tests.support.cli import assert_drawn, load_json, run_cli

torch.set_num_threads(1)

SCAN_FILES = ("sigma_min_profile.png", "alignment.png", "spectrum.png", "gamma.png")
REPORT_FILES = (
    "sigma_min_over_steps.png",
    "sigma_min_profile.png",
    "alignment.png",
    "gamma.png",
    "schur.png",
    "timeline.png",  # drawn when the run alerted or a read left its band
)
RMS_ONLY = {"rmsnorm", "rank-deficient"}


def _caught(monkeypatch: pytest.MonkeyPatch) -> dict[str, Figure]:
    """``{file name: Figure}`` of every figure saved while the patch is on."""
    seen: dict[str, Figure] = {}
    save = Figure.savefig

    def keep(self: Figure, fname, *args, **kwargs):
        seen[Path(fname).name] = self
        return save(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return seen


@pytest.fixture(scope="module")
def scans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Each kind's checkpoint scanned: (figures, report.json, stdout, out folder)."""
    done = {}
    for kind in figure_runs.KINDS:
        root = tmp_path_factory.mktemp(f"scan_{kind}")
        with pytest.MonkeyPatch.context() as mp:
            figures = _caught(mp)
            ckpt = figure_runs.save_checkpoint(kind, root / "ckpt")
            code, out, err = run_cli(
                "scan", ckpt, "--tokens", 512, "--seq-len", 32, "--out", root / "out"
            )
        assert code == 0, err
        done[kind] = (figures, load_json(root / "out" / "report.json"), out, root / "out")
    return done


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Each kind fitted for 10 steps (a read every 2) and reported on."""
    done = {}
    for kind in figure_runs.KINDS:
        root = tmp_path_factory.mktemp(f"run_{kind}")
        run = figure_runs.fit_run(kind, root / "run")
        with pytest.MonkeyPatch.context() as mp:
            figures = _caught(mp)
            code, out, err = run_cli("report", run, "--out", root / "out")
        assert code == 0, err
        done[kind] = (figures, load_json(root / "out" / "report.json"), out, root / "out")
    return done


# ------------------------------------------------------------------------------ the checks
def _is_scale(ax: Axes) -> bool:
    """A depth colour bar's axes (``figures.depth_scale``)."""
    return "by depth" in ax.get_ylabel() + ax.get_xlabel()


def _shows_data(artist) -> bool:
    """An artist that puts data on the axes: a line or markers with a finite point in data
    coordinates (reference lines such as ``axhline`` live in axes coordinates and do not
    count), stems, box plots."""
    ax = artist.axes
    if isinstance(artist, Line2D):
        if artist.get_transform() != ax.transData:
            return False
        x, y = (np.asarray(v, dtype=float) for v in artist.get_data())
        return bool(np.isfinite(x).any() and np.isfinite(y).any())
    if isinstance(artist, LineCollection):
        return any(np.isfinite(seg).all() for seg in artist.get_segments())
    if isinstance(artist, PathCollection):
        offsets = np.asarray(artist.get_offsets(), dtype=float)
        return offsets.size > 0 and bool(np.isfinite(offsets).all(axis=-1).any())
    return False


def _drawn(artist) -> bool:
    """Shown on the axes at all: data, or a reference line, or a shaded span."""
    if _shows_data(artist):
        return True
    if isinstance(artist, Line2D):  # axhline / axvline: two points in axes coordinates
        return artist.get_transform() != artist.axes.transData and len(artist.get_xdata()) > 0
    if isinstance(artist, Collection):
        return len(artist.get_paths()) > 0
    return artist.get_visible()


def _data_lines(ax: Axes) -> int:
    """Lines that need a name: coloured data lines across the x axis (not the parts of a box
    plot, which the x tick labels name, nor grey lines, which the legend counts as "other N
    layers")."""
    from matplotlib.colors import to_rgb

    count = 0
    for line in ax.lines:
        if not _shows_data(line):
            continue
        x = np.asarray(line.get_xdata(), dtype=float)
        r, g, b = to_rgb(line.get_color())
        if np.nanmax(x) - np.nanmin(x) > 1 and not (r == g == b):
            count += 1
    return count


def check_figure(fig: Figure, name: str) -> dict[str, object]:
    """The rules every figure keeps; returns what a kind-specific test looks at."""
    axes = [ax for ax in fig.axes if not _is_scale(ax)]
    scales = [ax for ax in fig.axes if _is_scale(ax)]
    titles = " ".join(ax.get_title() for ax in axes)
    assert titles.strip(), f"{name}: no title"
    labels: list[str] = []
    for ax in axes:
        artists = [*ax.lines, *ax.collections]
        if not any(_shows_data(a) for a in artists) and not ax.patches:
            said = [t.get_text() for t in ax.texts if t.get_transform() == ax.transAxes]
            assert any(s.startswith("no ") for s in said), (
                f"{name}: an axes with no data and no word why"
            )
        handles, names = ax.get_legend_handles_labels()
        for handle, label in zip(handles, names):
            assert handle.get_gid() == LEGEND_KEY or _drawn(handle), (
                f"{name}: legend entry {label!r} names nothing drawn"
            )
        labels += names
        if _data_lines(ax) > LEGEND_MAX + 2:  # per-layer lines, beyond the run-level ones
            assert scales, f"{name}: {_data_lines(ax)} lines and no colour scale"
            named = [t for t in ax.texts if isinstance(t, Annotation)]
            assert len(named) >= 3, f"{name}: {_data_lines(ax)} lines and the worst not named"
    return {"labels": labels, "titles": titles, "scales": len(scales)}


# ------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("kind", figure_runs.KINDS)
def test_scan_figures(scans, kind: str) -> None:
    figures, result, stdout, out = scans[kind]
    assert sorted(figures) == sorted(SCAN_FILES) == sorted(result["files"][:4])
    seen = {}
    for file in SCAN_FILES:
        assert_drawn(out / file)
        seen[file] = check_figure(figures[file], f"{kind} scan {file}")
    align = seen["alignment.png"]
    if kind in RMS_ONLY:  # an RMSNorm has no kernel: no LayerNorm line, and the title says why
        assert not any(lab.startswith("LayerNorm") for lab in align["labels"])
        assert "no kernel by design" in align["titles"]
    else:
        assert "LayerNorm: 1e-4 kernel-loss alert" in align["labels"]
    profile = seen["sigma_min_profile.png"]
    if kind == "post-norm":
        assert "post-norm" in profile["titles"]
        assert not any("threshold" in lab for lab in profile["labels"])
    else:
        assert "alert threshold 0.6" in profile["labels"]
    assert "nan at None" not in stdout


@pytest.mark.parametrize("kind", figure_runs.KINDS)
def test_report_figures(reports, kind: str) -> None:
    figures, result, stdout, out = reports[kind]
    written = [f for f in REPORT_FILES if f in result["files"]]
    assert sorted(figures) == sorted(written)
    seen = {}
    for file in written:
        assert_drawn(out / file)
        seen[file] = check_figure(figures[file], f"{kind} report {file}")
    align = seen["alignment.png"]
    if kind in RMS_ONLY:
        assert not any(lab.startswith("LayerNorm") for lab in align["labels"])
        assert "no kernel by design" in align["titles"]
        # Delta_gamma and its control are LayerNorm reads: nothing to draw, and the report says so
        assert "schur.png" not in written
        assert any(n.startswith("schur.png not written") for n in result["notes"])
    else:
        assert "LayerNorm: 1e-4 alert" in align["labels"]
    if kind == "post-norm":  # no premise for Delta_gamma: nothing to draw, said in words
        assert "schur.png" not in written
        assert any(
            n.startswith("schur.png not written") and "post_norm" in n for n in result["notes"]
        )
        assert any(n.startswith("post-norm run") for n in result["notes"])
    elif kind not in RMS_ONLY:
        assert "schur.png" in written
    for file in ("sigma_min_over_steps.png", "sigma_min_profile.png"):
        thresholds = [lab for lab in seen[file]["labels"] if "threshold" in lab]
        assert bool(thresholds) == (kind != "post-norm"), file
    if kind == "deep":  # 65 norms and 65 points after p_0: scales, not legends
        for file in written:
            assert seen[file]["scales"] == (file != "sigma_min_profile.png"), file


def test_rank_deficient_scan_says_what_happened_and_what_to_pass(scans) -> None:
    """A checkpoint without a tokenizer, scanned on UTF-8 bytes: fewer distinct tokens than its
    width, so sigma_min(p_0) = 0. The cumulative ratios are read against the first point whose
    rows span (issue 33: before it, every ratio was undefined and the summary read ``nan``);
    the scan says so in words and names what to pass; the figure is drawn."""
    figures, result, stdout, _ = scans["rank-deficient"]
    profile = result["profile"]
    assert profile[0]["sigma_min"] == 0 and profile[0]["sigma_min_ratio"] is None
    anchor = next(k for k, p in enumerate(profile) if p["sigma_min_ratio"] is not None)
    assert anchor >= 1 and profile[anchor]["sigma_min_ratio"] == 1.0
    assert all(isinstance(p["sigma_min_ratio"], float) for p in profile[anchor:])
    summary = next(line for line in stdout.splitlines() if line.startswith("sigma_min_ratio_min"))
    assert "nan" not in summary and " at " in summary
    note = next(n for n in result["notes"] if n.startswith("sigma_min(p_0) = 0"))
    assert "distinct token ids as UTF-8 bytes" in note and "pass its tokenizer" in note
    assert f"read against {profile[anchor]['name']}" in note
    assert any("do not span" in n and "profile_anchor_depth" in n for n in result["notes"])
    distinct = int(note.split("The text gave ")[1].split()[0])
    assert distinct < 128  # the width: why the rank falls short
    ax = figures["sigma_min_profile.png"].axes[0]
    assert _data_lines(ax) >= 1  # never blank


def test_rank_deficient_report_draws_step_ratios_and_says_why(reports) -> None:
    """The run of that model: every read anchored past p_0 (``dd/profile_anchor_depth``), so
    ``sigma_min_ratio_min`` is a number; the report says why and its plots are drawn."""
    figures, result, _, _ = reports["rank-deficient"]
    assert all(r["sigma_min_ratio_min"] != "nan" for r in result["reads"])
    assert any("profile_anchor_depth" in n for n in result["notes"])
    for file in ("sigma_min_over_steps.png", "sigma_min_profile.png"):
        ax = figures[file].axes[0]
        assert _data_lines(ax) >= 3, file  # the points after the anchor
    steps = [lab for lab in figures["sigma_min_profile.png"].axes[0].get_legend_handles_labels()[1]
             if lab.startswith("step ")]  # fmt: skip
    assert steps == [f"step {s}" for s in (2, 4, 6, 8, 10)]


def test_an_empty_panel_says_why(tmp_path: Path) -> None:
    """A panel with nothing finite (an RMSNorm's Delta_gamma beside a LayerNorm's control)
    says so in words; a figure with nothing at all is not written."""
    from normscope.cli.norm_plots import plot_norm_metrics

    reads = {2.0: {"dd/a/delta_gamma": math.nan, "dd/a/delta_gamma_control": 0.02},
             4.0: {"dd/a/delta_gamma": math.nan, "dd/a/delta_gamma_control": -0.01}}  # fmt: skip
    panels = [("delta_gamma", "Delta_gamma", False), ("delta_gamma_control", "control", False)]
    with pytest.MonkeyPatch.context() as mp:
        figures = _caught(mp)
        path = plot_norm_metrics(
            reads, ["a"], panels, [], tmp_path / "s.png", title="t",
            empty={"delta_gamma": "no finite Delta_gamma: because"},
        )  # fmt: skip
    assert path is not None
    check_figure(figures["s.png"], "schur")
    said = [t.get_text() for t in figures["s.png"].axes[0].texts]
    assert said == ["no finite Delta_gamma: because"]
    assert (
        figures["s.png"].axes[0].get_xlim()[0] < 2.0 < 4.0 < figures["s.png"].axes[0].get_xlim()[1]
    )
    for values in reads.values():
        values["dd/a/delta_gamma_control"] = math.nan
    assert plot_norm_metrics(reads, ["a"], panels, [], tmp_path / "n.png", title="t") is None
    assert not (tmp_path / "n.png").exists()
