"""Communicator helpers, and failures under a real mpiexec (launched from the unit tier)."""

import shutil
import subprocess
import sys
import time

import pytest

from mpitrain import launch
from mpitrain.comm import SingleComm, abort_on_exception, launcher_rank
from mpitrain.comm.communicator import LAUNCHER_RANK_VARIABLES

MPIEXEC = shutil.which("mpiexec") or shutil.which("mpirun")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
OPEN_MPI = MPIEXEC is not None and launch.kind_of([MPIEXEC]) == "openmpi"  # its mpiexec kills at a first SIGINT


def test_single_comm_is_a_one_rank_world():
    c = SingleComm()
    assert (c.rank, c.size) == (0, 1)
    assert c.allgather(5) == [5] and c.gather(5) == [5] and c.bcast(5) == 5
    assert c.agree(lambda: 3) == 3
    with pytest.raises(ValueError):
        c.agree(lambda: int("x"))


def test_without_mpi_exceptions_just_propagate():
    with pytest.raises(KeyError), abort_on_exception():
        raise KeyError("k")


def test_the_launcher_rank_comes_from_the_environment(monkeypatch):
    for name in LAUNCHER_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert launcher_rank() is None  # no launcher
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert launcher_rank() == 3
    monkeypatch.setenv("PMI_RANK", "1")  # Hydra's mpiexec inside a SLURM batch script
    assert launcher_rank() == 1


def run_mpi(n, code, timeout=60):
    tick = time.perf_counter()
    out = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout)
    return out, time.perf_counter() - tick


def assert_ended_by(run, error: str, rank: int, ranks: int) -> None:
    """The job failed within 10 s, with ``rank``'s traceback (``error``) printed once."""
    out, seconds = run
    assert out.returncode != 0
    assert out.stderr.count(error) == 1
    assert f"[rank {rank}]" in out.stderr and f"aborting all {ranks} ranks" in out.stderr
    assert seconds < 10


@needs_mpiexec
def test_an_exception_on_one_rank_ends_every_rank():
    code = ("from mpitrain.comm import world, abort_on_exception\n"
            "with abort_on_exception():\n"
            "    comm = world()\n"
            "    if comm.rank == 1:\n"
            "        raise RuntimeError('boom on one rank')\n"
            "    comm.barrier()  # would wait forever without the abort\n")
    out, seconds = run_mpi(2, code)
    assert out.returncode != 0
    assert "[rank 1]" in out.stderr and "boom on one rank" in out.stderr
    assert seconds < 30


@needs_mpiexec
def test_agreed_errors_are_raised_on_every_rank():
    code = ("from mpitrain.comm import world\n"
            "comm = world()\n"
            "def check():\n"
            "    if comm.rank == 1:\n"
            "        raise ValueError('only rank 1 sees it')\n"
            "try:\n"
            "    comm.agree(check)\n"
            "except ValueError as e:\n"
            "    print(f'rank {comm.rank}: {e}', flush=True)\n")
    out, _ = run_mpi(2, code)
    assert out.returncode == 0, out.stderr
    assert "rank 0: only rank 1 sees it (on rank 1)" in out.stdout
    assert "rank 1: only rank 1 sees it" in out.stdout


@needs_mpiexec
def test_cli_reports_a_damaged_dataset_once_and_exits_2(tmp_path):
    from test_data import damaged

    d, shard = damaged(tmp_path, "missing")
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpitrain", "bench", "io", str(d)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("mpitrain: error:")]
    assert len(lines) == 1 and f"{shard}: missing" in lines[0]


@needs_mpiexec
def test_a_rank_that_raises_mid_step_ends_the_job_within_10_s():
    """Rank 1 fails between forward and backward; rank 0 is waiting for its buckets in
    finish() and must be ended by the abort, not left hanging."""
    code = ("import numpy as np\n"
            "from mpitrain import nn, rng\n"
            "from mpitrain.comm import world, abort_on_exception\n"
            "from mpitrain.parallel.data_parallel import DataParallel\n"
            "with abort_on_exception():\n"
            "    comm = world()\n"
            "    rng.manual_seed(0)\n"
            "    model = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16))\n"
            "    dp = DataParallel(model, comm, bucket_cap_mb=1e-3)\n"
            "    x = np.zeros((2, 8), dtype=np.int64)\n"
            "    for step in range(5):\n"
            "        loss = model(x, x)[1]\n"
            "        if comm.rank == 1 and step == 2:\n"
            "            raise RuntimeError('injected failure on rank 1 at step 2')\n"
            "        loss.backward()\n"
            "        dp.finish()\n")
    assert_ended_by(run_mpi(2, code), "RuntimeError: injected failure on rank 1 at step 2", rank=1, ranks=2)



