"""Every scan and run-report figure rendered from known inputs, opened again as a PNG: its
size, that it is not blank, and that the colours that carry the message are there; the
one-line conclusions under the titles and the depth axis's label, each both ways.

The inputs are the shapes ``normscope scan`` and ``normscope report`` pass (the dicts of
``report.json``, ``{step: {key: value}}`` reads): a MiniLM-like post-norm checkpoint (the exact
LayerNorm kernel at rounding, one layer with three dead channels), an RMSNorm model (no kernel),
and a run whose step ratio falls below the threshold at step 30.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from normscope.cli import figures, norm_plots, plots, run_plots, spectrum_plots
from normscope.cli.figures import DPI
from tests.support.cli import assert_drawn, colour_share, png_pixels, png_size

BLUE, ORANGE, PURPLE = (31, 119, 180), (255, 127, 14), (148, 103, 189)
RED, GREY, LIGHT = (214, 39, 40), (127, 127, 127), (191, 191, 191)


def norm(name: str, kind: str = "layernorm", dead: int = 0, **over) -> dict:
    """One ``report.json`` norm: a LayerNorm with its exact kernel (one null eigenvalue)."""
    out = {
        "name": name, "kind": kind, "dim": 384, "dead_channels": dead,
        "dead_index": list(range(dead)), "gamma_alignment": 1.0 - 2e-16,
        "kernel_residual": 1e-15, "null_dim": 1.0,
        "bottom_eigenvalues": [1e-15] + [2e-4 * (1 + k / 10) for k in range(7)],
    }  # fmt: skip
    out.update(over)
    return out


def minilm_like() -> list[dict]:
    norms = [norm("embeddings.LayerNorm")]
    for k in range(3):
        norms.append(norm(f"encoder.layer.{k}.attention.output.LayerNorm"))
        norms.append(norm(f"encoder.layer.{k}.output.LayerNorm"))
    for i, n in enumerate(norms):  # live floors 2e-4 ... 1.2e-3, apart on the plot
        n["bottom_eigenvalues"] = [1e-15] + [2e-4 * (1 + i) * (1 + k / 10) for k in range(7)]
    norms[3]["bottom_eigenvalues"] = [3e-16] + [4e-5 * (1 + k / 10) for k in range(7)]  # lowest
    norms[-1].update(
        dead_channels=3, dead_index=[127, 223, 319], null_dim=3.0, gamma_alignment=1.0,
        bottom_eigenvalues=[-1e-17, 0.0, 4e-17, 1.5e-3, 1.6e-3, 1.7e-3, 1.8e-3, 1.9e-3],
    )  # fmt: skip
    return norms


def rms_model() -> list[dict]:
    return [
        norm(f"model.layers.{k}.input_layernorm", "rmsnorm", gamma_alignment=0.06 + 0.05 * k,
             kernel_residual=0.15, null_dim=0.0,
             bottom_eigenvalues=[8e-4 * (1 + k) * (1 + j / 4) for j in range(8)])
        for k in range(4)
    ]  # fmt: skip


def check_png(path: Path, width: float, height: float) -> np.ndarray:
    """The file is a PNG of the figure's size in pixels and something is drawn on it."""
    assert png_size(path) == (round(width * DPI), round(height * DPI))
    assert_drawn(path)
    return png_pixels(path)


def test_a_blank_figure_fails_the_not_blank_check(tmp_path: Path) -> None:
    """The check has teeth: an axes frame with a title and ticks, nothing plotted, fails it."""
    fig = figures.new_figure()
    ax = fig.add_subplot()
    ax.set_title("nothing here")
    ax.set_xlabel("step")
    figures.save(fig, tmp_path / "blank.png")
    with pytest.raises(AssertionError, match="of the pixels are drawn"):
        assert_drawn(tmp_path / "blank.png")


def unread(norms: list[dict], *keys: str) -> list[dict]:
    """The same norms with ``keys`` not read (NaN / empty): the figure's frame, legend and
    lines without the data, to tell the data's pixels from the legend's."""
    return [
        {**n, **{k: [] if k == "bottom_eigenvalues" else math.nan for k in keys}} for n in norms
    ]


