"""The benchmark scripts (``benchmarks/*.py``) as tests use them: imported as modules, or run
as a user runs them (``--quick --out FILE``) in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported (it imports its neighbours by bare name)."""
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


def run_quick(script: str, out: Path, *extra: str, timeout: int = 600) -> str:
    """Run ``benchmarks/<script> --quick --out <out> <extra...>``; its stdout. Fails the test,
    with the end of stderr, when the script exits non-zero."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
