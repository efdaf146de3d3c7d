"""MPI tier: the strategies composed on one grid, each combination against one process.

ZeRO over the replicas of a pipeline stage, of a tensor slice, or of a slice of a stage
(Megatron-LM's distributed optimizer): the GPT trained through the trainer in float64
(dropout, clipping, a tied embedding, 12 steps) reaches one process's validation loss
and checkpoint, its optimizer state written from the shards into the whole model's
layout. Rank 0 trains the one-process reference once; every rank compares with it.
"""

import json
import shutil

import numpy as np
import pytest

from conftest import LONGER as LONG  # the longer tier: every combination, not the pairwise cover

FOUR = ("model.n_head=4", "model.bias=true")
PP = ("parallel.pp=2", "train.micro_batches=4")


def world():
    from mpitrain.comm import world as w

    return w()


@pytest.fixture(scope="module")
def reference():
    """The shared data and the one-process run's directory and validation loss."""
    from test_mpi_data import shared_data
    from test_mpi_pipeline import gpt_cfg, text_set

    from mpitrain import train as trainer
    from mpitrain.comm import SingleComm

    comm = world()
    d = shared_data(comm, make=text_set)
    one = d.parent / "compose-one"
    loss = None
    if comm.rank == 0:
        loss = trainer.train(gpt_cfg(d, one, *FOUR), log=lambda *a: None, comm=SingleComm()).val_loss
    return d, one, comm.bcast(loss)


def equals_one_process(reference, name: str, *layout: str) -> None:
    from test_checkpoint import assert_close
    from test_mpi_pipeline import gpt_cfg

    from mpitrain import checkpoint
    from mpitrain import train as trainer

    d, one, loss = reference
    comm = world()
    run = d.parent / name
    grid = trainer.train(gpt_cfg(d, run, *layout, *FOUR), log=lambda *a: None, comm=comm)
    assert grid.val_loss == pytest.approx(loss, rel=1e-12), name
    assert_close(checkpoint.path_for(one, 12), checkpoint.path_for(run, 12), rtol=1e-10, floor=1e-6)


def resumes_elsewhere(reference, name: str, to: str, *layout: str) -> None:
    """Run ``name``'s step-6 checkpoint, resumed on another ``layout`` (``to``: its
    directory's name; no layout: one process, on rank 0), ends at one process's step 12."""
    from test_checkpoint import assert_close
    from test_mpi_pipeline import gpt_cfg

    from mpitrain import checkpoint
    from mpitrain import train as trainer
    from mpitrain.comm import SingleComm

    d, one, _ = reference
    comm = world()
    moved = d.parent / to
    if comm.rank == 0:
        (moved / "checkpoints").mkdir(parents=True)
        shutil.copy(checkpoint.path_for(d.parent / name, 6), moved / "checkpoints")
    comm.barrier()
    if layout or comm.rank == 0:
        trainer.train(gpt_cfg(d, moved, *layout, *FOUR), log=lambda *a: None, comm=comm if layout else SingleComm(),
                      resume=True)
        assert_close(checkpoint.path_for(one, 12), checkpoint.path_for(moved, 12), rtol=1e-10, floor=1e-6)
    comm.barrier()


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sync", ["zero1", "zero2"])
@pytest.mark.parametrize("grid", ["dp2-pp2", "dp2-tp2", "dp2-tp2-sp"])
def test_zero_over_the_replicas_of_a_stage_or_a_slice_equals_one_process(reference, sync, grid):
    if world().size != 4:
        pytest.skip("the 2 x 2 grids")
    layout = {"dp2-pp2": PP, "dp2-tp2": ("parallel.tp=2",),
              "dp2-tp2-sp": ("parallel.tp=2", "parallel.sequence_parallel=true")}[grid]
    equals_one_process(reference, f"{sync}-{grid}", f"parallel.sync={sync}", *layout)
    if grid == "dp2-tp2-sp":  # its shards, resumed as the other ZeRO stage on the other 2 x 2 grid
        other = "zero2" if sync == "zero1" else "zero1"
        resumes_elsewhere(reference, f"{sync}-{grid}", f"{sync}-{grid}-as-{other}-dp2-pp2",
                          f"parallel.sync={other}", *PP)


