"""Checkpoints: exact resume, damaged files, run directories, signals, NaN policy, metrics.

In-process runs are one process (no MPI); the kill and signal tests launch
``mpiexec -n 2 mpitrain train`` and stop it from outside, as a scheduler would."""

import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import small_text
from test_comm import MPIEXEC, OPEN_MPI, needs_mpiexec
from test_data import image_set
from test_train import JOBS

from mpitrain import checkpoint, config, train
from mpitrain.observe.metrics import read as read_metrics
from mpitrain.train import report


def gpt(text_data, run_dir, *extra):
    return config.load(JOBS / "tinyshakespeare_gpt.toml", [
        f"data.path={text_data}", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=8",
        "model.dropout=0.1", "train.steps=24", "train.global_batch_size=8", "train.log_interval=4",
        "train.eval_interval=0", "train.eval_batches=2", "train.sample_tokens=0", "train.threads=1",
        f"run.dir={json.dumps(str(run_dir))}", "run.checkpoint_interval=4", "run.keep=10", *extra])


def lenet(data, run_dir, *extra):
    raw = {"model": {"name": "lenet", "channels": [2, 4], "hidden": 8}, "data": {"path": str(data), "shift": 1},
           "optim": {"name": "sgd", "lr": 0.05}, "train": {"global_batch_size": 64, "epochs": 3, "log_interval": 5,
                                                            "threads": 1},
           "run": {"dir": str(run_dir), "checkpoint_interval": 5, "keep": 10}}
    return config.from_dict(raw, list(extra))


def arrays(path) -> dict:
    """Every dataset of a checkpoint (model and optimizer state)."""
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def assert_close(a, b, rtol: float, floor: float):
    """Two checkpoints' arrays equal within ``rtol`` of each float array's largest
    magnitude (at least ``floor``); other arrays exactly."""
    a, b = arrays(a), arrays(b)
    assert a.keys() == b.keys()
    for k in a:
        if a[k].dtype.kind == "f":
            scale = max(floor, float(np.abs(b[k]).max()))
            assert np.abs(a[k] - b[k]).max() <= rtol * scale, k
        else:
            assert np.array_equal(a[k], b[k]), k


def assert_identical(a, b):
    a, b = arrays(a), arrays(b)
    assert a.keys() == b.keys()
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not differ, f"differ: {differ}"


def resume_from(src_run, step, dst_run):
    """A run directory holding only ``src_run``'s checkpoint of ``step``."""
    (dst_run / "checkpoints").mkdir(parents=True)
    shutil.copy(checkpoint.path_for(src_run, step), dst_run / "checkpoints")


def quiet(*args):
    pass


def test_rank_0_writes_a_ranks_consecutive_rows_at_once_and_a_slice_where_it_goes():
    """The writer's plumbing (:mod:`mpitrain.checkpoint.layout`): a rank's pieces of a
    flat dataset that follow each other are one write; a gap, or a slice, stays apart;
    packed arrays start 8-byte aligned. (Every layout's checkpoint equals one process's in
    the MPI tier.)"""
    from mpitrain.checkpoint.layout import _packed, _runs

    a, b, c = np.arange(3.0), np.arange(3.0, 5.0), np.arange(9.0, 10.0)
    sliced = (("model/w", None, None, (slice(0, 1),), None), np.ones((1, 2)))
    runs = _runs([((("optim/state/m", (0, 3), None, None, None)), a), sliced,
                  (("optim/state/m", (3, 5), None, None, None), b), (("optim/state/m", (9, 10), None, None, None), c)])
    assert [(h[0], h[1]) for h, _ in runs] == [("optim/state/m", (0, 5)), ("optim/state/m", (9, 10)), ("model/w", None)]
    np.testing.assert_array_equal(runs[0][1], np.arange(5.0))
    assert runs[2][0] == sliced[0] and runs[2][1] is sliced[1]
    assert _packed([3, 8, 1, 0]).tolist() == [0, 8, 16, 24, 24]
    with h5py.File(io.BytesIO(), "w") as f:  # the writer itself: joined rows, a slice put together, scalar rows
        from mpitrain.checkpoint.layout import _Writer

        f.create_dataset("optim/state/m", (10,), dtype="f8"), f.create_dataset("model/w", (2, 2), dtype="f8")
        f.create_dataset("optim/has_state", (3,), dtype=bool)
        writer = _Writer(f)
        writer.write([(("optim/state/m", (0, 3), None, None, None), a), sliced,
                      (("optim/has_state", (1, 2), None, None, None), np.ones(1, dtype=bool))])
        writer.write([(("optim/state/m", (3, 5), None, None, None), b),
                      (("model/w", None, None, (slice(1, 2),), None), np.full((1, 2), 2.0))])
        writer.close()
        assert f["optim/state/m"][:5].tolist() == [0, 1, 2, 3, 4] and f["model/w"][()].tolist() == [[1, 1], [2, 2]]
        assert f["optim/has_state"][()].tolist() == [False, True, False]


