"""normscope.runs: reading real W&B offline runs, CSV logger folders and TensorBoard events back."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from normscope.runs import (
    RunReadError,
    read_csv_run,
    read_run,
    read_tensorboard_run,
    read_wandb_run,
    wandb_records,
)


def _wandb_run(tmp_path: Path, steps: int, width: int) -> tuple[Path, dict[int, dict[str, float]]]:
    import wandb

    run = wandb.init(project="normscope-test", dir=str(tmp_path))
    rng = np.random.default_rng(0)
    logged: dict[int, dict[str, float]] = {}
    for step in range(steps):
        row = {f"dd/layer.{i}/gamma_alignment": float(rng.standard_normal()) for i in range(width)}
        row["dd/sigma_min_ratio_min"] = math.nan if step == 2 else 1.0 + step
        run.log(row, step=step)
        logged[step] = row
        if step == 3:
            run.alert(title="normscope: test", text=f"something at step {step}", level="WARN")
    run.alert(title="no step named", text="plain text", level="INFO")
    run.finish()
    folder = Path(run.dir).parent
    _wait_for_rows(folder, steps)
    return folder, logged


def _wait_for_rows(folder: Path, rows: int, timeout_s: float = 30.0) -> None:
    """W&B 0.31's ``finish()`` can return before its core process has flushed the last rows
    to the offline file (seen under load, on main too): wait until they are there."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(read_wandb_run(folder).history) < rows:
        time.sleep(0.25)


def test_wandb_history_and_alerts_round_trip(tmp_path, wandb_offline):
    """Every logged scalar comes back bit for bit (W&B stores JSON doubles), NaN included; rows
    larger than a 32 KiB block (FIRST/MIDDLE/LAST chunks) are reassembled."""
    run_dir, logged = _wandb_run(tmp_path, steps=6, width=1500)
    run = read_run(run_dir)
    assert run.source == "wandb" and run.path.suffix == ".wandb"
    assert run.path.stat().st_size > 3 * 32768
    assert [int(r["step"]) for r in run.history] == list(range(6))
    for row in run.history:
        want = logged[int(row["step"])]
        for key, value in want.items():
            got = row[key]
            assert (math.isnan(value) and math.isnan(got)) or got == value, key
    steps, values = run.series("dd/sigma_min_ratio_min")
    assert steps.tolist() == [0, 1, 2, 3, 4, 5]
    assert np.isnan(values[2]) and values[5] == 6.0
    # An alert whose text names no step gets the last row written before it: W&B writes step 5's
    # row only at finish, after the alert, so that is step 4 (the documented "a step early").
    assert [(a["title"], a["step"], a["level"]) for a in run.alerts] == [
        ("normscope: test", 3.0, "WARN"),
        ("no step named", 4.0, "INFO"),
    ]
    assert "dd/layer.0/gamma_alignment" in run.keys() and "step" not in run.keys()


def test_corrupt_and_foreign_files_are_clear_errors(tmp_path, wandb_offline):
    run_dir, _ = _wandb_run(tmp_path, steps=2, width=3)
    file = read_wandb_run(run_dir).path
    data = bytearray(file.read_bytes())
    data[7 + 7 + 10] ^= 0xFF  # inside the first record's payload (file header 7, chunk 7)
    bad = tmp_path / "bad" / "run-bad.wandb"
    bad.parent.mkdir()
    bad.write_bytes(bytes(data))
    with pytest.raises(RunReadError, match="checksum"):
        list(wandb_records(bad, strict=True))
    other = tmp_path / "x.wandb"
    other.write_bytes(b"not a wandb file at all")
    with pytest.raises(RunReadError, match="bad header"):
        read_run(other)
    with pytest.raises(RunReadError, match="no such file"):
        read_run(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RunReadError, match="found no run"):
        read_run(empty)


def test_a_corrupt_chunk_costs_its_block_not_the_file(tmp_path, wandb_offline):
    """One flipped byte in the middle of a multi-block file: the rest of that 32 KiB block is
    skipped (LevelDB's recovery), a record straddling it is dropped whole, every other row comes
    back bit for bit, and one warning plus ``run.skipped`` say what was lost."""
    from normscope.runs import SkippedBytes

    run_dir, logged = _wandb_run(tmp_path, steps=30, width=200)
    intact = read_wandb_run(run_dir)
    data = bytearray(intact.path.read_bytes())
    assert len(data) > 5 * 32768
    at = 2 * 32768 + 5000  # inside block 2
    data[at] ^= 0x01
    bad = tmp_path / "bad" / "run-bad.wandb"
    bad.parent.mkdir()
    bad.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=r"1 corrupt stretch\(es\) skipped"):
        run = read_wandb_run(bad)
    assert len(run.skipped) == 1
    lost = run.skipped[0]
    assert isinstance(lost, SkippedBytes) and lost.reason == "checksum mismatch"
    assert 2 * 32768 <= lost.start <= at < lost.end == 3 * 32768
    assert lost.chunks_dropped >= 1
    rows = {int(r["step"]): r for r in run.history}
    missing = sorted(set(logged) - set(rows))
    # a row is ~7 KB: a 32 KiB block holds parts of at most 6 rows
    assert 1 <= len(missing) <= 6 and missing == list(range(missing[0], missing[-1] + 1))
    assert max(rows) == max(logged)  # reading went on after the corrupt block
    for step, row in rows.items():
        for key, value in logged[step].items():
            assert (math.isnan(value) and math.isnan(row[key])) or row[key] == value
    assert not intact.skipped