@pytest.mark.mpi(min_size=8)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sync", ["zero1", "zero2"])
def test_zero_over_the_replicas_of_a_slice_of_a_stage_equals_one_process(reference, sync):
    if world().size != 8:
        pytest.skip("the 2 x 2 x 2 grid")
    equals_one_process(reference, f"{sync}-cube", f"parallel.sync={sync}", "parallel.tp=2", *PP)
    resumes_elsewhere(reference, f"{sync}-cube", f"{sync}-cube-on-one")  # ddp on one process


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("grid", ["dp2-tp2", "dp2-pp2", "dp2-pp2-step", "dp2-pp2-interleaved", "dp2-pp2-zb-h1"])
def test_zero3_over_the_replicas_of_a_slice_or_a_stage_equals_one_process(reference, grid):
    """ZeRO-3 with tensor slices (FSDP x TP, torchtitan's) and with pipeline stages: each
    slice's or stage's layers gathered over its replicas as they run, freed after each
    use (``gather = "layer"``) or kept for the step and reduce-scattered once
    (``"step"``); the tied embedding is a group of its own on both stages, so both hold
    the same piece of it."""
    if world().size != 4:
        pytest.skip("the 2 x 2 grids")
    if grid not in ("dp2-tp2", "dp2-pp2") and not LONG:
        pytest.skip("the longer tier (MPITRAIN_LONGER=1)")
    layout = {"dp2-tp2": ("parallel.tp=2", "parallel.sequence_parallel=true"), "dp2-pp2": PP,
              "dp2-pp2-step": (*PP, "parallel.gather=step"),
              "dp2-pp2-interleaved": (*PP, "parallel.schedule=interleaved", "parallel.chunks=2", "parallel.gather=step"),
              "dp2-pp2-zb-h1": (*PP, "parallel.schedule=zb-h1")}[grid]
    equals_one_process(reference, f"zero3-{grid}", "parallel.sync=zero3", *layout)
    if grid == "dp2-tp2":  # its shards, on one process
        resumes_elsewhere(reference, f"zero3-{grid}", f"zero3-{grid}-on-one")


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_each_pipeline_schedule_with_zero1_equals_one_process_and_zb_h1_moves_to_one(reference, schedule):
    """ZeRO-1 over the replicas of each stage, under each schedule; the ZB-H1 run's step-6
    checkpoint resumed on one process, its saved config changed by ``--set parallel.pp=1``
    alone (its schedule is dropped with a note), ends at one process's step 12."""
    from test_checkpoint import assert_close

    from mpitrain import checkpoint, config
    from mpitrain import train as trainer
    from mpitrain.comm import SingleComm

    if world().size != 4:
        pytest.skip("dp 2 x pp 2")
    if schedule != "zb-h1" and not LONG:
        pytest.skip("the longer tier (MPITRAIN_LONGER=1): the pairwise cover runs ZB-H1")
    chunks = ("parallel.chunks=2",) if schedule == "interleaved" else ()
    name = f"zero1-{schedule}"
    equals_one_process(reference, name, "parallel.sync=zero1", f"parallel.schedule={schedule}", *chunks, *PP)
    if schedule != "zb-h1":
        return
    d, one, _ = reference
    comm = world()
    if comm.rank == 0:
        saved = checkpoint.check(checkpoint.path_for(d.parent / name, 6))["json"]["config"]
        moved = d.parent / f"{name}-on-one"
        (moved / "checkpoints").mkdir(parents=True)
        shutil.copy(checkpoint.path_for(d.parent / name, 6), moved / "checkpoints")
        cfg = config.from_saved(json.loads(json.dumps(saved)), ["parallel.pp=1", f"run.dir={json.dumps(str(moved))}"])
        assert [n.split(" of ")[0] for n in cfg.notes] == ["note: parallel.schedule = 'zb-h1'"]
        trainer.train(cfg, log=lambda *a: None, warn=lambda *a: None, comm=SingleComm(), resume=True)
        assert_close(checkpoint.path_for(one, 12), checkpoint.path_for(moved, 12), rtol=1e-10, floor=1e-6)
    comm.barrier()


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(240)
def test_sequence_parallelism_on_pipeline_stages_equals_one_process(reference):
    """pp 2 x tp 2, the sequence sliced between the blocks: what a stage sends the next is
    its slice of the sequence, to the same slice of the next stage."""
    if world().size != 4:
        pytest.skip("pp 2 x tp 2")
    equals_one_process(reference, "sp-pp2-tp2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=1",
                       *PP)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision, extra", [("bf16", ("parallel.sequence_parallel=true", "parallel.schedule=gpipe")),
                                              ("fp16", ("parallel.schedule=zb-h1",))])
