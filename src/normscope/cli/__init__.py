"""The ``normscope`` command line: ``normscope scan MODEL`` reads a checkpoint you already
have, ``normscope report RUN_DIR`` turns a finished run's logged metrics into plots.

    normscope scan path/to/hf-model-dir --out scan/          # table + report.md/.html + PNGs
    normscope scan mypkg.models:build_model --tokens 16384
    normscope report lightning_logs/version_0                # CSV logger or W&B offline run
    python -m normscope scan ...                             # the same

Needs the ``cli`` extra (``pip install normscope[cli]``: matplotlib, transformers,
safetensors). The entry point is :func:`normscope.cli.main.main`.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line (see :mod:`normscope.cli.main`)."""
    from normscope.cli.main import main as _main

    return _main(argv)
