"""``normscope report RUN_DIR`` on runs made by real Lightning fits with DeadDirectionMonitor.

One fit of the callback tests' tiny LM with a cancelling MLP branch switched on at step 4
(``LitTiny(cancel_at_step=4)``) logs to a CSVLogger and to an offline WandbLogger at once:

* the CSV log has no alert records, so the report re-evaluates the monitor's default rules over
  the logged reads: the alert must come out at the step and point where the monitor fired;
* the W&B run holds the alert record the monitor sent (``run.alert``): the report shows it, and
  its reads are the CSV's reads;
* a healthy fit gives no alert; a folder with no run, or a run without ``dd/`` keys, exits 2.
"""

from __future__ import annotations

import base64
import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from normscope import DeadDirectionMonitor
from normscope.alerts import alert_text
from normscope.cli.report import depth_order
from normscope.cli.run_alerts import reevaluate_alerts
from tests.support.cli import assert_drawn, load_json, png_size, run_cli
from tests.support.fits import fit
from tests.support.tiny_models import LitTiny, cpu_trainer

torch.set_num_threads(1)

RUN_PNGS = (
    "sigma_min_over_steps.png",
    "sigma_min_profile.png",
    "alignment.png",
    "gamma.png",
    "schur.png",
)


def logged_run(
    root: Path, module: L.LightningModule, steps: int, wandb: bool
) -> DeadDirectionMonitor:
    """A monitored fit logged to CSV (``root/csv``) and, with ``wandb``, to offline W&B too."""
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False, alerts=("log", "wandb"))
    loggers: list = [CSVLogger(root, name="csv")]
    if wandb:
        loggers.append(WandbLogger(project="normscope-cli-test", save_dir=str(root)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the alert's own UserWarning, Lightning's hints
        fit(root, module, monitor, steps=steps, logger=loggers)
    if wandb:
        loggers[1].experiment.finish()
    return monitor


@pytest.fixture(scope="module")
def collapsed_run(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("collapsed_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        torch.manual_seed(0)
        monitor = logged_run(root, LitTiny(cancel_at_step=4, cancel_layer=1), steps=12, wandb=True)
    assert monitor.alerts_fired, "the cancelling branch must make the monitor alert"
    csv_dir = root / "csv" / "version_0"
    (wandb_dir,) = (root / "wandb").glob("offline-run-*")
    return monitor, csv_dir, wandb_dir


@pytest.fixture(scope="module")
def csv_report(collapsed_run, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("csv_report")
    code, stdout, stderr = run_cli("report", collapsed_run[1], "--out", out)
    return code, stdout, stderr, out


def check_files(
    out: Path, result: dict, pngs: tuple[str, ...] = (*RUN_PNGS, "timeline.png")
) -> None:
    """The report's files; ``pngs``: the figures it must hold (an alerting run's timeline too)."""
    for name in (*pngs, "report.md", "report.html", "report.json"):
        assert (out / name).is_file() and name in result["files"], name
    for name in pngs:
        width, height = png_size(out / name)
        assert 600 <= width <= 2000 and 300 <= height <= 2000, (name, width, height)
        assert_drawn(out / name)
    page = (out / "report.html").read_text()
    sources = re.findall(r'src="([^"]+)"', page)
    assert len(sources) == len(pngs)
    assert {base64.b64decode(s.split(",", 1)[1]) for s in sources} == {
        (out / n).read_bytes() for n in pngs
    }


def test_csv_run_gets_the_monitors_alert_by_re_evaluation(collapsed_run, csv_report) -> None:
    monitor = collapsed_run[0]
    code, stdout, stderr, out = csv_report
    assert code == 0, stderr
    result = load_json(out / "report.json")
    assert result["run"]["source"] == "csv"
    fired = monitor.alerts_fired
    assert [a["step"] for a in result["alerts"]] == [float(a.step) for a in fired]
    for mine, theirs in zip(result["alerts"], fired):
        assert mine["origin"] == "re-evaluated" and mine["title"] == f"normscope: {theirs.rule}"
        assert f" at {theirs.point} " in mine["text"]
    assert result["points"][0] == "model.h.0.ln_1"  # p_0: ratio and step 1 at every read
    assert result["points"][-1] == "model.ln_f"
    # the baseline window is step 1 (step 0's forward is residual discovery's)
    assert [r["step"] for r in result["reads"]] == ["2", "4", "6", "8", "10", "12"]
    alert_row = next(
        line for line in stdout.splitlines() if line.split()[:1] == [str(fired[0].step)]
    )
    assert alert_row.rstrip().endswith("ALERT")
    assert "re-evaluated" in stdout
    check_files(out, result)
    assert f"ALERT at step {fired[0].step}" in (out / "report.md").read_text()


def test_wandb_run_shows_its_alert_records(collapsed_run, csv_report, tmp_path: Path) -> None:
    monitor, _, wandb_dir = collapsed_run
    code, stdout, stderr = run_cli("report", wandb_dir, "--out", tmp_path / "wandb", "--json")
    assert code == 0, stderr
    result = load_json(tmp_path / "wandb" / "report.json")
    assert __import__("json").loads(stdout) == result
    assert result["run"]["source"] == "wandb"
    first = monitor.alerts_fired[0]
    assert result["alerts"], "the alert record of the run"
    alert = result["alerts"][0]
    assert alert["origin"] == "logged" and alert["title"] == first.title
    # the W&B text is the message and what to try (issue 43)
    assert alert["text"] == alert_text(first) and alert["step"] == float(first.step)
    assert first.remedy and alert["text"].endswith(f" -- try: {first.remedy}")
    check_files(tmp_path / "wandb", result)
    # the same reads as the CSV log of the same fit
    from_csv = load_json(csv_report[3] / "report.json")
    assert result["points"] == from_csv["points"] and result["norms"] == from_csv["norms"]
    assert [r["step"] for r in result["reads"]] == [r["step"] for r in from_csv["reads"]]
    for a, b in zip(result["reads"], from_csv["reads"]):
        assert float(a["sigma_min_ratio_min"]) == pytest.approx(
            float(b["sigma_min_ratio_min"]), rel=1e-3
        )


def test_healthy_run_has_no_alert(tmp_path: Path) -> None:
    torch.manual_seed(1)
    monitor = logged_run(tmp_path / "run", LitTiny(), steps=8, wandb=False)
    assert not monitor.alerts_fired
    code, stdout, stderr = run_cli("report", tmp_path / "run", "--out", tmp_path / "out")
    assert code == 0, stderr
    assert load_json(tmp_path / "out" / "report.json")["alerts"] == []
    assert "no alert" in stdout
    assert "timeline: healthy: no read left its band" in stdout  # one line, no timeline.png
    assert "timeline.png" not in load_json(tmp_path / "out" / "report.json")["files"]
    # no alert column, and no empty cell in the reads table (it had an unnamed last column)
    md = (tmp_path / "out" / "report.md").read_text().splitlines()
    table = [line for line in md if line.startswith("| ") and line[2:3].isdigit()]
    assert table and all("|  |" not in line and " - |" not in line for line in table)
    assert (
        "| step | sigma_min_ratio_min | sigma_min_step_min | worst point | "
        "gamma_alignment_min |" in md
    )


def test_bad_run_folders_exit_2(tmp_path: Path) -> None:
    code, _, stderr = run_cli("report", tmp_path / "missing")
    assert code == 2 and "no such file or folder" in stderr
    code, _, stderr = run_cli("report", tmp_path)
    assert code == 2 and "found no run" in stderr
    (tmp_path / "v0").mkdir()
    (tmp_path / "v0" / "metrics.csv").write_text("epoch,step,train/loss\n0,0,3.4\n0,1,3.1\n")
    code, _, stderr = run_cli("report", tmp_path / "v0")
    assert code == 2 and "no normscope metrics" in stderr and "DeadDirectionMonitor" in stderr


def test_depth_order_is_inferred_from_p0_and_natural_order() -> None:
    points = ["m.ln_f", "m.h.10.ln_1", "m.h.2.ln_2", "m.h.2.ln_1", "m.h.0.ln_1"]
    reads = {1.0: {f"dd/{p}/sigma_min_ratio": 1.5 for p in points}}
    reads[1.0].update({"dd/m.h.2.ln_1/sigma_min_ratio": 1.0, "dd/m.h.2.ln_1/sigma_min_step": 1.0})
    # p_0 is h.2.ln_1 here (ratio and step exactly 1), even though h.0 sorts before it
    assert depth_order(points, reads) == ["m.h.2.ln_1", "m.h.0.ln_1", "m.h.2.ln_2", "m.h.10.ln_1",
                                          "m.ln_f"]  # fmt: skip


def test_kernel_loss_is_re_evaluated_on_layernorms_only() -> None:
    """The declared kind comes from norm_class and kind_mismatch; only a LayerNorm that loses
    its kernel alerts, once."""

    def read(ln_residual: float) -> dict[str, float]:
        return {
            "dd/ln/norm_class": 1.0 if ln_residual < 1e-8 else 0.0, "dd/ln/kind_mismatch": 0.0,
            "dd/ln/kernel_residual": ln_residual, "dd/ln/gamma_alignment": 1.0,
            "dd/rms/norm_class": -1.0, "dd/rms/kind_mismatch": 0.0,
            "dd/rms/kernel_residual": 0.3, "dd/rms/gamma_alignment": 0.1,
        }  # fmt: skip

    reads = {1.0: read(1e-15), 2.0: read(3e-3), 3.0: read(4e-3)}
    alerts = reevaluate_alerts(reads, ["ln", "rms"], [])
    assert [(a["step"], a["title"]) for a in alerts] == [(2.0, "normscope: layernorm_kernel_lost")]
    assert "at ln at step 2" in alerts[0]["text"]


def test_logged_depth_orders_points_that_path_order_would_get_wrong() -> None:
    """OPT-style names sort ``final_layer_norm`` before ``self_attn_layer_norm``; the monitor's
    logged ``dd/<point>/depth`` gives the forward order instead (and a log without it, or with
    a depth missing, falls back to the inferred order)."""
    names = ["decoder.layers.0.self_attn_layer_norm", "decoder.layers.0.final_layer_norm", "e"]
    reads = {
        1.0: {
            "dd/e/sigma_min_ratio": 1.0,
            "dd/e/sigma_min_step": 1.0,
            "dd/e/depth": 0.0,
            "dd/decoder.layers.0.self_attn_layer_norm/depth": 1.0,
            "dd/decoder.layers.0.final_layer_norm/depth": 2.0,
        }
    }
    assert depth_order(names, reads) == ["e", names[0], names[1]]
    del reads[1.0]["dd/decoder.layers.0.final_layer_norm/depth"]
    assert depth_order(names, reads) == ["e", names[1], names[0]]  # inferred: path order


def test_report_of_a_run_with_sources_shows_them_and_the_classification(tmp_path: Path) -> None:
    """A CSV-logged fit of examples/sources.py (the collapse on the code source only): the
    report reads the dd.<source>/ keys, tabulates each source and the collapse's class, and
    re-evaluates the source rule (the CSV holds no alert record)."""
    from torch.utils.data import DataLoader

    from examples import sources

    torch.manual_seed(0)
    # every row: the code source is a quarter of them, and its own profile needs 4 d of its own
    monitor = DeadDirectionMonitor(
        every_n_steps=10,
        verbose=False,
        alerts=(),
        sources="source",
        overhead_warn=None,
        rows_per_read="all",
    )
    trainer = cpu_trainer(30, [monitor], logger=[CSVLogger(tmp_path, name="csv")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            sources.LitSource(cancel_at=20),
            DataLoader(sources.Mixture(code_share=0.25), batch_size=32),
        )
    assert monitor.last_report.as_dict()["dd/collapse_class"] == 2.0
    out = tmp_path / "report"
    code, stdout, stderr = run_cli("report", tmp_path / "csv" / "version_0", "--out", out)
    assert code == 0, stderr
    result = load_json(out / "report.json")
    assert result["sources"] == ["code", "prose"]
    last = result["source_reads"][-1]
    assert last["step"] == "30" and last["collapse"] == "distribution-dependent"
    assert last["at"] == "model.h.2.ln_1"
    assert last["code ratio_min (rows)"].endswith("(128)")  # 8 code samples of 32 x 16 tokens
    assert [r["collapse"] for r in result["source_reads"][:-1]] == ["none"] * 3
    texts = [a["text"] for a in result["alerts"]]
    assert any("under source 'code' only" in t for t in texts), texts
    assert not any(t.startswith("sigma_min_collapse") for t in texts)  # pooled stays healthy
    assert "Per source:" in stdout and "## Per source" in (out / "report.md").read_text()


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory: pytest.TempPathFactory):
    """Real Hugging Face ``Trainer`` runs (tiny GPT-2, cancelling branch) to W&B and TensorBoard."""
    from tests.support.hf_runs import hf_run

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        return {
            kind: hf_run(tmp_path_factory.mktemp(f"hf_{kind}"), kind)
            for kind in ("wandb", "tensorboard")
        }


@pytest.mark.parametrize("kind", ["wandb", "tensorboard"])
def test_hugging_face_trainer_run_is_reported_at_its_global_steps(
    hf_runs, kind: str, tmp_path: Path
) -> None:
    """``train/dd/...`` keys, the Trainer's global step (not W&B's ``_step``), and the alert the
    callback logged as ``dd/alert/sigma_min_collapse`` at its first read."""
    hf = hf_runs[kind]
    code, stdout, stderr = run_cli("report", hf.folder, "--out", tmp_path)
    assert code == 0, stderr
    result = load_json(tmp_path / "report.json")
    assert result["run"]["source"] == kind
    assert [float(r["step"]) for r in result["reads"]] == sorted(hf.reads)
    fired = hf.alerts
    assert fired and [a["step"] for a in result["alerts"]] == [float(a.step) for a in fired]
    alert = result["alerts"][0]
    assert alert["origin"] == "logged" and alert["title"] == f"normscope: {fired[0].rule}"
    assert f" at {fired[0].point} at step {fired[0].step}" in alert["text"]
    assert any("Hugging Face Trainer run" in n for n in result["notes"])
    assert result["points"][0] == "transformer.h.0.ln_1" and result["norms"]
    check_files(tmp_path, result)
    md = (tmp_path / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| step")]
    assert table == ["| step | sigma_min_ratio_min | sigma_min_step_min | worst point | "
                     "gamma_alignment_min | alert |"]  # fmt: skip


def test_a_collapse_is_re_evaluated_under_the_runs_objective() -> None:
    """``normscope report --objective embedding``: the offset share of an embedding's final norm
    jumping from 0.14 to 0.997 in one read (the held-out Llama's self-supervised collapse) is
    the collapse; under the default objective (a language model, whose first steps look the
    same) the stream keeps its width and nothing fires."""

    def read(share: float) -> dict[str, float]:
        return {
            "dd/ln_f/n_rows": 2048.0, "dd/ln_f/rankme": 9.0, "dd/final_rows_per_dim": 8.0,
            "dd/final_out_offset_share": share, "dd/final_rankme_centred": 137.0,
            "dd/sigma_min_ratio_min": 1.42,
        }  # fmt: skip

    reads = {1.0: read(0.1414), 9.0: read(0.9967), 19.0: read(0.9992)}
    assert reevaluate_alerts(reads, ["ln_f"], []) == []
    alerts = reevaluate_alerts(reads, ["ln_f"], [], objective="embedding")
    assert [(a["step"], a["title"]) for a in alerts] == [
        (9.0, "normscope: representation_collapse")
    ]
