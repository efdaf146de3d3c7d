"""Communicators: buffer collectives, agreement on errors, abort on failure (the module
of the comm package that imports mpi4py).

``Comm`` wraps an mpi4py communicator; ``SingleComm`` is the same interface for one
process without MPI (every collective a no-op or a copy), for the unit tier and library
use. Importing this module does not start MPI; :func:`world` does, at the thread level
asked for (:func:`thread_level`).

**Arrays** go through the buffer methods (uppercase mpi4py calls on contiguous NumPy
arrays, no pickling: ``allreduce``, ``iallreduce``, ``bcast_array``, ``reduce_scatter``,
``allgather_array``, ``isend``/``irecv``); only small control messages (error texts, I/O
statistics) use the pickling lowercase ones. A method that returns a request
(:mod:`mpitrain.comm.requests`) never waits inside. **Counters**: every communicator has
one (:class:`~mpitrain.comm.requests.CommStats`; a duplicate's or a split's adds into its
parent's): point-to-point bytes exactly, MPI's own collectives by the bytes a
bandwidth-optimal algorithm sends (:func:`mpitrain.cost.collective_bytes`), which is
what mpitrain's ring sends exactly. **Tags** come from :class:`Tag`; concurrent operations
are kept apart by a duplicated communicator each (``dup``), never by tag arithmetic.

An error on one rank ends every rank, never leaving the others waiting: a check every
rank makes runs inside :meth:`Comm.agree` (every rank raises the first failure, naming
its rank); any other exception aborts the job (:func:`abort_on_exception`).
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import time
import traceback

import numpy as np

from mpitrain.comm.requests import CommStats, MPIRequest, Request, blocking
from mpitrain.cost import collective_bytes
from mpitrain.dtypes import is_half

THREAD_LEVELS = ("auto", "single", "funneled", "serialized", "multiple")


class Tag(enum.IntEnum):
    """Every point-to-point tag mpitrain uses."""

    RING = 1  # a step of a ring reduce-scatter or allgather
    WATCHDOG = 2  # a rank's state, sent to rank 0 by its stall watchdog
    PS_HEADER = 3  # worker -> server: (step, version the gradient was computed on); step -1: stop
    PS_GRAD = 4  # worker -> server: the gradient of the server's parameters
    PS_VERSION = 5  # server -> worker: the version of the parameters that follow
    PS_PARAMS = 6  # server -> worker: the server's parameters
    PP_ACTIVATION = 7  # pipeline stage -> the next: a micro-batch's activation
    PP_GRADIENT = 8  # pipeline stage -> the previous: the gradient of that activation
    CHECKPOINT = 9  # a rank's part of a checkpoint -> rank 0, which writes the file


def _words(buf: np.ndarray) -> np.ndarray:
    """``buf`` as any MPI can move it: 16-bit floats (mixed precision's, :mod:`mpitrain.precision`)
    as the 16-bit words they are. MPI knows no bfloat16, and float16 only as an extension
    (MPICH's ``MPIX_C_FLOAT16``; Open MPI 4 has none, and mpi4py then fails with ``cannot
    map 'e' to MPI datatype``). A copy needs no type, only the bytes: so every send,
    receive, broadcast and gather of 16-bit numbers goes as ``MPI_UINT16_T``. Sums of them
    are not MPI's to do (:func:`_summable`)."""
    return buf.view(np.uint16) if is_half(buf.dtype) else buf


def _summable(buf: np.ndarray) -> np.ndarray:
    """``buf``, for MPI to add: never 16-bit floats, which MPI cannot add portably (see
    :func:`_words`); mpitrain's ring adds them in float32, MPI a float32 copy
    (:func:`mpitrain.comm.allreduce.iallreduce`)."""
    if is_half(buf.dtype):
        raise TypeError(f"MPI cannot sum {buf.dtype} numbers on every MPI library: use mpitrain.comm.ring's "
                        f"iallreduce (the ring adds them in float32, MPI's allreduce a float32 copy)")
    return buf


class SingleComm:
    """A communicator of one rank, without MPI."""

    rank, size = 0, 1

    def __init__(self, stats: CommStats | None = None):
        self.stats = stats or CommStats()

    def dup(self) -> "SingleComm":
        return SingleComm(CommStats(parent=self.stats))

    def split(self, color: int, key: int) -> "SingleComm":
        return self.dup()

    def split_node(self) -> "SingleComm":
        return self.dup()

    def node_size(self) -> int:
        return 1

    def _nothing(self, *args, **kwargs) -> None:
        """With one rank a sum, a broadcast or a gather leaves the array as it is, and
        there is nothing to wait for or free."""

    def _done(self, *args, **kwargs) -> Request:
        return Request(done=True)

    allreduce = bcast_array = allgather_array = waitall = barrier = sleeping_barrier = free = _nothing
    iallreduce = iallgather_array = _done

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts) -> None:
        recv[...] = send[: counts[0]]

    def ireduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts) -> Request:
        self.reduce_scatter(send, recv, counts)
        return Request(done=True)

    def allgather(self, obj):
        return [obj]

    def gather(self, obj, root: int = 0):
        return [obj]

    def bcast(self, obj, root: int = 0):
        return obj

    def agree(self, fn, *args, share=Exception, **kwargs):
        return fn(*args, **kwargs)


