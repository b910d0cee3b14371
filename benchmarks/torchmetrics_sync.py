"""The transient memory of a cross-rank merge of a ``d x d`` state, three ways:

* ``default sync`` -- a plain ``torchmetrics.Metric`` holding the ``d x d`` float64 second
  moment as a state with ``dist_reduce_fx="sum"``; its default ``sync()`` gathers every rank's
  state (``gather_all_tensors``), stacks and sums;
* ``StreamingCovariance.sync()`` -- normscope's accumulator, a ``Metric`` whose ``dist_sync_fn``
  merges the states with two ``all_reduce``\\ s, the co-moment re-centred and summed in place,
  and hands each state back as a one-element list (``Metric.sync`` also keeps a copy of the
  local state for ``unsync()`` and stacks the list it is given);
* ``StreamingCovariance.reduce_()`` -- the same merge called directly, for good (what a read
  does): no copy kept, nothing stacked.

Real processes (gloo, CPU), each holding one accumulator filled with ``2 d`` rows. Measured per
merge: rank 0's peak resident memory above its memory before the merge, during the merge alone
(Linux: ``/proc/self/clear_refs`` resets the peak, ``VmHWM`` reads it). Every merged state is
checked against a float64 reference.

    python benchmarks/torchmetrics_sync.py                  # d = 512, 1024, 2048 on 2 ranks
    python benchmarks/torchmetrics_sync.py --world 4 --dims 1024
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

WAYS = ("default sync", "StreamingCovariance.sync()", "StreamingCovariance.reduce_()")


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


def _worker(rank: int, world: int, d: int, way: str, init: str, out: str) -> None:
    import torchmetrics

    from normscope.functional import StreamingCovariance

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    x = _rows(rank, d)
    if way == "default sync":

        class SecondMoment(torchmetrics.Metric):
            def __init__(self) -> None:
                super().__init__()
                self.add_state("s", torch.zeros(d, d, dtype=torch.float64), dist_reduce_fx="sum")

            def update(self, rows: torch.Tensor) -> None:
                self.s += rows.T @ rows

            def compute(self) -> torch.Tensor:
                return self.s

        acc = SecondMoment()
        acc.update(x)
        merge = acc.sync
    else:
        acc = StreamingCovariance(d)
        acc.update(x)
        merge = acc.sync if way == "StreamingCovariance.sync()" else acc.reduce_
    del x
    dist.barrier()
    _peak_reset()
    before = _rss("VmRSS")
    merge()
    peak = _rss("VmHWM") - before
    merged = acc.s if way == "default sync" else acc.second_moment() * acc.count
    if rank == 0:
        ref = sum(_rows(r, d).T @ _rows(r, d) for r in range(world))
        ok = torch.allclose(merged, ref, rtol=1e-10, atol=1e-8 * float(ref.abs().max()))
        with open(out, "w") as f:
            f.write(f"{peak} {int(ok)}\n")
    dist.barrier()
    dist.destroy_process_group()


def measure(d: int, way: str, world: int = 2) -> tuple[int, bool]:
    """Rank 0's peak bytes above its resting memory during one merge, and whether the merged
    state equals the reference."""
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/out.txt"
        mp.spawn(_worker, args=(world, d, way, f"file://{tmp}/rdzv", out), nprocs=world)
        peak, ok = open(out).read().split()
    return int(peak), ok == "1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    mib = 2**20
    print(f"{args.world} processes (gloo, CPU), one d x d float64 state each; MiB on rank 0")
    print(f"{'d':>6} {'state':>7} " + " ".join(f"{w:>30}" for w in WAYS))
    for d in args.dims:
        peaks = []
        for way in WAYS:
            peak, ok = measure(d, way, args.world)
            assert ok, f"{way}: the merged state differs from the reference"
            peaks.append(peak)
        cells = " ".join(f"{p / mib:30.1f}" for p in peaks)
        print(f"{d:6d} {d * d * 8 / mib:7.1f} {cells}", flush=True)


if __name__ == "__main__":
    main()
