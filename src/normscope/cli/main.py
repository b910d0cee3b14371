"""``normscope`` argument parsing and the exit-code contract.

Exit codes: 0 done; 2 bad input -- a usage error (argparse), a missing path, a model that cannot
be read or is refused (pickle-only weights, repository code without ``--trust-remote-code``),
a missing ``cli`` extra; 1 an unexpected failure (with its traceback: a bug to report).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from normscope import __version__
from normscope.cli import report, scan
from normscope.cli.errors import EXIT_USAGE, CLIError
from normscope.cli.options import report_arguments, scan_arguments

__all__ = ["build_parser", "main"]

# What each command imports beyond the runtime dependencies: the `cli` extra. The command
# modules import none of them when they load (matplotlib when a figure is drawn, transformers
# when a model directory is read, tqdm when a scan runs), so that this check speaks first.
_NEEDS = {
    "scan": ("matplotlib", "transformers", "safetensors", "tqdm"),
    "report": ("matplotlib",),
}
_RUN = {"scan": scan.run, "report": report.run}


def build_parser() -> argparse.ArgumentParser:
    """The ``normscope`` parser with its ``scan`` and ``report`` sub-commands."""
    parser = argparse.ArgumentParser(
        prog="normscope",
        description="Read the geometry of a transformer's norm layers and residual stream: "
        "scan a checkpoint, or report on a finished run's logged metrics.",
    )
    parser.add_argument("--version", action="version", version=f"normscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p_scan = sub.add_parser(
        "scan",
        help="scan a checkpoint: every norm's kernel reads and the sigma_min depth profile",
        description="Scan a checkpoint on a few thousand tokens and compare it with its "
        "random-init twin. Prints a table; writes report.md, report.html, report.json and PNGs.",
    )
    scan_arguments(p_scan)
    p_report = sub.add_parser(
        "report",
        help="plot a finished run's logged normscope metrics over training steps",
        description="Turn a run's logged metrics (a Lightning CSVLogger folder or a W&B "
        "offline run folder) into plots over training steps, alerts marked.",
    )
    report_arguments(p_report)
    return parser


def _check_extra(command: str) -> None:
    missing = []
    for name in _NEEDS.get(command, ()):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise CLIError(
            f"`normscope {command}` needs {', '.join(missing)}: pip install normscope[cli]"
        )


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code.

    Example::

        >>> main(["scan", "/no/such/model"])  # doctest: +SKIP
        normscope: error: /no/such/model: no such model directory (...)
        2
    """
    args_list = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exit_:  # argparse: --help/--version exit 0, usage errors exit 2
        return int(exit_.code or 0)
    try:
        _check_extra(args.command)
        return _RUN[args.command](args)
    except CLIError as err:
        print(f"normscope: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("normscope: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
