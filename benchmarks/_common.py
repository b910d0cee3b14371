"""What the benchmark scripts share: the machine line, timing, peak memory, table output.

Not part of the package: every script in ``benchmarks/`` is run as ``python benchmarks/<x>.py``,
so this module is importable as ``_common`` (the script's own folder is on ``sys.path``).

Example::

    >>> from _common import machine, markdown_table  # doctest: +SKIP
    >>> print(markdown_table(["d", "ms"], [[256, "1.0"]]))  # doctest: +SKIP
    | d | ms |
    |---:|---:|
    | 256 | 1.0 |
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "gpt_copy",
    "gpt_step",
    "machine",
    "machine_line",
    "markdown_table",
    "median_time",
    "meminfo_available",
    "peak_rss_reset",
    "peak_rss_bytes",
    "rss_bytes",
    "sync",
    "write_outputs",
]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device | None = None) -> dict[str, Any]:
    """What the figures ran on: CPU model, cores, RAM, load, torch, threads (and the GPU)."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "nproc": os.cpu_count(),
        "ram_gib": round(_meminfo("MemTotal") / 2**30, 1) if _meminfo("MemTotal") else None,
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_mem_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def machine_line(info: dict[str, Any]) -> str:
    """One line for a RESULTS.md section: ``Machine: ...``."""
    line = (
        f"Machine: {info['cpu']}, {info['nproc']} cores, {info['ram_gib']} GiB RAM, "
        f"torch {info['torch']}, {info['threads']} threads, load average {info['loadavg_1m']} "
        "at start"
    )
    if "gpu" in info:
        line += f"; GPU {info['gpu']} ({info['gpu_mem_gib']} GiB), CUDA {info['cuda']}"
    return line


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(
    fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1
) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn()`` over ``repeats`` calls, synchronised on both sides."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(max(1, repeats)):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; columns of text left-aligned, columns of numbers right-aligned."""

    def text_col(i: int) -> bool:
        cells = [str(r[i]) for r in rows if i < len(r) and str(r[i]).strip()]
        return bool(cells) and not any(_numeric(c) for c in cells)

    align = ["---" if text_col(i) else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _numeric(text: str) -> bool:
    return re.fullmatch(r"[-+0-9.eE,x%]+", text.strip()) is not None


def write_outputs(out: str | os.PathLike[str] | None, markdown: str, data: Any) -> list[Path]:
    """Write ``<out>.md`` (the tables) and ``<out>.json`` (the figures); a ``.md`` or ``.json``
    suffix on ``out`` is dropped first. Returns the paths written (none when ``out`` is None)."""
    if out is None:
        return []
    base = Path(out)
    if base.suffix in (".md", ".json"):
        base = base.with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)
    md, js = base.with_suffix(".md"), base.with_suffix(".json")
    md.write_text(markdown.rstrip() + "\n")
    js.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return [md, js]


# ------------------------------------------------------------------ memory (Linux /proc)
def _status_kib(key: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{key}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def _meminfo(key: str) -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(rf"^{key}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return 1024 * int(m.group(1)) if m else None


def meminfo_available() -> int | None:
    """``MemAvailable`` of the machine in bytes (None off Linux)."""
    return _meminfo("MemAvailable")


def rss_bytes() -> int | None:
    """Resident set size of this process now (``VmRSS``)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else 1024 * kib


def peak_rss_bytes() -> int | None:
    """Peak resident set size since the last :func:`peak_rss_reset` (``VmHWM``)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else 1024 * kib


def peak_rss_reset() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0: ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def gpt_step(model: Any, opt: Any, monitor: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    """Seconds of one training step of ``examples/nanogpt.py``'s GPT on ``(x, y)``: forward and
    backward inside ``monitor.step`` when there is a monitor, then the optimiser's step."""
    start = time.perf_counter()
    if monitor is None:
        _, loss = model(x, y)
        loss.backward()
    else:
        with monitor.step((x, y)):
            _, loss = model(x, y)
            loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def gpt_copy(base: Any, config: dict[str, Any] | None, every_n_steps: int) -> tuple[Any, Any, Any]:
    """``(model, optimiser, monitor)``: a deep copy of ``base`` (``examples/nanogpt.py``'s GPT),
    its AdamW (lr 1e-3, weight decay 0.1) and, unless ``config`` is None, a quiet dead-direction
    monitor (``DeadDirectionConfig(**config)``: no rules, no printing, no overhead warning)."""
    import copy

    from examples.nanogpt import make_optimizer

    from normscope import DeadDirectionConfig, Monitor

    model = copy.deepcopy(base)
    opt = make_optimizer(model, 1e-3, 0.1)
    monitor = None
    if config is not None:
        monitor = Monitor.of(
            DeadDirectionConfig(**config),
            model,
            every_n_steps=every_n_steps,
            alerts=(),
            verbose=False,
            overhead_warn=None,
        )
    return model, opt, monitor
