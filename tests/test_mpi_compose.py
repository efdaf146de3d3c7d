"""MPI tier: the strategies composed on one grid, each combination against one process.

ZeRO over the replicas of a pipeline stage, of a tensor slice, or of a slice of a stage
(Megatron-LM's distributed optimizer): the GPT trained through the trainer in float64
(dropout, clipping, a tied embedding, 12 steps) reaches one process's validation loss
and checkpoint, its optimizer state written from the shards into the whole model's
layout. Rank 0 trains the one-process reference once; every rank compares with it.
"""

import pytest

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


@pytest.mark.mpi(min_size=8)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sync", ["zero1", "zero2"])
def test_zero_over_the_replicas_of_a_slice_of_a_stage_equals_one_process(reference, sync):
    if world().size != 8:
        pytest.skip("the 2 x 2 x 2 grid")
    equals_one_process(reference, f"{sync}-cube", f"parallel.sync={sync}", "parallel.tp=2", *PP)