def test_mixed_precision_on_stages_and_slices_is_one_process_in_the_same_precision(precision, extra):
    """pp 2 x tp 2 in bf16 (sequence parallel, GPipe) and fp16 (its loss scaled on the
    last stage; ZB-H1) against one process in the same precision: not bit-equal, because
    the tied embedding's two gradients are each rounded to 16 bits on their own stage
    before their float32 sum (one process rounds their sum as it accumulates); within
    1e-4 of its loss."""
    from test_mpi_data import shared_data
    from test_mpi_pipeline import gpt_cfg, text_set

    from mpitrain import train as trainer
    from mpitrain.comm import SingleComm

    comm = world()
    if comm.size != 4:
        pytest.skip("pp 2 x tp 2")
    d = shared_data(comm, make=text_set)
    mixed = (*FOUR, "train.dtype='float32'", f"train.precision='{precision}'", "train.micro_batches=4")
    one = None
    if comm.rank == 0:
        one = trainer.train(gpt_cfg(d, d.parent / f"mixed-one-{precision}", *mixed), log=lambda *a: None,
                            comm=SingleComm()).val_loss
    one = comm.bcast(one)
    grid = trainer.train(gpt_cfg(d, d.parent / f"mixed-{precision}", *mixed, "parallel.pp=2", "parallel.tp=2", *extra),
                         log=lambda *a: None, comm=comm).val_loss
    assert grid == pytest.approx(one, abs=1e-4), precision


# ------------------------------------------------------------------ ZeRO in mixed precision
MIXED = {"dp2-pp2": PP, "dp2-tp2": ("parallel.tp=2",), "cube": ("parallel.tp=2", *PP)}


def mixed_run(name: str, precision: str, *layout: str, resume: bool = False, config: bool = False):
    """The GPT in ``precision`` (``fp32``: float32 throughout; else float32 masters)
    trained on ``layout``; its directory and result (and ``config``: its config)."""
    from test_mpi_data import shared_data
    from test_mpi_pipeline import gpt_cfg, text_set

    from mpitrain import train as trainer

    comm = world()
    d = shared_data(comm, make=text_set)
    run = d.parent / name
    cfg = gpt_cfg(d, run, *FOUR, "train.dtype='float32'", f"train.precision='{precision}'", *layout)
    result = trainer.train(cfg, log=lambda *a: None, warn=lambda *a: None, comm=comm, resume=resume)
    return (run, result, cfg) if config else (run, result)