def test_alignment_shows_the_distance_from_exact_and_the_dead_channels(tmp_path: Path) -> None:
    norms = minilm_like()
    pixels = check_png(plots.plot_alignment(norms, tmp_path / "a.png", title="Bert"), 9.0, 5.6)
    frame = png_pixels(
        plots.plot_alignment(
            unread(norms, "gamma_alignment", "kernel_residual"), tmp_path / "f.png", title="Bert"
        )
    )
    # the stems of the six LayerNorms without dead channels, in both panels, are blue: far
    # more blue than the legend's swatch; the dead-channel crosses add red
    assert colour_share(pixels, BLUE) > 5 * colour_share(frame, BLUE) > 0
    assert colour_share(pixels, RED) > colour_share(frame, RED) + 0.0002
    # 1 - gamma_alignment of exactly 0 (the dead layer's 1.0) is drawn at the floor, not dropped
    assert figures.log_floor(np.array([0.0, 2e-16]))[1].tolist() == [True, False]
    assert plots.alignment_verdict(norms) == (
        "6/6 LayerNorms without dead channels keep the exact kernel (kernel_residual <= 1e-15); "
        "dead channels: 3 in layer.2.output"
    )


def test_alignment_verdict_names_a_lost_kernel_and_rmsnorms() -> None:
    norms = minilm_like()[:-1]
    norms[2]["kernel_residual"] = 3e-3
    norms[4]["kernel_residual"] = math.nan  # not read: neither kept nor lost
    verdict = plots.alignment_verdict(norms)
    assert verdict == "kernel LOST at layer.0.output; 4/6 LayerNorms keep it"
    assert plots.alignment_verdict(rms_model()) == (
        "4 RMSNorms: no kernel by design, no kernel alert"
    )
    assert plots.alignment_verdict([]) == "no norm layer was read"


def test_alignment_of_an_rmsnorm_model_is_not_held_to_the_layernorm_kernel(
    tmp_path: Path,
) -> None:
    """An RMSNorm has no kernel: its stems are drawn (orange) against the random level only, no
    LayerNorm 0.9999 or 1e-4 line (red) and no red shading; with one LayerNorm beside them, the
    LayerNorm lines come back, labelled as the LayerNorm's."""
    path = plots.plot_alignment(rms_model(), tmp_path / "rms.png", title="Llama")
    pixels = check_png(path, 9.0, 5.6)
    assert colour_share(pixels, ORANGE) > 0.003  # rmsnorm stems near 1 - 1/sqrt(d) and 0.15
    assert colour_share(pixels, RED) < 0.0002  # no LayerNorm threshold line
    mixed = [*rms_model(), norm("model.ln_extra")]
    pixels = png_pixels(plots.plot_alignment(mixed, tmp_path / "mixed.png", title="Mixed"))
    assert colour_share(pixels, RED) > 0.0005  # the LayerNorm's 1e-4 and 0.9999 lines


def test_spectrum_highlights_first_worst_and_final(tmp_path: Path) -> None:
    norms = minilm_like()
    # worst in between: every inner layer has one null eigenvalue; layer.1.attention (index 3)
    # has the lowest live one, 4e-5
    assert spectrum_plots.spectrum_highlights(norms) == {0: "first", 6: "final", 3: "worst"}
    pixels = check_png(
        spectrum_plots.plot_spectrum(norms, tmp_path / "s.png", title="Bert"), 9.0, 4.8
    )
    for colour in (BLUE, ORANGE, PURPLE, LIGHT):  # first, worst, final, the four others grey
        assert colour_share(pixels, colour) > 0.0005, colour
    # the grey is the four other layers' lines: with only the three highlighted, none is grey
    trio = [norms[0], norms[3], norms[6]]
    assert spectrum_plots.spectrum_highlights(trio) == {0: "first", 2: "final", 1: "worst"}
    frame = png_pixels(spectrum_plots.plot_spectrum(trio, tmp_path / "f.png", title="Bert"))
    others = colour_share(pixels, LIGHT) - colour_share(frame, LIGHT)  # text edges aside
    assert others * pixels.shape[0] * pixels.shape[1] > 4 * 200  # four lines across the plot
    assert spectrum_plots.spectrum_verdict(norms) == (
        "6 layers: 1 null eigenvalue; layer.2.output: 3 null (3 dead channels); "
        "lowest live eigenvalue 4e-05 (layer.1.attention.output)"
    )
    # with more null eigenvalues, an inner layer is the worst however high its live floor
    norms[2]["null_dim"] = 2.0
    assert spectrum_plots.spectrum_highlights(norms)[2] == "worst"