class Comm(SingleComm):
    """An mpi4py communicator: buffer collectives on arrays, a few object collectives
    for small control messages, and counters."""

    def __init__(self, mpi_comm, stats: CommStats | None = None):
        self.mpi = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.stats = stats or CommStats()

    def dup(self) -> "Comm":
        """A duplicate: same ranks, its own message space; its counter adds into this
        one's (collective call)."""
        return Comm(self.mpi.Dup(), CommStats(parent=self.stats))

    def split(self, color: int, key: int) -> "Comm":
        """Ranks of equal ``color`` form a new communicator, ordered by ``key``; its
        counter adds into this one's."""
        return Comm(self.mpi.Split(color, key), CommStats(parent=self.stats))

    def free(self) -> None:
        if self.mpi is not _mpi().COMM_WORLD:
            self.mpi.Free()

    def split_node(self) -> "Comm":
        """The ranks of this communicator that share this node's memory (collective)."""
        return Comm(self.mpi.Split_type(_mpi().COMM_TYPE_SHARED, key=self.rank), CommStats(parent=self.stats))

    def node_size(self) -> int:
        """Ranks of this communicator that share this node's memory (and cores)."""
        node = self.mpi.Split_type(_mpi().COMM_TYPE_SHARED)
        size = node.Get_size()
        node.Free()
        return size

    # ------------------------------------------------------------ arrays
    def _collective(self, name: str, nbytes: int, call, *args, root: int = 0) -> None:
        """A blocking collective on an array of ``nbytes``: counted by the bytes one rank
        sends in a bandwidth-optimal algorithm (MPI chooses its own; mpitrain's ring sends
        exactly these), and timed."""
        self.stats.add(sent=collective_bytes(name, nbytes, self.size, root=root == self.rank))
        with blocking(self.stats, name, nbytes):
            call(*args)

    def _started(self, name: str, nbytes: int, mpi_request) -> Request:
        self.stats.add(sent=collective_bytes(name, nbytes, self.size))
        return MPIRequest(mpi_request, self.stats, name, nbytes)

    def allreduce(self, buf: np.ndarray, op: str = "sum") -> None:
        """Sum ``buf`` over ranks in place (``op = "max"``: the largest value)."""
        self._collective("allreduce", buf.nbytes, self.mpi.Allreduce, _mpi().IN_PLACE, _summable(buf),
                         _mpi().MAX if op == "max" else _mpi().SUM)

    def iallreduce(self, buf: np.ndarray) -> Request:
        """Start summing ``buf`` over ranks in place; ``buf`` must not be touched until
        the request is done."""
        return self._started("allreduce", buf.nbytes, self.mpi.Iallreduce(_mpi().IN_PLACE, _summable(buf)))

    def bcast_array(self, buf: np.ndarray, root: int = 0) -> None:
        """Overwrite ``buf`` with rank ``root``'s."""
        self._collective("broadcast", buf.nbytes, self.mpi.Bcast, _words(buf), root, root=root)

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts) -> None:
        """Sum ``send`` (all ranks' full arrays) and leave block ``rank`` of the sum, of
        ``counts[rank]`` elements, in ``recv``."""
        self._collective("reduce_scatter", send.nbytes, self.mpi.Reduce_scatter, _summable(send), recv,
                         list(counts))

    def ireduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts) -> Request:
        """Start :meth:`reduce_scatter`; neither array may be touched until the request is done."""
        return self._started("reduce_scatter", send.nbytes,
                             self.mpi.Ireduce_scatter(_summable(send), recv, [int(c) for c in counts]))

    def allgather_array(self, buf: np.ndarray, counts) -> None:
        """In place: every rank contributes block ``rank`` (``counts[rank]`` elements at
        offset ``sum(counts[:rank])``) of ``buf`` and receives everyone's."""
        self._collective("allgather", buf.nbytes, self.mpi.Allgatherv, _mpi().IN_PLACE, _vector(buf, counts))

    def iallgather_array(self, buf: np.ndarray, counts) -> Request:
        """Start :meth:`allgather_array`; ``buf`` may not be touched until the request is done."""
        return self._started("allgather", buf.nbytes, self.mpi.Iallgatherv(_mpi().IN_PLACE, _vector(buf, counts)))

    def isend(self, buf: np.ndarray, dest: int, tag: Tag) -> Request:
        self.stats.add(sent=buf.nbytes)
        return MPIRequest(self.mpi.Isend(_words(buf), dest, tag), self.stats, nbytes=buf.nbytes,
                          what=f"a send to rank {dest} ({getattr(tag, 'name', tag)})")

    def irecv(self, buf: np.ndarray, source: int, tag: Tag) -> Request:
        self.stats.add(received=buf.nbytes)
        return MPIRequest(self.mpi.Irecv(_words(buf), source, tag), self.stats, nbytes=buf.nbytes,
                          what=f"a receive from rank {source} ({getattr(tag, 'name', tag)})")

    def recv(self, buf: np.ndarray, source: int, tag: Tag) -> None:
        """Blocking receive of exactly ``buf.nbytes`` bytes."""
        self.stats.add(received=buf.nbytes)
        with blocking(self.stats):
            self.mpi.Recv(_words(buf), source, tag)

    def waitany(self, requests: list[Request]) -> int:
        """Block until one of ``requests`` (none done yet) completes; its index."""
        with blocking(self.stats):
            index = _mpi().Request.Waitany([r.mpi for r in requests])
        requests[index]._complete()
        return index

    def poll(self, source: int = -1, tag: Tag | None = None) -> bool:
        """Whether a message from ``source`` (``-1``: anyone) with ``tag`` (None: any)
        is waiting."""
        return bool(self.mpi.Iprobe(source if source >= 0 else _mpi().ANY_SOURCE,
                                    _mpi().ANY_TAG if tag is None else tag))

    def recv_any(self, buf: np.ndarray, tag: Tag) -> int:
        """Receive one message with ``tag`` from any rank into ``buf``; returns the sender."""
        self.stats.add(received=buf.nbytes)
        status = _mpi().Status()
        with blocking(self.stats):
            self.mpi.Recv(_words(buf), _mpi().ANY_SOURCE, tag, status)
        return status.Get_source()

    def waitall(self, requests: list[Request]) -> None:
        live = [r for r in requests if not r.done]
        if live:
            with blocking(self.stats):
                _mpi().Request.Waitall([r.mpi for r in live])
            for r in live:
                r._complete()

    def allgather(self, obj):
        return self.mpi.allgather(obj)

    def gather(self, obj, root: int = 0):
        return self.mpi.gather(obj, root=root)

    def bcast(self, obj, root: int = 0):
        return self.mpi.bcast(obj, root=root)

    def barrier(self) -> None:
        self.mpi.Barrier()

    def sleeping_barrier(self, poll: float = 1e-3) -> None:
        """A barrier that sleeps between tests: for ranks with nothing to do while
        others are timed, so that they do not spin on a core the others need."""
        request = self.mpi.Ibarrier()
        while not request.Test():
            time.sleep(poll)

    def agree(self, fn, *args, share=Exception, **kwargs):
        """Run ``fn`` on every rank. If it raises an exception of the kinds ``share`` on any
        rank, raise the first such error (lowest rank) on every rank; else return this
        rank's result. (Other exceptions propagate at once, to end the job.)"""
        try:
            result, failure = fn(*args, **kwargs), None
        except share as e:  # shared so that all ranks fail together
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
        """End every rank. Output is flushed first, with a moment for mpiexec to relay
        it: MPI_Abort also ends the process that forwards this rank's output, and a
        line still in flight was lost."""
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(0.2)
        self.mpi.Abort(code)
        os._exit(code)  # MPICH's Abort can return before the launcher's kill arrives: nothing more runs here


