"""``mpitrain plan --largest`` (mpitrain/plan/largest.py): the largest model of a family
that fits a layout, found by bisection and checked at its edge; and the layouts only GPU
frameworks run, planned and said to be."""

import subprocess
import sys

import pytest

from mpitrain import cli
from mpitrain import plan as planner
from mpitrain.config import ConfigError
from mpitrain.plan import largest, models

H100 = ["--model", "gpt-13b", "--hardware", "h100-nvl", "--set", "train.precision=bf16", "--set",
        "parallel.sync=zero3"]


def _grown(argv, how="both"):
    args = cli.build_parser().parse_args(["plan", *argv])
    cfg, data, _ = models.config_of(args)
    ranks, machine = planner.machine_of(args)
    return cfg, largest.largest(cfg, ranks, machine, data, how), machine


@pytest.mark.parametrize("how", largest.HOW)
def test_the_largest_fits_and_the_next_step_does_not(how):
    """On one 94 GB H100 and on a node of four under ZeRO-3 in bf16: the model found fits
    every rank's memory and the next step of its growth does not; width grows in whole
    heads of the family's width, depth keeps the width, both keep the proportion."""
    for n in (1, 4):
        argv = [*H100, "-n", str(n), "--gpus-per-node", str(n), "--set", f"train.global_batch_size={n}"]
        cfg, (best, above), machine = _grown(argv, how)
        m, bm, am = cfg.model, best.layout.cfg.model, above.layout.cfg.model
        assert best.largest().peak <= machine.memory < above.largest().peak
        assert bm.n_embd // bm.n_head == m.n_embd // m.n_head
        if how == "depth":
            assert (bm.n_embd, am.n_layer) == (m.n_embd, bm.n_layer + 1)
        else:
            assert am.n_head == bm.n_head + 1
        if how == "width":
            assert bm.n_layer == m.n_layer
        if how == "both":
            assert bm.n_layer == max(1, round(bm.n_embd * m.n_layer / m.n_embd))


def test_largest_prints_its_model_assumptions_plan_and_training_time():
    """The command line: the model and its neighbour that does not fit, what it assumes, its
    plan, the days to train it on each token count; a ZeRO-3 layout with checkpointing on a
    GPU is planned and said to be planned only; the flags that do not go together refused."""
    argv = [*H100, "-n", "4", "--gpus-per-node", "4", "--set", "train.global_batch_size=4", "--set",
            "model.checkpoint_activations=true", "--largest", "--train-tokens", "300e9,1e12"]
    out = subprocess.run([sys.executable, "-m", "mpitrain", "plan", *argv], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("largest: gpt-13b (mpitrain/plan/models.toml) grown in width (heads of 128) and "
                               "depth") and "B parameters; its largest rank peaks at" in lines[0]
    assert lines[1].startswith("assumes: 4 rank(s), dp 4 x pp 1 x tp 1, zero3") and "no allocator reserve" in lines[1]
    assert any(line.startswith("planned only: mpitrain's trainer refuses ZeRO-3 with activation checkpointing")
               for line in lines)
    trains = [line for line in lines if line.startswith("to train it on")]
    assert [t.split(":")[0] for t in trains] == ["to train it on 3e+11 tokens", "to train it on 1e+12 tokens"]
    days = [float(t.split(", ")[1].split(" days")[0].replace(",", "")) for t in trains]
    assert days[1] == pytest.approx(days[0] * 1e12 / 3e11, rel=0.01)
    for bad, said in ((["--train-tokens", "1e9"], "--train-tokens: goes with --largest"),
                      (["--largest", "--search"], "--largest: plans the grown model")):
        run = subprocess.run([sys.executable, "-m", "mpitrain", "plan", *H100, *bad], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode != 0 and said in run.stderr


def test_only_a_gpu_plan_takes_what_only_mpitrains_trainer_refuses():
    """ZeRO-3 with activation checkpointing: planned on a GPU, with the reason it is planned
    only; refused for this machine, whose plans are of mpitrain's trainer."""
    sets = ["--set", "parallel.sync=zero3", "--set", "model.checkpoint_activations=true"]
    gpu = planner.from_args(cli.build_parser().parse_args(["plan", "--model", "gpt2", "--hardware", "a100-80g",
                                                           "-n", "8", *sets]))[0]
    assert gpu.layout.par.sync == "zero3" and gpu.layout.cfg.model.checkpoint_activations
    with pytest.raises(ConfigError, match="ZeRO-3 .* replays every layer in backward already"):
        planner.from_args(cli.build_parser().parse_args(["plan", "jobs/shakespeare_gpt.toml", "-n", "2", *sets]))
