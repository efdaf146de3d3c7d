"""Stop signals of a training run: SIGINT (Ctrl-C), SIGTERM and SIGUSR1 (and SIGUSR2, a Ctrl-C that
``mpitrain launch`` relayed) set a flag that the
loop reads between steps (:func:`mpitrain.train.loop.agree_on_step` tells every rank), so a run
stops at a step boundary and saves a checkpoint instead of dying mid-step."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from mpitrain import launch


class StopSignals:
    """SIGINT (Ctrl-C), SIGTERM and SIGUSR1 (SLURM's notice before preemption or the time
    limit) only set a flag: the loop finishes the step, the run saves a checkpoint and
    returns. A SIGINT within :data:`~mpitrain.launch.REPEAT_S` of the first is the same
    stop (a key pressed twice; ``timeout`` passes on the SIGINT that the terminal sent its
    whole group, so one press arrives two or three times); a later one ends the process
    at once, saving nothing. (Under ``mpiexec`` the ranks never see a second SIGINT:
    MPICH's launcher kills them instead, unless ``mpitrain launch`` stands in front of it:
    :mod:`mpitrain.launch`.) Under ``mpitrain launch``, SIGUSR2 is a Ctrl-C it relayed to a
    launcher that would not pass SIGINT on (Open MPI's ``mpirun``, ``srun``), and taken as
    one (elsewhere it keeps its default action). ``loud``: this rank says so when the first arrives
    (what it does ``then``: a run's default; ``mpitrain sample`` prints what it has drawn).
    Installed in the main thread only, put back on exit."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", launch.RELAYED_INT)

    def __init__(self, loud: bool = False, launcher: str | None = None,
                 then: str = "finishing this step, then saving a checkpoint"):
        self.received: int | None = None
        self.loud = loud
        self._first_int: float | None = None
        self._previous: dict = {}
        if launcher == "mpiexec" and not os.environ.get(launch.ENV):
            again = ("a second Ctrl-C makes mpiexec abort at once, saving nothing ('mpitrain launch mpiexec ...' "
                     "makes repeats safe)")
        else:
            again = f"Ctrl-C again after {launch.REPEAT_S:g} s to abort at once, saving nothing"
        self._notice = f"\nmpitrain: Ctrl-C: {then}; {again}\n".encode()

    def _handler(self, signum, frame) -> None:
        if signum == getattr(signal, launch.RELAYED_INT):
            signum = signal.SIGINT  # a Ctrl-C relayed to Open MPI's mpirun or srun, which would not pass it on
        if signum == signal.SIGINT and self._first_int is not None:
            if time.monotonic() - self._first_int >= launch.REPEAT_S:
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # and end as a Ctrl-C ends a process
                os.kill(os.getpid(), signal.SIGINT)
            return
        self.received = self.received or signum
        if signum == signal.SIGINT:
            self._first_int = time.monotonic()
            if self.loud:  # os.write: a print here could land inside another print
                try:
                    os.write(sys.stderr.fileno(), self._notice)
                except (OSError, ValueError):  # no stderr file (a notebook), or a closed pipe: stop all the same
                    pass

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                if hasattr(signal, name) and (name != launch.RELAYED_INT or os.environ.get(launch.ENV)):
                    sig = getattr(signal, name)
                    self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def unsaved_stop(launcher: str | None, library: str) -> str | None:
    """A line for a run under Open MPI's ``mpirun`` started without ``mpitrain launch``: that
    ``mpirun`` kills every rank at its first SIGINT or SIGTERM, before any can save
    (:mod:`mpitrain.launch`); None elsewhere."""
    if launcher != "mpirun" or not library.startswith("Open MPI") or os.environ.get(launch.ENV):
        return None
    return ("note: Open MPI's mpirun kills every rank at Ctrl-C or SIGTERM, saving nothing; start the run as "
            "'mpitrain launch mpirun ...' so that Ctrl-C ends in a checkpoint (or send mpirun SIGUSR1)")
