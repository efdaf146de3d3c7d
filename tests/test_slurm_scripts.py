"""The SLURM scripts under signals, without SLURM: stand-ins for ``srun`` and ``scontrol``.

SLURM signals the tasks of a step itself: ``#SBATCH --signal=USR1@120`` and ``scancel``
(SIGTERM) reach every rank from its step daemon, whichever MPI runs them, while ``srun``
passes on what it is sent. The stand-in ``srun`` starts the ranks with this machine's
``mpiexec`` (MPICH's or Open MPI's) in a session of their own, so that no signal reaches
that launcher (Open MPI's would kill every rank at a SIGTERM), and hands each signal it gets
to every rank (the launcher's descendants running ``mpitrain train``), as the step daemon
does. ``scontrol requeue`` is recorded in a file.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_comm import MPIEXEC, needs_mpiexec
from test_data import text_set

JOBS = Path(__file__).resolve().parent.parent / "jobs"

SRUN = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    args = sys.argv[1:]
    seen = open(os.environ["STAND_IN_LOG"], "a")
    seen.write(" ".join(args) + "\\n")
    while args and args[0].startswith("--"):  # srun's own options: --mpi=pmix, --cpu-bind=cores, --ntasks=2
        args.pop(0)
    ranks = subprocess.Popen([os.environ["STAND_IN_MPIEXEC"], "-n", "2", *args], start_new_session=True)
    def to_every_rank(signum, frame):  # the step daemon's part: each task gets it
        # -ww: whole command lines, whatever COLUMNS says (pytest-xdist's workers set it to 80,
        # which cut "mpitrain train" off a long path: no rank was signalled and the job ran on)
        table = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
        rows = [line.split(None, 2) + [""] for line in table.splitlines()]
        below, found = {ranks.pid}, True
        while found:  # the launcher's descendants: MPICH's proxies start each rank in a session of its own
            found = {int(pid) for pid, ppid, *_ in rows if int(ppid) in below and int(pid) not in below}
            below |= found
        told = [int(pid) for pid, _, args, *_ in rows  # the ranks, not the launcher, whose command line names them too
                if int(pid) in below - {ranks.pid} and "mpitrain train" in args]
        for pid in told:
            os.kill(pid, signum)
        if not told:  # say so and end the ranks, rather than leave the test to wait on a run that never stops
            print(f"srun stand-in: no rank found to pass signal {signum} on to", file=sys.stderr, flush=True)
            os.killpg(ranks.pid, signal.SIGKILL)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, to_every_rank)
    sys.exit(ranks.wait())
""")


def stand_ins(tmp_path) -> dict:
    """A folder with ``srun`` and ``scontrol`` first on PATH, and the environment of a job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!{sys.executable}\n{SRUN}")
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                SLURM_JOB_ID="4242", SLURM_CPUS_PER_TASK="1", SRUN_MPI="pmix", STAND_IN_MPIEXEC=MPIEXEC,
                STAND_IN_LOG=str(tmp_path / "srun.log"))


@needs_mpiexec
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_the_ddp_script_checkpoints_at_slurms_signal_and_requeues_then_resumes(tmp_path, sig):
    """SLURM's notice before the time limit (SIGUSR1) or a SIGTERM to the step: every rank
    finishes its step and saves, the run stops with exit 0, and the script requeues the job;
    the requeued job resumes from that checkpoint."""
    data = tmp_path / "data"
    text_set(data, n=3000)
    env = stand_ins(tmp_path)
    options = ["--set", f"data.path={data}", "--set", "model.n_layer=1", "--set", "model.n_embd=32",
               "--set", "model.n_head=2", "--set", "model.block_size=16", "--set", "train.steps=100000",
               "--set", "train.global_batch_size=8", "--set", "train.eval_interval=0", "--set", "train.log_interval=1",
               "--set", "train.sample_tokens=0"]
    script = [str(JOBS / "slurm_ddp.sbatch"), str(JOBS / "tinyshakespeare_gpt.toml"), *options]
    job = subprocess.Popen(script, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    run = tmp_path / "runs" / "tinyshakespeare_gpt-slurm"
    deadline, metrics = time.monotonic() + 120, run / "metrics.jsonl"
    while time.monotonic() < deadline and (not metrics.exists() or metrics.read_text().count('"train"') < 10):
        time.sleep(0.2)  # ten steps trained
    srun = subprocess.run(["pgrep", "-s", str(job.pid), "-f", "bin/srun"], capture_output=True, text=True)
    os.kill(int(srun.stdout.split()[0]), getattr(signal, sig))
    try:
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out
    assert f"stopped by {sig} after step" in out, out
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # the script queued itself again
    assert "--mpi=pmix --cpu-bind=cores" in (tmp_path / "srun.log").read_text()  # SRUN_MPI reached srun
    saved = sorted((run / "checkpoints").glob("step-*.h5"))
    assert saved, out
    step = int(saved[-1].stem.split("-")[1])
    again = subprocess.run([*script, "--set", f"train.steps={step + 3}"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"at step {step} (saved by 2 rank(s)" in again.stdout, again.stdout  # resumed there