def _vector(buf: np.ndarray, counts) -> list:
    """``buf`` as an MPI vector of blocks of ``counts`` elements, end to end (16-bit floats as words)."""
    counts, words = [int(c) for c in counts], _words(buf)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
    return [words, counts, displs, _mpi().Datatype.fromcode(words.dtype.char)]


def _mpi():
    from mpi4py import MPI

    return MPI


def thread_level(requested: str = "auto", comm_thread: bool = False) -> str:
    """The MPI thread level to start with; ``auto`` is ``multiple`` (mpi4py's default).

    With the MPICH wheel, ``MPI_Allreduce`` and the data-parallel step were faster at
    ``multiple`` than at ``funneled``; an older MPICH did the opposite, so re-measure on
    yours (``mpitrain bench allreduce --thread-level``; ``mpitrain/bench/README.md``). With
    more ranks than cores a lock-free level makes MPICH spin, another reason for the
    default; and the stall watchdog (:mod:`mpitrain.observe.watchdog`) calls MPI from a thread.
    ``comm_thread`` (a thread besides the main one calls MPI) needs ``serialized`` or more."""
    if requested not in THREAD_LEVELS:
        raise ValueError(f"thread level must be one of {THREAD_LEVELS}, got {requested!r}")
    if requested == "auto" or (comm_thread and requested in ("single", "funneled")):
        return "multiple"
    return requested


