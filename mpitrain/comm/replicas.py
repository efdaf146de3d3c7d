"""What every strategy that keeps copies of the model does with them, once.

Each function takes a communicator and plain arrays (the caller passes its
parameters' and buffers' arrays), so it serves data parallelism, ZeRO and the
parameter servers alike:

* :func:`broadcast`: every rank takes rank ``root``'s values (one ``Bcast`` per array),
  so replicas start equal whatever each rank initialised;
* :func:`average`: floating arrays averaged over the ranks in place (batch-norm running
  statistics: each rank normalised with its own samples); integer arrays (counters)
  are left alone;
* :func:`check_same`: raise unless every rank holds bit-identical arrays; returns their
  SHA-256, which the trainer prints at the end of a run (:func:`digest`: the same
  without communication).
"""

from __future__ import annotations

import hashlib

import numpy as np


def broadcast(comm, arrays, root: int = 0) -> None:
    """Overwrite each array with rank ``root``'s, in place."""
    for a in arrays:
        comm.bcast_array(a, root)


def average(comm, arrays) -> None:
    """Replace each floating array by its mean over the ranks, in place."""
    if comm.size == 1:
        return
    for a in arrays:
        if a.dtype.kind == "f":
            comm.allreduce(a)
            a /= comm.size


def digest(arrays) -> str:
    """SHA-256 of the arrays' bytes, one after the other."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def check_same(comm, arrays, what: str = "parameters") -> str:
    """Raise unless every rank's ``arrays`` are bit-identical to rank 0's; their digest."""
    digests = comm.allgather(digest(arrays))
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise RuntimeError(f"replicas diverged: the {what} of rank(s) {differ} differ from rank 0's")
    return digests[0]
