"""MPI tier: fine-tuning from a trained checkpoint (frozen parameters, LoRA adapters) on
the job's ranks equals one process fine-tuning on the same seed and global batch, under
every data-parallel sync; what is exchanged is what trains, by the formula; the model
state each rank counts is the planner's, to the byte."""

import h5py
import numpy as np
import pytest
from test_data import text_set
from test_mpi_data import shared_data

from mpitrain import config, cost, train
from mpitrain.comm import SingleComm

MODEL = {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "dropout": 0.1}
TUNINGS = {"lora": ["model.lora_rank=2", "model.lora_alpha=4"],
           "frozen": ['train.trainable=["head.*", "blocks.1.*"]'],
           "lora+head": ["model.lora_rank=2", 'train.trainable=["head.*"]']}
SYNCS = ("ddp", "zero1", "zero2", "zero3")
STEPS = 4


def quiet(*args):
    pass


def cfg_of(d, run_dir, sets, steps=STEPS):
    return config.from_dict({
        "model": MODEL, "data": {"path": str(d)}, "optim": {"name": "adamw", "lr": 3e-2, "grad_clip": 0.5,
                                                            "weight_decay": 0.1},
        "train": {"global_batch_size": 8, "steps": steps, "eval_interval": 0, "eval_batches": 1, "sample_tokens": 0,
                  "threads": 1, "dtype": "float64", "log_interval": 1},
        "run": {"dir": str(run_dir)}}, sets)


def arrays(path) -> dict:
    with h5py.File(path, "r") as f:
        names = []
        f["model"].visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        return {n: f["model"][n][()] for n in names}


@pytest.fixture(scope="module")
def base():
    """A trained run's checkpoint (6 steps of the plain model), on every rank."""
    from mpitrain.comm import world

    comm = world()
    d = shared_data(comm, make=text_set, n=3000)
    path = d.parent / "base"
    result = train.train(cfg_of(d, path, [], steps=6), log=quiet, comm=comm)
    return comm, d, result.checkpoint


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("tuning", sorted(TUNINGS))
def test_fine_tuning_on_the_ranks_equals_one_process(base, tuning):
    comm, d, origin = base
    if comm.size != 2:
        pytest.skip("replicas alone, on 2 ranks")
    sets = TUNINGS[tuning]
    ref_dir = d.parent / f"one-{tuning}-{comm.rank}"  # every rank trains the reference alone
    one = train.train(cfg_of(d, ref_dir, sets), log=quiet, comm=SingleComm(), origin=origin)
    want = arrays(one.checkpoint)
    before = arrays(origin)
    frozen = [n for n in before if n in want and np.array_equal(before[n], want[n])]
    assert frozen, "some parameters stay as the base left them"
    for sync in SYNCS:
        run = train.train(cfg_of(d, d.parent / f"{sync}-{tuning}", sets + [f"parallel.sync={sync}"]), log=quiet,
                          comm=comm, origin=origin)
        got = arrays(comm.bcast(run.checkpoint))
        assert set(got) == set(want)
        for n in want:
            np.testing.assert_allclose(got[n], want[n], rtol=1e-9, atol=1e-12, err_msg=f"{sync}, {tuning}: {n}")
        for n in frozen:  # never touched: bit for bit the base's
            assert np.array_equal(got[n], before[n]), (sync, n)
        if comm.rank == 0:
            _exchanged_and_counted(run, cfg_of(d, "", sets + [f"parallel.sync={sync}"]), want, sync)


def _exchanged_and_counted(run, cfg, whole, sync):
    """Each rank's bytes sent in the steps: the sync's formula of the parameters that train
    (plus clipping's 8-byte allreduce a step where ZeRO sums the norm); the model state each
    rank counted equals the planner's, to the byte."""
    from mpitrain import plan as planner
    from mpitrain.nn.lora import is_adapter
    from mpitrain.plan import hardware

    built = config.trained_names(cfg, list(whole))
    n = sum(whole[k].size for k in built)
    assert 0 < n < sum(a.size for a in whole.values())
    if cfg.model.lora_rank and not cfg.train.trainable:
        assert all(is_adapter(k) for k in built)
    per_step = {"ddp": cost.data_parallel_bytes(n, 2, 8), "zero1": cost.zero_bytes(1, 8 * n, 2),
                "zero2": cost.zero_bytes(2, 8 * n, 2), "zero3": cost.zero_bytes(3, 8 * n, 2)}[sync]
    clip = 0 if sync == "ddp" else cost.collective_bytes("allreduce", 8, 2)
    assert len(run.timing) == len(run.states) == 2
    for row in run.timing:
        sent = row[6]
        assert abs(sent - STEPS * (per_step + clip)) <= 16 * STEPS, (sync, sent, STEPS * (per_step + clip))
    plan = planner.make(cfg, 2, planner.machine(hardware.load(), "this", 2))
    for rank, (state, _) in enumerate(run.states):
        p = next(q for q in plan.ranks if rank in q.ranks)
        counted = state["param_bytes"] + state["grad_bytes"] + state["optim_bytes"] + state["work_bytes"]
        assert p.state + p.memory["work"] == counted, (sync, rank, p.memory, state)