def model_state_is_zeros_formula(cfg, result) -> None:
    """Every rank's model state, counted from its arrays (``result.states``:
    :func:`mpitrain.observe.memory.model_state`), is the planner's to the byte, and the
    plan's is the ZeRO paper's mixed precision for a part of ``n`` numbers on ``N_d``
    replicas: 2n + 2n + 12 n_d bytes (ZeRO-1) or 2n + 2 n_d + 12 n_d (ZeRO-2), where the
    replicas' shards ``n_d`` add up to the part (so ``2 + 2 + 12/N_d`` and
    ``2 + (2 + 12)/N_d`` bytes per parameter), or 2 n_d + 2 n_d + 12 n_d (ZeRO-3:
    ``(2 + 2 + 12)/N_d``), plus Adam's 8-byte step count per piece."""
    from mpitrain import plan as planner
    from mpitrain.plan import hardware
    from mpitrain.plan.data import resolve

    comm = world()
    plan = planner.make(cfg, comm.size, planner.machine(hardware.load(), "this", comm.size), resolve(cfg))
    lay, by_rank = plan.layout, {r: p for p in plan.ranks for r in p.ranks}
    if comm.rank != 0:  # the run's result holds every rank's states on rank 0
        return
    assert len(result.states) == comm.size
    for rank, (state, _) in enumerate(result.states):
        m, n = by_rank[rank].memory, state["parameters"]
        shard = m["masters"] // 4  # the numbers of this rank's shard: a float32 master each
        assert (state["param_bytes"], state["grad_bytes"], state["optim_bytes"]) == \
            (m["parameters"], m["gradients"], m["optimizer state"] + m["masters"]), rank
        zero3 = cfg.parallel.sync == "zero3"
        assert m["parameters"] == 2 * (shard if zero3 else n), rank
        assert m["gradients"] == 2 * (n if cfg.parallel.sync == "zero1" else shard), rank
        counters = m["optimizer state"] - 8 * shard  # two float32 moments a number, then the step counts
        assert counters > 0 and counters % 8 == 0, rank
    for s in range(lay.pp):
        for r in range(lay.tp):
            ranks = [lay.rank_of(s, d, r) for d in range(lay.dp)]
            assert sum(by_rank[k].memory["masters"] // 4 for k in ranks) == result.states[ranks[0]][0]["parameters"]


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision, sync, grid, clip", [
    ("fp16", "zero1", "dp2-pp2", 0.0), ("bf16", "zero2", "dp2-tp2", 1.0), ("bf16", "zero1", "cube", 1.0),
    ("fp16", "zero3", "dp2-pp2", 1.0),
    # the longer tier: the pairs they make meet above (ZeRO-3 x tp, 16 bits x the cube)
    pytest.param("fp16", "zero2", "cube", 0.0, marks=pytest.mark.longer),
    pytest.param("bf16", "zero3", "dp2-tp2", 0.0, marks=pytest.mark.longer),
    pytest.param("bf16", "zero3", "cube", 0.0, marks=pytest.mark.longer)])
def test_zero_in_mixed_precision_is_ddp_in_the_same_precision_and_its_checkpoint_moves(precision, sync, grid, clip):
    """ZeRO-1 and ZeRO-2 over the replicas of a stage or a slice, in 16 bits with sharded
    float32 masters, against ddp on the same grid in the same precision. Without clipping
    they are bit-equal: the sums are the same float32 sums of the same 16-bit numbers
    (MPI's reduce-scatter of a float32 copy, as ddp's allreduce), the updates elementwise.
    With clipping the whole model's norm is summed in another order (the shards' pieces,
    not whole arrays), so its last bit, and with it a master's, may differ: equal to 1e-6.
    Each checkpoint holds the masters gathered whole and the moments in the whole model's
    layout, as ddp's. (ZeRO-2's ``"sharded"`` micro-batches would round each micro-batch's
    sum on its own: on the pipeline it accumulates in ``"full"``, as ddp does.) The bf16 ZeRO-2 run's step-6
    checkpoint then resumes in float32 as ZeRO-3 on 4 ranks and ends within bf16's reach
    of the run that never moved. Every rank's model state is the ZeRO paper's formula
    (:func:`model_state_is_zeros_formula`)."""
    from test_checkpoint import assert_close, assert_identical

    from mpitrain import checkpoint

    size = 8 if grid == "cube" else 4
    if world().size != size:
        pytest.skip(f"{grid} runs on {size} ranks")
    layout = (*MIXED[grid], f"optim.grad_clip={clip}")
    full = {"zero2": ("parallel.accumulate=full",) if grid == "cube" else (),  # micro-batches added whole
            "zero3": ("parallel.gather=step",) if grid != "dp2-tp2" else ()}.get(sync, ())
    ddp, a = mixed_run(f"mixed-ddp-{precision}-{grid}-{clip}", precision, *layout)
    zero, b, cfg = mixed_run(f"mixed-{sync}-{precision}-{grid}-{clip}", precision, f"parallel.sync={sync}", *full,
                             *layout, config=True)
    model_state_is_zeros_formula(cfg, b)
    if sync == "zero3":  # not bit-equal: the tied embedding's two gradients are rounded into its 16-bit sum
        # in the other order (one process's backward meets the lookup's first, ZeRO-3's the head's unit; a
        # CNN's ZeRO-3 is bit-equal: test_the_cnn_sharded_on_pipeline_stages_equals_one_process)
        assert b.val_loss == pytest.approx(a.val_loss, abs=1e-3), (a.val_loss, b.val_loss)
        return
    for step in (6, 12):
        if clip:
            assert_close(checkpoint.path_for(ddp, step), checkpoint.path_for(zero, step), rtol=1e-6, floor=1e-6)
        else:
            assert_identical(checkpoint.path_for(ddp, step), checkpoint.path_for(zero, step))
    assert b.val_loss == (pytest.approx(a.val_loss, rel=1e-6) if clip else a.val_loss)
    if (precision, sync, grid) != ("bf16", "zero2", "dp2-tp2"):
        return
    moved = zero.parent / f"{zero.name}-as-fp32-zero3"
    if world().rank == 0:
        (moved / "checkpoints").mkdir(parents=True)
        shutil.copy(checkpoint.path_for(zero, 6), moved / "checkpoints")
    world().barrier()
    _, c = mixed_run(moved.name, "fp32", "parallel.sync=zero3", resume=True)
    assert c.val_loss == pytest.approx(b.val_loss, abs=2e-4), (b.val_loss, c.val_loss)