def test_spectrum_without_null_or_without_rows(tmp_path: Path) -> None:
    assert spectrum_plots.spectrum_verdict(rms_model()) == (
        "4 layers: 0 null eigenvalues; lowest live eigenvalue 8e-04 (0)"
    )
    check_png(
        spectrum_plots.plot_spectrum(rms_model(), tmp_path / "rms.png", title="Llama"), 9.0, 4.8
    )
    empty = [norm("a.ln", bottom_eigenvalues=[]), norm("b.ln", bottom_eigenvalues=[])]
    assert spectrum_plots.spectrum_highlights(empty) == {}
    assert spectrum_plots.spectrum_verdict(empty) == "no spectrum: too few rows"
    path = spectrum_plots.plot_spectrum(empty, tmp_path / "none.png", title="tiny")
    assert png_size(path) == (990, 528)


def test_scan_profile_and_gamma_render(tmp_path: Path) -> None:
    profile = [
        {"name": "h.0.ln_1", "sublayer": None, "sigma_min_ratio": 1.0, "sigma_min_step": 1.0,
         "baseline_ratio": 1.0},
        {"name": "h.0.ln_2", "sublayer": "attn", "sigma_min_ratio": 1.4, "sigma_min_step": 1.4,
         "baseline_ratio": 1.1},
        {"name": "h.1.ln_1", "sublayer": "mlp", "sigma_min_ratio": 0.3, "sigma_min_step": 0.2,
         "baseline_ratio": 1.2},
    ]  # fmt: skip
    pixels = check_png(plots.plot_profile(profile, tmp_path / "p.png", title="GPT"), 9.0, 4.8)
    assert colour_share(pixels, BLUE) > 0.0001 and colour_share(pixels, ORANGE) > 0.0001
    rng = np.random.default_rng(0)
    gammas = {"h.0.ln_1": rng.normal(1, 0.1, 64), "ln_f": rng.normal(0.8, 0.2, 64)}
    gammas["ln_f"][[3, 7]] = 0.0
    path = plots.plot_gamma(gammas, {"ln_f": [3, 7]}, tmp_path / "g.png", title="GPT")
    assert colour_share(check_png(path, 9.0, 4.8), RED) > 0.0001  # the two dead channels


def run_reads(depth: bool = True) -> dict[float, dict[str, float]]:
    """Six reads of three points; the step ratio at h.1.ln_1 falls to 0.3 from step 30."""
    reads = {}
    for step in (1.0, 10.0, 20.0, 30.0, 40.0, 50.0):
        late = step >= 30
        r = {
            "dd/h.0.ln_1/sigma_min_ratio": 1.0, "dd/h.0.ln_1/sigma_min_step": 1.0,
            "dd/h.0.ln_2/sigma_min_ratio": 2.0 + step / 50, "dd/h.0.ln_2/sigma_min_step": 2.0,
            "dd/h.1.ln_1/sigma_min_ratio": 0.9 if late else 2.5,
            "dd/h.1.ln_1/sigma_min_step": 0.3 if late else 1.2,
            "dd/sigma_min_ratio_min": 0.9 if late else 2.0, "dd/sigma_min_step_min": 0.3 if late else 1.0,
        }  # fmt: skip
        if depth:
            r.update({"dd/h.0.ln_1/depth": 0.0, "dd/h.0.ln_2/depth": 1.0, "dd/h.1.ln_1/depth": 2.0})
        reads[step] = r
    return reads


POINTS = ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1"]


