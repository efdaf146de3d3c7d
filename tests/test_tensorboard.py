"""TensorBoard scalars (``run.tensorboard``), read back with TensorBoard's own reader;
``metrics.jsonl`` stays the record, and the events hold the same figures."""

import importlib.util
import types

import pytest
from test_checkpoint import gpt, quiet

from mpitrain import train
from mpitrain.config import ConfigError
from mpitrain.observe.metrics import read as read_metrics

pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def scalars(run_dir) -> dict:
    events = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_the_scalars_are_the_metrics_records_and_the_shares_of_step_time(text_data, tmp_path):
    run = tmp_path / "a"
    train.train(gpt(text_data, run, "train.steps=8", "train.log_interval=2", "train.eval_interval=4",
                    "run.tensorboard=true"), log=quiet)
    got = scalars(run)
    records = read_metrics(run / "metrics.jsonl")
    trains = [r for r in records if r["kind"] == "train"]
    for name in ("loss", "lr", "samples_per_s", "gflops_per_s"):
        assert [s for s, _ in got[f"train/{name}"]] == [r["step"] for r in trains] == [2, 4, 6, 8]
        assert [v for _, v in got[f"train/{name}"]] == pytest.approx([r[name] for r in trains], rel=1e-6)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [s for s, _ in got["eval/val_loss"]] == [r["step"] for r in evals] == [4, 8]
    assert [v for _, v in got["eval/val_loss"]] == pytest.approx([r["val_loss"] for r in evals], rel=1e-6)
    for share in ("comm_exposed", "bubble", "io_stall"):
        assert all(0 <= v <= 1 for _, v in got[f"time/{share}"]), share
    first, last = trains[0]["ranks"][0], trains[1]["ranks"][0]  # rank 0's totals so far, at steps 2 and 4
    assert got["time/step_ms/rank_0"][1] == (4, pytest.approx(1000 * (last["step_s"] - first["step_s"]) / 2,
                                                             rel=1e-5))


@pytest.mark.parametrize("same_second", [False, True], ids=["the-clock", "same-second"])
def test_a_resumed_run_drops_the_events_of_the_steps_it_does_again(text_data, tmp_path, monkeypatch, same_second):
    if same_second:  # both event files get one timestamp in their names: only the suffix orders them
        import tensorboardX.event_file_writer as event_file
        monkeypatch.setattr(event_file, "time", types.SimpleNamespace(time=lambda: 1_800_000_000.0))
    run = tmp_path / "a"
    options = ["train.log_interval=2", "run.checkpoint_interval=4", "run.tensorboard=true"]
    train.train(gpt(text_data, run, "train.steps=6", *options), log=quiet)  # checkpoints 4 and 6; events to 6
    (run / "checkpoints" / "step-00000006.h5").unlink()  # as if killed after step 5
    train.train(gpt(text_data, run, "train.steps=8", *options), log=quiet, resume=True)
    assert [s for s, _ in scalars(run)["train/loss"]] == [2, 4, 6, 8]


def test_without_tensorboardx_the_option_is_one_message(text_data, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    with pytest.raises(ConfigError, match=r"run.tensorboard: needs the tensorboardX package: pip install -e "):
        gpt(text_data, tmp_path / "a", "run.tensorboard=true")


def test_a_wait_for_data_longer_than_the_steps_is_a_share_below_one():
    """A rank waits for its batch before its step begins: a slow read (the reader's first)
    can outlast the steps of a window. The stall is a share of steps and waits together,
    the communication and the bubble shares of the steps alone."""
    from mpitrain.observe.tensorboard import Board

    written = {}
    board = Board.__new__(Board)  # no files: the writer is a dict
    writer = type("Writer", (), {"add_scalar": lambda _, tag, value, step: written.__setitem__(tag, value)})
    board.writer, board.before = writer(), None
    row = {"rank": 0, "step_s": 0.010, "comm_exposed_s": 0.002, "bubble_s": 0.0, "wait_s": 0.030}
    board._times(2, {0: row})
    assert written["time/io_stall"] == pytest.approx(0.030 / 0.040)
    assert written["time/comm_exposed"] == pytest.approx(0.002 / 0.010)
    assert written["time/step_ms/rank_0"] == pytest.approx(5.0)


def test_the_documented_install_brings_the_documented_command(text_data, tmp_path):
    """The README's ``pip install -e ".[tensorboard]"`` brings the writer and the viewer its
    next line runs (``tensorboard --logdir runs``): the extra names both, and the command
    installed beside this Python (the test extra installs the same) reads a run's events."""
    import configparser
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    setup = configparser.ConfigParser()
    setup.read(root / "setup.cfg")
    extra = setup["options.extras_require"]["tensorboard"].split()
    assert any(e.startswith("tensorboardX") for e in extra) and any(e.startswith("tensorboard>=") for e in extra)
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert 'pip install -e ".[tensorboard]"' in readme and "tensorboard --logdir runs" in readme
    command = shutil.which("tensorboard", path=str(Path(sys.executable).parent)) or shutil.which("tensorboard")
    assert command, "the tensorboard command is not installed beside this Python"
    out = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip()[0].isdigit(), out
    train.train(gpt(text_data, tmp_path / "runs" / "a", "train.steps=4", "train.log_interval=2",
                    "run.tensorboard=true"), log=quiet)
    seen = subprocess.run([command, "--inspect", "--logdir", "runs"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert seen.returncode == 0 and "train/loss" in seen.stdout + seen.stderr, seen

