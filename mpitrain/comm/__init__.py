"""The communication layer: the only package that imports mpi4py.

* :mod:`~mpitrain.comm.communicator`: ``Comm`` (an mpi4py communicator with buffer
  collectives) and ``SingleComm`` (the same interface for one process without MPI),
  tags, the MPI thread level, errors agreed over ranks, abort on exception;
* :mod:`~mpitrain.comm.requests`: started operations, the counters every communicator
  keeps (bytes, seconds blocked and busy, per axis of the grid), the communication thread;
* :mod:`~mpitrain.comm.ring`: mpitrain's ring allreduce (and its two-rank exchange);
* :mod:`~mpitrain.comm.hierarchical`: the node-aware allreduce built on it;
* :mod:`~mpitrain.comm.allreduce`: which allreduce runs, by name (MPI's, the ring, the node-aware one);
* :mod:`~mpitrain.comm.grid`: the ``dp x pp x tp`` process grid and its communicators;
* :mod:`~mpitrain.comm.replicas`: broadcast, averaging and checking of model replicas.

It knows arrays, not tensors. Importing it does not start MPI; :func:`world` does.
"""

from mpitrain.comm.communicator import (
    THREAD_LEVELS, Comm, SingleComm, Tag, abort_on_exception, alone, launcher_rank, library, started_thread_level,
    started_world, thread_level, world,
)
from mpitrain.comm.requests import CommStats, CommThread, Request, trace_operations

__all__ = [
    "THREAD_LEVELS", "Comm", "CommStats", "CommThread", "Request", "SingleComm", "Tag", "abort_on_exception",
    "alone", "launcher_rank", "library", "started_thread_level", "started_world", "thread_level", "trace_operations", "world",
]
