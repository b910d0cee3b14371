"""The options of each command (no heavy imports here: ``--help`` and the missing-extra
message must work without matplotlib or transformers)."""

from __future__ import annotations

import argparse

__all__ = ["DEFAULT_TOKENS", "parse_size", "report_arguments", "scan_arguments"]

DEFAULT_TOKENS = 8192


_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"4GiB"``, ``"1.5GB"`` or plain bytes, as an int of bytes (> 0).

    Example::

        >>> parse_size("64KiB")
        65536
    """
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("kmgib")
    unit = raw[len(number) :]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write bytes, or a number with KiB, MiB, GiB (KB, MB, GB)"
        ) from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return int(value)


def scan_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``normscope scan``."""
    p.add_argument(
        "model",
        metavar="MODEL",
        help="a Hugging Face model directory (config.json + *.safetensors, loaded offline) "
        "or package.module:factory returning an nn.Module (or a (model, tokenizer) pair)",
    )
    p.add_argument(
        "--data",
        metavar="[NAME=]PATH",
        action="append",
        help="a text file or a folder of text files (default: the Python standard library's "
        "own source, the demo's corpus). Repeat it (or write NAME=PATH) to scan several "
        "sources: each gets --tokens rows, its own sigma_min profile (dd.NAME/...), and a "
        "collapse is classified intrinsic or distribution-dependent",
    )
    p.add_argument(
        "--tokens",
        type=int,
        metavar="N",
        help=f"token rows to read (default: max({DEFAULT_TOKENS}, 4 d), d the widest norm; "
        "reads need at least 2 d)",
    )
    p.add_argument(
        "--out",
        default="normscope_scan",
        metavar="DIR",
        help="output folder (default: %(default)s)",
    )
    p.add_argument(
        "--baseline",
        choices=("random-init", "none"),
        default="random-init",
        help="scan beside the checkpoint the same architecture at random init (seeded), whose "
        "reads are shown as what an untrained model reads, or nothing",
    )
    p.add_argument("--json", action="store_true", help="print report.json to stdout, no table")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model directory's own Python code (auto_map) to run",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=128,
        metavar="T",
        help="tokens per window (default: %(default)s, capped by the model's positions)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="B",
        help="windows per forward (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="torch device for the forwards (default: %(default)s; cuda, cuda:1 ...)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the random-init twin (default: %(default)s)"
    )
    p.add_argument(
        "--max-memory",
        type=parse_size,
        metavar="SIZE",
        help="budget for the float64 accumulators (e.g. 4GiB; default: none). Over it, points "
        "and layers are read at a stride over depth; the notes say what was left out",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch CPU threads (default: torch's choice; 1 is fastest on a busy machine)",
    )


def report_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``normscope report``."""
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a finished run: a Lightning CSVLogger folder (metrics.csv), a W&B run folder or "
        "run-*.wandb file (offline runs too), or a folder of TensorBoard event files",
    )
    p.add_argument(
        "--out",
        default="normscope_report",
        metavar="DIR",
        help="output folder (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print report.json to stdout, no table")
    p.add_argument(
        "--objective",
        choices=("tokens", "embedding"),
        default="tokens",
        help="what the run trained, for the re-evaluated collapse rule (as "
        "DeadDirectionMonitor(objective=...)): tokens (a language model, default) or embedding "
        "(embeddings made to agree across views: self-supervised, contrastive)",
    )
    p.add_argument(
        "--name",
        default=None,
        metavar="NAME",
        help="report on the monitor named NAME (DeadDirectionMonitor(name=NAME): its dd[NAME]/ "
        "keys); default: the unnamed monitor's dd/ keys (the names a run holds are listed)",
    )
