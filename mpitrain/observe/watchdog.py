"""The stall watchdog: say which ranks have not arrived when a collective waits too long.

A rank that hangs (an endless loop, a dead node, a deadlock) leaves the others blocked
in their next collective with nothing printed. Following Horovod's stall inspector, each
rank's training loop marks what it is doing (:meth:`Watchdog.phase`), and a background
thread per rank sends its state (step, phase, seconds in it) to rank 0 every ``interval``
seconds, on its own duplicated communicator. A rank that has waited in one collective
phase longer than ``warn_after`` seconds prints the stall once: what it waits in and
(rank 0) each rank not waiting there, with its step, its phase and how long ago it was
heard from; after ``abort_after`` seconds it aborts every rank (``MPI_Abort``): a stalled
job ends instead of holding its allocation.

The waits are the phases its owner names (the trainer's step agreement; the gradient
sync's calls that wait for other ranks, its ``waits``), the same on
every rank of ``comm`` in the same order (a phase travels as its index); everything else
is ``computing``. Evaluations and checkpoint writes are not watched: their length is
mostly work, not waiting, and a long one would look like a stall.

The thread calls MPI beside the main thread, so it needs thread level ``multiple``
(mpitrain's default); at another level the watchdog is off and says so. Its messages
are 24 bytes per rank per interval.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import numpy as np

from mpitrain.comm import Tag, started_thread_level

COMPUTING = "computing"  # the phase of everything that is not a named wait


class Watchdog:
    """Watch the main thread's phases on every rank of ``comm``; ``waits``: the phases
    that wait for other ranks, which :meth:`phase` may be given besides ``computing``."""

    def __init__(self, comm, warn_after: float, abort_after: float, waits=(), log=None,
                 interval: float | None = None):
        self.phases = (COMPUTING, *dict.fromkeys(w for w in waits if w != COMPUTING))  # index: the code sent
        self.warn_after, self.abort_after = warn_after, abort_after
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.state = (0, 0, time.perf_counter())  # step, phase code, since: one tuple, replaced whole
        self.comm = self._thread = None
        on = comm.size > 1 and (warn_after > 0 or abort_after > 0)
        if on and started_thread_level() != "multiple":
            if comm.rank == 0:
                self.log("warning: the stall watchdog needs MPI thread level 'multiple'; it is off")
            on = False
        if not on:
            return
        self.interval = interval or min(1.0, min(x for x in (warn_after, abort_after) if x > 0) / 4)
        self.comm = comm.dup()
        self.heard = {r: (0.0, 0.0, 0.0, time.perf_counter()) for r in range(comm.size)}  # step, code, waited, when
        self._sends: list = []  # (state, its send) not seen complete yet
        self._sent, self._received = 0, dict.fromkeys(range(comm.size), 0)  # states sent; on rank 0, received
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def phase(self, step: int, name: str | None):
        """Mark the main thread as in ``name`` (one of the waits, or None: ``computing``) at
        ``step``; the thread reads the state as one tuple, never half of an update."""
        previous = self.state[1]
        self.state = (step, self.phases.index(name or COMPUTING), time.perf_counter())
        try:
            yield
        finally:
            self.state = (step, previous, time.perf_counter())

    def close(self) -> None:
        """Stop the thread; then every state sent to rank 0 is received before the
        communicator goes (collective: the loop's ranks close together, at its agreed
        end). A send left unmatched never completes (MPI-4.1 3.7.2: its buffer is MPI's
        until then): MPICH let it be; Open MPI's tier failed on its request, collected in
        flight (:class:`mpitrain.comm.requests.MPIRequest`). On an error's way out
        (:meth:`__exit__`) nothing is waited for: the job is ending, and another rank may
        never come; the sends are left to MPI (:meth:`~mpitrain.comm.requests.Request.leave`)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        counts = self.comm.gather(self._sent, root=0)  # how many states each rank sent
        if self.comm.rank == 0:
            incoming = np.empty(3)
            for source, count in enumerate(counts[1:], start=1):
                for _ in range(count - self._received[source]):
                    self.comm.recv(incoming, source, Tag.WATCHDOG)
                    self._received[source] += 1
        self.comm.waitall([r for _, r in self._sends])
        self.comm.free()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.close()
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            for _, request in self._sends:
                request.leave()

    # ------------------------------------------------------------ the thread
    def _watch(self) -> None:
        comm, warned = self.comm, False
        incoming = np.empty(3)
        while not self._stop.wait(self.interval):
            step, code, since = self.state
            now = time.perf_counter()
            waited = now - since
            mine = np.array([step, code, waited])
            if comm.rank == 0:
                self.heard[0] = (*mine, now)
                while comm.poll(-1, Tag.WATCHDOG):
                    source = comm.recv_any(incoming, Tag.WATCHDOG)
                    self.heard[source] = (*incoming, now)
                    self._received[source] += 1
            else:
                self._sends = [(buf, r) for buf, r in self._sends if not r.test()]  # each buffer kept until sent
                self._sends.append((mine, comm.isend(mine, 0, Tag.WATCHDOG)))
                self._sent += 1
            if code == 0:  # computing
                warned = False
                continue
            if self.warn_after > 0 and waited > self.warn_after and not warned:
                self.log(self._describe(step, code, waited, "stall"))
                warned = True
            if self.abort_after > 0 and waited > self.abort_after:
                self.log(self._describe(step, code, waited, "aborting") + f"; ending all {comm.size} ranks "
                         f"(run.stall_abort_s = {self.abort_after:g})")
                comm.abort(1)

    def _describe(self, step: int, code: int, waited: float, what: str) -> str:
        here = f"[rank {self.comm.rank}] {what}: waited {waited:.0f} s in '{self.phases[code]}' at step {step}"
        if self.comm.rank != 0:
            return here
        now = time.perf_counter()
        missing = [f"rank {rank} (step {int(their_step)}, {self.phases[int(their_code)]} for {seconds:.0f} s, "
                   f"heard from {now - when:.0f} s ago)"
                   for rank, (their_step, their_code, seconds, when) in sorted(self.heard.items())
                   if rank != 0 and (int(their_step) != step or int(their_code) != code)]
        return here + ("; not there: " + ", ".join(missing) if missing else "; every rank is waiting there too")