@pytest.mark.parametrize("strategy,sampling", [("ddp", "stride"), ("zero1", "stride"), ("ddp", "random")])
def test_a_resumed_gpt_run_ends_bit_identical(text_data, tmp_path, strategy, sampling):
    """Dropout on, so the random stream must be restored too; AdamW state; windows at a
    stride or at random tokens."""
    settings = (f"parallel.sync={strategy!r}", f"data.sampling={sampling!r}")
    full = train.train(gpt(text_data, tmp_path / "a", *settings), log=quiet)
    assert [p.name for p in checkpoint.listed(tmp_path / "a")] == [f"step-{s:08d}.h5" for s in range(4, 25, 4)]
    resume_from(tmp_path / "a", 12, tmp_path / "b")
    lines = []
    again = train.train(gpt(text_data, tmp_path / "b", *settings), log=lines.append, resume=True)
    assert again.start_step == 12 and any("resumed from" in line and "at step 12" in line for line in lines)
    assert_identical(checkpoint.path_for(tmp_path / "a", 24), checkpoint.path_for(tmp_path / "b", 24))
    assert again.val_loss == full.val_loss


@pytest.mark.parametrize("step", [10, 15])  # inside an epoch; at its end (the evaluation comes after)
def test_a_resumed_cnn_run_with_augmentation_ends_bit_identical(tmp_path, step):
    image_set(tmp_path / "d", n=960, test=100)  # 15 steps per epoch
    full = train.train(lenet(tmp_path / "d", tmp_path / "a", "data.flip=true"), log=quiet)  # and data.shift 1
    resume_from(tmp_path / "a", step, tmp_path / "b")
    again = train.train(lenet(tmp_path / "d", tmp_path / "b", "data.flip=true"), log=quiet, resume=True)
    assert_identical(checkpoint.path_for(tmp_path / "a", 45), checkpoint.path_for(tmp_path / "b", 45))
    assert [h for h in again.history] == [h for h in full.history if h["step"] >= step]


def damage(path: Path, how: str) -> None:
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    elif how == "flipped":  # one byte inside a parameter's data: only the checksum sees it
        with h5py.File(path, "r") as f:
            offset = f["model/embed.wte.weight"].id.get_chunk_info(0).byte_offset
        with open(path, "r+b") as f:
            f.seek(offset + 5)
            byte = f.read(1)
            f.seek(offset + 5)
            f.write(bytes([byte[0] ^ 0x10]))
    else:
        path.write_bytes(b"not a checkpoint")


