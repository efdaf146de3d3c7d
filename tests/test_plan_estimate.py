"""Tier 1, the textbook planner (mpitrain/plan/estimate.py), against tier 2's exact plan:
model state equal to the byte but Adam's step counts (tier 2's correction: an int64 per
piece the optimizer updates), FLOPs equal but ZeRO-3's replayed layers (tier 2's
correction: mpitrain runs each layer's forward again in backward); and the formulas the
notes give."""

import glob
import json
import math

import pytest

from mpitrain import config
from mpitrain import plan as planner
from mpitrain.plan import estimate, hardware, space
from mpitrain.plan.predict import model_state, shards
from mpitrain.plan.traffic import NAMED as BYTES_CORRECTIONS  # tier 2's calls tier 1 does not count

GRIDS = {  # ranks -> the layouts the MPI tier trains, and more
    1: [[], ["train.precision=bf16"], ["model.checkpoint_activations=true"], ["train.dtype='float64'"]],
    2: [["parallel.sync=zero1"], ["parallel.sync=zero2", "train.precision=fp16"], ["parallel.sync=zero3"],
        ["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.pp=2", "train.micro_batches=4"]],
    4: [["parallel.pp=2", "parallel.sync=zero1", "train.micro_batches=2"],
        ["parallel.tp=2", "parallel.sync=zero3", "train.precision=bf16"],
        ["parallel.pp=2", "parallel.sync=zero2", "train.dtype='float64'", "train.micro_batches=2"],
        ["parallel.pp=2", "parallel.tp=2", "parallel.schedule=zb-h1", "train.micro_batches=4"]],
    8: [["parallel.pp=2", "parallel.tp=2", "parallel.sync=zero1", "train.precision=bf16",
         "model.checkpoint_activations=true", "train.micro_batches=3"],
        ["parallel.pp=2", "parallel.tp=2", "parallel.sync=zero2", "parallel.sequence_parallel=true",
         "train.micro_batches=3"]],
}


def plans_of(job: str):
    """(overrides, plan) of ``job`` on each layout the MPI tier trains (GRIDS, CNN_LAYOUTS)
    that its model takes: a CNN refuses slices and checkpointing, a GPT nothing."""
    from mpitrain.config import ConfigError

    layouts = [(P, sets) for P, grid in GRIDS.items() for sets in grid] + CNN_LAYOUTS
    planned = 0
    for ranks, sets in layouts:
        try:
            cfg = config.load(job, sets, data_needed=False)
            plan = planner.make(cfg, ranks, planner.machine(hardware.load(), "this", ranks))
        except ConfigError:  # slices and checkpointing are the GPT's
            assert "gpt" not in job
            continue
        planned += 1
        yield sets, plan


@pytest.mark.parametrize("job", sorted(glob.glob("jobs/*.toml")))
def test_tier_1_is_tier_2_less_its_named_corrections(job):
    """On every shipped job and each layout the MPI tier trains (those its model takes),
    each rank's model state in tier 1 is tier 2's to the byte but Adam's step counts, and
    its FLOPs tier 2's but ZeRO-3's replayed forwards."""
    for sets, plan in plans_of(job):
        lay = plan.layout
        for s in range(lay.pp):
            for r in range(lay.tp):
                memory, flops, _ = estimate.of_layout(lay, s, r)
                for d in range(lay.dp):
                    exact, where = model_state(lay, s, r, d), (sets, s, r, d)
                    counters = 8 * len(shards(lay, s, r, d)[2]) if lay.moments == 2 else 0  # Adam's step, an int64
                    for category in ("parameters", "gradients", "masters"):
                        assert memory[category] == exact[category], (*where, category)
                    assert memory["optimizer state"] + counters == exact["optimizer state"], where
                rank = next(p for p in plan.ranks if lay.rank_of(s, 0, r) in p.ranks)
                # a vocabulary that does not divide over the slices: the head's rows of this slice, not the even share
                head = [x for x in lay.layers(s, r) if x.name == "head"]
                rows = head[0].gemm[2] - lay.data.ids / lay.tp if head else 0
                uneven = lay.micro_batch * lay.m * 2 * lay.T * lay.cfg.model.n_embd * rows
                assert rank.flops["forward"] == pytest.approx(flops["forward"] + uneven, rel=1e-12), (sets, s, r)
                assert rank.flops["backward"] == pytest.approx(flops["backward"] + 2 * uneven, rel=1e-12)
                assert (rows != 0) <= (lay.data.ids % lay.tp != 0)
                # tier 2's correction: mpitrain's ZeRO-3 frees a layer's gathered weights after its
                # forward, and runs the layer again in backward (the textbook's keeps its activations)
                again = rank.flops["forward"] if lay.par.sync == "zero3" else flops["recompute"]
                assert rank.flops["recompute"] == again, (sets, s, r)


