"""Tier 1 over every layout at once (mpitrain/plan/space.py): each row's answer is tier 1's
scalar formulas for that layout as the trainer cuts it (mpitrain/plan/estimate.py), the
space holds every layout the trainer accepts and nothing the search does not try, and
``mpitrain plan --search`` on a GPU cluster ranks with it and confirms with tier 2."""

import argparse
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from mpitrain import cli, cost
from mpitrain import plan as planner
from mpitrain.config import ConfigError
from mpitrain.plan import estimate, gpu, hardware, machine_of, search, space
from mpitrain.plan.data import resolve
from mpitrain.plan.layout import Layout
from mpitrain.plan.models import config_of

CONFIG = "jobs/shakespeare_gpt.toml"


def _setup(P, *argv, what=(CONFIG,)):
    args = cli.build_parser().parse_args(["plan", *what, "-n", str(P), "--hardware", "a100-80g", *argv])
    _, machine = machine_of(args)
    make = lambda sets: config_of(argparse.Namespace(**{**vars(args), "set": [*args.set, *sets]}))[0]  # noqa: E731
    base = make(())
    data = resolve(base)
    model = space.Gpt.of(base, data)
    table = space.grids(model, P)
    rows = space.build(model, table)
    return make, machine, data, model, table, rows


def _sets(rows, i, table):
    return search.overrides(**rows.row(i, table))


@pytest.mark.parametrize("P", [4, 8])
def test_the_space_is_every_layout_the_trainer_accepts_and_no_other(P):
    """Every layout the search tries that the trainer's checks accept is a row; every row is
    a layout the search tries (tier 1 leaves out only what its arithmetic rules out)."""
    make, _, data, _, table, rows = _setup(P)
    ours = {_sets(rows, i, table) for i in range(len(rows))}
    assert len(ours) == len(rows)
    tried = set(search.layouts(make(()), P))
    assert ours <= tried
    accepted = set()
    for sets in tried - ours:
        if "parallel.sync=ps" in sets:
            continue
        try:
            Layout.of(make(sets), P, data)
        except ConfigError:
            continue
        accepted.add(sets)
    assert not accepted, sorted(accepted)[:3]


def _stage_kernels(lay, machine, s):
    """The GPU model's compute of pipeline rank ``s`` of ``lay``, from its layers one by one."""
    layers = lay.layers(s, 0)
    blocks = sum(x.name.startswith("block") for x in layers)
    first, last = (any(x.name == n for x in layers) for n in ("embed", "head"))
    N = sum(math.prod(shape) for shape in lay.parameters(s, 0).values())
    model, t = space.Gpt.of(lay.cfg, lay.data), lay.cfg.train
    updated = cost.state_shares(lay.par.sync, lay.dp)[2] * N
    micro_batches, _, once = gpu.stage_seconds(machine.device, model, t.precision, lay.micro_batch, lay.m, lay.tp,
                                               blocks, first, last, N, updated, lay.cfg.model.checkpoint_activations,
                                               lay.tp > 1 and lay.par.sequence_parallel, lay.par.sync)
    return micro_batches + once  # the update, once a step


@pytest.mark.parametrize("P, what, device", [(4, (CONFIG,), "kernels"), (8, (CONFIG,), "kernels"),
                                             (16, ("--model", "gpt2"), "kernels"), (4, (CONFIG,), "peak")],
                         ids=["4", "8", "gpt2 on 16", "4, no GPU model"])
