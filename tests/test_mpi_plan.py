"""MPI tier: every counted quantity the planner predicts equals what the same run counts,
per rank, for every strategy and combination: the bytes of parameters, gradients,
optimizer state and the optimizer's work array, the bytes each communicator sent per
step, the FLOPs of a step, and the pipeline's idle slots; and its storage need is the
I/O table's at the same samples/s (``mpitrain plan --validate``'s comparison, :mod:`mpitrain.plan.validate`);
and the heap, at rest between steps and a step's peak above it (``tracemalloc``), within
:data:`~mpitrain.plan.validate.HEAP_TOLERANCE`. Time is an estimate: ``mpitrain plan
--validate`` and ``mpitrain bench plan`` print it, tests do not assert it."""

import pytest
from test_data import text_set
from test_mpi_data import shared_data

from mpitrain import config
from mpitrain import plan as planner
from mpitrain.plan import hardware, peak, validate
from mpitrain.plan.data import resolve

LAYOUTS = {  # ranks -> {name: overrides}
    2: {"ddp": [], "ddp, ring, bf16 on the wire": ["parallel.allreduce='ring'", "parallel.wire='bf16'"],
        "zero1": ["parallel.sync='zero1'"],
        "zero2, 2 micro-batches": ["parallel.sync='zero2'", "train.micro_batches=2", "parallel.bucket_mb=0.002"],
        "zero2, accumulated in full": ["parallel.sync='zero2'", "train.micro_batches=2", "parallel.accumulate='full'"],
        "zero3": ["parallel.sync='zero3'"],
        "gpipe": ["parallel.pp=2", "parallel.schedule='gpipe'", "train.micro_batches=4"],
        "1f1b": ["parallel.pp=2", "train.micro_batches=4"],
        "zb-h1": ["parallel.pp=2", "parallel.schedule='zb-h1'", "train.micro_batches=4"],
        "zb-h1, checkpointing": ["parallel.pp=2", "parallel.schedule='zb-h1'", "train.micro_batches=4",
                                 "model.checkpoint_activations=true"],
        "interleaved": ["parallel.pp=2", "parallel.schedule='interleaved'", "parallel.chunks=2",
                        "train.micro_batches=4", "model.n_layer=4"],
        "tp": ["parallel.tp=2"], "tp, sequence parallel": ["parallel.tp=2", "parallel.sequence_parallel=true"],
        "bf16": ["train.precision='bf16'"], "checkpointing": ["model.checkpoint_activations=true"],
        "bf16 on pp2": ["parallel.pp=2", "train.precision='bf16'", "train.micro_batches=2"],
        "bf16 on tp2, sequence parallel": ["parallel.tp=2", "parallel.sequence_parallel=true",
                                           "train.precision='bf16'"],
        "tp, checkpointing": ["parallel.tp=2", "model.checkpoint_activations=true"],
        "bf16, checkpointing": ["train.precision='bf16'", "model.checkpoint_activations=true"]},
    3: {"ps": ["parallel.sync='ps'", "optim.grad_clip=0.0"], "zero3, uneven shards": ["parallel.sync='zero3'",
                                                                                     "train.global_batch_size=6"]},
    4: {"zero3 on 4": ["parallel.sync='zero3'"],  # (ddp, ZeRO-1 and ZeRO-2 on dp 4 count as on dp 2: the 2-rank tier's)
        "dp2 x pp2": ["parallel.pp=2", "train.micro_batches=2"],
        "pp2 x tp2": ["parallel.pp=2", "parallel.tp=2", "train.micro_batches=4"],
        "dp2 x tp2": ["parallel.tp=2"],
        "zero1 on dp2 x pp2": ["parallel.pp=2", "parallel.sync='zero1'", "train.micro_batches=2"],
        "zero2 on dp2 x tp2, sequence parallel": ["parallel.tp=2", "parallel.sync='zero2'",
                                                  "parallel.sequence_parallel=true"],
        "ps, 2 servers": ["parallel.sync='ps'", "parallel.servers=2", "optim.grad_clip=0.0",
                          "train.global_batch_size=6"],
        "zero3 on dp2 x tp2, sequence parallel": ["parallel.tp=2", "parallel.sync='zero3'",
                                                  "parallel.sequence_parallel=true"],
        "zero3 on dp2 x pp2, zb-h1": ["parallel.pp=2", "parallel.sync='zero3'", "parallel.schedule='zb-h1'",
                                      "train.micro_batches=2"],
        "zero3 on dp2 x pp2 in fp16, gathered per step": ["parallel.pp=2", "parallel.sync='zero3'",
                                                          "parallel.gather='step'", "train.precision='fp16'",
                                                          "train.micro_batches=2"]},
}

# layouts whose step's peak the planner does not walk yet (their counted quantities are held all the same).
# ZB-H1 with checkpointing: a split backward of a replayed block holds more than the walk counts, mid-op
# (measured on 2 ranks, 6 runs: stage 1 +3.9% above "at most" in a warm process, +6.0% in a cold one;
# stage 0 +2.1%, and once +5.45% in CI's MPI tier); ZB-H1 without checkpointing is +2.2% on its last stage
HEAP_NOT_WALKED: dict = {"zb-h1, checkpointing": "the split backward of a replayed block, mid-op"}


def gpt(data, overrides):
    return config.from_dict({
        "model": {"name": "gpt", "n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64},  # arrays, not objects
        "data": {"path": str(data)}, "optim": {"name": "adamw", "lr": 3e-3, "grad_clip": 1.0},
        "train": {"global_batch_size": 8, "steps": 4, "threads": 1}}, overrides)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted({n for layouts in LAYOUTS.values() for n in layouts}))
