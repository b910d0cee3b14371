"""benchmarks/gpu_suite.py: the no-CUDA exit, the --smoke-cpu run of every code path, and the
deadline that skips what would overrun. Run as a real subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"
PARTS = ("accumulate", "eigensolves", "monitor read", "training", "overhead")


def _run(*args: str, hide_cuda: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", HF_HUB_OFFLINE="1")
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch.cuda.is_available() is False, GPU or not
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def test_without_cuda_it_says_so_and_exits_0(tmp_path: Path) -> None:
    proc = _run("--out", str(tmp_path / "gpu"), hide_cuda=True)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device available" in proc.stdout
    assert "--smoke-cpu" in proc.stdout  # it tells the user what to run instead
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written


@pytest.fixture(scope="module")
def smoke(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess, dict, str]:
    out = tmp_path_factory.mktemp("smoke") / "gpu_smoke"
    # A generous budget: on a loaded CI machine the tiny sizes must still all run.
    proc = _run("--smoke-cpu", "--budget", "300", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    return proc, data, out.with_suffix(".md").read_text()


def test_smoke_writes_every_part_as_markdown_and_json(smoke) -> None:
    proc, data, md = smoke
    assert data["smoke_cpu"] is True and data["device"] == "cpu"
    assert data["machine"]["torch"] and data["machine"]["nproc"] >= 1
    for part in PARTS:
        assert f"### {part}" in md
        assert "error" not in data["parts"][part], data["parts"][part].get("error")
        rows = data["parts"][part]["rows"]
        assert rows and all(r.get("status") == "ok" for r in rows), rows
    assert "gpu_suite: done" in proc.stdout


def test_smoke_accumulator_matches_the_cpu_float64_reference(smoke) -> None:
    _, data, md = smoke
    rows = data["parts"]["accumulate"]["rows"]
    assert [r["d"] for r in rows] == [64, 128]
    for r in rows:
        # The same code path as on CUDA; on the CPU both sides run the same float64 kernels,
        # so the error is rounding only (the bound the GPU run must meet is 1e-12).
        assert r["comoment_rel_err"] <= 1e-12 and r["mean_rel_err"] <= 1e-12
        assert r["accuracy_ok"] is True
        assert r["update_gflops"] > 0 and r["matmul_gflops"] > 0
    assert "PASS" in md and "FAIL" not in md


def test_smoke_eigensolves_and_reads_are_timed(smoke) -> None:
    _, data, _ = smoke
    for r in data["parts"]["eigensolves"]["rows"]:
        for key in (
            "symmetric_eigh",
            "eigvalsh",
            "kernel_read",
            "kernel_read_fast",
            "schur_quotient",
            "sigma_min",
            "sigma_min_fast",
        ):
            assert r[key] > 0
        assert r["eig_ok"] is True
        # the default route against the dense one on the device (dense below d = 1024)
        assert r["fast_ok"] is True and r["fast_rel_err"] <= 1e-10
    (read,) = data["parts"]["monitor read"]["rows"]
    assert read["model"] == "2x64" and read["read_finite"] is True
    assert read["taps"] > 0 and read["read_s"] > 0 and read["every_1pct"] >= 1


def test_smoke_training_runs_each_monitor_configuration(smoke) -> None:
    _, data, md = smoke
    rows = {r["configuration"]: r for r in data["parts"]["training"]["rows"]}
    assert set(rows) == {
        "none",
        "DeadDirectionMonitor every=3 (default)",
        "DeadDirectionMonitor every=3 sync",
        "DeadDirectionMonitor every=3 async",
        "SignMagnitudeMonitor every=3",
        "both every=3",
        "DeadDirectionMonitor every=1",
    }
    assert rows["none"]["mean_over_none"] == 1.0
    for name, r in rows.items():
        assert r["steps"] >= 4 and r["mean"] > 0
        if name != "none":
            assert r["failures"] == []  # no monitor disabled itself
            assert all(n >= 2 for n in r["reads"]), (name, r["reads"])  # it really read
    # every=1 reads at every step but the first, whose forward finds the stream: 6 steps, 5 reads
    assert rows["DeadDirectionMonitor every=1"]["reads"] == [5]
    assert "| none |" in md


def test_smoke_overhead_interleaves_the_monitor_and_wandb_watch(smoke) -> None:
    """Part 5 is benchmarks/overhead.py's step-interleaved run: every configuration trained
    the same steps in one process, the monitor really read, wandb.watch really logged."""
    _, data, md = smoke
    rows = {r["configuration"]: r for r in data["parts"]["overhead"]["rows"]}
    assert set(rows) == {"none", "dd every=2", "wandb.watch every=2"}
    assert len({r["steps"] for r in rows.values()}) == 1  # the same steps for every copy
    assert rows["none"]["ratio"] == 1.0 and rows["none"]["reads"] == 0
    assert rows["dd every=2"]["reads"] >= 1 and rows["wandb.watch every=2"]["reads"] >= 1
    for r in rows.values():
        assert r["mean_ms"] > 0 and r["plain_ms"] > 0 and r["width"] == 32
    assert "per-read extra, plain steps" in md


def test_deadline_skips_instead_of_overrunning(tmp_path: Path) -> None:
    # A budget equal to the write reserve: the global deadline has passed before any item.
    proc = _run("--smoke-cpu", "--budget", "10", "--out", str(tmp_path / "late"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "late.json").read_text())
    for part in PARTS:
        rows = data["parts"][part]["rows"]
        assert rows and all(r["status"] == "skipped: global deadline" for r in rows), rows
    assert "skipped: global deadline" in (tmp_path / "late.md").read_text()
