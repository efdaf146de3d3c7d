"""Which allreduce runs, by name: MPI's own (``"mpi"``, ``MPI_Allreduce``), mpitrain's ring
(``"ring"``, :mod:`mpitrain.comm.ring`; on two ranks on different nodes its one-round
exchange, :class:`~mpitrain.comm.ring.Exchange`), or the node-aware one built on it
(``"hierarchical"``, :mod:`mpitrain.comm.hierarchical`). Whichever runs, half-precision
numbers are added in float32: by the ring, or by MPI as a float32 copy
(:class:`~mpitrain.comm.ring.Float32Sum`); ``wire`` sends the ring's numbers in 16 bits.
"""

from __future__ import annotations

import weakref

import numpy as np

from mpitrain.comm.hierarchical import HierarchicalAllreduce
from mpitrain.comm.requests import Request
from mpitrain.comm.ring import Exchange, Float32Sum, Ring
from mpitrain.dtypes import is_half

ALGORITHMS = ("mpi", "ring", "hierarchical")


def iallreduce(comm, buf: np.ndarray, algorithm: str = "mpi", wire=None) -> Request:
    """Start summing the flat array ``buf`` over ``comm`` in place; ``wire`` (a dtype, the
    ring only) sends its numbers in that format. A half-precision ``buf`` is added in
    float32 at each step: by the ring, or as a float32 copy by MPI (:class:`Float32Sum`)."""
    if wire is not None and algorithm != "ring":
        raise ValueError(f"a wire format of 16-bit numbers needs mpitrain's ring (MPI cannot add them in float32), "
                         f"not {algorithm!r}")
    if algorithm == "mpi":
        return Float32Sum(comm, buf) if is_half(buf.dtype) else comm.iallreduce(buf)
    if algorithm == "ring":
        if comm.size == 2 and _across_nodes(comm):
            return Exchange(comm, buf, wire)
        return Ring(comm, buf, wire=wire)
    if algorithm == "hierarchical":
        return HierarchicalAllreduce(comm, buf)
    raise ValueError(f"allreduce algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def allreduce(comm, buf: np.ndarray, algorithm: str = "mpi", wire=None) -> None:
    """Sum the flat array ``buf`` over ``comm`` in place (``wire``: as :func:`iallreduce`)."""
    if algorithm == "mpi" and wire is None and not is_half(buf.dtype):
        comm.allreduce(buf)
    else:
        iallreduce(comm, buf, algorithm, wire).wait()


_across: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _across_nodes(comm) -> bool:
    """Whether every rank of ``comm`` is on a node of its own (asked once per communicator:
    the question is a collective call)."""
    if comm not in _across:
        _across[comm] = comm.node_size() == 1
    return _across[comm]