def test_every_counted_prediction_is_what_the_run_counts(name):
    from mpitrain.comm import world

    comm = world()
    if name not in LAYOUTS.get(comm.size, {}):
        pytest.skip(f"layout {name!r} runs at {[n for n, ls in LAYOUTS.items() if name in ls]} ranks")
    cfg = gpt(shared_data(comm, make=text_set, n=3000), LAYOUTS[comm.size][name])
    machine = planner.machine(hardware.load(), "this", comm.size)
    plan = planner.make(cfg, comm.size, machine, resolve(cfg))
    result, _, storage = validate.measure(cfg, comm, 4, trace=True)
    if comm.rank != 0:
        return
    rows = validate.compare(plan, result, storage)
    exact = [row for row in rows if validate.tolerance(row[1]) == 0]
    assert len(exact) >= 4 * comm.size
    servers = cfg.parallel.sync == "ps"  # rank 0 serves: the workers' I/O table is printed by worker 0
    assert servers or any(row[1].startswith("storage need") for row in exact)  # the I/O table's, at its samples/s
    wrong = [row for row in exact if row[2] != row[3]]
    assert not wrong, validate.table(wrong)[0]
    heap = [row for row in rows if row[1].startswith("heap")]
    assert len(heap) >= 2 * (comm.size - (cfg.parallel.servers if servers else 0))  # a server's is not traced
    off = [row for row in heap if not validate.holds(*row[1:]) and not (name in HEAP_NOT_WALKED and "peak" in row[1])]
    assert not off, validate.table(off)[0]


CNN_LAYOUTS = {"zero3": ["parallel.sync='zero3'"], "1f1b": ["parallel.pp=2", "train.micro_batches=4"]}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(CNN_LAYOUTS))
def test_a_cnns_heap_holds_under_zero3_and_on_every_pipeline_stage(name):
    """A narrow ResNet-8 on 32x32 RGB images, 2 ranks: ZeRO-3 replays each layer (the
    engine holds a replayed layer's output gradient while its private graph makes its
    own); on 1F1B's later stage, which takes activations, no images are prepared, and each
    stage's peak lies between its bounds: none or its last sends still in flight."""
    from mpitrain.comm import world

    comm = world()
    if comm.size != 2:
        pytest.skip("layouts of two ranks")
    d = shared_data(comm, n=256, test=32, shard_mb=1, shape=(32, 32, 3))
    cfg = config.from_dict({"model": {"name": "resnet", "widths": [8, 16, 32]}, "data": {"path": str(d)},
                            "optim": {"name": "sgd", "lr": 0.1},
                            "train": {"global_batch_size": 32, "steps": 4, "threads": 1}}, CNN_LAYOUTS[name])
    plan = planner.make(cfg, comm.size, planner.machine(hardware.load(), "this", comm.size), resolve(cfg))
    result, _, storage = validate.measure(cfg, comm, 4, trace=True)
    if comm.rank == 0:  # a stage's sends and ZeRO-3's reduce-scatter in flight depend on the messages' timing
        heap = [row for row in validate.compare(plan, result, storage) if row[1].startswith("heap peak above rest")]
        assert len(heap) == 2 * 2 and all(validate.holds(*row[1:]) for row in heap), validate.table(heap)[0]
        assert all(row[1].endswith((", at least", ", at most")) for row in heap)  # its bounds


@pytest.mark.mpi(min_size=2)
def test_zero2s_heap_bound_holds_when_a_rank_runs_ahead(monkeypatch):
    """Rank 0 starts each micro-batch's first bucket 0.3 s late, so rank 1 runs its next
    micro-batch's backward with the previous one's buckets still in flight (its tests
    fail until rank 0 has started them): the most that holds is within "at most"."""
    import time

    from mpitrain.comm import world
    from mpitrain.parallel import zero

    comm = world()
    if comm.size != 2:
        pytest.skip("the skew is set up between two ranks")
    if comm.rank == 0:
        start = zero.Zero2._start

        def late(self, i):
            if i == 0:
                time.sleep(0.3)  # long enough that rank 1 runs ahead even on a busy machine
            start(self, i)

        monkeypatch.setattr(zero.Zero2, "_start", late)
    cfg = gpt(shared_data(comm, make=text_set, n=3000), LAYOUTS[2]["zero2, 2 micro-batches"])
    machine = planner.machine(hardware.load(), "this", comm.size)
    plan = planner.make(cfg, comm.size, machine, resolve(cfg))
    held = peak._zero2_held

    def unaware_of_the_previous(lay, layers, after, in_flight, later=False):
        return held(lay, layers, after, in_flight)

    monkeypatch.setattr(peak, "_zero2_held", unaware_of_the_previous)
    unaware = planner.make(cfg, comm.size, machine, resolve(cfg))  # the bound without the previous buckets
    result, _, storage = validate.measure(cfg, comm, 4, trace=True)
    if comm.rank != 0:
        return
    rows = validate.compare(plan, result, storage)
    most, before = ([row for row in validate.compare(p, result, storage) if row[1] == "heap peak above rest, at most"]
                    for p in (plan, unaware))
    assert len(most) == 2
    assert all(validate.holds(*row[1:]) for row in most), validate.table(most)[0]
    heap = validate.table([row for row in rows if row[1].startswith("heap")])[0]
    assert before[1][3] > before[1][2] and before[1][2] < most[1][2], heap  # rank 1 held them: above the bound without
