"""MPI tier: mixed precision across ranks. Half-precision gradients are averaged in
float32 arithmetic, alike on every rank (MPI's path and the ring's); a gradient that
overflows on one rank skips that step on every rank and halves every rank's loss scale;
a mixed-precision checkpoint holds the float32 masters and the loss scale and resumes
bit for bit."""

import json

import h5py
import numpy as np
import pytest
from test_data import text_set
from test_mpi_data import shared_data

from mpitrain import checkpoint, config, cost, nn, optim, rng, train
from mpitrain.comm.replicas import digest
from mpitrain.dtypes import dtype_of
from mpitrain.precision import MixedPrecision


def quiet(*args):
    pass


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_gradients_are_averaged_in_float32_alike_on_every_rank(algorithm, precision):
    from mpitrain.comm import world
    from mpitrain.parallel.data_parallel import DataParallel

    comm, half = world(), dtype_of(precision)
    P = comm.size
    rng.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16))
    mixed = MixedPrecision(optim.AdamW(model.parameters(), lr=1e-3), precision)
    dp = DataParallel(model, comm, optimizer=mixed, bucket_cap_mb=2e-3, algorithm=algorithm)  # several buckets
    assert len(dp.flats) > 2 and {f.dtype for f in dp.flats} == {half}
    r = np.random.default_rng(10 + comm.rank)  # each rank its own batch
    x, y = r.integers(0, 13, (2, 8)), r.integers(0, 13, (2, 8))
    with dp.no_sync():  # this rank's own half gradients
        model(x, y)[1].backward(np.float32(mixed.scaler.scale))
    mine = [p.grad.astype(np.float32) for p in model.parameters()]
    everyone = comm.allgather(mine)
    dp.zero_grad()
    sent = dp.comm.stats.bytes_sent
    model(x, y)[1].backward(np.float32(mixed.scaler.scale))
    dp.finish()
    # half the bytes on the ring (each bucket's share of P ranks rounds to whole bytes)
    n = sum(p.size for p in model.parameters())
    formula = cost.data_parallel_bytes(n, P, 2, algorithm=algorithm)
    assert dp.comm.stats.bytes_sent - sent == pytest.approx(formula, abs=4 * len(dp.flats))
    assert formula == 2 * (P - 1) / P * n * (4 if algorithm == "mpi" else 2)
    # MPI sums a float32 copy, the ring rounds at each hop; the 1/P rounds too unless P is a power of 2
    roundings = (1 if algorithm == "mpi" else P - 1) + (P & (P - 1) != 0)
    eps = 2.0**-8 if precision == "bf16" else 2.0**-11
    for i, p in enumerate(model.parameters()):
        assert p.grad.dtype == half
        exact = sum(g[i].astype(np.float64) for g in everyone) / P
        # a rounding's error is relative to the partial sum it rounds, at most the sum of magnitudes
        bound = roundings * eps * sum(np.abs(g[i].astype(np.float64)) for g in everyone) / P
        assert np.all(np.abs(p.grad.astype(np.float64) - exact) <= bound), i
    digests = comm.allgather(digest([p.grad for p in model.parameters()]))
    assert len(set(digests)) == 1  # the same bits on every rank
    dp.close()


def gpt_cfg(root, run_dir, precision, steps=8, **run):
    return config.from_dict({
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"path": str(root / "d")}, "optim": {"name": "adamw", "lr": 3e-3, "grad_clip": 1.0},
        "train": {"global_batch_size": 12, "steps": steps, "log_interval": 4, "eval_batches": 1, "sample_tokens": 0,
                  "threads": 1, "precision": precision},
        "parallel": {"allreduce": "ring", "bucket_mb": 0.01}, "run": {"dir": str(run_dir), **run}})


@pytest.mark.mpi(min_size=2)
def test_an_overflow_on_one_rank_skips_that_step_on_every_rank_and_halves_the_scale(monkeypatch):
    from mpitrain.comm import world

    comm = world()
    root = shared_data(comm, text_set).parent
    seen, masters = [], []
    real = MixedPrecision.check

    def check(self):
        """The real check, after an inf put into the last rank's averaged gradient at step 3."""
        seen.append(self)
        masters.append(np.concatenate([m.reshape(-1) for m in self.masters]))
        if len(masters) == 4 and comm.rank == comm.size - 1:
            self.params[0].grad.flat[0] = np.inf
        return real(self)

    monkeypatch.setattr(MixedPrecision, "check", check)
    train.train(gpt_cfg(root, root / "overflow", "fp16", steps=6), log=quiet, comm=comm)
    mixed = seen[0]
    assert mixed.scaler.skipped == 1 and mixed.scaler.scale == 2.0**15  # halved once from 2^16, on every rank
    assert mixed.step_count == 5  # six steps, one skipped
    assert not np.array_equal(masters[3], masters[2])  # step 2 updated
    np.testing.assert_array_equal(masters[4], masters[3])  # step 3 did not, on every rank
    assert not np.array_equal(masters[5], masters[4])  # step 4 did again


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_checkpoint_holds_the_float32_masters_and_resumes_bit_for_bit(precision):
    from mpitrain.comm import world

    comm = world()
    if comm.size == 4:
        pytest.skip("on 2 and 3 ranks (an even and an odd number of replicas)")
    root = shared_data(comm, text_set).parent
    straight, resumed = root / f"straight-{precision}", root / f"resumed-{precision}"
    train.train(gpt_cfg(root, straight, precision, steps=12, checkpoint_interval=6), log=quiet, comm=comm)
    if comm.rank == 0:
        (resumed / "checkpoints").mkdir(parents=True)
        checkpoint.path_for(straight, 6).replace(resumed / "checkpoints" / "step-00000006.h5")
    comm.barrier()
    train.train(gpt_cfg(root, resumed, precision, steps=12, checkpoint_interval=6), log=quiet, comm=comm,
                resume=True)
    a, b = checkpoint.path_for(straight, 12), checkpoint.path_for(resumed, 12)
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        scales = [json.loads(f.attrs["optimizer"])["loss_scale"] for f in (fa, fb)]
        assert scales[0] == scales[1] and scales[0]["precision"] == precision
        for name in fa["model"]:
            wa, wb = fa["model"][name][()], fb["model"][name][()]
            assert wa.dtype == np.float32
            np.testing.assert_array_equal(wa, wb)
        masters = np.concatenate([fa["model"][n][()].reshape(-1) for n in fa["model"] if "weight" in n])
        assert np.any(masters != masters.astype(dtype_of(precision)).astype(np.float32))  # not the working copy
