"""Shared helpers of the command-line tests: run ``normscope`` in-process, save tiny
random-init Hugging Face models, read PNG headers."""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from normscope.cli.main import main  # noqa: E402
from tests.hf_models import build_hf_model  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCAN_PNGS = ("sigma_min_profile.png", "alignment.png", "spectrum.png", "gamma.png")


class _Terminal(io.StringIO):
    """A captured stream that says it is a terminal (tqdm draws its bar only on one)."""

    def isatty(self) -> bool:
        return True


def run_cli(*argv: Any, tty: bool = False) -> tuple[int, str, str]:
    """``normscope *argv`` in this process: (exit code, stdout, stderr); ``tty``: stderr looks
    like a terminal."""
    out, err = io.StringIO(), (_Terminal() if tty else io.StringIO())
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def save_tiny(name: str, path: Path) -> Path:
    """The tiny random-init ``tests.hf_models`` model ``name`` (seed 0), saved with
    ``save_pretrained`` (config.json + model.safetensors, no tokenizer)."""
    model, _ = build_hf_model(name)
    model.save_pretrained(path)
    return path


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header, after checking the signature and the IHDR chunk."""
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13, f"{path}: no IHDR chunk first"
    return struct.unpack(">II", data[16:24])


def load_json(path: Path) -> dict[str, Any]:
    """Strict JSON: a NaN or Infinity in the file fails the test."""

    def refuse(token: str) -> None:
        raise AssertionError(f"{path}: non-standard JSON constant {token}")

    return json.loads(Path(path).read_text(), parse_constant=refuse)