@pytest.mark.parametrize("ranks, sets", [(P, sets) for P, layouts in GRIDS.items() for sets in layouts],
                         ids=lambda v: v if isinstance(v, int) else " ".join(v) or "ddp")
def test_tier_2s_compute_is_tier_1s_plus_its_named_corrections(ranks, sets):
    """On a device with one GEMM rate (this machine's calibration, its products all at the
    rate of a block's MLP product), the plan's compute (its slowest rank's) is tier 1's
    plus that rank's named corrections (timing.CORRECTIONS), each of them positive where
    it applies, and its products tier 1's compute. (With the real calibration the products' shapes and BLAS
    threads are one more correction.)"""
    from dataclasses import replace

    from mpitrain.plan import timing

    cfg = config.load("jobs/shakespeare_gpt.toml", [*sets, "model.bias=true"], data_needed=False)
    machine = planner.machine(hardware.load(), "this", ranks)
    T, C = cfg.model.block_size, cfg.model.n_embd
    dtype = cfg.train.dtype
    one = machine.device.matmul_flops_per_s(T, C, 4 * C, dtype, machine.threads(cfg.train.threads))
    # one float32 row (a float64 product runs at half its rate, in both tiers)
    device = replace(machine.device, gemm=((T, C, 4 * C, "float32", one * (2 if dtype == "float64" else 1), 1),))
    machine = replace(machine, device=device)
    plan = planner.make(cfg, ranks, machine)
    parts = [timing.compute_parts(plan.layout, p, machine) for p in plan.ranks]
    slowest = max(parts, key=lambda x: sum(x.values()))  # the rank whose compute the plan's step takes
    tier1 = space.of_layout(plan.layout, machine)["compute"]
    corrections = {k: slowest[k] for k in timing.CORRECTIONS}
    assert plan.time["compute"] == pytest.approx(tier1 + sum(corrections.values()), rel=1e-6)
    assert slowest["products"] == pytest.approx(tier1, rel=1e-6)
    assert corrections["elementwise"] > 0 and corrections["op calls"] > 0 and corrections["update calls"] > 0
    assert (corrections["mixed precision"] > 0) == plan.layout.mixed
    assert (corrections["ZeRO-3's replays"] > 0) == (plan.layout.par.sync == "zero3")




