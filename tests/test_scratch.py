"""A test run leaves nothing in the temporary directory (conftest.py's scratch directory)."""

import os
import subprocess
import sys
from pathlib import Path

from test_comm import MPIEXEC, needs_mpiexec

TESTS = Path(__file__).resolve().parent


def pytest_in(tmp: Path, *args, ranks: int = 0):
    """Run pytest on ``args`` with ``TMPDIR=tmp`` and no ``MPITRAIN_DATA`` (so the run
    makes its own data cache), under ``mpiexec -n ranks`` if ranks."""
    env = dict(os.environ, TMPDIR=str(tmp))
    env.pop("MPITRAIN_DATA", None)
    launcher = [MPIEXEC, "-n", str(ranks)] if ranks else []
    return subprocess.run([*launcher, sys.executable, "-m", "pytest", "-q", *args], capture_output=True, text=True,
                          cwd=TESTS.parent, env=env, timeout=240, check=False)


def test_the_unit_tier_leaves_nothing_in_the_temporary_directory(tmp_path):
    out = pytest_in(tmp_path, str(TESTS / "test_train.py") + "::test_cli_help_and_version",  # mkdtemp
                    str(TESTS / "test_report.py") + "::test_report_draws_the_plots_and_a_summary")  # tmp_path
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@needs_mpiexec
def test_the_mpi_tier_leaves_nothing_in_the_temporary_directory(tmp_path):
    out = pytest_in(tmp_path, "--with-mpi", "-m", "mpi",  # a directory made by rank 0 for every rank
                    str(TESTS / "test_mpi_data.py") + "::test_epoch_union_and_global_batches_across_ranks", ranks=2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