def world(level: str = "auto", comm_thread: bool = False) -> Comm:
    """COMM_WORLD, starting MPI at thread ``level`` (see :func:`thread_level`) if it is
    not started yet."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.thread_level = thread_level(level, comm_thread=comm_thread)
    return Comm(_mpi().COMM_WORLD)


def started_thread_level() -> str:
    """The thread level MPI actually provides in this process."""
    MPI = _mpi()
    return {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized",
            MPI.THREAD_MULTIPLE: "multiple"}[MPI.Query_thread()]


def library() -> str:
    """The MPI library this process runs on, as its vendor names it ("MPICH 5.0.2",
    "Open MPI 5.0.11"): what a run's header and ``mpitrain plan --validate`` say, since
    the heap a step reaches can depend on it (``mpitrain/plan/README.md``)."""
    name, version = _mpi().get_vendor()
    return f"{name} {'.'.join(map(str, version))}"


def started_world() -> Comm | None:
    """COMM_WORLD if this process has started MPI (and not finished it), else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return Comm(mpi.COMM_WORLD)


# where launchers put a process's rank, the MPI launchers' first: under SLURM, a Hydra
# mpiexec started in a batch script passes its SLURM_PROCID (0) on to every rank
LAUNCHER_RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def launcher_rank() -> int | None:
    """This process's rank as its launcher (``mpiexec``, ``srun``) set it in the
    environment, readable before MPI starts (MPICH's Hydra and Intel MPI: ``PMI_RANK``;
    PMIx launchers: ``PMIX_RANK``; Open MPI: ``OMPI_COMM_WORLD_RANK``; SLURM:
    ``SLURM_PROCID``); None when no launcher started it. It lets an error found before
    MPI starts (a bad config, a command-line mistake) be printed by one rank. A process
    that a rank starts itself inherits the variables, and with them that rank's number."""
    for name in LAUNCHER_RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


@contextlib.contextmanager
def alone(kinds: tuple, code: int = 2):
    """Errors of ``kinds`` raised inside are this rank's alone: a reader that found a
    damaged shard while the other ranks went on into the step's collectives, where
    they would wait for it until the stall watchdog ended them. So this rank prints
    its message, naming itself, and ends every rank with ``code``. Without MPI, or with
    one rank, the error simply propagates (the command line prints it)."""
    try:
        yield
    except kinds as e:
        comm = started_world()
        if comm is None or comm.size == 1:
            raise
        sys.stderr.write(f"[rank {comm.rank}] mpitrain: error: {e}\n")
        comm.abort(code)


@contextlib.contextmanager
def abort_on_exception(expected: tuple = ()):
    """End the whole job when this rank fails with an exception not in ``expected``
    (errors the caller raises on every rank alike and reports itself). Without MPI,
    or with one rank, the exception simply propagates. A Ctrl-C that arrives where the
    training loop does not catch it (while building, say) ends the job with one line
    per rank, no traceback, and exit status 130."""
    try:
        yield
    except expected:
        raise
    except BaseException as e:
        comm = started_world()
        if comm is None or comm.size == 1 or isinstance(e, SystemExit):
            raise
        if isinstance(e, KeyboardInterrupt):
            sys.stderr.write(f"[rank {comm.rank}] interrupted; aborting all {comm.size} ranks\n")
            comm.abort(130)
        sys.stderr.write(f"[rank {comm.rank}] {''.join(traceback.format_exception(e))}"
                         f"[rank {comm.rank}] aborting all {comm.size} ranks\n")
        comm.abort(1)