@pytest.mark.mpi(min_size=8)
@pytest.mark.timeout(240)
def test_an_fp16_overflow_on_one_rank_skips_the_same_step_on_all_eight(monkeypatch):
    """fp16, ZeRO-1 on dp 2 x pp 2 x tp 2: one rank (a slice of the last stage's second
    replica) finds an infinity in its shard of the gradients at step 3. Every rank skips
    that step and only that one (the loop's agreement), every rank halves its loss scale
    there, and the run goes on to a finite loss with the ranks' parameters identical."""
    from mpitrain import precision
    from mpitrain.train import parts

    comm = world()
    if comm.size != 8:
        pytest.skip("the 2 x 2 x 2 grid")
    finish, seen = parts.PartSync.finish, {"calls": 0}

    def overflowing(self):
        finish(self)
        seen["calls"] += 1
        if comm.rank == 7 and seen["calls"] == 4:  # step 3 (steps count from 0)
            next(g for g in self.inner.held().values() if g.size)[0] = np.inf
    monkeypatch.setattr(parts.PartSync, "finish", overflowing)
    updates, scales = [], []
    update = precision.LossScaler.update

    def recorded(self, overflow):
        updates.append(bool(overflow))
        update(self, overflow)
        scales.append(self.scale)
    monkeypatch.setattr(precision.LossScaler, "update", recorded)
    _, result = mixed_run("fp16-overflow", "fp16", "parallel.sync=zero1", *MIXED["cube"])
    everyone = comm.allgather((updates, scales))
    assert all(theirs == everyone[0] for theirs in everyone), everyone
    assert updates == [step == 3 for step in range(12)], updates
    assert scales[2] == 2.0**16 and scales[3] == 2.0**15 and scales[-1] == 2.0**15
    assert np.isfinite(result.val_loss)


# ------------------------------------------------------------------ the CNN
@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sync, precision", [("zero1", "fp32"), ("zero2", "fp32"), ("zero3", "fp32"), ("zero1", "bf16"),
                                             ("zero3", "bf16")])