def test_each_rows_answer_is_tier_1s_formulas_for_its_layout(P, what, device):
    """Memory: the largest pipeline rank's :func:`estimate.of_layout` (on a GPU as its
    frameworks hold it, their allowance added); compute: of the pipeline rank with the most
    FLOPs (with a large vocabulary the head's stage, or with recomputation one with more
    blocks), a device without a GPU model: its FLOPs at the peak for the precision; a GPU:
    its kernels one by one (:mod:`mpitrain.plan.gpu`); for every layout of the space the
    trainer accepts (a sample of them)."""
    from dataclasses import replace

    make, machine, data, model, table, rows = _setup(P, what=what)
    if device == "peak":
        machine = replace(machine, device=replace(machine.device, sms=0))
    out = space.evaluate(model, table, rows, machine)
    checked = 0
    for i in range(0, len(rows), 5):
        try:
            lay = Layout.of(make(_sets(rows, i, table)), P, data)
        except ConfigError:  # tier 1 answers it; the trainer does not run it
            continue
        answers = [estimate.of_layout(lay, s)[:2] for s in range(lay.pp)]
        if device == "kernels":
            axes = sum(n > 1 for n in (lay.dp, lay.pp, lay.tp))
            peaks = [sum(gpu.held(m, lay.par.sync, lay.mixed, axes).values()) for m, _ in answers]
        else:
            peaks = [sum(m.values()) for m, _ in answers]
        assert out["peak"][i] == pytest.approx(max(peaks), rel=1e-12), i
        flops = [sum(f.values()) for _, f in answers]
        if device == "kernels":
            expected = _stage_kernels(lay, machine, flops.index(max(flops)))
        else:
            expected = max(flops) / machine.device.peak_flops[hardware.PRECISION_OF[lay.cfg.train.precision]]
        assert out["compute"][i] == pytest.approx(expected, rel=1e-12), i
        assert out["step"][i] == pytest.approx(out["compute"][i] + out["exposed"][i] + out["bubble"][i])
        one = space.of_layout(lay, machine)  # the plan's tier 1 line: the same answer for its one layout
        assert one == {k: pytest.approx(float(x[i]), rel=1e-12) for k, x in out.items()}, i
        checked += 1
    assert checked > 30


def test_the_bubble_and_the_exposed_sync_are_the_textbooks():
    """One layout by hand: GPT-3 as Megatron trains it on 1,024 A100s (tp 8 in a node, pp 16,
    dp 8, 1F1B, 64 micro-batches, ZeRO-1 in bf16, recomputation): the bubble is
    ``(p - 1)(F + B + W)`` of a micro-batch's pass plus the fill's messages, ZeRO-1's
    exchange (float32 gradients, bf16 weights) is all exposed, the step is their sum with the compute and the slices' sums;
    the compute is the stage's kernels' (:mod:`mpitrain.plan.gpu`), the collectives' bytes
    at the bus bandwidth measured for their arrays' size (NVLink's curve; InfiniBand's one
    figure and its latency), a stage's sends a slice's share (Megatron-LM's scatter-gather),
    gathered over NVLink and waited on in each micro-batch."""
    catalogue = hardware.load()
    machine = planner.machine(catalogue, "a100-80g", 1024, 8, "ib-hdr")
    model = space.Gpt(50257, 2048, 96, 96, 12288, 1536)
    knobs = {**space.KNOBS, "micro_batches": (64,)}
    table = space.grids(model, 1024)
    rows = space.build(model, table, knobs)
    out = space.evaluate(model, table, rows, machine, knobs)
    want = {"dp": 8, "pp": 16, "tp": 8, "chunks": 1, "sync": "zero1", "schedule": "1f1b", "precision": "bf16",
            "recompute": True, "sequence": False, "micro_batches": 64, "bucket_mb": 0.0}
    i = next(i for i in range(len(rows)) if rows.row(i, table, knobs) == want)
    compute = out["compute"][i]
    # the last stage, its 6 blocks and the head: 4.58 PFLOP a GPU with recomputation, at half the peak or more
    assert 0.5 < 4.576e15 / compute / 312e12 < 271.2 / 312
    g = int(rows.grid[i])
    b = 1536 // (8 * 64)
    work = [sum(estimate.gpt_flops(table["blocks"][g, s], 2048, 12288, 50257, samples=b * 64, tp=8, recompute=True,
                                   last=table["last"][g, s]).values()) for s in range(16)]
    s = int(np.argmax(work))
    N, blocks = table["N"][g, s], table["blocks"][g, s]
    first, last = table["first"][g, s], table["last"][g, s]
    kernels = gpu.stage_seconds(machine.device, model, "bf16", b, 64, 8, blocks, first, last, N, N / 8, True, False,
                                "zero1")
    assert compute == pytest.approx(kernels[0] + kernels[2], rel=1e-12)
    sums = 64 * (6 * blocks + first + last)  # the blocks', the embedding's, the head's
    nvlink, ib = catalogue.link("nvlink3"), catalogue.link("ib-hdr")
    assert nvlink.measured and not ib.measured and ib.busbw(1e9) == 24e9 < ib.bandwidth
    activation = b * 2048 * 12288 * 2
    tp = sums * cost.collective_bytes("allreduce", activation, 8) / nvlink.busbw(activation)
    # ZeRO-1 in bf16 (Megatron-LM's distributed optimizer): float32 gradients reduce-scattered, bf16 weights gathered
    sent = cost.collective_bytes("reduce_scatter", N * 4, 8) + cost.collective_bytes("allgather", N * 2, 8)
    dp = cost.alpha_beta_seconds("reduce_scatter", 8, sent, ib.alpha, 24e9, 2)
    send = ib.alpha + activation / 8 / 24e9
    tied = cost.alpha_beta_seconds("allreduce", 2, 50257 * 12288 / 8 * 2, ib.alpha, 24e9)
    # each micro-batch's activations out and gradient back, waited on (Megatron-LM), each a slice's share over
    # InfiniBand and the slices' allgather over NVLink
    gather = cost.collective_bytes("allgather", activation, 8) / nvlink.busbw(activation)
    waited = 64 * 2 * (send + gather)
    assert out["exposed"][i] == pytest.approx(dp + tp + tied + waited, rel=1e-9)
    one = (kernels[0] + tp) / 64  # a micro-batch's: the update is once a step, after the schedule
    assert out["bubble"][i] == pytest.approx(15 * one + 30 * send, rel=1e-9)