def test_csv_logger_folder(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="run")
    logger.log_metrics({"dd/a": 0.5, "loss": 2.0}, step=0)
    logger.log_metrics({"loss": 1.5}, step=1)
    logger.log_metrics({"dd/a": float("nan")}, step=3)
    logger.save()
    run = read_run(tmp_path)
    assert run.source == "csv"
    steps, values = run.series("dd/a")
    assert steps.tolist() == [0.0, 3.0] and values[0] == 0.5 and np.isnan(values[1])
    assert run.series("loss")[1].tolist() == [2.0, 1.5]
    second = CSVLogger(tmp_path, name="run")
    second.log_metrics({"x": 1.0}, step=0)
    second.save()
    with pytest.raises(RunReadError, match="several runs"):
        read_csv_run(tmp_path)


def test_tensorboard_events(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="tb")
    logger.log_metrics({"dd/a": 0.25, "loss": 3.0}, step=0)
    logger.log_metrics({"dd/a": 0.75}, step=5)
    logger.finalize("success")
    run = read_tensorboard_run(tmp_path)
    assert run.source == "tensorboard"
    steps, values = run.series("dd/a")
    assert steps.tolist() == [0.0, 5.0] and values.tolist() == [0.25, 0.75]
    assert read_run(tmp_path).keys() == ["dd/a", "loss"]


def test_a_wandb_save_folder_with_its_latest_run_link(tmp_path, wandb_offline):
    """``wandb/`` holds the run folder and a ``latest-run`` link to it: one run, not two."""
    run_dir, _ = _wandb_run(tmp_path, steps=2, width=2)
    save_dir = run_dir.parent
    assert (save_dir / "latest-run").is_symlink()
    assert read_run(save_dir).path.resolve() == read_run(run_dir).path.resolve()
    # the folder a user hands to WandbLogger(save_dir=...), two levels above the file
    assert read_run(save_dir.parent).path.resolve() == read_run(run_dir).path.resolve()


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """One real Hugging Face ``Trainer`` run logged to W&B (offline), one to TensorBoard."""
    from tests.support.hf_runs import hf_run

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        return {
            kind: hf_run(tmp_path_factory.mktemp(f"hf_{kind}"), kind)
            for kind in ("wandb", "tensorboard")
        }


@pytest.mark.parametrize("kind", ["wandb", "tensorboard"])
def test_hugging_face_trainer_runs_read_at_the_global_step(hf_runs, kind):
    """The Trainer logs ``train/dd/...`` (W&B and TensorBoard) and, on W&B, the step as
    ``train/global_step`` between its own loss rows: the keys come back as ``dd/...`` at the
    Trainer's global step, the Trainer's own keys untouched."""
    hf = hf_runs[kind]
    run = read_run(hf.folder)
    assert run.source == kind and run.key_prefix == "train/"
    assert sorted(hf.reads) == [2, 4, 8, 12, 16, 20, 24]  # the baseline window is step 1
    steps, values = run.series("dd/sigma_min_ratio_min")
    assert steps.tolist() == sorted(hf.reads)
    want = [hf.reads[s]["dd/sigma_min_ratio_min"] for s in sorted(hf.reads)]
    # W&B keeps the double; TensorBoard stores float32
    assert values.tolist() == pytest.approx(want, rel=0 if kind == "wandb" else 1e-6)
    assert not any(k.startswith("train/dd") for k in run.keys())
    assert "train/loss" in run.keys() and "dd/alert/sigma_min_collapse" in run.keys()
    if kind == "wandb":  # what the reader must not use: W&B's row counter
        rows = [r for r in run.history if "dd/sigma_min_ratio_min" in r]
        assert [r["_step"] for r in rows] != steps.tolist()
        assert [r["train/global_step"] for r in rows] == steps.tolist()


def test_prefix_is_dropped_from_normscope_keys_only():
    from normscope.runs import RunLog

    rows = [{"train/dd/a": 1.0, "train/dd[fast].code/b": 2.0, "train/sm/c": 3.0,
             "train/loss": 4.0, "train/dda/x": 5.0, "step": 1.0}]  # fmt: skip
    run = RunLog("tensorboard", Path("."), rows)
    assert run.key_prefix == "train/"
    assert run.keys() == ["dd/a", "dd[fast].code/b", "sm/c", "train/dda/x", "train/loss"]
    plain = RunLog("csv", Path("."), [{"dd/a": 1.0, "step": 1.0}])
    assert plain.key_prefix == "" and plain.keys() == ["dd/a"]


def test_plain_loop_wandb_log_is_read_at_its_steps(tmp_path, wandb_offline):
    """A plain loop's ``Monitor.of(config, model, log=wandb.log)`` (the loop passes ``step=``, so
    W&B's ``_step`` is the loop's step): the reads come back at the steps they were logged at."""
    import wandb

    from normscope import DeadDirectionConfig, Monitor
    from tests.support import loops

    run = wandb.init(project="normscope-test", dir=str(tmp_path))
    model = loops.gpt2(cancel=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=loops.LR)
    batch = next(iter(loops.loader()))
    read_at = []

    def log(metrics, step):  # wandb.log, noting the steps it was given
        read_at.append(step)
        wandb.log(metrics, step=step)

    monitor = Monitor.of(
        DeadDirectionConfig(rows_per_read="all"), model, log=log, every_n_steps=2, alerts=(),
        overhead_warn=None, verbose=False,
    )  # fmt: skip
    for _ in range(7):
        with monitor.step(batch):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    monitor.close()
    folder = Path(run.dir).parent
    run.finish()
    _wait_for_rows(folder, len(read_at))
    steps, values = read_run(folder).series("dd/sigma_min_ratio_min")
    assert read_at and steps.tolist() == [float(s) for s in read_at]
    assert np.isfinite(values).all() and read_run(folder).key_prefix == ""
