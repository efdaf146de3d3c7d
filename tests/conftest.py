"""Shared test set-up. In the MPI tier, a test failing on one rank ends the whole run.

Without this, the other ranks would wait in their next collective until the time limit;
with it, the failing rank prints its report and calls MPI_Abort (never a hang)."""

import os
import sys
import tempfile

import numpy as np
import pytest

# embedded datasets built by tests go to a scratch cache, not the user's ~/.cache
os.environ.setdefault("MPITRAIN_DATA", tempfile.mkdtemp(prefix="mpitrain-test-data-"))


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


@pytest.fixture
def text_data(tmp_path):
    """A shard directory of a small text (90/10 split)."""
    from mpitrain_datasets import text

    p = tmp_path / "input.txt"
    words = np.random.default_rng(0).choice(["to be", "or not", "that is", "the question"], 600)
    p.write_text("\n".join(words) + "\n")
    text.text(p, tmp_path / "shards")
    return tmp_path / "shards"
