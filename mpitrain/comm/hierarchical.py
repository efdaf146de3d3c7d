"""Node-aware allreduce (Horovod's hierarchical allreduce): shared memory inside a node,
the network between nodes, each byte over the network once per node.

A flat ring over ``P = N x L`` ranks (``N`` nodes of ``L`` ranks) sends ``2(P-1)/P x n``
per rank, and the ``L`` ranks of a node share its one link, so a node sends about
``2 L (P-1)/P x n`` over the network: ``L`` times what it must. Here, with a node's
ranks each owning a slice of the buffer:

1. **reduce-scatter inside the node** (mpitrain's ring on ``node``): local rank ``l``
   ends with slice ``l`` (``n / L`` elements) summed over its node;
2. **allreduce across nodes** of that slice, between the ranks with the same local
   rank on every node (``cross``, one per local rank: ``L`` allreduces side by side,
   MPI's own): each slice now holds the sum over all ``P`` ranks;
3. **allgather inside the node** (the ring again): every rank has every slice.

Network bytes per node: ``L`` slices of ``n / L``, each allreduced among ``N`` nodes,
``2 (N-1)/N x n`` in all, the least any algorithm can send; the shared-memory phases
move ``2 (L-1)/L x n`` per rank at memory speed (:func:`mpitrain.cost.node_aware_bytes`).
Equal to MPI's allreduce up to the order of the additions (tested).

Nodes are the ranks that share memory (``MPI_Comm_split_type``, as MPI sees them, so
under ``mpitrain cluster`` its emulated nodes), or, for tests on one machine,
``ranks_per_node`` consecutive ranks. Every node must have the same number of ranks.
:func:`hierarchy` builds the two communicators once per communicator (collective).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from mpitrain.comm.requests import Request
from mpitrain.comm.ring import Ring, chunk_bounds
from mpitrain.dtypes import is_half

_hierarchies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class Hierarchy:
    """``node``: this rank's node (local rank = ``node.rank``); ``cross``: the ranks of
    this local rank on every node (node index = ``cross.rank``)."""

    node: object
    cross: object


def hierarchy(comm, ranks_per_node: int | None = None) -> Hierarchy:
    """The node and cross communicators of ``comm``, made on its first use (collective)
    and kept with it: later calls return them whatever ``ranks_per_node`` they give."""
    made = _hierarchies.get(comm)
    if made is not None:
        return made
    if ranks_per_node is None:
        node = comm.split_node()
    else:
        if comm.size % ranks_per_node:
            raise ValueError(f"{comm.size} ranks do not form nodes of {ranks_per_node}")
        node = comm.split(comm.rank // ranks_per_node, comm.rank)
    sizes = comm.allgather(node.size)
    if len(set(sizes)) != 1:
        raise ValueError(f"the node-aware allreduce needs the same number of ranks on every node, got "
                         f"{sorted(set(sizes))}")
    cross = comm.split(node.rank, comm.rank)
    made = _hierarchies[comm] = Hierarchy(node, cross)
    return made


class HierarchicalAllreduce(Request):
    """The three phases above as one request: :meth:`test` advances the current phase
    and starts the next when it is done, so it overlaps with compute like the ring."""

    def __init__(self, comm, buf: np.ndarray, ranks_per_node: int | None = None):
        super().__init__(comm.stats)  # its phases are the collectives that are busy, counted on node and cross
        if buf.ndim != 1 or not buf.flags.c_contiguous:
            raise ValueError("the node-aware allreduce works on a flat contiguous array")
        h = hierarchy(comm, ranks_per_node)
        bounds = chunk_bounds(buf.size, h.node.size)  # the ring's slices: local rank l owns slice l
        mine = buf[bounds[h.node.rank] : bounds[h.node.rank + 1]]
        self.phases = [lambda: Ring(h.node, buf, ("reduce_scatter",)),
                       lambda: Ring(h.cross, mine) if is_half(mine.dtype) else h.cross.iallreduce(mine),
                       lambda: Ring(h.node, buf, ("allgather",))]
        self.current = self.phases.pop(0)()

    def _progress(self) -> bool:
        while self.current.done or self.current.test():
            if not self.phases:
                return True
            self.current = self.phases.pop(0)()
        return False

    def _block(self) -> None:
        while not self._progress():
            self.current.wait()
