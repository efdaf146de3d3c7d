"""The planner (``mpitrain plan``): its shapes equal the models built for real, it handles
a 175-billion-parameter GPT on a laptop, and it reproduces the published figures it
plans by (GPT-3's size, ZeRO's memory table, the course notes' arithmetic). What it
predicts against a run is checked in tests/test_mpi_plan.py."""

import math
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_comm import needs_mpiexec

from mpitrain import cli, nn
from mpitrain import plan as planner
from mpitrain.config import ConfigError, from_dict, load
from mpitrain.parallel.tensor_parallel import slice_gpt
from mpitrain.plan import hardware, models, shapes
from mpitrain.plan.data import DataShape
from mpitrain.plan.layout import Layout
from mpitrain.plan.predict import rank_plans

GPT3 = ["--model", "gpt3-175b", "--hardware", "a100-80g", "--gpus-per-node", "8", "--nodes", "128",
        "--network", "ib-hdr", "--set", "train.global_batch_size=2048"]


def planned(argv):
    return planner.from_args(cli.build_parser().parse_args(["plan", *argv]))[0]


SMALL = ["jobs/tinyshakespeare_gpt.toml", "-n", "4", "--set", "parallel.pp=2", "--set", "parallel.tp=2",
         "--set", "train.micro_batches=4"]


@pytest.fixture(scope="module")
def warm():
    """One plan made untraced before a test traces one: what a first plan allocates once in
    a process (the modules it imports, the catalogues it reads) is not the plan's heap, and
    a test's result must not depend on which tests ran before it in its process."""
    planned(SMALL)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("t", [1, 2, 3])
def test_the_gpt_shapes_are_the_model_built_for_real(bias, t):
    """Every parameter's name and shape, on every tensor-parallel slice (a vocabulary of 85
    does not divide by 2 or 3: the first slices are one row larger)."""
    V, T, L, H, C = 85, 12, 2, 6, 24
    for r in range(t):
        model = nn.GPT(nn.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, bias=bias))
        if t > 1:
            slice_gpt(model, SimpleNamespace(size=t, rank=r))  # building slices makes no collective call
        real = {n: p.shape for n, p in model.named_parameters()}
        shape = shapes.gpt(V, T, L, H, C, bias, t=t, rank=r)
        assert shape.parameters() == real
        assert [layer.name for layer in shape.layers] == [n for n, _ in model.named_layers()]
        whole = nn.GPT(nn.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, bias=bias))
        assert [layer.whole for layer in shape.layers] == [sum(q.size for q in m.parameters())
                                                           for m in whole.layers()]


@pytest.mark.parametrize("kind", ["lenet", "convnet", "resnet8", "resnet20"])
def test_the_cnn_shapes_are_the_models_built_for_real(kind):
    build = {"lenet": (lambda: nn.LeNet(1, 28, 10, (6, 16), 84), lambda: shapes.lenet((28, 28, 1), 10, (6, 16), 84)),
             "convnet": (lambda: nn.ConvNet(3, 32, 10, (8, 16, 32)),
                         lambda: shapes.convnet((32, 32, 3), 10, (8, 16, 32))),
             "resnet8": (lambda: nn.ResNet(3, 32, 10), lambda: shapes.resnet((32, 32, 3), 10)),
             "resnet20": (lambda: nn.ResNet(3, 32, 10, (8, 16, 32), 3),
                          lambda: shapes.resnet((32, 32, 3), 10, (8, 16, 32), 3))}[kind]
    model, shape = build[0](), build[1]()
    assert shape.parameters() == {n: p.shape for n, p in model.named_parameters()}
    assert [layer.name for layer in shape.layers] == [n for n, _ in model.named_layers()]


class _SlicesComm:
    """A tensor-parallel communicator of ``size`` that moves nothing: a sliced block's arrays
    have their shapes (their values are not looked at)."""

    def __init__(self, size: int):
        self.size, self.rank = size, 0

    def allreduce(self, a, *args, **kwargs):
        return a

    def allgather_array(self, a, counts):
        a.reshape(-1)[counts[0]:] = 0  # the other ranks' blocks: zeros, not what the memory held (no overflow)

    def allgather(self, x):
        return [x] * self.size

    def reduce_scatter(self, send, recv, counts):
        recv[...] = send[: recv.size]