def test_ddp_hides_its_sums_behind_the_last_micro_batchs_backward_but_its_last_bucket():
    """ddp sums the gradients once a step, in the last micro-batch's backward (the others
    accumulate: PyTorch's no_sync, mpitrain's too), each bucket as backward passes its
    parameters: what the earlier micro-batches compute hides none of it, and the last bucket,
    ready when backward ends, is exposed whole; one bucket of all the gradients hides
    nothing. ZeRO-2's sums of every micro-batch hide behind every backward."""
    parts = lambda **k: estimate.step_seconds(12.0, 0.0, 3.0, 0.0, 0.0, schedule="1f1b", p=1, m=4, **k)  # noqa: E731
    assert parts(sync="ddp")["exposed"] == pytest.approx(3 - 8 / 4)  # the last of 4 backward passes: 2 s
    assert parts(sync="ddp", last=0.5)["exposed"] == pytest.approx(3 - 1.5)
    assert parts(sync="ddp", last=1.0)["exposed"] == pytest.approx(3)
    assert parts(sync="zero2")["exposed"] == pytest.approx(3 - 3 * 4 / 5)
    argv = ["--model", "gpt2-xl", "--hardware", "a100-80g", "--nodes", "2", "--gpus-per-node", "8", "--network",
            "ib-hdr", "--set", "train.precision=bf16", "--set", "train.global_batch_size=64"]
    one, many = (planner.from_args(cli.build_parser().parse_args(["plan", *argv, "--set",
                                                                  f"parallel.bucket_mb={b}"]))[0] for b in (1e6, 25))
    assert one.time["exposed"] == pytest.approx(one.time["comm_total"]) and many.time["exposed"] < one.time["exposed"]