def test_sigma_over_steps_shows_p0_and_says_when_it_alerted(tmp_path: Path) -> None:
    reads = run_reads()
    alerts = [{"step": 30.0}, {"step": 40.0}]
    path = run_plots.plot_sigma_over_steps(reads, POINTS, alerts, tmp_path / "o.png", title="r")
    pixels = check_png(path, 9.0, 4.8)
    # p_0 is the line at 1; its six logged reads are grey rings on it, not hidden under it:
    # without p_0's logged ratio only the legend's ring is grey
    no_p0 = {s: {k: v for k, v in r.items() if "h.0.ln_1/sigma" not in k} for s, r in reads.items()}
    frame = png_pixels(
        run_plots.plot_sigma_over_steps(no_p0, POINTS, alerts, tmp_path / "f.png", title="r")
    )
    # (antialiased text is grey too: count what the rings add, about 70 pixels each)
    rings = colour_share(pixels, GREY, tol=12) - colour_share(frame, GREY, tol=12)
    assert rings * pixels.shape[0] * pixels.shape[1] > 6 * 40
    assert colour_share(pixels, RED) > 0.0005  # the alert lines and the threshold
    assert run_plots.sigma_verdict(reads, alerts) == "2 alerts, the first at step 30"
    assert run_plots.sigma_verdict(reads, []) == (
        "no alert; lowest sigma_min_step_min 0.3 (step 30), threshold 0.6"
    )
    assert run_plots.sigma_verdict({1.0: {}}, []) == "no alert"


def test_depth_axis_label_says_logged_or_inferred() -> None:
    logged = run_reads(depth=True)
    inferred = run_reads(depth=False)
    label = "residual point (forward order, from the logged dd/<point>/depth)"
    fig = run_plots.run_profile_figure(logged, POINTS, [1.0, 50.0], [], title="r")
    assert fig.axes[0].get_xlabel() == label == run_plots.depth_axis_label(POINTS, logged)
    fig = run_plots.run_profile_figure(inferred, POINTS, [1.0, 50.0], [], title="r")
    assert fig.axes[0].get_xlabel() == "residual point (depth order inferred from module paths)"
    # two points logging one depth, or one point two depths: the order is not the log's
    clash = run_reads()
    clash[1.0]["dd/h.1.ln_1/depth"] = 1.0
    assert run_plots.logged_depths(POINTS, clash) is None
    assert "inferred" in run_plots.depth_axis_label(POINTS, clash)
    assert run_plots.logged_depths(POINTS, logged) == {"h.0.ln_1": 0, "h.0.ln_2": 1, "h.1.ln_1": 2}


def test_run_profile_and_norm_metrics_render(tmp_path: Path) -> None:
    reads = run_reads()
    path = run_plots.plot_run_profile(
        reads, POINTS, [1.0, 30.0, 50.0], [30.0], tmp_path / "p.png", title="r"
    )
    assert colour_share(check_png(path, 9.0, 4.8), RED) > 0.0005  # the read at the alert
    for step, values in reads.items():
        values.update({"dd/ln/gamma_alignment": 1.0, "dd/ln/kernel_residual": 1e-15 * step})
    path = norm_plots.plot_norm_metrics(
        reads, ["ln"], [("gamma_alignment", "a", False), ("kernel_residual", "k", True)],
        [{"step": 30.0}], tmp_path / "n.png", title="r",
    )  # fmt: skip
    check_png(path, 9.0, 2.8 * 2 + 0.6)


def test_titles_wrap_and_tick_labels_stay_short() -> None:
    verdict = plots.alignment_verdict(minilm_like()) + "; " + "x" * 40
    lines = figures.titled("Bert", verdict).split("\n")
    assert lines[0] == "Bert" and len(lines) == 3 and all(len(line) <= 90 for line in lines)
    assert "; ".join(line.rstrip(";") for line in lines[1:]) == verdict
    names = [n["name"] for n in minilm_like()]
    short = figures.short_names(names)
    assert short[:3] == ["embeddings", "layer.0.attention.output", "layer.0.output"]
    assert len(set(short)) == len(names) and max(map(len, short)) <= 24
    # short labels are left alone: h.0.ln_1 keeps its h
    assert figures.short_names(["m.h.0.ln_1", "m.h.1.ln_1", "m.ln_f"]) == ["h.0.ln_1", "h.1.ln_1",
                                                                           "ln_f"]  # fmt: skip