@pytest.mark.parametrize("fast, t, sequence", [(True, 1, False), (False, 1, False), (True, 2, False),
                                               (True, 2, True), (True, 4, False)])
def test_a_blocks_kept_bytes_are_what_the_real_block_keeps(fast, t, sequence):
    """cost.gpt_block_activation_bytes against tracemalloc: a real block's forward, fused or op
    by op, whole or one slice of t (with sequence parallelism), holds its formula's bytes."""
    import numpy as np

    from mpitrain import cost, ops, rng
    from mpitrain.tensor import Tensor

    B, T, C, H = 4, 64, 128, 4
    rng.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=50, block_size=T, n_layer=1, n_head=H, n_embd=C))
    if t > 1:
        slice_gpt(model, _SlicesComm(t), sequence)
    x = Tensor(np.ones((B, T // t if sequence else T, C), np.float32), requires_grad=True)
    with ops.fast_paths(fast):
        model.blocks[0](x)  # once untraced: what a cold process makes on first use (imports, caches) is no activation
        tracemalloc.start()
        try:
            y = model.blocks[0](x)
            held = tracemalloc.get_traced_memory()[0] - y.data.nbytes  # its output is the next layer's input
        finally:
            tracemalloc.stop()
    formula = cost.gpt_block_activation_bytes(B, T, C, H, 4, t=t, sequence=sequence)
    assert held == pytest.approx(formula, rel=0.02)  # the rest: the arrays' and nodes' Python objects


def test_gpt3_has_the_parameters_its_paper_states():
    """Brown et al. 2020, table 2.1: 175.0 B for 96 layers of width 12,288 (the planner's
    count, the same code the test above holds equal to the built model)."""
    count = shapes.gpt(50257, 2048, 96, 96, 12288).count()
    assert abs(count - 175e9) / 175e9 < 0.005
    assert count == 174_591_270_912


@pytest.mark.parametrize("sync", ["ddp", "zero1", "zero2", "zero3"])
def test_gpt3_on_1024_gpus_plans_fast_without_arrays(sync, warm):
    """Shapes only: a 175 B model planned per GPU with a heap of megabytes; ZeRO
    divides the model state as its formula says (Adam, float32: 16, 8 + 8/P, 4 + 12/P, 16/P
    bytes per parameter, within the shards' rounding and Adam's step counters)."""
    tracemalloc.start()
    plan = planned(GPT3 + ["--set", f"parallel.sync={sync}"])
    heap = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    state = sum(p.state * len(p.ranks) for p in plan.ranks)
    assert heap < 1e-6 * state  # megabytes for petabytes (its time: the README's, never asserted here)
    N, P = plan.layout.whole, 1024
    per = {"ddp": 16, "zero1": 8 + 8 / P, "zero2": 4 + 12 / P, "zero3": 16 / P}[sync]
    for p in plan.ranks:
        assert p.state == pytest.approx(per * N, rel=1e-6)
    assert "does not fit" in plan_text(plan) or sync == "zero3"


def plan_text(plan) -> str:
    from mpitrain.plan import show

    return show.verdict(plan)


def test_a_small_plan_allocates_little(warm):
    """The issue's example (the tiny Shakespeare config, 4 ranks as pp 2 x tp 2): its heap
    under 10% of the model state it predicts, with no dataset built."""
    tracemalloc.start()
    plan = planned(SMALL)
    heap = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert heap < 0.1 * sum(p.state * len(p.ranks) for p in plan.ranks)
    assert [p.where for p in plan.ranks] == ["stage 0, slice 0", "stage 0, slice 1", "stage 1, slice 0",
                                           "stage 1, slice 1"]


def test_zeros_memory_table():
    """Rajbhandari et al. 2020, figure 1: 7.5 B parameters on 64 GPUs, K = 12: 120 GB,
    31.4 GB, 16.6 GB, 1.9 GB."""
    table = models.zero_table(7.5e9, 64)
    got = [round(table[s] / 1e9, 1) for s in ("ddp", "zero1", "zero2", "zero3")]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_the_notes_resnet_run():
    """11.4e9 multiply-adds x 2 x 3 x 1.2 M images x 128 epochs: 1.05e19 FLOPs, 0.12
    PFLOP/s-days (the notes' 0.116 divides their rounded 10 EFLOP), 114 kFLOP per byte of a
    float32 224 x 224 x 3 image (the notes' 108 k, again from 10 EFLOP); 4.4 days on 2 GPUs
    of 41.58 TFLOP/s at 33%."""
    r = models.resnet_run(models.catalogue()["notes"])
    assert r["flops"] == pytest.approx(1.05e19, rel=0.005)
    assert round(r["pflops_days"], 2) == 0.12
    assert 1e19 / 8.64e19 == pytest.approx(0.116, abs=5e-4)
    assert 1e19 / (1.2e6 * 128 * 602112) == pytest.approx(108e3, rel=0.005)  # the notes' own division
    assert r["flop_per_byte"] == pytest.approx(113.6e3, rel=0.005)
    assert r["days"] == pytest.approx(4.43, abs=0.01)


def test_the_notes_storage_calculator():
    """Bytes per sample / FLOPs per sample x FLOP/s for every (model, accelerator) pair;
    ResNet-50 on a V100 573 MB/s; CosmoFlow at its measured 35-50 TFLOP/s 2.2-3.2 GB/s."""
    peaks = hardware.load().notes
    assert peaks == {"V100": 130, "A100": 312, "H100": 3958}
    table = models.calculator(models.catalogue()["notes"], peaks)
    sample = {"cosmoflow": (16, 247), "deepcam": (27, 2887), "resnet50": (0.14, 31)}  # MiB, GiFLOP
    assert set(table) == {(m, a) for m in sample for a in peaks}
    for (model, acc), rate in table.items():
        mib, gi = sample[model]
        assert rate / 1e6 == pytest.approx(mib / (gi * 1024) * peaks[acc] * 1e6, rel=1e-12)  # MB/s
    assert round(table["resnet50", "V100"] / 1e6) == 573
    text = models.notes_text(peaks)
    assert "cosmoflow at the measured 35-50 TFLOP/s: 2.2-3.2 GB/s" in text
    # the calculator's H100 rate is FP8 with sparsity: the dense BF16 peak (a quarter) and the sustained beside it
    h100 = hardware.load().device("h100")
    assert peaks["H100"] == 4 * h100.peak_flops["bf16"] / 1e12
    said = models.notes_text(peaks, h100).splitlines()[-1]
    dense = table["resnet50", "H100"] * h100.peak_flops["bf16"] / (peaks["H100"] * 1e12)
    assert said.startswith("the calculator's H100 3958 TFLOP/s is FP8 with sparsity")
    assert "at its dense BF16 peak 989.5 TFLOP/s cosmoflow" in said and f"resnet50 {dense / 1e6:,.0f} MB/s" in said
    assert "at its sustained BF16 813 TFLOP/s" in said


def test_a_layout_the_trainer_refuses_the_planner_refuses_alike():
    raw = {"model": {"name": "gpt", "n_head": 4}, "data": {"name": "shakespeare"}, "train": {"steps": 1},
           "parallel": {"tp": 3}}
    data = DataShape("shakespeare", "text", (), 84, 1, 0, 10**6, "assumed")
    with pytest.raises(ConfigError, match="parallel.tp"):
        Layout.of(from_dict(raw), 3, data)


def test_ranks_alike_are_grouped():
    raw = {"model": {"name": "gpt"}, "data": {"name": "shakespeare"}, "train": {"steps": 1, "global_batch_size": 16},
           "parallel": {"pp": 2}}
    data = DataShape("shakespeare", "text", (), 84, 1, 0, 10**6, "assumed")
    plans = rank_plans(Layout.of(from_dict(raw), 8, data))
    assert [p.ranks for p in plans] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    raw["parallel"] = {"tp": 2}  # 84 characters: both slices alike
    plans = rank_plans(Layout.of(from_dict(raw), 4, data))
    assert [(p.ranks, p.where) for p in plans] == [([0, 1, 2, 3], "slices 0-1")]


@pytest.mark.parametrize("argv, message", [
    (["jobs/shakespeare_gpt.toml", "--hardware", "tpu"], "no device 'tpu'"),
    (["jobs/shakespeare_gpt.toml", "-n", "3", "--set", "parallel.tp=3"], "parallel.tp"),
    (["--model", "gpt5"], "no reference model 'gpt5'"),
    ([], "give a CONFIG file"),
])
def test_bad_input_is_one_line_with_status_2(argv, message):
    out = subprocess.run([sys.executable, "-m", "mpitrain", "plan", *argv], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_the_command_prints_every_part():
    out = subprocess.run([sys.executable, "-m", "mpitrain", "plan", "jobs/shakespeare_gpt.toml", "-n", "2",
                          "--set", "parallel.sync=zero2"], capture_output=True, text=True, check=True).stdout
    for part in ("per rank (ranks alike grouped)", "communication per step", "FLOPs per step", "step time:",
                 "storage:", "the run:", "verdict: fits"):
        assert part in out


@pytest.mark.parametrize("command", [["plan", "jobs/shakespeare_gpt.toml", "-n", "2"], ["config", "reference"]],
                         ids=["plan", "config-reference"])
def test_a_reader_gone_away_ends_the_command_quietly(command):
    """`mpitrain plan ... | head`: the pipe's reader is gone before the output is written
    (by the command's own flush, or main's). The command ends as a Unix tool that SIGPIPE
    ended (141), not with a traceback."""
    import os

    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run([sys.executable, "-m", "mpitrain", *command], stdout=write, stderr=subprocess.PIPE,
                             text=True)
    finally:
        os.close(write)
    assert out.returncode == 141 and out.stderr == ""


def test_a_broken_pipe_that_is_not_stdouts_stays_an_error(monkeypatch):
    """A BrokenPipeError from another pipe or socket while standard output's reader is
    still there is the command's error, raised, not a quiet 141."""
    import os

    def broken(argv):
        raise BrokenPipeError("a socket's peer went away")

    read, write = os.pipe()
    with os.fdopen(write, "w") as stdout, os.fdopen(read) as _:
        monkeypatch.setattr(sys, "stdout", stdout)
        monkeypatch.setattr(cli, "_main", broken)
        with pytest.raises(BrokenPipeError, match="peer went away"):
            cli.main([])


@pytest.mark.parametrize("model,optim,precision", [
    ("gpt", {"name": "adamw"}, "fp32"), ("lenet", {"name": "adamw"}, "fp32"),
    ("lenet", {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True}, "fp32"),
    ("lenet", {"name": "sgd", "lr": 0.1}, "fp32"), ("gpt", {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "bf16"),
    ("gpt", {"name": "sgd", "lr": 0.1}, "bf16")])
def test_one_process_counts_what_the_plan_predicts(model, optim, precision, tmp_path):
    """--validate's comparison in one process, without MPI (every layout on several
    ranks: tests/test_mpi_plan.py): the counted quantities exact, for a GPT and a CNN
    (whose first convolution's backward has no input gradient); Adam keeps a work array
    for its update, SGD none, mixed precision one for the unscaled gradients."""
    from test_data import image_set, text_set

    from mpitrain.comm import SingleComm
    from mpitrain.plan import validate

    data = tmp_path / "d"
    (text_set if model == "gpt" else image_set)(data)
    shape = {"gpt": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16},
             "lenet": {"name": "lenet", "channels": [2, 4], "hidden": 8}}[model]
    cfg = from_dict({"model": shape, "data": {"path": str(data)}, "optim": {**optim, "grad_clip": 1.0},
                     "train": {"global_batch_size": 8, "steps": 4, "threads": 1, "precision": precision}})
    plan = planner.make(cfg, 1, planner.machine(hardware.load(), "this", 1))
    result, _, storage = validate.measure(cfg, SingleComm(), 4, trace=True)
    rows = validate.compare(plan, result, storage)
    exact = [row for row in rows if validate.tolerance(row[1]) == 0]
    assert len(exact) >= 6 and all(row[2] == row[3] for row in exact), validate.table(exact)[0]


CNNS = {"lenet": {"name": "lenet", "channels": [8, 16], "hidden": 32},
        "convnet": {"name": "convnet", "channels": [8, 16]},
        "resnet8": {"name": "resnet", "widths": [8, 16, 32]},
        "resnet20": {"name": "resnet", "widths": [8, 16, 32], "blocks": 3}}


WAYS = {"1 thread": (1, True), "2 threads": (2, True), "plain": (1, False)}  # BLAS threads, fast paths


@pytest.mark.parametrize("model,threads,fast", [
    pytest.param(model, *WAYS[way], id=f"{model}-{way}",
                 marks=[pytest.mark.longer] if model == "resnet20" and way != "1 thread" else [])  # resnet8's layers
    for model in sorted(CNNS) for way in WAYS])
def test_a_cnns_step_peaks_where_the_plan_walks(model, threads, fast, tmp_path):
    """The heap a CNN's step holds above rest (32x32 RGB images, batch 32) is the planner's
    walk within the heap tolerance: each op's kept arrays (a convolution's padded input, a
    pool's input and output), a convolution's columns in tiles of images (BLAS threads size
    them) and their gradient, the input gradient of every layer but the first; on the plain
    path each convolution's whole columns, kept, and their whole gradient."""
    from test_data import image_set

    from mpitrain import plan as planner
    from mpitrain.comm import SingleComm
    from mpitrain.plan import validate

    image_set(tmp_path / "d", n=256, test=32, shard_mb=1, shape=(32, 32, 3))
    cfg = from_dict({"model": CNNS[model], "data": {"path": str(tmp_path / "d")}, "optim": {"name": "sgd", "lr": 0.1},
                     "train": {"global_batch_size": 32, "steps": 4, "threads": threads, "fast_paths": fast}})
    plan = planner.make(cfg, 1, planner.machine(hardware.load(), "this", 1))
    result, _, storage = validate.measure(cfg, SingleComm(), 4, trace=True)
    peak = [row for row in validate.compare(plan, result, storage) if row[1] == "heap peak above rest"]
    assert len(peak) == 1 and validate.holds(*peak[0][1:]), validate.table(peak)[0]


@needs_mpiexec
def test_bench_plan_prints_a_row_per_layout(tmp_path):
    """`mpitrain bench plan` end to end on one small layout (its figures are measurements:
    only the form and the exact column are tested)."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text('[model]\nname = "gpt"\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n'
                   '[data]\nname = "shakespeare"\n[train]\nglobal_batch_size = 4\nsteps = 1\n')
    (tmp_path / "calibrated.toml").write_text("")  # the shipped calibration: the bench's own takes 20 s
    out = subprocess.run([sys.executable, "-m", "mpitrain", "bench", "plan", "--config", str(cfg), "--layouts",
                          "one process", "--steps", "10", "--catalogue", str(tmp_path / "calibrated.toml")],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    row = [line for line in out.stdout.splitlines() if line.startswith("one process")]
    assert len(row) == 1 and row[0].split("|")[6].strip() == "yes", out.stdout[-2000:]  # the "exact" column


def test_bench_plan_calibrates_the_machine_and_each_rate_first_and_predicts_with_that(monkeypatch):
    """Without --catalogue the bench measures this machine, shared memory and each rate's
    emulated link into a file of its own, and every validation is told that file and the
    link's key."""
    from mpitrain.bench import plan as bench
    from mpitrain.cluster import bits_per_second
    from mpitrain.plan import calibrate
    from mpitrain.plan.hardware import emulated_link

    seen = {}

    def fake(links, rates_gbit, out, log):
        seen.update(links=links, rates=rates_gbit)
        Path(out).write_text("")

    monkeypatch.setattr(calibrate, "calibrate", fake)
    monkeypatch.setattr(bench, "_table", lambda config, steps, rates, names, common, tmp, log: seen.update(
        common=common, exists=Path(common[1]).is_file()) or 0)
    assert bench.run("x.toml", 5, ["1gbit", "2.5gbit"], ["ddp"], log=lambda line: None) == 0
    assert seen["links"] == ("shm",) and seen["rates"] == [1.0, 2.5]
    assert seen["common"][0] == "--catalogue" and seen["exists"]
    assert [emulated_link(bits_per_second(r)) for r in ("1gbit", "10gbit", "2.5gbit", "100mbit")] == [
        "emu-1g", "emu-10g", "emu-2.5g", "emu-0.1g"]


def test_the_queueing_network_of_parameter_servers_meets_its_bounds():
    """timing.queued (mean-value analysis): one customer alone cycles in think + service;
    many at one station never exceed the station's rate and approach it; a straggler
    takes fewer steps. served(): asynchronous workers at 10 Gbit/s step as their compute
    allows, at 100 Mbit/s the servers' links hold them all, and a bounded one keeps pace
    with the slowest, between asynchronous and synchronous."""
    from dataclasses import replace

    from mpitrain import plan as planner
    from mpitrain.plan import timing

    assert timing.queued([0.3], [{"link": 0.1}]) == pytest.approx([1 / 0.4])
    rates = timing.queued([0.1] * 8, [{"link": 0.1}] * 8)
    assert sum(rates) <= 1 / 0.1 + 1e-9 and sum(rates) > 0.9 / 0.1
    slow, fast = timing.queued([0.4, 0.2], [{"link": 0.01}] * 2)
    assert slow < fast and slow == pytest.approx(1 / 0.41, rel=0.02)

    def step(bandwidth, staleness):  # 1 server and 3 workers, a node each
        sets = ["parallel.sync=ps", "parallel.servers=1", "parallel.dp=-1", f"parallel.staleness={staleness}",
                "parallel.slow_worker=0", "parallel.slow_factor=2", "optim.grad_clip=0", "train.global_batch_size=12"]
        machine = planner.machine(hardware.load(), "this", 4, 1, "emu-10g")
        machine = replace(machine, inter=replace(machine.inter, bandwidth=bandwidth))
        return planner.make(load("jobs/shakespeare_gpt.toml", sets), 4, machine).time

    fast, narrow = step(1.25e9, -1), step(1.25e7, -1)
    pushed = 806_528 * 4 * 3  # each of 3 workers pushes the model's gradient (and pulls it back) once a step
    # the link into the servers' node carries every push (a bound); each push, then pull, at most in series
    assert narrow["step"] > 10 * fast["step"] and pushed / 1.25e7 < narrow["step"] < 2 * pushed / 1.25e7
    bounded, sync = step(1.25e9, 1), step(1.25e9, 0)
    assert fast["step"] < bounded["step"] <= sync["step"]


def test_a_nodes_ranks_share_its_port_and_take_turns_on_its_cores():
    """An emulated node has one port (per_node): 2 ranks a node calling their own pairs'
    collectives at once get half of it each; a group of 4 on 2 nodes sends 2/3 of its bytes
    off the node, beside its neighbour's. A GPU node's port a rank is its own. Ranks that
    outnumber a node's cores take turns, which each call between two of them pays."""
    from dataclasses import replace

    from mpitrain import plan as planner

    catalogue = hardware.load()
    m = replace(planner.machine(catalogue, "this", 4, 2, "emu-1g"), cores=1)
    port = catalogue.link("emu-1g").bandwidth
    assert m.link([0, 1]) is m.intra and m.link([0, 2]).bandwidth == pytest.approx(port / 2)
    assert m.link([0, 1, 2, 3]).bandwidth == pytest.approx(port / (2 * 2 / 3))
    assert replace(m, per_node=1).link([0, 1]).bandwidth == port
    gpus = planner.machine(catalogue, "a100-80g", 16, 8, "ib-hdr")
    assert gpus.link([0, 8]).bandwidth == catalogue.link("ib-hdr").bandwidth
    switch = catalogue.device("this").switch
    assert switch > 0 and m.switches([0, 1]) == m.switches([0, 1, 2, 3]) == switch and m.switches([0, 2]) == 0
    assert replace(m, cores=2).switches([0, 1]) == 0 and gpus.switches(list(range(8))) == 0


def test_the_plans_of_a_new_gpu_user_read_as_they_should():
    """What a user meets first planning a GPU: V100 plans (its NVLink 2); nodes without
    --network are refused, naming the flag; one bubble figure, the step's; FLOP/s labelled
    model or executed, and MFU/HFU of the peak of the precision the device multiplies in;
    three significant digits, a small rate not rounded to 0; the vocabulary named."""
    from mpitrain.plan import show

    v100 = planned(["--model", "gpt2", "--hardware", "v100", "--set", "train.precision=fp16"])
    assert v100.machine.intra.key == "nvlink2" and v100.time["step"] > 0
    with pytest.raises(hardware.HardwareError, match="v100 .* has no bf16 peak .*train.precision = 'fp16'"):
        planned(["--model", "gpt2", "--hardware", "v100", "--set", "train.precision=bf16"])
    with pytest.raises(hardware.HardwareError, match="16 ranks at 8 a node are 2 nodes: --network names the link"):
        planned(["--model", "gpt2", "--hardware", "a100-80g", "--nodes", "2", "--gpus-per-node", "8"])
    plan = planned([*GPT3, "--set", "parallel.tp=8", "--set", "parallel.pp=16", "--set", "train.micro_batches=64",
                    "--set", "train.precision=bf16", "--set", "model.checkpoint_activations=true"])
    text = show.text(plan, "gpt3-175b")
    share = f"{100 * plan.time['bubble'] / plan.time['step']:.1f}% of the step"
    assert share in text and text.count("% of the step") == 1 and "% of a step" not in text
    rate, executed = (f / plan.time["step"] / 1024 for f in (plan.model_flops, plan.executed_flops))
    peak = plan.machine.device.peak_flops["bf16"]
    assert executed > rate  # recomputation is executed, not the model's
    assert (f"{show.sig(rate / 1e12)} model TFLOP/s per rank (without recomputation), "
            f"{show.sig(executed / 1e12)} executed; MFU {100 * rate / peak:.1f}%, HFU {100 * executed / peak:.1f}% "
            "of the bf16 peak 312 TFLOP/s") in text
    assert "a vocabulary of 50,257" in text
    assert [show.sig(x) for x in (0.38, 31.14, 463228, 0.000691)] == ["0.380", "31.1", "463,000", "0.000691"]
    assert show.duration(0.0723) == "72.3 ms" and show.duration(40.44) == "40.4 s"
    assert show.duration(1.33e-6) == "1.33 us" and show.duration(0) == "0 ms"


def test_gpt2_in_bf16_on_an_h100_is_faster_by_the_tensor_cores_ratio_and_holds_no_numpy_arrays():
    """The issue's example: GPT-2 on one H100 in bf16 against fp32. A GPU's products run in
    the training's 16 bits (its tensor cores), not in float32 as NumPy's do here: faster by
    the ratio of the bf16 rate measured to the float32 peak (794.5 / 67; none measured),
    and by the words' bytes (4 / 2) for the kernels that only move memory; the step's
    compute between the two. No GPU plan counts NumPy's upcast copies or work arrays (tier
    1's memory, as GPU frameworks hold it)."""
    from mpitrain.plan import estimate, gpu

    fp32, bf16 = (planned(["--model", "gpt2", "--hardware", "h100", "--set", f"train.precision={p}"])
                  for p in ("fp32", "bf16"))
    h100 = bf16.machine.device
    big = (8192, 768, 3072)  # the MLP's product of a micro-batch of 8
    tensor = gpu.gemm_seconds(h100, "fp32", *big) / gpu.gemm_seconds(h100, "bf16", *big)
    assert tensor == pytest.approx(794.5 / 67)
    moved = gpu.moved_seconds(h100, 4e9) / gpu.moved_seconds(h100, 2e9)
    ratio = fp32.time["compute"] / bf16.time["compute"]
    assert moved < ratio < tensor and ratio > 4
    for plan in (fp32, bf16, planned([*GPT3, "--set", "parallel.tp=8", "--set", "parallel.pp=16",
                                      "--set", "train.micro_batches=64", "--set", "train.precision=bf16",
                                      "--set", "parallel.sync=zero1"])):
        lay = plan.layout
        assert lay.textbook and lay.work_arrays == 0 and lay.dtype_bytes == lay.itemsize
        for p in plan.ranks:
            rest, r = divmod(p.ranks[0], lay.tp)
            memory = estimate.of_layout(lay, rest // lay.dp, r)[0]
            assert p.memory["work"] == p.memory["buffers"] == p.memory["objects"] == 0
            assert p.memory["activations"] == memory["activations"]  # the published formula, 16-bit, no copies


def test_mfu_sets_the_whole_step_and_prints_the_planners_own_beside_it():
    """--mfu 0.45: the step whose model FLOPs reach 45% of the bf16 peak on every GPU, each
    of the planner's parts scaled alike, the planner's own step and MFU printed beside; on
    this machine (measured, not published) refused."""
    from mpitrain.plan import show

    argv = [*GPT3, "--set", "parallel.tp=8", "--set", "parallel.pp=16", "--set", "train.micro_batches=64",
            "--set", "train.precision=bf16", "--set", "model.checkpoint_activations=true"]
    own, at = planned(argv), planned([*argv, "--mfu", "0.45"])
    assert at.model_flops / at.time["step"] / 1024 == pytest.approx(0.45 * 312e12, rel=1e-12)
    scale = at.time["step"] / own.time["step"]
    assert all(at.time[k] == pytest.approx(own.time[k] * scale, rel=1e-12) for k in own.time)
    assert at.own == own.time and at.samples_per_s == pytest.approx(own.samples_per_s / scale)
    text = show.text(at, "gpt3-175b")
    mfu = 100 * own.model_flops / own.time["step"] / 1024 / 312e12
    assert (f"step time (set by --mfu 45%, every part scaled; the planner's own: "
            f"{show.duration(own.time['step'])}, MFU {mfu:.1f}%)") in text and "MFU 45.0%" in text
    with pytest.raises(ConfigError, match="--mfu: sets a published device's step"):
        planned(["jobs/shakespeare_gpt.toml", "--mfu", "0.5"])
    out = subprocess.run([sys.executable, "-m", "mpitrain", "plan", *argv, "--mfu", "0.45", "--search"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--mfu: sets one plan's step; leave it out of --search" in out.stderr


def test_no_gpu_plan_executes_more_than_the_peak():
    """A GPU plan's executed FLOPs are what GPU frameworks replay (what checkpointing drops),
    not mpitrain's zero-bubble or ZeRO-3 replays: its HFU stays under 100% with ZB-H1 and
    with ZeRO-3; and --mfu that would make the GPUs execute more than their peak with the
    layout's recomputation is refused, naming the most it can be."""
    from mpitrain.plan import show

    zb = [*GPT3, "--set", "parallel.dp=64", "--set", "parallel.pp=4", "--set", "parallel.tp=4", "--set",
          "parallel.sync=zero1", "--set", "parallel.schedule=zb-h1", "--set", "train.micro_batches=8", "--set",
          "train.precision=bf16", "--set", "model.checkpoint_activations=true", "--set",
          "parallel.sequence_parallel=true"]
    f1b = [x.replace("zb-h1", "1f1b") for x in zb]
    assert planned(zb).executed_flops == planned(f1b).executed_flops
    zero3 = planned(["--model", "gpt-13b", "--hardware", "h100", "-n", "8", "--set", "train.precision=bf16", "--set",
                     "train.global_batch_size=64", "--set", "parallel.sync=zero3"])
    assert zero3.executed_flops == zero3.model_flops
    for plan in (planned(zb), zero3):
        hfu = float(show.text(plan, "x").split("HFU ")[1].split("%")[0])
        assert 0 < hfu < 100
    argv = ["--model", "gpt2", "--hardware", "h100", "-n", "8", "--set", "train.precision=bf16", "--set",
            "model.checkpoint_activations=true"]
    ratio = planned(argv).executed_flops / planned(argv).model_flops
    most = math.floor(1000 / ratio) / 1000
    with pytest.raises(ConfigError, match=rf"--mfu 0.9: .* execute {0.9 * ratio:.1%} of their peak \(HFU\); this "
                                          rf"layout's MFU is {most:g} at most"):
        planned([*argv, "--mfu", "0.9"])
    assert planned([*argv, "--mfu", f"{most:g}"]).time["step"] > 0  # the most it said is taken


@pytest.mark.parametrize("nodes, said", [
    (["-n", "4", "--nodes", "3"], "-n 4 ranks do not share --nodes 3 evenly: give a multiple of 3 ranks"),
    (["-n", "12", "--gpus-per-node", "8"], "-n 12 is not a whole number of nodes of --gpus-per-node 8 (1 and 4 "
                                           "rank(s) over): give a multiple of 8 ranks"),
    (["-n", "4", "--gpus-per-node", "8"], None), (["-n", "16", "--nodes", "2"], None)])
def test_the_ranks_fill_whole_nodes_and_a_node_partly_used_is_its_ranks(nodes, said):
    """Ranks that do not fill their nodes evenly are refused, rather than planned on nodes
    the user did not ask for; fewer ranks than a node's GPUs are one node of those ranks."""
    argv = ["--model", "gpt2", "--hardware", "h100", "--network", "ib-hdr", *nodes]
    if said:
        with pytest.raises(ConfigError, match=f"^{re.escape(said)}$"):
            planner.machine_of(cli.build_parser().parse_args(["plan", *argv]))
        return
    P, machine = planner.machine_of(cli.build_parser().parse_args(["plan", *argv]))
    assert (P, machine.per_node) == ((4, 4) if "4" in nodes else (16, 8))
