"""``mpitrain launch``: what reaches the launch line it runs. A child that records the
signals it gets stands in for mpiexec (the terminal tests in test_checkpoint.py run
the real one)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mpitrain import launch

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    got = []
    for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGQUIT"):
        signal.signal(getattr(signal, name), lambda s, f: got.append(signal.Signals(s).name))
    print("ready", os.getsid(0) == os.getpid(), os.environ.get("MPITRAIN_LAUNCH"), flush=True)
    deadline = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < deadline and len(got) < int(sys.argv[2]):
        time.sleep(0.01)
    print(" ".join(got), flush=True)
    sys.exit(int(sys.argv[3]))
""")


def start(*child_args):
    proc = subprocess.Popen([sys.executable, "-m", "mpitrain", "launch", sys.executable, "-c", CHILD,
                             *map(str, child_args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready True 1\n"  # in a session of its own, told it was launched
    return proc


def test_the_first_sigint_is_passed_on_repeats_within_the_window_are_not_a_later_one_is():
    proc = start(launch.REPEAT_S + 5, 2, 7)
    for _ in range(3):  # a key pressed three times, or timeout's copies
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    time.sleep(launch.REPEAT_S)
    proc.send_signal(signal.SIGINT)  # after the window: passed on (mpiexec then aborts)
    out, err = proc.communicate(timeout=60)
    assert out == "SIGINT SIGINT\n" and proc.returncode == 7
    assert err.count("mpitrain launch: stopping already") == 2


def test_ctrl_c_repeated_while_the_launcher_exits_does_not_kill_it():
    """SIGINTs every few milliseconds from the first until ``mpitrain launch`` has exited:
    the launch line stops at the first, and the launcher, exiting, takes none of the
    others as its own death (the status stays the launch line's 130, not killed by SIGINT)."""
    proc = subprocess.Popen([sys.executable, "-m", "mpitrain", "launch", sys.executable, "-c", CHILD, "30", "1", "130"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout.readline() == "ready True 1\n"
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.002)
    assert proc.wait(timeout=10) == 130
    assert proc.stdout.read().startswith("SIGINT")  # (a child slower than REPEAT_S to exit would get a second)


@pytest.mark.parametrize("sent,got", [("SIGTERM", "SIGTERM"), ("SIGUSR1", "SIGUSR1"), ("SIGHUP", "SIGTERM")])
def test_other_stop_signals_are_passed_on_each_time(sent, got):
    proc = start(30, 2, 0)
    for _ in range(2):
        proc.send_signal(getattr(signal, sent))
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=60)
    assert out == f"{got} {got}\n" and proc.returncode == 0


def test_the_status_of_a_launch_line_ended_by_a_signal_is_128_plus_it():
    done = subprocess.run([sys.executable, "-m", "mpitrain", "launch", "sh", "-c", "kill -KILL $$"],
                          capture_output=True, timeout=60)
    assert done.returncode == 128 + signal.SIGKILL


def test_a_signal_before_the_launch_line_has_started_is_passed_on_once_it_has():
    forwarder = launch.Forwarder()
    forwarder.on_int(signal.SIGINT, None)
    assert forwarder.pending == [signal.SIGINT]
    # SIGINT's default action, not the one inherited: a shell's background job starts with it ignored
    child = subprocess.Popen(["sleep", "30"], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        forwarder.started(child)
        assert child.wait(timeout=30) == -signal.SIGINT
    finally:
        child.kill()
    hangup = launch.Forwarder()
    hangup.on_other(signal.SIGHUP, None)
    assert hangup.pending == [signal.SIGTERM]


def test_a_launch_line_that_cannot_start_is_one_line(capsys):
    from mpitrain import cli

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    assert cli.main(["launch", "/nonexistent/mpiexec", "-n", "2"]) == 2
    assert capsys.readouterr().err == "mpitrain: error: cannot run /nonexistent/mpiexec: No such file or directory\n"
    assert os.environ.get(launch.ENV) is None
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # this process's own, put back


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_closed_terminal_is_a_sigterm_and_the_launch_line_writes_on_to_the_end(tmp_path):
    """The terminal (or the ssh connection) goes away: the launch line gets SIGTERM and
    its output, which a closed terminal would refuse (mpiexec then kills the ranks),
    is read on and dropped, so it ends as it means to."""
    import fcntl
    import termios

    saved = tmp_path / "saved"
    child = textwrap.dedent(f"""
        import signal, sys, time
        stop = []
        signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
        while not stop:
            print("step", flush=True)
            time.sleep(0.01)
        for _ in range(100):  # to a closed terminal: EIO, unless something reads on
            print("saving", flush=True)
        open({str(saved)!r}, "w").write("done")
    """)
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "mpitrain", "launch", sys.executable, "-c", child],
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # noqa: PLW1509
    os.close(slave)
    assert os.read(master, 4) == b"step"  # the launch line runs, and writes through the launcher
    os.close(master)  # the terminal closes: SIGHUP to the launcher, its controlling process
    assert proc.wait(timeout=60) == 0
    assert saved.read_text() == "done"


def stand_in(tmp_path, name: str, version: str) -> str:
    """An executable called ``name`` that answers ``--version`` with ``version`` and is
    otherwise :data:`CHILD` (it records the signals it gets): a launcher, for
    :func:`mpitrain.launch.kind_of`, without the launcher."""
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\nimport sys\n"
                    f"if sys.argv[1:] == ['--version']:\n    print({version!r})\n    sys.exit(0)\n"
                    + CHILD.replace('("SIGINT", "SIGTERM", "SIGUSR1", "SIGQUIT")',
                                    '("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGQUIT")'))
    path.chmod(0o755)
    return str(path)


def test_the_launcher_a_line_runs_is_told_by_its_name_and_version(tmp_path):
    assert launch.kind_of([stand_in(tmp_path, "mpirun", "mpirun (Open MPI) 5.0.11")]) == "openmpi"
    assert launch.kind_of([stand_in(tmp_path, "mpiexec", "prterun (Open MPI) 4.1.4\n")]) == "openmpi"
    hydra = tmp_path / "hydra"
    hydra.mkdir()
    assert launch.kind_of([stand_in(hydra, "mpiexec", "HYDRA build details:\n    Version: 4.3.2")]) == "other"
    assert launch.kind_of(["srun", "-n", "2"]) == "srun"  # by its name alone: never started to ask
    assert launch.kind_of([sys.executable, "-c", "pass"]) == "other"
    assert launch.kind_of(["/nonexistent/mpirun"]) == "other"  # run() then says it cannot start


@pytest.mark.parametrize("name,version", [("mpirun", "mpirun (Open MPI) 5.0.11"), ("srun", "slurm 24.05.3")])
def test_a_first_ctrl_c_goes_to_open_mpis_mpirun_and_to_srun_as_sigusr2_a_later_one_as_sigint(tmp_path, name,
                                                                                              version):
    """Open MPI's mpirun kills every rank at its first SIGINT, srun passes one on only when a
    second follows within a second: the first Ctrl-C goes as SIGUSR2, which the ranks take
    as it (test_signals_of_a_relayed_ctrl_c...); one after the window as SIGINT (mpirun
    aborts; srun gets two, and ends its tasks)."""
    proc = subprocess.Popen([sys.executable, "-m", "mpitrain", "launch", stand_in(tmp_path, name, version),
                             str(launch.REPEAT_S + 10), "3" if name == "srun" else "2", "130"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready True 1\n"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # a repeat: passed on as nothing
    time.sleep(launch.REPEAT_S)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert out == ("SIGUSR2 SIGINT SIGINT\n" if name == "srun" else "SIGUSR2 SIGINT\n"), err
    assert proc.returncode == 130 and err.count("stopping already") == 1


def test_sigterm_and_sighup_go_to_open_mpis_mpirun_as_sigusr1(tmp_path):
    """Its SIGTERM would kill every rank before any saved; SIGUSR1 stops the run as SIGTERM does."""
    proc = subprocess.Popen([sys.executable, "-m", "mpitrain", "launch",
                             stand_in(tmp_path, "mpiexec", "mpiexec (Open MPI) 5.0.11"), "30", "3", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready True 1\n"
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        proc.send_signal(sig)
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=60)
    assert out == "SIGUSR1 SIGUSR1 SIGUSR1\n" and proc.returncode == 0


def test_signals_of_a_relayed_ctrl_c_stop_a_run_as_ctrl_c_does_only_under_mpitrain_launch(monkeypatch):
    from mpitrain.train.signals import StopSignals

    monkeypatch.setenv(launch.ENV, "1")
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert stop.received == signal.SIGINT  # "stopped by SIGINT", exit 130
    monkeypatch.delenv(launch.ENV)
    before = signal.getsignal(signal.SIGUSR2)
    with StopSignals():
        assert signal.getsignal(signal.SIGUSR2) == before  # not ours to take: its default action stays


def test_a_run_under_open_mpis_mpirun_without_mpitrain_launch_says_ctrl_c_saves_nothing(monkeypatch):
    from mpitrain.train.signals import unsaved_stop

    monkeypatch.delenv(launch.ENV, raising=False)
    assert "mpitrain launch mpirun" in unsaved_stop("mpirun", "Open MPI 5.0.11")
    assert unsaved_stop("mpirun", "MPICH 5.0.2") is None  # Hydra's mpirun passes a first SIGINT on
    assert unsaved_stop("srun", "Open MPI 5.0.11") is None  # SLURM signals the tasks itself
    monkeypatch.setenv(launch.ENV, "1")
    assert unsaved_stop("mpirun", "Open MPI 5.0.11") is None
