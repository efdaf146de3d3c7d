"""Started operations and what communication costs a rank: requests, the counters of each
communicator, the communication thread.

**Requests.** A method that starts an operation returns a :class:`Request` and never
waits inside: ``test()`` lets it move forward (MPICH progresses a non-blocking operation
only while the process is inside an MPI call) and says whether it is done; ``wait()``
finishes it. mpitrain's own algorithms (the ring, the two-rank exchange, the node-aware
allreduce) are requests too, advanced step by step from ``test()``.

**Counters.** Every communicator's :class:`CommStats` counts the bytes this rank sends,
the bytes it receives point to point, the seconds it is *blocked* (in a blocking call or
a wait: exposed communication) and the seconds its collectives are *busy* (each from its
start until seen complete, waited for or not, those in flight together counted once:
with blocked, how much overlap hid). A communicator made from another (``dup``,
``split``) has its own counter, which adds into its parent's: the grid's ``dp_comm``,
``pp_comm`` and ``tp_comm`` each count everything on their axis, and a strategy counts
nothing itself. A blocked second is counted once, by the outermost call (a ring's
``wait`` waits for its messages inside it), and not on a :class:`CommThread`: its calls
are busy, the training thread's wait for them blocked.

**Tracing.** :func:`trace_operations` installs a function called with ``(name, start,
end, bytes)`` as each collective completes (the timeline's communication track), as
:func:`mpitrain.tensor.observe_ops` does for ops.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

_local = threading.local()  # per thread: how deep in blocking calls; whether a communication thread
_counting = threading.Lock()  # a communication thread and the training thread add into the same counters
_tracers: list = []  # called (name, start, end, nbytes) as each collective completes


@dataclass
class CommStats:
    """What one rank did on one communicator and on everything made from it."""

    bytes_sent: int = 0
    bytes_received: int = 0  # point-to-point receives only (collectives count what they send)
    seconds: float = 0.0  # blocked: inside blocking calls and waits
    busy: float = 0.0  # some collective in progress: from each one's start until seen complete
    parent: CommStats | None = field(default=None, repr=False)  # a split adds into the communicator it came from
    _busy_until: float = field(default=0.0, repr=False)  # the end of the busy time counted so far

    def add(self, sent: float = 0, received: float = 0, seconds: float = 0.0, span: tuple | None = None) -> None:
        """Count bytes, blocked seconds, and a collective's ``span`` (start, end) as busy
        time, where it does not overlap the spans counted before it (collectives complete
        nearly in the order they start); here and in every parent."""
        stats = self
        with _counting:
            while stats is not None:
                stats.bytes_sent += int(sent)
                stats.bytes_received += int(received)
                stats.seconds += seconds
                if span is not None:
                    stats.busy += max(0.0, span[1] - max(span[0], stats._busy_until))
                    stats._busy_until = max(stats._busy_until, span[1])
                stats = stats.parent

    def totals(self) -> tuple[int, float, float]:
        """(bytes sent, seconds blocked, seconds busy) so far."""
        return self.bytes_sent, self.seconds, self.busy


@contextlib.contextmanager
def trace_operations(tracer):
    """Call ``tracer(name, start, end, nbytes)`` as each collective completes inside the block."""
    _tracers.append(tracer)
    try:
        yield tracer
    finally:
        del _tracers[next(i for i, t in enumerate(_tracers) if t is tracer)]


def _traced(name: str, start: float, end: float, nbytes: int) -> None:
    for tracer in _tracers:
        tracer(name, start, end, nbytes)


@contextlib.contextmanager
def blocking(stats: CommStats | None, name: str = "", nbytes: int = 0):
    """Around a call that blocks: its seconds are blocked time (unless an outer call
    counts them already, or this is a communication thread); ``name``d, it is a
    blocking collective, whose seconds are also busy, and traced."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    tick = time.perf_counter()
    try:
        yield
    finally:
        _local.depth = depth
        end = time.perf_counter()
        if depth == 0 and stats is not None:
            blocked = 0.0 if getattr(_local, "background", False) else end - tick
            stats.add(seconds=blocked, span=(tick, end) if name else None)
            if name:
                _traced(name, tick, end, nbytes)


