"""Shared test set-up.

In the MPI tier, a test failing on one rank ends the whole run. Without this, the other
ranks would wait in their next collective until the time limit; with it, the failing
rank prints its report and calls MPI_Abort (never a hang).

A test run writes only into one scratch directory, removed when the run ends, so it
leaves nothing in the temporary directory: pytest's ``tmp_path`` (instead of
``/tmp/pytest-of-$USER``), whatever tests and the processes they start make with
``tempfile``, and the embedded datasets tests build (``$MPITRAIN_DATA``, instead of the
user's ``~/.cache``). In the MPI tier every rank uses rank 0's: the ranks of a run share
one embedded-data cache (rank 0 builds it, atomically, and every rank reads it). A run
that MPI_Abort ends leaves its scratch directory behind.

Nor does a test read the user's home: ``HOME`` and the XDG folders point into the scratch
directory and ``$MPITRAIN_HARDWARE`` and ``$MPITRAIN_MODELS`` are unset, in the tests and in
the processes they start, so a calibration the user wrote
(``~/.config/mpitrain/hardware.toml``) changes no test's outcome (``test_plan_hardware.py``
proves it with a poisoned one).

MPICH's Hydra writes each job's node topology to ``/tmp/hydra_hwloc_xmlfile_*`` (a path
it fixes, whatever ``TMPDIR`` says) and removes it when the job ends, but not when a rank
calls MPI_Abort, as several tests make one do on purpose; the run removes the files of
such jobs at its end: those that appeared during the run and that no process holds open
(a running job's proxy holds its own).
"""

import contextlib
import glob
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

SCRATCH: Path | None = None  # this run's (rank 0's in the MPI tier), set by pytest_configure
HYDRA_TOPOLOGY_FILES = "/tmp/hydra_hwloc_xmlfile_*"
hydra_files_before: set[str] = set()


def open_files() -> set[str]:
    """The paths that the processes this user may inspect hold open (Linux: /proc)."""
    held = set()
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        with contextlib.suppress(OSError):  # the process or the descriptor is gone, or not ours
            held.add(os.readlink(fd))
    return held