@pytest.mark.parametrize("job", sorted(glob.glob("jobs/*.toml")))
def test_tier_1s_bytes_are_what_each_rank_sends_but_tier_2s_named_corrections(job):
    """On every shipped job and each layout the MPI tier trains (those the job's model
    takes), each rank's bytes on each communicator, counted call by call by tier 2 (what
    the trainer's counters count), are tier 1's textbook sums (``estimate.of_layout``) plus
    ``traffic.corrections``: the calls tier 1 does not count (clipping's sums, the
    vocabulary-parallel cross-entropy's, the replicated weights'), NumPy's and MPI's float32
    words in mixed precision, ZeRO-3's replayed sums, the tied weight summed as ZeRO's
    pieces, and a vocabulary's uneven slices; each where its cause is."""
    from mpitrain.plan import traffic

    for sets, plan in plans_of(job):
        lay = plan.layout
        for p in plan.ranks:
            rest, r = divmod(p.ranks[0], lay.tp)
            _, _, sent = estimate.of_layout(lay, rest // lay.dp, r)
            fixes = traffic.corrections(lay, p.calls, r)
            for axis in ("dp", "pp", "tp"):
                fix, where = fixes[axis], (sets, p.ranks, axis)
                assert list(fix) == list(traffic.BYTES_CORRECTIONS)
                assert p.sent.get(axis, 0) == pytest.approx(sent[axis] + sum(fix.values()), rel=1e-12, abs=1), where
                assert fix["named calls"] == sum(c.sent for c in p.calls if c.axis == axis
                                                 and c.what.startswith(BYTES_CORRECTIONS)), where
                assert (fix["float32 words"] > 0) <= lay.mixed, where
                assert (fix["ZeRO-3's replays"] > 0) <= (lay.par.sync == "zero3" and axis == "tp"), where
                assert (fix["ZeRO's pieces"] != 0) <= (lay.par.sync.startswith("zero") and axis == "pp"), where
                assert (fix["uneven slices"] != 0) <= (lay.data.ids % lay.tp != 0 and axis == "pp"), where


def test_zero1_with_slices_and_stages_in_bf16_is_the_zero_papers_formula():
    """The notes' layout: GPT-3 on 1,024 GPUs as tp 8 x pp 16 x dp 8, ZeRO-1, bf16: each
    rank's model state is 2 + 2 + 12/8 bytes for each parameter its part holds."""
    args = ["plan", "--model", "gpt3-175b", "--hardware", "a100-80g", "--nodes", "128", "--gpus-per-node", "8",
            "--network", "ib-hdr", "--set", "parallel.tp=8", "--set", "parallel.pp=16", "--set",
            "parallel.sync=zero1", "--set", "train.precision=bf16", "--set", "model.checkpoint_activations=true",
            "--set", "train.micro_batches=64"]
    from mpitrain import cli

    lay = planner.from_args(cli.build_parser().parse_args(args))[0].layout
    assert (lay.dp, lay.pp, lay.tp) == (8, 16, 8)
    for s in (0, 7, 15):
        memory, _, _ = estimate.of_layout(lay, s)
        N = sum(math.prod(shape) for shape in lay.parameters(s).values())
        state = sum(memory[k] for k in ("parameters", "gradients", "optimizer state", "masters"))
        assert state == pytest.approx((2 + 2 + 12 / 8) * N, rel=1e-12)


def test_the_activation_formulas_slice_as_their_paper_says():
    """Korthikanti et al. 2022: a block keeps s b h (34 + 5 a s/h) bytes in 16-bit numbers;
    sliced over t, s b h (10 + 24/t + 5 a s/(h t)); with sequence parallelism all of it over
    t; recomputed, 2 s b h (its input); float32 numbers twice as many bytes."""
    T, C, H, b = 2048, 12288, 96, 1
    whole = estimate.gpt_memory(0, 1, T, C, H, 50257, b=b, held=1, precision="bf16", last=False)["activations"]
    assert whole == T * b * C * (34 + 5 * H * T / C)
    sliced = estimate.gpt_memory(0, 1, T, C, H, 50257, b=b, held=1, tp=8, precision="bf16", last=False)
    assert sliced["activations"] == T * b * C * (10 + 24 / 8 + 5 * H * T / (C * 8))
    sequence = estimate.gpt_memory(0, 1, T, C, H, 50257, b=b, held=1, tp=8, sequence=True, precision="bf16",
                                   last=False)
    assert sequence["activations"] == pytest.approx(whole / 8)
    again = estimate.gpt_memory(0, 1, T, C, H, 50257, b=b, held=3, precision="bf16", recompute=True, last=False)
    assert again["activations"] == 3 * 2 * T * b * C
    fp32 = estimate.gpt_memory(0, 1, T, C, H, 50257, b=b, held=1, last=False)["activations"]
    assert fp32 == 2 * whole


def test_validate_prints_the_estimate_beside_the_exact_plan_and_the_run():
    """--validate's table: estimate | exact | measured | error, tier 1's figure where it
    answers the row (a bound of the peak: its activations), "-" where it does not."""
    from mpitrain.plan import validate

    cfg = config.load("jobs/shakespeare_gpt.toml", ["parallel.pp=2", "train.micro_batches=2"], data_needed=False)
    plan = planner.make(cfg, 2, planner.machine(hardware.load(), "this", 2))
    textbook = validate.estimates(plan)
    rows = [(1, "parameters", 5, 5), (1, "heap peak above rest, at most", 7, 6), (1, "reader, its queue full", 3, 3),
            ("mean", "FLOPs", 9, 9)]
    text, ok = validate.table(rows, (0.5, 0.5), textbook)
    lines = text.splitlines()
    assert ok and lines[0] == "rank | quantity | estimate | exact | measured | error | holds"
    assert lines[1] == f"1 | parameters | {textbook[1, 'parameters']:,.0f} | 5 | 5 | +0.00% | yes"
    assert lines[2].startswith(f"1 | heap peak above rest, at most | {textbook[1, 'heap peak above rest']:,.0f} | 7")
    assert lines[3].startswith("1 | reader, its queue full | - | 3 | 3")
    assert lines[-1].startswith(f"all | step time (s) | {textbook['all', 'step time (s)']:.4f} | 0.5000 | 0.5000")
    assert textbook["all", "step time (s)"] == pytest.approx(space.of_layout(plan.layout, plan.machine)["step"])
    assert validate.table(rows)[0].splitlines()[0] == "rank | quantity | predicted | measured | error | holds"
    cnn = config.load("jobs/mnist_lenet.toml", data_needed=False)
    said = validate.estimates(planner.make(cnn, 1, planner.machine(hardware.load(), "this", 1)))
    assert said[0, "parameters"] > 0 and said[0, "dp sent"] == 0 and said["all", "step time (s)"] > 0
    json.dumps(list(said.values()))  # --json writes them: plain numbers
    for job, sets, timed in (("jobs/mnist_lenet.toml", ["parallel.sync=local"], False),  # tier 1 times ddp and ZeRO
                             ("jobs/shakespeare_gpt.toml", ["parallel.sync=local", "parallel.pp=2",
                                                            "train.micro_batches=2"], False),
                             ("jobs/mnist_lenet.toml", ["parallel.pp=2", "train.micro_batches=2"], True)):
        one = config.load(job, sets, data_needed=False)
        P = 2 if "parallel.pp=2" in sets else 1
        said = validate.estimates(planner.make(one, P, planner.machine(hardware.load(), "this", P)))
        assert said[0, "dp sent"] == 0 and (("all", "step time (s)") in said) == timed, (job, sets)
        json.dumps(list(said.values()))


CNN_LAYOUTS = [(1, []), (2, ["parallel.sync=zero1"]), (2, ["parallel.pp=2", "train.micro_batches=2"]),
               (4, ["parallel.pp=2", "parallel.sync=zero2", "train.micro_batches=2"]),
               (4, ["parallel.pp=2", "parallel.sync=zero3", "train.precision=bf16"])]


@pytest.mark.parametrize("job", ["jobs/mnist_lenet.toml", "jobs/cifar10_resnet.toml"])
@pytest.mark.parametrize("ranks, sets", CNN_LAYOUTS, ids=lambda v: " ".join(v) or "ddp" if isinstance(v, list) else v)
def test_a_cnns_tier_1_is_tier_2_less_its_named_corrections(job, ranks, sets):
    """The CNNs' tier 1 (``estimate.of_cnn``) on each rank: model state tier 2's but Adam's
    step counts; FLOPs tier 2's but ZeRO-3's replayed layers; bytes on each communicator
    tier 2's but clipping's sums and, in mixed precision, NumPy's float32 words (the
    activations between stages, MPI's sums of 16-bit gradients); activations each layer's
    input, less than what mpitrain's ops keep."""
    cfg = config.load(job, sets, data_needed=False)
    plan = planner.make(cfg, ranks, planner.machine(hardware.load(), "this", ranks))
    lay = plan.layout
    for p in plan.ranks:
        s, d = divmod(p.ranks[0], lay.dp)
        memory, flops, sent = estimate.of_layout(lay, s)
        exact = model_state(lay, s, 0, d)
        counters = 8 * len(shards(lay, s, 0, d)[2]) if lay.moments == 2 else 0
        for category in ("parameters", "gradients", "masters"):
            assert memory[category] == exact[category], (p.ranks, category)
        assert memory["optimizer state"] + counters == exact["optimizer state"], p.ranks
        assert 0 < memory["activations"] < p.memory["activations"]
        assert flops["forward"] == p.flops["forward"] and flops["backward"] == p.flops["backward"]
        assert p.flops["recompute"] == (p.flops["forward"] if lay.par.sync == "zero3" else 0)
        words = 2 if lay.mixed else 1  # NumPy's float32 activations between the stages, the textbook's 16 bits
        assert p.sent.get("pp", 0) == words * sent["pp"] + sum(c.sent for c in p.calls if c.axis == "pp"
                                                                and c.what.startswith("clipping"))
        if not lay.mixed:
            assert p.sent.get("dp", 0) == sent["dp"] + sum(c.sent for c in p.calls if c.axis == "dp"
                                                            and c.what.startswith("clipping"))


@pytest.mark.parametrize("job", sorted(glob.glob("jobs/*.toml")))
def test_tier_2s_activations_are_tier_1s_plus_its_named_corrections(job):
    """On every shipped job and each layout the MPI tier trains (those the job's model
    takes), each rank's activations in tier 2's plan are tier 1's (``estimate.of_layout``)
    plus ``peak.corrections``, each correction where its cause is and nowhere else."""
    from mpitrain.plan import peak

    for sets, plan in plans_of(job):
        lay = plan.layout
        image = lay.data.kind == "image"
        for p in plan.ranks:
            rest, r = divmod(p.ranks[0], lay.tp)
            s = rest // lay.dp
            textbook = estimate.of_layout(lay, s, r)[0]["activations"]
            fixes = peak.corrections(lay, s, r, textbook)
            where = (sets, p.ranks)
            assert list(fixes) == list(peak.ACTIVATION_CORRECTIONS), where
            assert textbook + sum(fixes.values()) == pytest.approx(p.memory["activations"], abs=1), where
            assert (fixes["16-bit words"] > 0) == lay.mixed, where
            products = any(x.forward and not peak.replays(lay, x) for x in lay.layers(s, r))  # a replay's: not kept
            assert (fixes["float32 weights"] > 0) == (lay.mixed and products), where
            head = lay.models[r].layers[lay.bounds[s]]  # the stage's first layer: a replay keeps its input
            assert (fixes["received"] > 0) == (s > 0 and not peak.replays(lay, head)), where
            assert (fixes["sends"] > 0) == (lay.pp > 1), where
            assert (fixes["zero"] > 0) <= (lay.par.sync in ("zero2", "zero3")), where
            assert (fixes["ZeRO-3's replays"] != 0) <= (lay.par.sync == "zero3"), where
            assert (fixes["images"] > 0) == (image and s == 0), where
            assert fixes["scratch"] >= 0 and fixes["gradients"] >= 0, where


def test_plan_tiers_prints_tier_1_the_corrections_and_tier_2_for_each_rank():
    """``mpitrain plan --tiers``: per rank tier 1's activations, each named correction and
    tier 2's figure, which add up as printed; the compute's parts; the step by tier. On a
    GPU, tier 1 is the answer: no corrections."""
    from mpitrain import cli
    from mpitrain.plan import peak, show, timing

    argv = ["plan", "jobs/shakespeare_gpt.toml", "-n", "2", "--set", "parallel.pp=2", "--set", "train.micro_batches=4",
            "--set", "train.precision=bf16", "--tiers"]
    args = cli.build_parser().parse_args(argv)
    assert args.tiers
    plan, source = planner.from_args(args)
    lines = show.text(plan, source, tiers=True).splitlines()
    head = lines.index("ranks | tier 1 | " + " | ".join(peak.ACTIVATION_CORRECTIONS) + " | tier 2")
    for p, row in zip(plan.ranks, lines[head + 1 : head + 3]):
        cells = row.split(" | ")
        assert cells[0] == show.ranks_text(p.ranks) and cells[-1] == show.size(p.memory["activations"])
        assert len(cells) == len(peak.ACTIVATION_CORRECTIONS) + 3
        assert cells[1 + list(peak.ACTIVATION_CORRECTIONS).index("16-bit words") + 1].startswith("+")
    assert any(line.startswith("ranks | products | elementwise") for line in lines)
    step = lines.index("tier 1 | shapes | " + " | ".join([*timing.CORRECTIONS, *timing.STEP_CORRECTIONS]) + " | tier 2")
    said = lines[step + 1].split(" | ")
    assert float(said[0]) + sum(float(x) for x in said[1:-1]) == pytest.approx(float(said[-1]), rel=0.01)
    gpu = planner.from_args(cli.build_parser().parse_args([*argv, "--hardware", "a100-80g"]))[0]
    assert "no corrections" in show.text(gpu, source, tiers=True)
    ps = planner.from_args(cli.build_parser().parse_args(["plan", "jobs/shakespeare_gpt.toml", "-n", "3", "--set",
                                                          "parallel.sync=ps", "--set", "optim.grad_clip=0"]))[0]
    assert "tier 1 has no model of parameter servers" in show.text(ps, source, tiers=True)


STEP_LAYOUTS = [("jobs/shakespeare_gpt.toml", P, sets) for P, grid in GRIDS.items() for sets in grid] + [
    (job, P, sets) for job in ("jobs/mnist_lenet.toml", "jobs/cifar10_resnet.toml") for P, sets in CNN_LAYOUTS]


@pytest.mark.parametrize("job, ranks, sets", STEP_LAYOUTS,
                         ids=lambda v: " ".join(v) or "ddp" if isinstance(v, list) else str(v))
def test_tier_2s_step_is_tier_1s_plus_its_named_corrections(job, ranks, sets):
    """Tier 2's step is tier 1's (``space.of_layout``) plus ``timing.step_corrections``:
    the compute's, the ranks' turns on shared cores where ranks outnumber them, the calls
    tier 1 does not count, the overlap walked, the bubble at tier 2's costs and simulated,
    the I/O wait; each where its cause is."""
    from mpitrain.plan import timing

    cfg = config.load(job, sets, data_needed=False)
    machine = planner.machine(hardware.load(), "this", ranks)
    plan = planner.make(cfg, ranks, machine)
    lay, textbook = plan.layout, space.of_layout(plan.layout, machine)
    fixes = timing.step_corrections(plan, textbook)
    assert list(fixes) == ["shapes", *timing.CORRECTIONS, *timing.STEP_CORRECTIONS]
    assert textbook["step"] + sum(fixes.values()) == pytest.approx(plan.time["step"], rel=1e-9)
    assert fixes["elementwise"] > 0 and fixes["op calls"] > 0 and fixes["update calls"] > 0
    assert (fixes["mixed precision"] > 0) == lay.mixed
    shared = machine.share < 1 and (lay.dp > 1 or lay.tp > 1)
    assert (fixes["ranks taking turns"] > 0) == shared
    assert (fixes["named calls"] > 0) == any(c.axis != "pp" and c.what.startswith(BYTES_CORRECTIONS)
                                             for p in plan.ranks for c in p.calls)
    assert (fixes["bubble of the corrections"] > 0) == (lay.pp > 1)  # tier 2's costs are this machine's: more
    assert fixes["schedule simulated"] == 0 or lay.pp > 1
    assert fixes["I/O wait"] >= 0
