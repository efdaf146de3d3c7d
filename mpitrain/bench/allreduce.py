"""``mpitrain bench allreduce``: mpitrain's ring against MPI's ``Allreduce``, beside the bound.

Run under ``mpiexec -n 2`` (or ``-n 4`` for the 2- and 4-rank tables; with more ranks
than cores the 4-rank figures measure the oversubscription, not the algorithms). For each
group size ``P`` (the first ``P`` ranks; the others wait) and each message of ``n`` bytes
from 4 KiB to 64 MiB (float32), it times, interleaved so that both see the same machine:

* **mpi**: ``MPI_Allreduce`` in place;
* **ring**: :mod:`mpitrain.comm.ring`'s ring (reduce-scatter + allgather, point to point);
* **bound**: the time of the ring's data movement alone: ``2(P - 1)`` neighbour exchanges
  (``Isend`` to the right, ``Irecv`` from the left, all ranks at once) of one ring chunk
  (``n/P``), without the additions; no allreduce that sends ``2(P-1)/P x n`` per rank
  over these links can beat it by much (a shared-memory algorithm can, by not sending).

Figures are *algorithm bandwidth* ``n / time`` (GB/s) and the ring's share of MPI's.
Each is the median over ``--repeats`` timings of enough calls to take about 20 ms.
"""

from __future__ import annotations

import time

import numpy as np

from mpitrain.comm import Tag, started_thread_level, world
from mpitrain.comm.ring import allreduce, chunk_bounds

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _exchange(comm, buf: np.ndarray, recv: np.ndarray) -> None:
    """The ring's data movement alone: 2(P-1) neighbour exchanges of one chunk, with
    the ring's own calls."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for _ in range(2 * (comm.size - 1)):
        comm.waitall([comm.irecv(recv, left, Tag.RING), comm.isend(buf, right, Tag.RING)])


def _time(comm, fn, calls: int) -> float:
    comm.barrier()
    tick = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - tick
    return max(comm.allgather(seconds)) / calls


def run(repeats: int = 5, sizes=SIZES, log=print) -> list[dict]:
    everyone = world()
    groups = [p for p in (2, 4) if p <= everyone.size] or [1]
    log(f"allreduce of float32 buffers, MPI thread level {started_thread_level()}; GB/s = bytes / time "
        f"(median of {repeats})")
    results = []
    for P in groups:
        inside = everyone.rank < P
        comm = everyone.split(0 if inside else 1, everyone.rank)
        if inside:
            log(f"{P} ranks:      size |   mpi GB/s |  ring GB/s | ring/mpi | bound GB/s")
        for n in sizes:
            x = np.zeros(n // 4, dtype=np.float32)  # (n/4,)
            chunk = int(np.diff(chunk_bounds(x.size, P)).max()) if P > 1 else 0
            send, recv = np.zeros(chunk, np.float32), np.zeros(chunk, np.float32)
            steps = {"mpi": lambda: allreduce(comm, x, "mpi"), "ring": lambda: allreduce(comm, x, "ring"),
                     "bound": lambda: _exchange(comm, send, recv)}
            times = {k: [] for k in steps}
            if inside:
                calls = max(1, int(0.02 / max(_time(comm, steps["mpi"], 1), 1e-6)))
                for _ in range(repeats):
                    for k, fn in steps.items():
                        times[k].append(_time(comm, fn, calls))
                gbs = {k: n / float(np.median(v)) / 1e9 for k, v in times.items()}
                row = {"ranks": P, "bytes": n, **gbs}
                results.append(row)
                log(f"{_size(n):>18} | {gbs['mpi']:10.2f} | {gbs['ring']:10.2f} | {gbs['ring'] / gbs['mpi']:8.2f} | "
                    f"{gbs['bound']:10.2f}")
        comm.free()
        everyone.sleeping_barrier()  # ranks outside the group sleep here while it is timed
    return results


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