def test_the_search_on_a_gpu_cluster_ranks_by_tier_1_and_holds_the_fastest_to_the_trainers_checks():
    """GPT-2 on two nodes of 8 A100s: the command says how many layouts tier 1 ranked and
    how fast; the table's layouts are the fastest by tier 1 that the trainer accepts, their
    steps tier 1's (a GPU's plan is tier 1's: Layout.textbook), fastest first."""
    out = subprocess.run([sys.executable, "-m", "mpitrain", "plan", "--model", "gpt2", "--hardware", "a100-80g",
                          "--nodes", "2", "--gpus-per-node", "8", "--network", "ib-hdr", "--search", "--top", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "layouts ranked by tier 1 in" in lines[0] and "a second" in lines[0], lines[0]
    counted = int(re.search(r": ([\d,]+) layouts ranked by tier 1", lines[0]).group(1).replace(",", ""))
    fit = int(re.match(r"([\d,]+) layout\(s\) fit", lines[1]).group(1).replace(",", ""))
    assert counted == fit + int(re.search(r"memory (\d+)", lines[1]).group(1))
    rows = [line.split(" | ") for line in lines[3:6]]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    steps = [float(r[1]) for r in rows]
    assert steps == sorted(steps) and steps[0] > 0
    args = cli.build_parser().parse_args(["plan", "--model", "gpt2", "--hardware", "a100-80g", "--nodes", "2",
                                          "--gpus-per-node", "8", "--network", "ib-hdr"])
    _, machine = machine_of(args)
    cfg, data, _ = config_of(args)
    model = space.Gpt.of(cfg, data)
    table = space.grids(model, 16)
    rows = space.build(model, table)
    every = space.evaluate(model, table, rows, machine)
    make = lambda sets: config_of(argparse.Namespace(**{**vars(args), "set": list(sets)}))[0]  # noqa: E731
    for i in np.flatnonzero(every["peak"] <= 80e9)[np.argsort(every["step"][every["peak"] <= 80e9], kind="stable")]:
        try:  # the fastest that fits and that the trainer accepts
            Layout.of(make(_sets(rows, i, table)), 16, data)
        except ConfigError:
            continue
        assert steps[0] == pytest.approx(1e3 * every["step"][i], rel=1e-3)  # the table prints four digits
        break


def test_a_wide_space_is_ranked_whole():
    """Every micro-batch count, eight bucket sizes, five chunk counts and fp16 too: GPT-3 on
    1,024 GPUs has over half a million layouts, each answered (no wall-clock assertion:
    ``mpitrain bench search`` prints the rate)."""
    catalogue = hardware.load()
    machine = planner.machine(catalogue, "a100-80g", 1024, 8, "ib-hdr")
    model = space.Gpt(50257, 2048, 96, 96, 12288, 3072)
    table = space.grids(model, 1024, space.WIDE["chunks"])
    rows = space.build(model, table, space.WIDE)
    out = space.evaluate(model, table, rows, machine, space.WIDE)
    assert len(rows) > 500_000
    assert np.isfinite(out["step"]).all() and (out["peak"] > 0).all()


@pytest.mark.parametrize("sets", [[], ["parallel.pp=2", "parallel.sync=zero1", "train.micro_batches=2"]],
                         ids=["ddp", "zero1 on pp 2"])
def test_a_cnn_on_gpus_is_planned_by_tier_1(sets):
    """ResNet-8 on 2 nodes of 8 A100s in bf16: each rank's memory is tier 1's for its stage
    (estimate.of_cnn: no NumPy work arrays, buffers, objects or reader) as GPU frameworks
    hold it, with their allowance; the step's compute the FLOPs of the stage with the most
    at the GPU model's rate of its heaviest layer's product in bf16."""
    argv = ["plan", "jobs/cifar10_resnet.toml", "--hardware", "a100-80g", "--nodes", "2", "--gpus-per-node", "8",
            "--network", "ib-hdr", "--set", "train.precision=bf16", *[x for s in sets for x in ("--set", s)]]
    args = cli.build_parser().parse_args(argv)
    plan = planner.from_args(args)[0]
    lay = plan.layout
    assert lay.textbook
    answers = [estimate.of_cnn(lay, s) for s in range(lay.pp)]
    axes = sum(n > 1 for n in (lay.dp, lay.pp, lay.tp))
    held = [gpu.held(m, lay.par.sync, True, axes) for m, _, _ in answers]
    assert all(m["gradients"] == 2 * a["gradients"] > 0 for m, (a, _, _) in zip(held, answers))  # float32 ones
    for p in plan.ranks:
        assert p.memory == {**held[p.ranks[0] // lay.dp], "work": 0, "buffers": 0, "objects": 0, "reader": 0}
    s = max(range(lay.pp), key=lambda k: sum(answers[k][1].values()))
    heavy = max(lay.layers(s), key=lambda x: x.forward)
    _, k, n = heavy.gemm
    rows = heavy.product_rows(lay.micro_batch, lay.dtype_bytes, lay.threads, lay.cfg.train.fast_paths)
    rate = 2 * rows * k * n / gpu.gemm_seconds(plan.machine.device, "bf16", rows, k, n)
    assert plan.time["compute"] == pytest.approx(sum(answers[s][1].values()) / rate, rel=1e-12)
    assert plan.largest().peak == pytest.approx(max(sum(m.values()) for m in held))
    if lay.pp > 1:  # each micro-batch's activations across the cut, and their gradient back, on the node's link
        cut = math.prod(lay.models[0].layers[lay.bounds[1] - 1].out) * lay.micro_batch * 2
        nvlink = hardware.load().link("nvlink3")
        assert plan.time["comm_total"] >= 2 * lay.m * (nvlink.alpha + cut / nvlink.bandwidth)


def test_the_gpu_searchs_page_draws_every_layout_tier_1_ranked(tmp_path, monkeypatch, capsys):
    """``--search --html`` on a GPU cluster: the scatter holds every layout tier 1 answered
    (GPT-2 on 16 A100s: 3,744), not only those planned in turn."""
    from mpitrain.plan import page, search

    drawn, draw = [], page.search_figure
    monkeypatch.setattr(page, "search_figure", lambda fits, over, *rest: drawn.append(len(fits) + len(over))
                        or draw(fits, over, *rest))
    out = tmp_path / "search.html"
    argv = ["plan", "--model", "gpt2", "--hardware", "a100-80g", "--nodes", "2", "--gpus-per-node", "8", "--network",
            "ib-hdr", "--search", "--html", str(out)]
    assert search.run(cli.build_parser().parse_args(argv)) == 0
    said = re.search(r": ([\d,]+) layouts ranked by tier 1", capsys.readouterr().out)
    counted = int(said.group(1).replace(",", ""))
    assert drawn == [counted] and "Every layout: step time against peak memory" in out.read_text(encoding="utf-8")


def test_a_group_across_nodes_runs_no_faster_than_the_link_inside_them():
    """A ring across nodes runs through each node's link too: PCIe cards' data parallelism
    over NDR is bound by PCIe Gen4, and slower still over a slower link inside, while
    NVLink inside leaves the network to bound it."""
    argv = ["--hardware", "a100-80g-pcie", "--model", "gpt2-medium", "--set", "train.precision=bf16", "--set",
            "train.global_batch_size=64", "--nodes", "2", "--gpus-per-node", "8", "--network", "ib-ndr"]
    steps = {x: planner.from_args(cli.build_parser().parse_args(["plan", *argv, "--intra", x]))[0].time["comm_total"]
             for x in ("nvlink3", "pcie4", "eth-10g")}
    assert steps["nvlink3"] < steps["pcie4"] < steps["eth-10g"]
    # tier 2's link (timing.crossing) takes the slower the same way: this machine's shared memory under 100 GbE
    from mpitrain.plan import timing

    catalogue = hardware.load()
    cpus = planner.machine(catalogue, "this", 4, 2, "eth-100g")
    shm, eth = catalogue.link("shm"), catalogue.link("eth-100g")
    assert shm.p2p < eth.p2p and cpus.link([0, 2]).bandwidth == shm.bandwidth and cpus.link([0, 1]) is cpus.intra
    assert timing.crossing(eth, catalogue.link("nvlink3")) is eth
