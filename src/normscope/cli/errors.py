"""The one error the command line turns into a message and exit code 2."""

from __future__ import annotations

from normscope._common import NormscopeError

__all__ = ["EXIT_OK", "EXIT_USAGE", "CLIError"]

EXIT_OK = 0
EXIT_USAGE = 2  # bad input: a path, a model, a missing extra (argparse uses 2 as well)


class CLIError(NormscopeError):
    """A problem with what the user asked for (a path, a model, a missing dependency).

    ``normscope`` prints ``normscope: error: <message>`` and exits with code 2; no traceback,
    because the message says what to change.

    Example::

        >>> raise CLIError("no config.json in /tmp/x")  # doctest: +SKIP
    """
