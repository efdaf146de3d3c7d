"""MPI tier: label smoothing (``train.label_smoothing``) trains every layout as one process
does, through the trainer, in float64: the GPT under ZeRO-2 with micro-batches, on a
pipeline, and with its vocabulary sliced over tensor-parallel ranks (31 tokens: an uneven
cut, each rank's part of the mean logit summed by the target's allreduce); LeNet
data-parallel, on a pipeline and with a parameter server (one worker)."""

import pytest
from test_checkpoint import assert_close
from test_mpi_data import shared_data
from test_mpi_pipeline import gpt_cfg, lenet_cfg, text_set

from mpitrain import checkpoint, train
from mpitrain.comm import SingleComm

pytestmark = pytest.mark.same_under_any_mpi  # mpitrain's logic above MPI: MPICH's tier checks it for both

SMOOTH = "train.label_smoothing=0.1"
quiet = lambda *a: None  # noqa: E731


def world():
    from mpitrain.comm import world as w

    return w()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", [["parallel.sync=zero2", "train.micro_batches=2"],
                                    ["parallel.pp=2", "train.micro_batches=4"], ["parallel.tp=2"]],
                         ids=["zero2", "pp", "tp"])
def test_a_smoothed_gpt_trains_on_every_layout_as_one_process(layout):
    comm = world()
    if comm.size != 2:
        pytest.skip("layouts of two ranks")
    d = shared_data(comm, make=text_set)
    name = layout[0].split("=")[0].replace("parallel.", "")
    run = train.train(gpt_cfg(d, d.parent / name, SMOOTH, *layout), log=quiet, comm=comm)
    mine = d.parent / f"{name}-one-{comm.rank}"
    micro = [o for o in layout if o.startswith("train.micro_batches")]
    one = train.train(gpt_cfg(d, mine, SMOOTH, *micro), log=quiet, comm=SingleComm())
    assert run.val_loss == pytest.approx(one.val_loss, rel=1e-11)
    assert_close(checkpoint.path_for(mine, 12), checkpoint.path_for(d.parent / name, 12), rtol=1e-10, floor=1e-6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,shared", [([], []), (["parallel.pp=2", "parallel.dp=1"], ["train.micro_batches=4"]),
                                           (["parallel.sync=ps"], ["optim.grad_clip=0"])],
                         ids=["ddp", "pp", "ps"])
def test_a_smoothed_cnn_trains_data_parallel_on_a_pipeline_and_by_a_server_as_one_process(layout, shared):
    comm = world()
    if comm.size != 2:
        pytest.skip("layouts of two ranks")
    d = shared_data(comm, n=480, test=64)
    run = train.train(lenet_cfg(d, d.parent / "lenet", SMOOTH, *layout, *shared), log=quiet, comm=comm)
    mine = d.parent / f"lenet-one-{comm.rank}"
    one = train.train(lenet_cfg(d, mine, SMOOTH, *shared), log=quiet, comm=SingleComm())
    assert run.test_accuracy == one.test_accuracy
    assert run.test_loss == pytest.approx(one.test_loss, rel=1e-12)
    assert_close(checkpoint.path_for(mine, 8), checkpoint.path_for(d.parent / "lenet", 8), rtol=1e-11, floor=1e-6)
