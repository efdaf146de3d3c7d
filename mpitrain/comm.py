"""The one module that imports mpi4py: communicators, agreement on errors, abort on failure.

``Comm`` wraps an mpi4py communicator; ``SingleComm`` is the same interface for one
process without MPI, for the unit tier and library use. Importing this module does not
start MPI; :func:`world` does, on first call.

Two failure rules (ARCHITECTURE.md, convention 6):

* **agreed errors**: a check that every rank makes (opening a dataset, building the
  embedded data) runs inside :meth:`Comm.agree`; the outcome is allgathered, and if any
  rank failed, every rank raises the same error, naming the rank that saw it. No rank is
  left waiting in a collective that the others skipped.
* **abort on exception**: any other exception on any rank prints that rank's traceback
  and calls ``MPI_Abort``, which ends every rank of the job at once instead of leaving
  the others to hang (:func:`abort_on_exception`).

Only small control messages (error texts, I/O statistics) use the pickling lowercase
methods here; arrays go through the buffer methods.
"""

from __future__ import annotations

import contextlib
import sys
import traceback


class SingleComm:
    """A communicator of one rank, without MPI."""

    rank, size = 0, 1

    def allgather(self, obj):
        return [obj]

    def gather(self, obj, root: int = 0):
        return [obj]

    def bcast(self, obj, root: int = 0):
        return obj

    def barrier(self) -> None:
        pass

    def agree(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


class Comm(SingleComm):
    """An mpi4py communicator with the few object collectives the trainer needs."""

    def __init__(self, mpi_comm):
        self.mpi = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()

    def allgather(self, obj):
        return self.mpi.allgather(obj)

    def gather(self, obj, root: int = 0):
        return self.mpi.gather(obj, root=root)

    def bcast(self, obj, root: int = 0):
        return self.mpi.bcast(obj, root=root)

    def barrier(self) -> None:
        self.mpi.Barrier()

    def agree(self, fn, *args, **kwargs):
        """Run ``fn`` on every rank. If it raises an :class:`Exception` on any rank, raise
        the first such error (lowest rank) on every rank; else return this rank's result."""
        try:
            result, failure = fn(*args, **kwargs), None
        except Exception as e:  # every kind is shared so that all ranks fail together
            result, failure = None, (type(e), str(e))
        failures = self.allgather(failure)
        for rank, f in enumerate(failures):
            if f is not None:
                kind, message = f
                where = "" if failures[self.rank] is not None or self.size == 1 else f" (on rank {rank})"
                try:
                    error = kind(message + where)
                except TypeError:  # an exception class that wants other arguments
                    error = RuntimeError(f"{kind.__name__}: {message}{where}")
                raise error
        return result

    def abort(self, code: int = 1) -> None:
        self.mpi.Abort(code)


def world() -> Comm:
    """COMM_WORLD, starting MPI if needed."""
    from mpi4py import MPI

    return Comm(MPI.COMM_WORLD)


def started_world() -> Comm | None:
    """COMM_WORLD if this process has started MPI (and not finished it), else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return Comm(mpi.COMM_WORLD)


@contextlib.contextmanager
def abort_on_exception(expected: tuple = ()):
    """End the whole job when this rank fails with an exception not in ``expected``
    (errors the caller raises on every rank alike and reports itself). Without MPI,
    or with one rank, the exception simply propagates."""
    try:
        yield
    except expected:
        raise
    except BaseException as e:
        comm = started_world()
        if comm is None or comm.size == 1 or isinstance(e, SystemExit):
            raise
        sys.stderr.write(f"[rank {comm.rank}] {''.join(traceback.format_exception(e))}")
        sys.stderr.write(f"[rank {comm.rank}] aborting all {comm.size} ranks\n")
        sys.stderr.flush()
        comm.abort(1)
