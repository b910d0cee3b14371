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
from tests.support.hf_models import build_hf_model  # noqa: E402

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
    """The tiny random-init ``tests.support.hf_models`` model ``name`` (seed 0), saved with
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


def png_pixels(path: Path) -> Any:
    """The PNG's RGB pixels as ``(height, width, 3)`` uint8, read back by matplotlib."""
    import matplotlib.image
    import numpy as np

    rgba = matplotlib.image.imread(path)
    return np.round(rgba[..., :3] * 255).astype(np.uint8)


def colour_share(pixels: Any, rgb: tuple[int, int, int], tol: int = 10) -> float:
    """Share of the pixels within ``tol`` (per channel) of ``rgb``: how much of a figure is
    drawn in one colour (antialiased edges aside)."""
    import numpy as np

    return float(np.all(np.abs(pixels.astype(int) - np.array(rgb)) <= tol, axis=-1).mean())


def assert_drawn(path: Path, min_ink: float = 0.03) -> float:
    """The PNG is not blank: at least ``min_ink`` of its pixels are not the white background
    (an empty axes frame with a title and tick labels inks 2.1%, the sparsest real figure,
    a scan's gamma box plots of 5 layers, 3.6%); returns that share."""
    ink = 1.0 - colour_share(png_pixels(path), (255, 255, 255), tol=8)
    assert ink >= min_ink, f"{path}: only {ink:.1%} of the pixels are drawn"
    return ink