@pytest.mark.parametrize("how", ["truncated", "flipped", "garbage"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(text_data, tmp_path, how):
    train.train(gpt(text_data, tmp_path / "a", "train.steps=12"), log=quiet)
    newest = checkpoint.path_for(tmp_path / "a", 12)
    damage(newest, how)
    with pytest.raises(checkpoint.CheckpointError, match=str(newest)):
        checkpoint.check(newest)
    warnings, lines = [], []
    again = train.train(gpt(text_data, tmp_path / "a", "train.steps=12"), log=lines.append, warn=warnings.append,
                        resume=True)
    assert again.start_step == 8 and again.steps == 12
    aside = tmp_path / "a" / "checkpoints" / "unusable" / newest.name
    assert warnings == [warnings[0]] and warnings[0].startswith(f"warning: cannot resume from {newest}: ")
    assert warnings[0].endswith(f"; moved to {aside}")
    checkpoint.check(newest)  # written whole by the resumed run
    with pytest.raises(checkpoint.CheckpointError):  # the damaged file, kept
        checkpoint.check(aside)


def test_resuming_a_finished_run_evaluates_and_returns(text_data, tmp_path):
    train.train(gpt(text_data, tmp_path / "a", "train.steps=8"), log=quiet)
    lines = []
    again = train.train(gpt(text_data, tmp_path / "a", "train.steps=8"), log=lines.append, resume=True)
    assert again.start_step == 8 and again.steps == 8 and again.val_loss is not None
    assert any(line.startswith("done: 0 steps") for line in lines)


def test_a_resume_past_a_damaged_checkpoint_keeps_it_aside_and_deletes_nothing_unread(text_data, tmp_path):
    train.train(gpt(text_data, tmp_path / "a", "train.steps=12"), log=quiet)  # checkpoints 4, 8, 12
    damage(checkpoint.path_for(tmp_path / "a", 12), "garbage")
    again = train.train(gpt(text_data, tmp_path / "a", "train.steps=12", "run.keep=1", "run.checkpoint_interval=2"),
                        log=quiet, warn=quiet, resume=True)
    assert again.start_step == 8
    assert [p.name for p in checkpoint.listed(tmp_path / "a")] == ["step-00000012.h5"]
    checkpoint.check(checkpoint.path_for(tmp_path / "a", 12))
    assert (tmp_path / "a" / "checkpoints" / "unusable" / "step-00000012.h5").read_bytes() == b"not a checkpoint"


def test_a_resume_that_changes_the_batch_order_is_warned_about(text_data, tmp_path):
    train.train(gpt(text_data, tmp_path / "a", "train.steps=4"), log=quiet)
    warnings = []
    train.train(gpt(text_data, tmp_path / "a", "train.steps=8", "data.buffer_mb=1.0", "train.seed=5"), log=quiet,
                warn=warnings.append, resume=True)
    assert len(warnings) == 2 and warnings[0].startswith("resume: changes to the saved config: ")
    assert "train.seed = 5 (saved: 1337)" in warnings[0] and "data.buffer_mb = 1.0 (saved: 32" in warnings[0]
    assert "train.steps = 8 (saved: 4)" in warnings[0]
    assert "resuming with another data.buffer_mb, train.seed: the batches differ" in warnings[1]


def test_a_run_directory_with_checkpoints_needs_resume(text_data, tmp_path):
    cfg = gpt(text_data, tmp_path / "a", "train.steps=4")
    train.train(cfg, log=quiet)
    with pytest.raises(config.ConfigError, match="run.dir: .* already holds the checkpoints of a run"):
        train.train(cfg, log=quiet)
    with pytest.raises(config.ConfigError, match="resuming needs the run directory"):
        train.train(gpt(text_data, tmp_path / "a", 'run.dir=""'), log=quiet, resume=True)


def test_a_checkpoint_of_another_model_is_refused_naming_the_file(text_data, tmp_path):
    train.train(gpt(text_data, tmp_path / "a", "train.steps=4"), log=quiet)
    with pytest.raises(checkpoint.CheckpointError, match=r"step-00000004\.h5: .*model.n_embd = 32 \(saved: 16\)"):
        train.train(gpt(text_data, tmp_path / "a", "train.steps=8", "model.n_embd=32"), log=quiet, resume=True)
    with pytest.raises(checkpoint.CheckpointError, match="optim.name = 'adamw'"):
        train.train(gpt(text_data, tmp_path / "a", "train.steps=8", "optim.name='adam'"), log=quiet, resume=True)


def test_only_the_newest_keep_checkpoints_stay(text_data, tmp_path):
    train.train(gpt(text_data, tmp_path / "a", "run.keep=2"), log=quiet)
    assert [p.name for p in checkpoint.listed(tmp_path / "a")] == ["step-00000020.h5", "step-00000024.h5"]
    assert not list((tmp_path / "a" / "checkpoints").glob("*.tmp"))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")  # the divergence asked for
def test_a_non_finite_loss_stops_naming_the_last_checkpoint_or_is_skipped(text_data, tmp_path):
    diverge = ["optim.lr=1e30", "optim.grad_clip=0.0", "optim.warmup_steps=0", "run.checkpoint_interval=1"]
    with pytest.raises(FloatingPointError, match=r"loss is nan at step (\d+); last good checkpoint: .*step-\d+\.h5"):
        train.train(gpt(text_data, tmp_path / "a", *diverge), log=quiet)
    warnings = []
    result = train.train(gpt(text_data, tmp_path / "b", *diverge, "run.on_nan='skip'"), log=quiet,
                         warn=warnings.append)
    assert result.steps == 24 and result.skipped == len(warnings) > 0
    assert "update skipped (run.on_nan = 'skip')" in warnings[0]


def test_metrics_file_reads_as_one_run_after_a_resume(text_data, tmp_path):
    train.train(gpt(text_data, tmp_path / "a", "train.eval_interval=6"), log=quiet)
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "metrics.jsonl", tmp_path / "b")
    resume_from(tmp_path / "a", 12, tmp_path / "b")  # an evaluation step too
    train.train(gpt(text_data, tmp_path / "b", "train.eval_interval=6"), log=quiet, resume=True)
    for run in ("a", "b"):
        records = read_metrics(tmp_path / run / "metrics.jsonl")
        steps = [r["step"] for r in records if r["kind"] == "train"]
        assert steps == list(range(4, 25, 4))
        assert [r["step"] for r in records if r["kind"] == "eval"] == [6, 12, 18, 24]
        assert [r["kind"] for r in records].count("end") == 1
        r = next(r for r in records if r["kind"] == "train")
        assert {"loss", "lr", "samples_per_s", "ranks"} <= set(r)
        assert set(r["ranks"][0]) == set(report.TIME_FIELDS)


# ------------------------------------------------ under mpiexec, from outside
STEPS = 200  # each run's: a stop asked at step 60 or later reaches the ranks well before the last
GPT_ARGS = ["--set", "model.n_layer=2", "--set", "model.n_embd=48", "--set", "model.n_head=2",
            "--set", "model.block_size=32", "--set", "model.dropout=0.1", "--set", "train.global_batch_size=16",
            "--set", f"train.steps={STEPS}", "--set", "train.log_interval=50", "--set", "train.eval_interval=0",
            "--set", "train.eval_batches=2", "--set", "train.sample_tokens=0", "--set", "run.checkpoint_interval=10",
            "--set", "run.keep=50"]


def launch(text_data, run_dir, *extra, **popen):
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpitrain", "train", str(JOBS / "tinyshakespeare_gpt.toml"),
           "--set", f"data.path={text_data}", *GPT_ARGS, "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(proc, timeout=120):
    """Wait for a launched run; past ``timeout`` end it (its whole process group, ranks
    included, when it was started in a session of its own) and fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, out, err


def wait_for_checkpoint(run_dir, step, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = checkpoint.listed(run_dir)
        if done and int(done[-1].stem.split("-")[1]) >= step:
            return
        assert proc.poll() is None, "the run ended before it could be stopped"
        time.sleep(0.005)
    raise TimeoutError(f"no checkpoint of step >= {step} in {run_dir}")


def ranks_of(proc) -> list[int]:
    """The pids of the rank processes under an mpiexec (Linux /proc)."""
    found, todo = [], [proc.pid]
    while todo:
        pid = todo.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            (found if b"mpitrain" in cmdline and b"python" in cmdline else todo).append(child)
    return sorted(found)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-rank run's final checkpoint, and its data."""
    root = tmp_path_factory.mktemp("reference")
    small_text(root / "shards", 3000)
    code, _, err = finish(launch(root / "shards", root / "run"))
    assert code == 0, err
    return root / "shards", checkpoint.path_for(root / "run", STEPS)


@needs_mpiexec
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux /proc")
def test_sigkill_at_a_random_step_then_resume_is_bit_identical(reference, tmp_path):
    data, final = reference
    step = random.Random().randrange(40, STEPS - 100, 10)
    proc = launch(data, tmp_path / "run", start_new_session=True)
    wait_for_checkpoint(tmp_path / "run", step, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = int(checkpoint.listed(tmp_path / "run")[-1].stem.split("-")[1])
    assert killed_at < STEPS, "the run was not killed before its end"
    code, out, err = finish(launch(data, tmp_path / "run", "--resume"))
    assert code == 0, err
    assert f"at step {killed_at}" in out
    assert_identical(final, checkpoint.path_for(tmp_path / "run", STEPS))
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(50, STEPS + 1, 50)), f"killed at {step}"



PP_ARGS = ["--set", "parallel.pp=2", "--set", "train.micro_batches=4", "--set", "train.steps=100"]


@needs_mpiexec
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux /proc")
def test_sigkill_during_a_pipeline_run_then_resume_is_bit_identical(reference, tmp_path):
    """Two stages (1F1B, dropout on): killed between two checkpoints, resumed, the same
    bits as a run that was never killed."""
    data, _ = reference
    code, _, err = finish(launch(data, tmp_path / "whole", *PP_ARGS))
    assert code == 0, err
    step = random.Random().randrange(20, 80, 10)
    proc = launch(data, tmp_path / "run", *PP_ARGS, start_new_session=True)
    wait_for_checkpoint(tmp_path / "run", step, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = int(checkpoint.listed(tmp_path / "run")[-1].stem.split("-")[1])
    assert killed_at < 100, "the run was not killed before its end"
    code, out, err = finish(launch(data, tmp_path / "run", *PP_ARGS, "--resume"))
    assert code == 0, err
    assert f"at step {killed_at}" in out
    assert_identical(checkpoint.path_for(tmp_path / "whole", 100), checkpoint.path_for(tmp_path / "run", 100))

@needs_mpiexec
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux /proc")
@pytest.mark.parametrize("sig,to", [("SIGTERM", "one"), ("SIGUSR1", "all"), ("SIGINT", "one"), ("SIGINT", "mpiexec")])
def test_a_signal_checkpoints_and_exits_then_resume_is_bit_identical(reference, tmp_path, sig, to):
    """To one rank (mpiexec's user), to every rank (as SLURM does), or Ctrl-C to
    mpiexec (a terminal sends it to mpiexec's process group, and mpiexec forwards it to
    every rank): a checkpoint, one message, exit 0 (130 after SIGINT), no traceback."""
    data, final = reference
    proc = launch(data, tmp_path / "run")
    wait_for_checkpoint(tmp_path / "run", 60, proc)
    ranks = ranks_of(proc)
    assert len(ranks) == 2
    for pid in [proc.pid] if to == "mpiexec" else ranks[1:] if to == "one" else ranks:
        os.kill(pid, getattr(signal, sig))
    code, out, err = finish(proc)
    assert code == (130 if sig == "SIGINT" else 0), err
    assert "Traceback" not in err and "error" not in err.lower(), err
    stopped = [line for line in out.splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1 and stopped[0].startswith(f"stopped by {sig} after step"), out
    assert stopped[0].endswith(f"resume with: mpiexec -n 2 mpitrain train --resume {tmp_path / 'run'}")
    at = int(stopped[0].split("after step ")[1].split(";")[0])
    assert checkpoint.listed(tmp_path / "run")[-1] == checkpoint.path_for(tmp_path / "run", at)
    code, _, err = finish(launch(data, tmp_path / "run", "--resume"))
    assert code == 0, err
    assert_identical(final, checkpoint.path_for(tmp_path / "run", STEPS))


PS_ARGS = ["--set", "parallel.sync=ps", "--set", "optim.grad_clip=0.0", "--set", "model.n_layer=1",
           "--set", "model.n_embd=16", "--set", "model.n_head=2", "--set", "model.block_size=8",
           "--set", "train.global_batch_size=8", "--set", "train.log_interval=5", "--set", "train.eval_batches=1",
           "--set", "train.sample_tokens=0", "--set", "train.threads=1"]


def launch_ps(text_data, run_dir, *extra):
    """1 server and 2 synchronous workers."""
    cmd = [MPIEXEC, "-n", "3", sys.executable, "-m", "mpitrain", "train", str(JOBS / "tinyshakespeare_gpt.toml"),
           "--set", f"data.path={text_data}", *PS_ARGS, "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@needs_mpiexec
def test_a_parameter_server_run_that_diverges_ends_every_rank_with_one_message(text_data, tmp_path):
    """The workers agree the loss is not finite and say goodbye; the servers stop serving;
    every rank raises the same error, printed once (no rank is left waiting)."""
    code, out, err = finish(launch_ps(text_data, tmp_path / "run", "--set", "optim.lr=1e30", "--set",
                                      "optim.warmup_steps=0", "--set", "train.steps=50"))
    assert code == 1, err
    assert err.count("mpitrain: training diverged: loss is") == 1, err
    assert "Traceback" not in err


@needs_mpiexec
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux /proc")
def test_a_signal_stops_a_parameter_server_run_whose_checkpoint_ddp_resumes(text_data, tmp_path):
    """SIGTERM to every rank (as SLURM does): the workers stop at the same step, the
    servers hand out the parameters and write the checkpoint; ddp resumes it."""
    run = tmp_path / "run"
    proc = launch_ps(text_data, run, "--set", "train.steps=100000")
    deadline = time.monotonic() + 60
    while not any(r["kind"] == "train" for r in (read_metrics(run / "metrics.jsonl")
                                                  if (run / "metrics.jsonl").exists() else [])):
        assert proc.poll() is None and time.monotonic() < deadline, "no training step was logged"
        time.sleep(0.05)
    for pid in ranks_of(proc):
        os.kill(pid, signal.SIGTERM)
    code, out, err = finish(proc)
    assert code == 0, err
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM after step")]
    assert len(stopped) == 1, out
    assert stopped[0].endswith(f"resumes with ddp or zero1: mpiexec -n 3 mpitrain train --resume {run} --set parallel.sync=ddp")
    at = int(stopped[0].split("after step ")[1].split(";")[0])
    assert checkpoint.listed(run) == [checkpoint.path_for(run, at)]
    more = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpitrain", "train", str(JOBS / "tinyshakespeare_gpt.toml"),
            "--set", f"data.path={text_data}", *PS_ARGS[2:], "--set", f"train.steps={at + 5}", "--run-dir", str(run),
            "--resume", "--set", "parallel.sync=ddp"]
    done = subprocess.run(more, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"resumed from {checkpoint.path_for(run, at)} at step {at}" in done.stdout
    assert checkpoint.listed(run)[-1] == checkpoint.path_for(run, at + 5)


def test_a_first_ctrl_c_asks_for_a_stop_repeats_are_the_same_and_a_later_one_ends_the_process():
    """The loop stops at the end of the step after a first SIGINT. Another within
    REPEAT_S is the same stop (timeout passes on the terminal's SIGINT: one press
    arrives two or three times); one after it ends the process as Ctrl-C does."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        from mpitrain import launch
        from mpitrain.train.signals import StopSignals
        launch.REPEAT_S = 0.5
        before = signal.getsignal(signal.SIGINT)
        with StopSignals(loud=True) as signals:
            assert signal.getsignal(signal.SIGINT) == signals._handler
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)  # the handler runs between two bytecodes of the main thread
            print("stop asked:", signals.received == signal.SIGINT, flush=True)
            time.sleep(0.6)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        print("not reached", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGINT, done.stderr
    assert done.stdout == "stop asked: True\n"
    assert done.stderr.count("mpitrain: Ctrl-C: finishing this step, then saving a checkpoint; Ctrl-C again after "
                             "0.5 s to abort at once, saving nothing") == 1, done.stderr


RESUMER = "mpirun" if OPEN_MPI else "mpiexec"  # the launcher a stop line names (Open MPI's mpiexec runs prterun)


def on_a_terminal(cmd, run_dir, presses: tuple[float, ...]):
    """Run ``cmd`` on a pseudo-terminal that is its controlling terminal, with it as the
    foreground process group, as a shell runs a command; once the run has saved its
    step-60 checkpoint, type ``^C`` at each time of ``presses`` (seconds after the
    first), so that the terminal's line discipline sends SIGINT to the whole foreground
    group, as a user's Ctrl-C does. (exit status, what the terminal showed)"""
    import fcntl
    import termios
    import threading

    master, slave = os.openpty()

    def controlling_terminal():  # runs in the child after setsid (start_new_session)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                            preexec_fn=controlling_terminal)  # noqa: PLW1509 - one ioctl, no lock
    os.close(slave)
    chunks = []

    def drain():  # the terminal's output, until every process holding it has closed it
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: no process holds the terminal any more
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        wait_for_checkpoint(run_dir, 60, proc)
        assert os.tcgetpgrp(master) == proc.pid, "the command is not the terminal's foreground group"
        start = time.monotonic()
        for at in presses:
            time.sleep(max(0.0, start + at - time.monotonic()))
            os.write(master, b"\x03")  # ^C
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


@needs_mpiexec
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
@pytest.mark.parametrize("front,presses,hint", [
    ([], (0,), f"resume with: {RESUMER} -n 2 mpitrain train --resume "),
    ([sys.executable, "-m", "mpitrain", "launch"], (0, 0.05, 0.3),
     f"resume with: mpitrain launch {RESUMER} -n 2 mpitrain train --resume "),
    (["timeout", "600", sys.executable, "-m", "mpitrain", "launch"], (0,),
     f"resume with: mpitrain launch {RESUMER} -n 2 mpitrain train --resume "),
], ids=["mpiexec", "launch-three-times", "timeout-launch"])
def test_ctrl_c_typed_on_a_terminal_checkpoints_once_then_resume_is_bit_identical(reference, tmp_path, front, presses,
                                                                                   hint):
    """The user's Ctrl-C: once to ``mpiexec -n 2``; to ``mpitrain launch mpiexec -n 2``
    three times (0.05 s and 0.3 s after the first: MPICH's mpiexec alone kills every
    rank at a second SIGINT, mpitrain/launch.py), and once under ``timeout`` (which
    passes the SIGINT on: two or three reach its child). One checkpoint, one "stopped by
    SIGINT" line naming the launch line that resumes, exit 130, no traceback; the
    resumed run ends bit-identical to one never stopped. Under Open MPI, whose mpiexec
    kills every rank at its first SIGINT, only through ``mpitrain launch`` (which relays
    it as SIGUSR2); alone, the run said so when it started."""
    data, final = reference
    cmd = [*front, MPIEXEC, "-n", "2", sys.executable, "-m", "mpitrain", "train",
           str(JOBS / "tinyshakespeare_gpt.toml"), "--set", f"data.path={data}", *GPT_ARGS,
           "--run-dir", str(tmp_path / "run")]
    code, text = on_a_terminal(cmd, tmp_path / "run", presses)
    if OPEN_MPI and not front:  # killed at once: what the run's start said
        assert code != 0 and "stopped by" not in text, text
        assert "note: Open MPI's mpirun kills every rank at Ctrl-C or SIGTERM, saving nothing" in text, text
        return
    assert code == 130, text
    assert "Traceback" not in text and "error" not in text.lower(), text
    stopped = [line for line in text.splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1 and stopped[0].startswith("stopped by SIGINT after step"), text
    assert hint in stopped[0], stopped[0]
    assert len(presses) == 1 or "mpitrain launch: stopping already" in text, text  # the run still going
    at = int(stopped[0].split("after step ")[1].split(";")[0])
    assert checkpoint.listed(tmp_path / "run")[-1] == checkpoint.path_for(tmp_path / "run", at)
    code, _, err = finish(launch(data, tmp_path / "run", "--resume"))
    assert code == 0, err
    assert_identical(final, checkpoint.path_for(tmp_path / "run", STEPS))