# the longer tier (tests/README.md), not in CI; MPITRAIN_COMPOSE=all, its composition part's earlier switch
LONGER = os.environ.get("MPITRAIN_LONGER") == "1" or os.environ.get("MPITRAIN_COMPOSE") == "all"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``longer`` skip outside the longer tier (:data:`LONGER`)."""
    if LONGER:
        return
    skip = pytest.mark.skip(reason="the longer tier (MPITRAIN_LONGER=1)")
    for item in items:
        if item.get_closest_marker("longer"):
            item.add_marker(skip)


def isolate_home(home: Path) -> None:
    """``home`` as this process's (and its children's) home, with its XDG folders; no user
    hardware catalogue named by the environment."""
    home.mkdir(exist_ok=True)
    os.environ["HOME"] = str(home)
    for name, sub in (("XDG_CONFIG_HOME", ".config"), ("XDG_CACHE_HOME", ".cache"), ("XDG_DATA_HOME", ".local/share")):
        os.environ[name] = str(home / sub)
    os.environ.pop("MPITRAIN_HARDWARE", None)
    os.environ.pop("MPITRAIN_MODELS", None)


@pytest.hookimpl(tryfirst=True)  # before pytest's tmpdir plugin reads the basetemp
def pytest_configure(config):
    global SCRATCH
    rank, comm = 0, None
    if config.getoption("--with-mpi", default=False):  # the MPI tier: every test starts MPI anyway
        from mpitrain.comm import world

        comm = world()
        rank = comm.rank
    made = tempfile.mkdtemp(prefix="mpitrain-tests-") if rank == 0 else None
    SCRATCH = Path(comm.bcast(made) if comm else made)
    tempfile.tempdir = str(SCRATCH)  # tempfile.mkdtemp() and the like, in tests
    os.environ["TMPDIR"] = str(SCRATCH)  # ... and in the processes they start
    os.environ.setdefault("MPITRAIN_DATA", str(SCRATCH / "data"))
    isolate_home(SCRATCH / "home")
    if config.option.basetemp is None:
        config.option.basetemp = str(SCRATCH / f"pytest-rank{rank}")
    hydra_files_before.update(glob.glob(HYDRA_TOPOLOGY_FILES))
    if rank != 0:  # the MPI tier's other ranks: see pytest_sessionstart
        config.stash[RANK_REPORT] = io.StringIO()
        config.stash[REAL_STDOUT] = sys.stdout
        sys.stdout = config.stash[RANK_REPORT]  # the terminal reporter, made after this hook, writes here


@pytest.hookimpl(tryfirst=True)  # before the terminal reporter prints the session's header
def pytest_sessionstart(session):
    """In the MPI tier, only rank 0 prints the run's progress and summary: the other
    ranks' terminal reporters were made writing to a buffer (pytest_configure), printed
    only if that rank's run fails (a test that fails on a rank prints its own report and
    aborts the job: pytest_runtest_makereport). Standard output itself is put back."""
    real = session.config.stash.get(REAL_STDOUT, None)
    if real is not None:
        sys.stdout = real


RANK_REPORT = pytest.StashKey[io.StringIO]()
REAL_STDOUT = pytest.StashKey[object]()


def pytest_sessionfinish(session, exitstatus):
    buffer = session.config.stash.get(RANK_REPORT, None)
    if buffer is not None and exitstatus not in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.config.add_cleanup(lambda: sys.stderr.write(buffer.getvalue()))


def pytest_unconfigure(config):
    from mpitrain.comm import started_world

    comm = started_world()
    if comm is not None:
        comm.barrier()  # rank 0 removes the directory once every rank is done with it
    if SCRATCH is not None and (comm is None or comm.rank == 0):
        shutil.rmtree(SCRATCH, ignore_errors=True)
        for path in set(glob.glob(HYDRA_TOPOLOGY_FILES)) - hydra_files_before - open_files():
            with contextlib.suppress(OSError):  # removed meanwhile, or another user's
                os.remove(path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    mpi = sys.modules.get("mpi4py.MPI")
    if report.failed and mpi is not None and mpi.Is_initialized() and mpi.COMM_WORLD.Get_size() > 1:
        rank = mpi.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n[rank {rank}] {item.nodeid} FAILED:\n{report.longreprtext}\n"
                         f"[rank {rank}] aborting the MPI run\n")
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(1)


@pytest.fixture(autouse=True)
def no_request_dropped_in_flight():
    """A test fails if an MPI request was collected before it completed (its owner
    dropped without a wait): MPI may still be moving its buffer, which only mpitrain's
    parking keeps alive (:class:`mpitrain.comm.requests.MPIRequest`). Under MPICH such a
    bug passed silently; under Open MPI it crashed."""
    from mpitrain.comm import requests

    before = len(requests.dropped)
    yield
    dropped = requests.dropped[before:]
    del requests.dropped[before:]
    assert not dropped, f"requests collected in flight: {dropped}"


@contextlib.contextmanager
def tmpfs(folder: Path, options: str):
    """A tmpfs mounted on ``folder`` with ``options`` (``size=3m``, ``ro``), unmounted after;
    the test is skipped where it cannot be mounted (it needs root and mount)."""
    import subprocess
    import uuid

    folder.mkdir(exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, f"mpitrain-test-{uuid.uuid4().hex[:8]}",
                           str(folder)], capture_output=True, text=True) if shutil.which("mount") else None
    if made is None or made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: it needs root and mount")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


WORDS = ("to be", "or not", "that is", "the question")


def small_text(shards: Path, lines: int = 600, words=WORDS) -> Path:
    """The shard directory ``shards`` (90/10 split) of a text of ``lines`` lines, each one
    of ``words`` drawn by a seeded stream; the text beside it, as ``input.txt``."""
    from mpitrain_datasets import text

    shards.parent.mkdir(parents=True, exist_ok=True)
    src = shards.parent / "input.txt"
    src.write_text("\n".join(np.random.default_rng(0).choice(list(words), lines)) + "\n")
    text.text(src, shards)
    return shards


@pytest.fixture
def text_data(tmp_path):
    """A shard directory of a small text (90/10 split)."""
    return small_text(tmp_path / "shards")


SMALL_CNNS = {
    "lenet": dict(kind="LeNet", in_channels=2, image_size=12, channels=(4, 6), hidden=16, dropout=0.2),
    "convnet": dict(kind="ConvNet", in_channels=2, image_size=12, channels=(4, 6)),
    "resnet": dict(kind="ResNet", in_channels=2, widths=(4, 6), blocks=1),
}


@pytest.fixture(params=list(SMALL_CNNS))
def small_cnn(request, monkeypatch):
    """(make, images, labels): one of each CNN the package builds, small, its convolutions
    cut into several tiles so that a walk meets the tiled paths; images are float64, (6, 12, 12, 2)."""
    from mpitrain import nn
    from mpitrain.ops import conv

    monkeypatch.setattr(conv, "TILE_BYTES_PER_THREAD", 4000)
    kwargs = dict(SMALL_CNNS[request.param])
    model = getattr(nn, kwargs.pop("kind"))
    r = np.random.default_rng(8)
    images, labels = r.standard_normal((6, 12, 12, 2)), r.integers(0, 10, 6)
    return (lambda: model(**kwargs)), images, labels
