"""``mpitrain launch LAUNCH LINE``: run a launch line (``mpiexec -n 4 mpitrain train
CONFIG``) so that a stop by Ctrl-C always ends in a checkpoint, however many times it
is pressed, and under ``timeout`` too.

Why a run needs it (MPICH's launcher, Hydra): ``mpiexec`` passes its first SIGINT to every
rank, but answers a second one by killing every rank at once (SIGKILL, through its
proxies: the ``assert (!closed) failed`` it prints is a proxy finding mpiexec gone). A
terminal sends each Ctrl-C to mpiexec, and coreutils ``timeout`` passes on the SIGINT it
gets, so one press under ``timeout`` is two SIGINTs to mpiexec, and two presses a moment
apart are too; the ranks, killed, save nothing. No rank can prevent it: the ranks run in
sessions of Hydra's making, never see that second SIGINT, and cannot catch SIGKILL; and
Hydra has no option that changes it. (Its SIGTERM and SIGUSR1 reach the ranks each time.)

What this does: it starts the launch line in a session of its own, so that no signal of
the terminal, nor one ``timeout`` sends to its process group, reaches mpiexec directly;
it passes on the first SIGINT, takes the ones that follow within :data:`REPEAT_S`
seconds as the same one, and passes on a later one (with Hydra: abort at once, saving
nothing). SIGTERM, SIGUSR1 and SIGQUIT are passed on, and SIGHUP (the terminal closed)
as SIGTERM. The launch line's output comes through this process, which goes on reading
it once its own terminal is gone: mpiexec, writing to a closed terminal, would fail
and kill the ranks before they save. It exits with the launch line's status (``128 + N``
if it ended by signal ``N``). It sets ``MPITRAIN_LAUNCH=1`` for the launch line, so that a run's stop line
names it in its resume command. Ctrl-Z stops only this process, not the run.

**Open MPI's ``mpirun``** (PRRTE's ``prterun`` in Open MPI 5, ORTE's ``orterun`` in 4) kills
every rank at its first SIGINT or SIGTERM, before any can save: Open MPI 5.0.11 at once
(the ranks, in process groups of their own, see neither signal); 4.1.4 sends SIGCONT, a
second later SIGTERM, and SIGKILL right after it. It passes SIGUSR1 and SIGUSR2 on. So to an Open MPI launch line the first SIGINT goes as SIGUSR2, which a rank
started by ``mpitrain launch`` takes as that Ctrl-C (:class:`mpitrain.train.signals.StopSignals`:
the step ends, a checkpoint, exit 130), and SIGTERM and SIGHUP go as SIGUSR1 (a checkpoint,
exit 0); a later SIGINT goes as it is, and ``mpirun`` aborts. **SLURM's ``srun``** answers a
first Ctrl-C by printing its tasks' states and passes it on only when a second follows
within a second (then ending the tasks): so to ``srun`` too the first SIGINT goes as SIGUSR2.
Which launcher a line runs is :func:`kind_of` its first word.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

REPEAT_S = 2.0  # a SIGINT this soon after the first is the same stop (a key pressed twice, timeout's copy)
ENV = "MPITRAIN_LAUNCH"  # set for the launch line: its ranks know a repeated Ctrl-C is taken care of
PASSED_ON = {"SIGTERM": "SIGTERM", "SIGUSR1": "SIGUSR1", "SIGQUIT": "SIGQUIT", "SIGHUP": "SIGTERM"}
RELAYED_INT = "SIGUSR2"  # a first Ctrl-C, as it goes to a launcher that would not pass SIGINT on (see above)
# per launcher: what the first SIGINT goes as, and the signals sent as another
AS = {"openmpi": {"SIGINT": RELAYED_INT, "SIGTERM": "SIGUSR1"}, "srun": {"SIGINT": RELAYED_INT}, "other": {}}
MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun", "oshrun")


def kind_of(command: list[str]) -> str:
    """The launcher a launch line runs: ``openmpi`` (an ``mpirun``/``mpiexec`` whose
    ``--version`` says Open MPI), ``srun``, or ``other`` (MPICH's Hydra, Intel MPI's,
    Cray's ``srun`` wrappers, no launcher at all)."""
    name = os.path.basename(command[0]) if command else ""
    if name == "srun":
        return "srun"
    if name not in MPI_LAUNCHERS:
        return "other"
    try:
        version = subprocess.run([command[0], "--version"], capture_output=True, text=True, timeout=20,
                                 stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return "other"  # it will fail to start, and say so, in run()
    return "openmpi" if "Open MPI" in version.stdout + version.stderr else "other"


class Forwarder:
    """The signal handlers of :func:`run`; a signal that arrives before the launch line
    has started is passed on as soon as it has. ``kind``: the launcher's (:func:`kind_of`),
    which decides what each signal goes as (:data:`AS`)."""

    def __init__(self, kind: str = "other"):
        self.child: subprocess.Popen | None = None
        self.first_int: float | None = None
        self.pending: list[int] = []
        self.kind = kind

    def on_int(self, signum, frame) -> None:
        now = time.monotonic()
        if self.first_int is not None and now - self.first_int < REPEAT_S:
            _say(f"mpitrain launch: stopping already; Ctrl-C again after {REPEAT_S:g} s to abort, saving nothing")
            return
        first = self.first_int is None
        if first:
            self.first_int = now
        self._send(getattr(signal, AS[self.kind].get("SIGINT", "SIGINT")) if first else signal.SIGINT)
        if not first and self.kind == "srun":  # srun ends its tasks at a second SIGINT within a second
            time.sleep(0.1)
            self._send(signal.SIGINT)

    def on_other(self, signum, frame) -> None:
        name = PASSED_ON[signal.Signals(signum).name]
        self._send(getattr(signal, AS[self.kind].get(name, name)))

    def _send(self, sig: int) -> None:
        if self.child is None:
            self.pending.append(sig)
        elif self.child.poll() is None:
            os.kill(self.child.pid, sig)

    def started(self, child: subprocess.Popen) -> None:
        self.child = child
        for sig in self.pending:
            self._send(sig)


def run(command: list[str]) -> int:
    """Run ``command`` as the module's docstring says; its exit status. The stop signals
    are ignored from then on: the process is about to exit. (If ``command`` cannot start,
    LaunchError, with the handlers as they were.)"""
    forwarder = Forwarder(kind_of(command))
    before = {name: signal.signal(getattr(signal, name), forwarder.on_int if name == "SIGINT" else forwarder.on_other)
              for name in ("SIGINT", *PASSED_ON)}
    try:
        child = subprocess.Popen(command, start_new_session=True, env={**os.environ, ENV: "1"},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        for name, handler in before.items():
            signal.signal(getattr(signal, name), handler)
        raise LaunchError(f"cannot run {command[0]}: {e.strerror or e}") from None
    relays = [threading.Thread(target=_relay, args=(pipe.fileno(), sink), daemon=True)
              for pipe, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
    for relay in relays:
        relay.start()
    forwarder.started(child)
    code = child.wait()  # PEP 475: a handled signal does not interrupt the wait
    # nothing is left to pass on, and a late Ctrl-C (a repeat) must not kill this process as it
    # exits: Python, finishing, puts back the default action of the signals it handled (SIGINT's
    # kills), and leaves those it ignores ignored
    for name in ("SIGINT", *PASSED_ON):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    for relay in relays:  # the last lines; a process the launch line left behind may hold its pipe
        relay.join(timeout=5)
    return code if code >= 0 else 128 - code


def _relay(source: int, sink) -> None:
    """Copy the launch line's output from ``source`` to ``sink`` as it comes; once
    ``sink`` fails (its terminal closed, a pipe's reader gone), read on and drop it."""
    try:
        out = sink.fileno()
    except (AttributeError, OSError, ValueError):  # a stream with no file (a notebook's)
        out = None
    while chunk := os.read(source, 1 << 16):
        while out is not None and chunk:
            try:
                chunk = chunk[os.write(out, chunk):]
            except OSError:
                out = None


class LaunchError(Exception):
    """The launch line could not be started."""


def _say(message: str) -> None:
    try:  # os.write: a handler must not print into the middle of another print
        os.write(sys.stderr.fileno(), f"\n{message}\n".encode())
    except (OSError, ValueError):
        pass
