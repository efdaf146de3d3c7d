"""MPI tier: the shard reader and data errors across real ranks (run under mpiexec -n 2 and 4)."""

import tempfile
from pathlib import Path

import numpy as np
import pytest
from test_data import damaged, image_set

from mpitrain import config, train
from mpitrain.data import DataError, ShardReader, open_dataset
from mpitrain.train import build

pytestmark = pytest.mark.same_under_any_mpi  # mpitrain's logic above MPI: MPICH's tier checks it for both


def shared_dir(comm):
    """A temporary directory made by rank 0 and known to every rank."""
    path = tempfile.mkdtemp(prefix="mpitrain-test-") if comm.rank == 0 else None
    return Path(comm.bcast(path))


def shared_data(comm, make=image_set, **sizes) -> Path:
    """A shard set written by rank 0 (``make(path, **sizes)``) into ``<shared dir>/d``,
    ready on every rank when this returns."""
    d = shared_dir(comm) / "d"
    if comm.rank == 0:
        make(d, **sizes)
    comm.barrier()
    return d


@pytest.mark.mpi(min_size=1)
def test_epoch_union_and_global_batches_across_ranks():
    from mpitrain.comm import world

    comm = world()
    d = shared_data(comm, n=1003)
    split = open_dataset(d).split("train")
    B = 64  # divisible by 1, 2 and 4
    for drop_last in (False, True):
        mine = [b.index for b in ShardReader(split, rank=comm.rank, size=comm.size, global_batch=B, seed=11,
                                             drop_last=drop_last, buffer_mb=0.01).epoch(2)]
        everyone = comm.gather(mine)
        if comm.rank == 0:
            steps = len(everyone[0])
            assert all(len(e) == steps for e in everyone)
            global_batches = [np.concatenate([e[s] for e in everyone]) for s in range(steps)]
            seen = np.concatenate(global_batches)
            if drop_last:
                assert len(seen) == 1003 // B * B == len(set(seen.tolist()))
            else:
                assert sorted(seen.tolist()) == list(range(1003))  # every sample exactly once
            alone = ShardReader(split, rank=0, size=1, global_batch=B, seed=11, drop_last=drop_last,
                                buffer_mb=0.01)
            for ours, single in zip(global_batches, alone.epoch(2), strict=True):
                np.testing.assert_array_equal(ours, single.index)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["flipped byte", "missing", "truncated", "object header"])
def test_a_damaged_dataset_fails_on_every_rank(how):
    from mpitrain.comm import world

    comm = world()
    base = shared_dir(comm)
    d = None
    if comm.rank == 0:
        d, _ = damaged(base, how)
    d = comm.bcast(str(d) if d else None)
    cfg = config.from_dict({"data": {"path": d}, "train": {"epochs": 1}})
    with pytest.raises(DataError) as raised:
        build.open_data(cfg, comm, log=lambda *a: None)
    assert "train-00002.h5" in str(raised.value)
    messages = comm.allgather(str(raised.value).split(" (on rank")[0])
    assert len(set(messages)) == 1  # the same error everywhere


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy,algorithm", [("ddp", "mpi"), ("ddp", "ring"), ("zero1", "mpi")])
def test_trainer_on_p_ranks_equals_one_process(strategy, algorithm):
    """`mpitrain train` at any rank count: same losses and test accuracy as one process
    (float64), the I/O table has a row per rank, replicas are identical."""
    from mpitrain.comm import SingleComm, world

    comm = world()
    d = shared_data(comm, n=1024, test=200)
    raw = {"model": {"name": "lenet", "channels": [4, 8], "hidden": 16}, "data": {"path": str(d)},
           "optim": {"name": "adamw", "lr": 3e-3, "grad_clip": 0.5},
           "train": {"global_batch_size": 64, "epochs": 2, "dtype": "float64", "log_interval": 8},
           "parallel": {"sync": strategy, "allreduce": algorithm}}
    cfg = config.from_dict(raw)
    ours = train.train(cfg, log=lambda *a: None, comm=comm)
    alone = train.train(cfg, log=lambda *a: None, comm=SingleComm())
    assert abs(ours.final_loss - alone.final_loss) <= 1e-10 * abs(alone.final_loss)
    assert [h["test_accuracy"] for h in ours.history] == [h["test_accuracy"] for h in alone.history]
    if comm.rank == 0:
        assert all(len(rows) == comm.size for rows in ours.io)
        assert [row[0] for row in ours.timing] == list(range(comm.size))


@pytest.mark.mpi(min_size=2)
def test_global_batch_not_divisible_by_ranks_is_a_config_error():
    from mpitrain.comm import world

    comm = world()
    cfg = config.from_dict({"train": {"global_batch_size": comm.size * 8 + 1, "epochs": 1}})
    with pytest.raises(config.ConfigError, match="train.global_batch_size: .* not divisible"):
        train.train(cfg, log=lambda *a: None, comm=comm)


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_configs_or_versions_stop_naming_the_rank(monkeypatch):
    import mpitrain
    from mpitrain.comm import world

    comm = world()
    d = shared_data(comm, n=256, test=64)
    lr = 0.1 if comm.rank == 1 else 0.2
    cfg = config.from_dict({"data": {"path": str(d)}, "optim": {"lr": lr}, "train": {"epochs": 1}})
    with pytest.raises(config.ConfigError, match="rank 1 differs from rank 0 in its config:"):
        train.train(cfg, log=lambda *a: None, comm=comm)
    if comm.rank == comm.size - 1:
        monkeypatch.setattr(mpitrain, "__version__", "0.0.0-other")
    cfg = config.from_dict({"data": {"path": str(d)}, "train": {"epochs": 1}})
    with pytest.raises(config.ConfigError, match=f"rank {comm.size - 1} differs from rank 0 in its mpitrain version"):
        train.train(cfg, log=lambda *a: None, comm=comm)
