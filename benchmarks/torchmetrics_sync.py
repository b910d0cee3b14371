"""The transient memory of a cross-rank merge: a torchmetrics ``Metric``'s default sync against
normscope's ``StreamingCovariance.reduce_`` (one ``all_reduce`` of the centred co-moment).

Two real processes (gloo, CPU), each holding one ``d x d`` float64 co-moment. The torchmetrics
metric declares it as a state with ``dist_reduce_fx="sum"``; its ``sync()`` gathers every rank's
state (``gather_all_tensors``), stacks and sums. normscope's reduce re-centres the co-moment in
place and sums it with one ``all_reduce``. Measured per merge: rank 0's peak resident memory
above its memory before the merge, during the merge alone (Linux: ``/proc/self/clear_refs``
resets the peak, ``VmHWM`` reads it).
Both merged states are checked against a float64 reference.

    python benchmarks/torchmetrics_sync.py            # d = 512, 1024, 2048
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def _rows(rank: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(2 * d, d, dtype=torch.float64, generator=g) + rank


def _peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _worker(rank: int, world: int, d: int, which: str, init: str, out: str) -> None:
    import torchmetrics

    from normscope.functional import StreamingCovariance

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    x = _rows(rank, d)
    if which == "torchmetrics":

        class CoMoment(torchmetrics.Metric):
            def __init__(self) -> None:
                super().__init__()
                self.add_state("s", torch.zeros(d, d, dtype=torch.float64), dist_reduce_fx="sum")

            def update(self, rows: torch.Tensor) -> None:
                self.s += rows.T @ rows

            def compute(self) -> torch.Tensor:
                return self.s

        acc = CoMoment()
        acc.update(x)
        del x
        dist.barrier()
        _peak_reset()
        before = _rss("VmRSS")
        acc.sync()
        peak = _rss("VmHWM") - before
        merged = acc.s
    else:
        acc = StreamingCovariance(d)
        acc.update(x)
        del x
        dist.barrier()
        _peak_reset()
        before = _rss("VmRSS")
        acc.reduce_()
        peak = _rss("VmHWM") - before
        merged = acc.second_moment() * acc.count
    if rank == 0:
        ref = sum(_rows(r, d).T @ _rows(r, d) for r in range(world))
        ok = torch.allclose(merged, ref, rtol=1e-10, atol=1e-8 * float(ref.abs().max()))
        with open(out, "w") as f:
            f.write(f"{peak} {int(ok)}\n")
    dist.barrier()
    dist.destroy_process_group()


def measure(d: int, which: str, world: int = 2) -> tuple[int, bool]:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/out.txt"
        mp.spawn(_worker, args=(world, d, which, f"file://{tmp}/rdzv", out), nprocs=world)
        peak, ok = open(out).read().split()
    return int(peak), ok == "1"


def main() -> None:
    world, mib = 2, 2**20
    print(f"{world} processes (gloo, CPU), one d x d float64 co-moment each; MiB on rank 0")
    print(f"{'d':>6} {'state':>7} {'torchmetrics sync peak':>23} {'normscope reduce_ peak':>23}")
    for d in (512, 1024, 2048):
        tm_peak, ok_tm = measure(d, "torchmetrics", world)
        ns_peak, ok_ns = measure(d, "normscope", world)
        assert ok_tm and ok_ns, "a merged state differs from the reference"
        state = d * d * 8
        print(f"{d:6d} {state / mib:7.1f} {tm_peak / mib:23.1f} {ns_peak / mib:23.1f}")


if __name__ == "__main__":
    main()