def test_the_cnn_sharded_on_pipeline_stages_equals_one_process(sync, precision):
    """LeNet (convolutions, pools, a classifier with dropout; augmented) on dp 2 x pp 2,
    its optimizer state (and gradients, and parameters) sharded over each stage's two
    replicas: one process's test loss and checkpoint in float64. In bf16 (float32
    masters) ZeRO-1, and ZeRO-3 gathering once a step, are bit-equal to ddp on the same
    grid (the same float32 sums of the same 16-bit gradients; ZeRO-3's ``"layer"``
    gathers are not: they sum each micro-batch over the replicas before adding the
    micro-batches), but not to one process: each replica sums its own micro-batches'
    16-bit gradients before the replicas' float32 sum, where one process rounds the
    running sum of all of them; after 8 steps its test loss is within 1e-3, its
    parameters within 2% of each array's largest."""
    from test_checkpoint import assert_close, assert_identical
    from test_mpi_data import shared_data
    from test_mpi_pipeline import lenet_cfg

    from mpitrain import checkpoint
    from mpitrain import train as trainer
    from mpitrain.comm import SingleComm

    comm = world()
    if comm.size != 4:
        pytest.skip("dp 2 x pp 2")
    if (sync, precision) in (("zero1", "fp32"), ("zero2", "fp32")) and not LONG:
        pytest.skip("the longer tier (MPITRAIN_LONGER=1)")
    d = shared_data(comm, n=480, test=64)
    kind = ("train.dtype='float32'", f"train.precision='{precision}'") if precision != "fp32" else ()
    once = ("parallel.gather=step",) if sync == "zero3" and precision != "fp32" else ()
    both = ("train.micro_batches=4", "data.flip=true", *kind)
    name = f"lenet-{sync}-{precision}"

    def on_the_grid(run, sync):
        return trainer.train(lenet_cfg(d, d.parent / run, *both, "parallel.pp=2", f"parallel.sync={sync}",
                                       *(once if sync == "zero3" else ())), log=lambda *a: None, comm=comm)
    grid = on_the_grid(name, sync)
    one, mine = None, d.parent / f"{name}-one"
    if comm.rank == 0:
        one = trainer.train(lenet_cfg(d, mine, *both), log=lambda *a: None, comm=SingleComm()).test_loss
    one = comm.bcast(one)
    fp32 = precision == "fp32"
    assert grid.test_loss == (pytest.approx(one, rel=1e-12) if fp32 else pytest.approx(one, abs=1e-3))
    if not fp32:
        on_the_grid(f"{name}-ddp", "ddp")
    if comm.rank == 0:
        ours = checkpoint.path_for(d.parent / name, 8)
        assert_close(checkpoint.path_for(mine, 8), ours, rtol=1e-10 if fp32 else 2e-2, floor=1e-6)
        if not fp32:
            assert_identical(checkpoint.path_for(d.parent / f"{name}-ddp", 8), ours)
    comm.barrier()


# ------------------------------------------------------------------ 16 bits against float32, 50 steps
@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("sync, grid", [("zero2", "dp2-pp2"), ("zero3", "dp2-tp2"), ("zero1", "cube")])
def test_sixteen_bits_on_the_grid_stay_near_float32_after_fifty_steps(precision, sync, grid):
    """The longer tier: 50 steps of the GPT in ``precision`` (float32 masters, the loss
    scaled in fp16) on ``grid`` with ``sync``, against float32 on one process: the
    validation loss within 0.02. The difference is rounding's and the loss scale's, not
    the layout's (the layouts equal one process in float32): fp16's scale starts at 2^16
    and the first steps overflow and are skipped while it comes down (as with PyTorch's
    GradScaler), so fp16 ends about 0.01 above float32, bf16 within 1e-3."""
    from test_mpi_data import shared_data
    from test_mpi_pipeline import gpt_cfg, text_set

    from mpitrain import train as trainer
    from mpitrain.comm import SingleComm

    comm = world()
    size = 8 if grid == "cube" else 4
    if comm.size != size:
        pytest.skip(f"{grid} runs on {size} ranks")
    if not LONG:
        pytest.skip("the longer tier (MPITRAIN_LONGER=1)")
    d = shared_data(comm, make=text_set)
    longer = (*FOUR, "train.dtype='float32'", "train.steps=50", "train.eval_interval=50", "run.checkpoint_interval=50",
              "optim.warmup_steps=5")
    one = None
    if comm.rank == 0:
        one = trainer.train(gpt_cfg(d, d.parent / "fifty-fp32", *longer), log=lambda *a: None,
                            comm=SingleComm()).val_loss
    one = comm.bcast(one)
    grid_run = trainer.train(gpt_cfg(d, d.parent / f"fifty-{precision}-{sync}-{grid}", *longer,
                                     f"train.precision='{precision}'", f"parallel.sync={sync}", *MIXED[grid]),
                             log=lambda *a: None, warn=lambda *a: None, comm=comm).val_loss
    assert grid_run == pytest.approx(one, abs=0.02), (one, grid_run)
