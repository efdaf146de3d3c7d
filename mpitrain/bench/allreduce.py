"""``mpitrain bench allreduce``: mpitrain's ring against MPI's ``Allreduce``, beside the bound.

Run under ``mpiexec -n 2`` (or ``-n 4`` for the 2- and 4-rank tables; with more ranks
than cores the 4-rank figures measure the oversubscription, not the algorithms). For each
group size ``P`` (the first ``P`` ranks; the others wait) and each message of ``n`` bytes
from 4 KiB to 64 MiB (float32), it times, round by round:

* **mpi**: ``MPI_Allreduce`` in place;
* **ring**: :mod:`mpitrain.comm.ring`'s ring (reduce-scatter + allgather, point to point);
* **bound**: the ring's data movement alone, with its own calls: ``2(P - 1)`` neighbour
  exchanges (``Isend`` right, ``Irecv`` left, all ranks at once) of one ring chunk
  (``n/P``), without the additions; no allreduce sending ``2(P-1)/P x n`` per rank over
  these links can beat it by much (a shared-memory algorithm can, by not sending).

Figures are *algorithm bandwidth* ``n / time`` (GB/s) and the ring's share of MPI's,
each the median over ``--repeats`` timings of enough calls to take about 20 ms.

Across ``N`` nodes of ``L`` ranks (``mpitrain cluster``, or a real cluster) a last table
times MPI's, the ring's and the node-aware allreduce (:mod:`mpitrain.comm.hierarchical`)
over all ranks, in ms, beside its bounds: its network phase alone (``L`` allreduces of
``n/L`` across the nodes, side by side) and, where ``$MPITRAIN_LINK_RATE`` gives the
link's rate (``mpitrain cluster`` sets it), ``2 (N-1)/N x n`` bytes per node over it.
"""

from __future__ import annotations

import os

import numpy as np

from mpitrain import cost
from mpitrain.bench.measure import interleaved, medians, slowest
from mpitrain.cluster import bits_per_second
from mpitrain.comm import Tag, started_thread_level, world
from mpitrain.comm.hierarchical import hierarchy
from mpitrain.comm.allreduce import allreduce
from mpitrain.comm.ring import chunk_bounds

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _exchange(comm, buf: np.ndarray, recv: np.ndarray) -> None:
    """The bound's data movement (above)."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for _ in range(2 * (comm.size - 1)):
        comm.waitall([comm.irecv(recv, left, Tag.RING), comm.isend(buf, right, Tag.RING)])


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
            if inside:
                calls = max(1, int(0.02 / max(slowest(comm, steps["mpi"]), 1e-6)))
                times = medians(interleaved(steps, repeats, lambda fn: slowest(comm, fn, calls)))
                gbs = {k: n / t / 1e9 for k, t in times.items()}
                results.append({"ranks": P, "bytes": n, **gbs})
                log(f"{_size(n):>18} | {gbs['mpi']:10.2f} | {gbs['ring']:10.2f} | {gbs['ring'] / gbs['mpi']:8.2f} | "
                    f"{gbs['bound']:10.2f}")
        comm.free()
        everyone.sleeping_barrier()  # ranks outside the group sleep here while it is timed
    nodes = everyone.dup()
    if hierarchy(nodes).cross.size > 1:
        results += _node_aware(nodes, repeats, [n for n in sizes if n >= 1 << 20], log)
    nodes.free()
    return results


def _node_aware(comm, repeats: int, sizes, log) -> list[dict]:
    """All ranks, across nodes: MPI, ring, node-aware, and the node-aware bound (ms)."""
    h = hierarchy(comm)
    N, L = h.cross.size, h.node.size
    link = os.environ.get("MPITRAIN_LINK_RATE", "")
    rate = bits_per_second(link)
    log(f"{N} nodes x {L} ranks: size |  mpi ms | ring ms | node-aware ms | /mpi | network alone ms"
        + (f" | bound ms ({link}) | /bound" if rate else ""))
    results = []
    for n in sizes:
        x = np.zeros(n // 4, dtype=np.float32)  # (n/4,)
        b = chunk_bounds(x.size, L)
        mine = x[b[h.node.rank] : b[h.node.rank + 1]]
        steps = {"mpi": lambda: allreduce(comm, x, "mpi"), "ring": lambda: allreduce(comm, x, "ring"),
                 "hierarchical": lambda: allreduce(comm, x, "hierarchical"), "network": lambda: h.cross.allreduce(mine)}
        ms = {k: 1e3 * t for k, t in medians(interleaved(steps, repeats, lambda fn: slowest(comm, fn))).items()}
        row = {"nodes": N, "ranks_per_node": L, "bytes": n, **ms}
        line = (f"{_size(n):>23} | {ms['mpi']:7.1f} | {ms['ring']:7.1f} | {ms['hierarchical']:13.1f} | "
                f"{ms['hierarchical'] / ms['mpi']:4.2f} | {ms['network']:16.1f}")
        if rate:
            row["bound"] = 1e3 * 8 * cost.collective_bytes("allreduce", n, N) / rate  # rate in bits/s
            line += f" | {row['bound']:{14 + len(link)}.1f} | {ms['hierarchical'] / row['bound']:6.2f}"
        results.append(row)
        log(line)
    return results


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
