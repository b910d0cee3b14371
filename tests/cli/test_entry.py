"""How ``normscope`` is started: the console script from ``[project.scripts]``, ``python -m
normscope``, ``--help``/``--version``, and the message when the ``cli`` extra is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from normscope import __version__
from tests.support.cli import run_cli

SCRIPT = Path(sys.executable).with_name("normscope")


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)


def test_console_script_is_installed() -> None:
    """`pip install -e .` (what `make test` runs) puts the entry point beside the interpreter."""
    assert SCRIPT.exists(), f"no {SCRIPT}: the [project.scripts] entry point was not installed"
    done = run(str(SCRIPT), "--version")
    assert done.returncode == 0 and done.stdout.strip() == f"normscope {__version__}"


def test_python_m_normscope_reports_a_bad_path(tmp_path: Path) -> None:
    done = run(sys.executable, "-m", "normscope", "report", str(tmp_path / "missing"))
    assert done.returncode == 2
    assert done.stderr.startswith("normscope: error: ") and "Traceback" not in done.stderr


def test_help_lists_every_scan_option() -> None:
    code, out, _ = run_cli("scan", "--help")
    assert code == 0
    for option in ("--data", "--tokens", "--out", "--baseline", "--json", "--trust-remote-code",
                   "--seq-len", "--batch-size", "--device", "--seed", "--threads"):  # fmt: skip
        assert option in out, option
    code, out, _ = run_cli("--help")
    assert code == 0 and "scan" in out and "report" in out


@pytest.mark.parametrize("command, blocked", [("scan", "transformers"), ("report", "matplotlib")])
def test_missing_cli_extra_is_named(
    monkeypatch: pytest.MonkeyPatch, command: str, blocked: str
) -> None:
    # None in sys.modules makes `import name` raise ImportError: the package is "not installed"
    monkeypatch.setitem(sys.modules, blocked, None)
    code, _, err = run_cli(command, "anything")
    assert code == 2
    assert "pip install normscope[cli]" in err and blocked in err