class Request:
    """A started operation. ``stats`` counts the seconds a ``wait()`` blocks; a ``name``d
    request is a collective whose time from start to completion is busy time (and
    traced). Subclasses move forward in ``_progress()`` (True once done) and finish in
    ``_block()``; the base is an operation with nothing left to do (one rank)."""

    def __init__(self, stats: CommStats | None = None, name: str = "", nbytes: int = 0, done: bool = False):
        self.stats, self.name, self.nbytes, self.done = stats, name, nbytes, done
        self.started = time.perf_counter()

    def test(self) -> bool:
        if not self.done and self._progress():
            self._complete()
        return self.done

    def wait(self) -> None:
        if not self.done:
            with blocking(self.stats):
                self._block()
            self._complete()

    def _complete(self) -> None:
        self.done = True
        if self.name and self.stats is not None:
            end = time.perf_counter()
            self.stats.add(span=(self.started, end))
            _traced(self.name, self.started, end, self.nbytes)

    def _progress(self) -> bool:
        return True

    def _block(self) -> None:
        pass

    def leave(self) -> None:
        """Give up on this request on purpose: nothing to leave, but for MPI's (:class:`MPIRequest`)."""


class MPIRequest(Request):
    """An MPI request (``Isend``, ``Iallreduce``, ...).

    **Its buffer lives until MPI is done with it.** The MPI standard (MPI-4.1, section
    3.7.2) forbids touching, let alone freeing, a non-blocking operation's buffer until
    the operation completes. mpi4py's request holds the array, but when that request is
    collected while still active (its owner dropped before a wait or a successful test)
    the array goes with it, and MPI later reads or writes freed memory. MPICH happened to
    survive that; Open MPI, moving a large message by a single copy between processes,
    crashed (a ring started only to read one of its attributes, dropped in flight). So a
    request collected in flight is parked instead, with its buffer, and named in
    :data:`dropped` (the MPI tier fails a test that leaves one: ``tests/conftest.py``);
    parked requests are let go as MPI completes them (:func:`reap`, as each new request starts)."""

    def __init__(self, mpi_request, stats: CommStats, name: str = "", nbytes: int = 0, what: str = ""):
        super().__init__(stats, name, nbytes)
        self.mpi, self.what = mpi_request, what or name
        if _parked:
            reap()

    def _progress(self) -> bool:
        return bool(self.mpi.Test())

    def _block(self) -> None:
        self.mpi.Wait()

    def leave(self) -> None:
        """Give up on this request on purpose (a job ending by an error): parked, its
        buffer kept, until MPI completes it; not a dropped request."""
        if self.mpi and not _finalized():
            _parked.append(self.mpi)
        self.mpi = None

    def __del__(self) -> None:
        mpi = getattr(self, "mpi", None)
        if mpi is not None and mpi and not _finalized():  # a handle not yet null: still in flight
            _parked.append(mpi)
            dropped.append(f"{self.what or 'request'} ({self.nbytes:,} bytes) collected in flight")


dropped: list[str] = []  # what was collected in flight (a bug in its caller), for the tests to fail on
_parked: list = []  # those requests, with the buffers they hold, until MPI completes them


def reap() -> None:
    """Let go of the parked requests that MPI has completed (a ``Test`` each)."""
    if not _finalized():
        _parked[:] = [r for r in _parked if not r.Test()]


def _finalized() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is None or mpi.Is_finalized()


class CommThread:
    """A thread that runs the blocking communication handed to it, one call at a time,
    while the training thread computes (Horovod's design); MPI must run at thread level
    ``serialized`` or ``multiple``. :meth:`submit` returns a request whose ``wait()``
    blocks the training thread until the call has run (and raises what it raised)."""

    def __init__(self, stats: CommStats, name: str):
        self.stats, self._queue = stats, queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, call) -> Request:
        handed = _Handed(self.stats)
        self._queue.put((call, handed))
        return handed

    def _serve(self) -> None:
        _local.background = True  # its blocked seconds are not the training thread's
        while (item := self._queue.get()) is not None:
            call, handed = item
            try:
                call()
            except BaseException as e:  # handed to the waiting thread, which raises it
                handed.error = e
            handed.event.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class _Handed(Request):
    def __init__(self, stats: CommStats):
        super().__init__(stats)
        self.event, self.error = threading.Event(), None

    def _progress(self) -> bool:
        if self.event.is_set() and self.error is not None:
            raise self.error  # on test() as on wait(): a request never completes past its error
        return self.event.is_set()

    def _block(self) -> None:
        self.event.wait()
        self._progress()
