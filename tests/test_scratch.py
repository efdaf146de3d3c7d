"""A test run leaves nothing in the temporary directory (conftest.py's scratch directory)."""

import glob
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


def hydra_files_nobody_holds() -> set[str]:
    """MPICH's Hydra writes /tmp/hydra_hwloc_xmlfile_* whatever TMPDIR says, and a job
    ended by MPI_Abort leaves its file behind; a running job's proxy holds its own open."""
    from conftest import HYDRA_TOPOLOGY_FILES, open_files

    return set(glob.glob(HYDRA_TOPOLOGY_FILES)) - open_files()


def test_the_unit_tier_leaves_nothing_in_the_temporary_directory(tmp_path):
    before = hydra_files_nobody_holds()
    out = pytest_in(tmp_path, str(TESTS / "test_train.py") + "::test_cli_help_and_version",  # mkdtemp
                    str(TESTS / "test_report.py") + "::test_report_draws_the_plots_and_a_summary",  # tmp_path
                    str(TESTS / "test_comm.py") + "::test_an_exception_on_one_rank_ends_every_rank")  # MPI_Abort
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert hydra_files_nobody_holds() <= before


@needs_mpiexec
def test_the_mpi_tier_leaves_nothing_in_the_temporary_directory(tmp_path):
    out = pytest_in(tmp_path, "--with-mpi", "-m", "mpi",  # a directory made by rank 0 for every rank
                    str(TESTS / "test_mpi_data.py") + "::test_epoch_union_and_global_batches_across_ranks", ranks=2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@needs_mpiexec
def test_the_mpi_tier_prints_one_header_and_one_summary(tmp_path):
    """Rank 0 alone prints the run's header, progress and summary; the other ranks'
    reports stay in their buffers when the run passes (conftest.py)."""
    out = pytest_in(tmp_path, "--with-mpi", "-m", "mpi", str(TESTS / "test_mpi_tier.py"), ranks=3)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("2 passed in ") == 1 and out.stdout.count("MPI vendor: ") == 1, out.stdout