@needs_mpiexec
def test_a_pipeline_stage_that_raises_ends_the_job_within_10_s():
    """The last stage fails in its loss at step 2; the first is waiting for a gradient in
    the middle of its 1F1B schedule and must be ended by the abort, not left hanging."""
    code = ("import numpy as np\n"
            "from mpitrain import nn, ops, optim, rng\n"
            "from mpitrain.comm import world, abort_on_exception\n"
            "from mpitrain.parallel.local import LocalSync\n"
            "from mpitrain.parallel.pipeline import PipelineStage\n"
            "with abort_on_exception():\n"
            "    comm = world()\n"
            "    rng.manual_seed(0)\n"
            "    model = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16))\n"
            "    step = [0]\n"
            "    def loss(out, y):\n"
            "        if step[0] == 2:\n"
            "            raise RuntimeError('injected failure in the last stage at step 2')\n"
            "        return ops.cross_entropy(out, y)\n"
            "    stage = PipelineStage(model, comm, np.zeros((1, 8), dtype=np.int64), loss, micro_batches=4)\n"
            "    sync = LocalSync(stage, optim.SGD(stage.parameters(), 0.1))\n"
            "    x = np.zeros((8, 8), dtype=np.int64)\n"
            "    for step[0] in range(5):\n"
            "        stage.run(x, x, np.arange(8), sync)\n")
    assert_ended_by(run_mpi(2, code), "RuntimeError: injected failure in the last stage at step 2", rank=1, ranks=2)

STALL = ("import sys, time\n"
         "import numpy as np\n"
         "from mpitrain.comm import world, abort_on_exception\n"
         "from mpitrain.observe.watchdog import Watchdog\n"
         "with abort_on_exception():\n"
         "    comm = world()\n"
         "    dog = Watchdog(comm, warn_after=0.5, abort_after=float(sys.argv[1]), waits=['agreeing on the step'],\n"
         "                   interval=0.1)\n"
         "    for step in range(3):\n"
         "        with dog.phase(step, 'computing'):\n"
         "            if comm.rank == 1 and step == 2:\n"
         "                time.sleep(float(sys.argv[2]))\n"
         "        with dog.phase(step, 'agreeing on the step'):\n"
         "            comm.allreduce(np.zeros(1))\n"
         "    dog.close()\n"
         "    print(f'rank {comm.rank} done', flush=True)\n")


@needs_mpiexec
def test_the_stall_watchdog_names_the_missing_rank_then_aborts():
    tick = time.perf_counter()
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", STALL, "2.0", "30"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode != 0 and time.perf_counter() - tick < 10
    warned = [line for line in out.stderr.splitlines() if line.startswith("[rank 0] stall:")]
    assert len(warned) == 1, out.stderr
    assert "in 'agreeing on the step' at step 2; not there: rank 1 (step 2, computing for" in warned[0]
    assert "[rank 0] aborting: waited 2 s" in out.stderr and "ending all 2 ranks (run.stall_abort_s = 2)" in out.stderr
    assert "done" not in out.stdout


@needs_mpiexec
def test_a_stall_shorter_than_the_abort_limit_only_warns():
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", STALL, "0", "1.5"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("[rank 0] stall:") == 1 and "rank 0 done" in out.stdout and "rank 1 done" in out.stdout


@needs_mpiexec
def test_a_worker_that_raises_ends_the_parameter_server_job():
    """Worker 1 fails at step 2: the server blocked in Waitany and the other worker
    waiting for its reply are ended by the abort."""
    code = ("import numpy as np\n"
            "from mpitrain import nn, optim, rng\n"
            "from mpitrain.comm import world, abort_on_exception\n"
            "from mpitrain.parallel.param_server import ParameterServer\n"
            "with abort_on_exception():\n"
            "    comm = world()\n"
            "    rng.manual_seed(0)\n"
            "    model = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16))\n"
            "    ps = ParameterServer(model, optim.SGD(model.parameters(), lr=0.1), comm, servers=1)\n"
            "    if ps.is_server:\n"
            "        ps.serve()\n"
            "    else:\n"
            "        x = np.zeros((2, 8), dtype=np.int64)\n"
            "        for step in range(5):\n"
            "            ps.pull_wait()\n"
            "            if ps.worker == 1 and step == 2:\n"
            "                raise RuntimeError('injected failure on worker 1 at step 2')\n"
            "            model(x, x)[1].backward()\n"
            "            ps.push(step)\n"
            "        ps.leave()\n")
    assert_ended_by(run_mpi(3, code), "RuntimeError: injected failure on worker 1 at step 2", rank=2, ranks=3)
