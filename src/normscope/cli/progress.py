"""Progress on long work for ``normscope scan`` and ``normscope report``: one line on stderr
for each phase that took longer than :data:`PROGRESS_AFTER_S` (a short command prints none;
stdout, and with it ``--json``, stays clean). The scan's forwards also get a bar on a terminal
(``normscope.cli.scan``).

Example::

    phases = Phases("report")
    log = read_run(path)
    phases.done(f"read the run ({len(log.history)} rows)")
    # stderr, when it took over a second: "normscope report: read the run (812 rows) in 3.2 s"
"""

from __future__ import annotations

import sys
import time

__all__ = ["PROGRESS_AFTER_S", "Phases"]

#: a phase that takes longer than this (seconds) says so on stderr
PROGRESS_AFTER_S = 1.0


class Phases:
    """Times the phases of ``normscope <command>``: :meth:`done` ends one and starts the next."""

    def __init__(self, command: str) -> None:
        self.command, self.after, self.t0 = command, PROGRESS_AFTER_S, time.perf_counter()

    def done(self, what: str) -> None:
        took, self.t0 = time.perf_counter() - self.t0, time.perf_counter()
        if took > self.after:
            print(f"normscope {self.command}: {what} in {took:.1f} s", file=sys.stderr, flush=True)
