"""A background worker for a read's eigensolves: one thread, at most one read in flight.

The float64 eigensolves of a read (:func:`~normscope.families.dead_direction.solve_window`) need
nothing but the window's frozen accumulators, so they can run while training goes on: CPU
LAPACK releases the GIL, and on a GPU they run on a side CUDA stream (after it waits for the
stream that filled the accumulators; the handed tensors are ``record_stream``-ed so that the
caching allocator does not reuse their memory under the side stream). No collective ever runs
on the worker: gathering a split read and deciding a stop stay on the main thread.

The thread is started by the first :meth:`ReadWorker.submit` and joined by
:meth:`ReadWorker.shutdown` (the monitor's fit end, teardown and ``on_exception``).

Example::

    worker = ReadWorker()
    worker.submit(lambda: 6 * 7)
    worker.result()          # waits: 42
    worker.shutdown()
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["ReadWorker"]


class ReadWorker:
    """One ``ThreadPoolExecutor(max_workers=1)``, created on first use, and the read in flight.

    Args:
        name: the thread's name prefix (``threading.enumerate()`` shows it).
    """

    def __init__(self, name: str = "normscope-read") -> None:
        self.name = name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._future: concurrent.futures.Future | None = None
        self._stream: Any = None

    @property
    def pending(self) -> bool:
        """A read was submitted and its result not yet taken."""
        return self._future is not None

    def ready(self) -> bool:
        """The read in flight has finished (its :meth:`result` returns at once)."""
        return self._future is not None and self._future.done()

    def submit(
        self, fn: Callable[[], Any], tensors: Sequence[torch.Tensor] = (), device: Any = None
    ) -> None:
        """Run ``fn()`` on the worker. ``tensors``: what it reads (on a CUDA ``device``, the side
        stream waits for the current stream first and each tensor is ``record_stream``-ed).

        Raises:
            RuntimeError: a read is still in flight (take its :meth:`result` first).
        """
        if self._future is not None:
            raise RuntimeError("normscope: a read is already in flight")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.name)
        run = fn
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
            if self._stream is None or self._stream.device != dev:
                self._stream = torch.cuda.Stream(device=dev)
            side = self._stream
            side.wait_stream(torch.cuda.current_stream(dev))
            for t in tensors:
                if t.device.type == "cuda":
                    t.record_stream(side)

            def run() -> Any:
                with torch.cuda.device(dev), torch.cuda.stream(side):
                    out = fn()
                side.synchronize()  # the results are host values; nothing left queued
                return out

        self._future = self._pool.submit(run)

    def result(self) -> Any:
        """Wait for the read in flight and return what it gave (re-raising what it raised);
        nothing is in flight after."""
        if self._future is None:
            raise RuntimeError("normscope: no read in flight")
        future, self._future = self._future, None
        return future.result()

    def drop(self) -> None:
        """Forget the read in flight (a queued one is cancelled; a running one finishes on its
        own and its result is never read). :meth:`shutdown` still joins the thread."""
        if self._future is not None:
            self._future.cancel()
            self._future = None

    def shutdown(self) -> None:
        """Drop the read in flight and join the thread (no thread is left behind)."""
        self.drop()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class InFlight:
    """At most one read in flight on a :class:`ReadWorker`: its window, whether it was taken
    under several processes, and the optimiser step it belongs to.

    Example::

        >>> import torch
        >>> class Window:
        ...     def tensors(self): return []
        >>> flight = InFlight()
        >>> flight.submit(lambda: "records", Window(), distributed=False, step=4, device="cpu")
        >>> flight.due(5, wait=True)[2]
        'records'
        >>> flight.stop()
    """

    def __init__(self) -> None:
        self.worker = ReadWorker()
        self.pending: tuple[Any, bool, int] | None = None  # window, distributed, its step
        self.handoff_seconds = 0.0
        self._waited: Any = None

    def submit(
        self,
        solve: Callable[[], Any],
        window: Any,
        *,
        distributed: bool,
        step: int,
        device: torch.device | str,
    ) -> None:
        """Hand ``solve`` (the middle part of a read of ``window``) to the worker."""
        self.pending = (window, distributed, step)
        self.worker.submit(solve, window.tensors(), device)

    def due(self, step_at_begin: int, *, wait: bool) -> tuple[Any, bool, Any] | None:
        """``(window, distributed, records)`` of the read in flight if its time has come: under
        DDP at the next optimiser step end (waiting for it), else once it is ready (``wait``:
        now); None otherwise."""
        if self.pending is None:
            return None
        window, distributed, completed = self.pending
        if distributed and not wait and step_at_begin <= completed:
            return None
        if not (wait or distributed or self.worker.ready()):
            return None
        records = self._waited or self.worker.result()
        self._waited = None
        self.pending = None
        return window, distributed, records

    def hold(self) -> bool:
        """A checkpoint while a read is in flight: True when one process should publish it now
        (the checkpoint holds it whole); under DDP (the publish is a collective) its solves are
        waited for here and it is published at its usual step."""
        if self.pending is None:
            return False
        if not self.pending[1]:
            return True
        if self._waited is None and self.worker.pending:
            self._waited = self.worker.result()
        return False

    def stop(self) -> None:
        """Drop a read in flight and join the worker thread."""
        self.pending = None
        self._waited = None
        self.worker.shutdown()
