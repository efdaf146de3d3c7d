"""MPI tier: the strategies composed on one grid, each combination against one process.

ZeRO over the replicas of a pipeline stage, of a tensor slice, or of a slice of a stage
(Megatron-LM's distributed optimizer): the GPT trained through the trainer in float64
(dropout, clipping, a tied embedding, 12 steps) reaches one process's validation loss
and checkpoint, its optimizer state written from the shards into the whole model's
layout. Rank 0 trains the one-process reference once; every rank compares with it.
"""

import json
import os
import shutil

import pytest

LONG = os.environ.get("MPITRAIN_COMPOSE") == "all"  # the longer tier: every combination, not the pairwise cover

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
        pytest.skip("the longer tier (MPITRAIN_COMPOSE=all): the pairwise cover runs ZB-H1")
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
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_stages_and_slices_is_one_process_in_the_same_precision(precision):
    """pp 2 x tp 2 in bf16 (and fp16, its loss scaled on the last stage) against one
    process in the same precision: not bit-equal, because the tied embedding's two
    gradients are each rounded to 16 bits on their own stage before their float32 sum
    (one process rounds their sum as it accumulates); within 1e-4 of its loss."""
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
    grid = trainer.train(gpt_cfg(d, d.parent / f"mixed-{precision}", *mixed, "parallel.pp=2", "parallel.tp=2"),
                         log=lambda *a: None, comm=comm).val_loss
    assert grid == pytest.approx(one, abs=1e-4), precision
