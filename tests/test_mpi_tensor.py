"""MPI tier: tensor-parallel operators by their adjoint; a GPT sliced over all ranks
trains as one process; bytes per block against the formula.

Every rank also trains the one-process reference (same seed, the same global batch and
per-sample dropout streams) and compares its slices with the reference's same slices."""

import numpy as np
import pytest

from mpitrain import cost, nn, optim, rng
from mpitrain.parallel import tensor_parallel as tp
from mpitrain.tensor import Tensor, default_dtype
from mpitrain.train.parts import grad_norm

STEPS, B, T, SEED, CLIP = 20, 8, 8, 3, 0.5


def world():
    from mpitrain.comm import world as w

    return w()


def gpt(vocab=13, dropout=0.1):
    rng.manual_seed(SEED)
    with default_dtype(np.float64):
        return nn.GPT(nn.GPTConfig(vocab_size=vocab, block_size=T, n_layer=2, n_head=4, n_embd=16,
                                   dropout=dropout, bias=True))


def batches(vocab=13):
    x = np.random.default_rng(11).integers(0, vocab, (STEPS, B, T))
    return [(x[s], np.roll(x[s], -1, axis=1)) for s in range(STEPS)]


def adamw(model):
    return optim.AdamW(optim.decay_groups(model.named_parameters(), 0.1), 3e-3)


def train(model, comm=None, clip=CLIP, vocab=13, sequence=False):
    opt = adamw(model)
    for step, (x, y) in enumerate(batches(vocab)):
        with rng.sample_streams(SEED, step, np.arange(B)):
            model(x, y)[1].backward()
        if sequence:
            tp.sum_replicated_grads(model, comm)
        if comm is None:
            optim.clip_grad_norm(model.parameters(), clip)
        else:
            sliced = tp.sliced_parameters(model)
            norm = grad_norm(model.parameters(), lambda q: id(q) in sliced or comm.rank == 0, [comm])
            if norm > clip:
                for q in model.parameters():
                    q.grad *= clip / (norm + 1e-6)
        opt.step()
        opt.zero_grad()
    return model


def slices_of(whole: nn.GPT, comm) -> dict:
    """The reference's parameters cut as the sliced model cuts them (by the same swap)."""
    return {n: q.data for n, q in tp.slice_gpt(whole, comm).named_parameters()}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("vocab,sequence", [(13, False), (16, False), (13, True)])  # 13: an uneven cut
def test_a_sliced_gpt_trains_as_one_process(vocab, sequence):
    comm = world().dup()
    if 4 % comm.size:
        pytest.skip("4 heads over the ranks")
    mine = train(tp.slice_gpt(gpt(vocab), comm, sequence), comm, vocab=vocab, sequence=sequence)
    ref = slices_of(train(gpt(vocab), vocab=vocab), comm)
    got = {n: q.data for n, q in mine.named_parameters()}
    assert got.keys() == ref.keys()
    a = np.concatenate([got[n].reshape(-1) for n in sorted(got)])
    b = np.concatenate([ref[n].reshape(-1) for n in sorted(got)])
    err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    assert err < 1e-10, err
    assert err > 0  # sums in another order: equal bits would mean the test compares nothing
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_the_loss_and_the_logits_slices_are_one_process_s():
    comm = world().dup()
    if 4 % comm.size:
        pytest.skip("4 heads over the ranks")
    x, y = batches()[0]
    sliced, whole = tp.slice_gpt(gpt(), comm), gpt()
    with rng.sample_streams(SEED, 0, np.arange(B)):
        logits, loss = sliced(x, y)
    with rng.sample_streams(SEED, 0, np.arange(B)):
        ref_logits, ref_loss = whole(x, y)
    lo, hi = tp.shard(13, comm.size, comm.rank)
    np.testing.assert_allclose(logits.data, ref_logits.data[..., lo:hi], rtol=1e-12, atol=1e-14)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-13)
    comm.free()


def inner(a, b):
    return float(np.sum(a * b))


# per operator: is its input the same on every rank, is its output's gradient? (In autograd
# a value held whole on every rank has one gradient, the same everywhere, unless the ops
# after it are sliced: then each rank's gradient is a partial sum, the whole being theirs.)
SPACES = {"f": (True, False), "g": (False, True), "scatter": (False, False), "gather": (False, False)}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", list(SPACES))
def test_each_operator_is_the_adjoint_of_its_backward(op):
    """<F x, y> = <x, F* y>, F the operator's forward, F* its backward. A vector held the
    same on every rank counts once; one held in parts (slices, or partial sums) is the
    sum of its ranks' parts, and so is its inner product."""
    comm = world().dup()
    t = comm.size
    same_x, same_y = SPACES[op]
    shape = (2, 4 * t, 3) if op != "gather" else (2, 4, 3)
    x = Tensor(np.random.default_rng(100 if same_x else 100 + comm.rank).standard_normal(shape), requires_grad=True)
    fn = {"f": tp.copy_to, "g": tp.reduce_from, "scatter": tp.scatter_sequence, "gather": tp.gather_sequence}[op]
    y = fn(x, comm)
    w = np.random.default_rng(200 if same_y else 200 + comm.rank).standard_normal(y.shape)
    y.backward(w)
    once = float(comm.rank == 0)
    totals = np.array([inner(y.data, w) * (once if same_y else 1.0), inner(x.data, x.grad) * (once if same_x else 1.0)])
    comm.allreduce(totals)
    assert totals[0] == pytest.approx(totals[1], rel=1e-12)
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sequence", [False, True])
def test_a_block_sends_its_formula_in_bytes(sequence):
    """Per block and step, 4 allreduces of (b, T, C): 2 forward (g), 2 backward (f); with
    sequence parallelism a reduce-scatter and an allgather in place of each, the same bytes."""
    comm = world().dup()
    if 4 % comm.size:
        pytest.skip("4 heads over the ranks")
    sliced = tp.slice_block(nn.models.Block(nn.GPTConfig(vocab_size=13, block_size=T, n_layer=1, n_head=4,
                                                         n_embd=16)), comm, sequence)
    t = comm.size
    x = Tensor(np.random.default_rng(0).standard_normal((B, T // t if sequence else T, 16)).astype(np.float32),
               requires_grad=True)
    before = comm.stats.bytes_sent
    sliced(x).sum().backward()
    assert comm.stats.bytes_sent - before == pytest.approx(cost.tensor_parallel_bytes(B, T, 16, 4, t))
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_the_trainer_on_sliced_layers_equals_one_process_and_its_checkpoints_cross_over():
    """``mpitrain train`` with tp = all ranks (float64, dropout, clipping) reaches the
    parameters and validation loss of one process; its step-6 checkpoint (the whole
    model, written slice by slice) resumed on one process ends where it ended, and the
    one process's resumed on the sliced ranks ends where the one process ended; with 4
    ranks, dp 2 x tp 2 as well."""
    import shutil

    from test_checkpoint import assert_close
    from test_mpi_data import shared_data
    from test_mpi_pipeline import gpt_cfg, text_set

    from mpitrain import checkpoint
    from mpitrain import train as trainer
    from mpitrain.comm import SingleComm

    comm = world()
    if 4 % comm.size:
        pytest.skip("4 heads over the ranks")
    d = shared_data(comm, make=text_set)
    root = d.parent
    quiet = lambda *a: None  # noqa: E731
    four = ("model.n_head=4", "model.bias=true")
    sliced = trainer.train(gpt_cfg(d, root / "tp", f"parallel.tp={comm.size}", *four), log=quiet, comm=comm)
    mine = root / f"tp-one-{comm.rank}"
    one = trainer.train(gpt_cfg(d, mine, *four), log=quiet, comm=SingleComm())
    assert sliced.val_loss == pytest.approx(one.val_loss, rel=1e-12)
    assert_close(checkpoint.path_for(mine, 12), checkpoint.path_for(root / "tp", 12), rtol=1e-10, floor=1e-6)
    resumed = root / f"tp-resumed-{comm.rank}"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(checkpoint.path_for(root / "tp", 6), resumed / "checkpoints")
    trainer.train(gpt_cfg(d, resumed, *four), log=quiet, comm=SingleComm(), resume=True)
    assert_close(checkpoint.path_for(root / "tp", 12), checkpoint.path_for(resumed, 12), rtol=1e-10, floor=1e-6)
    (root / "tp-back" / "checkpoints").mkdir(parents=True, exist_ok=True)
    if comm.rank == 0:
        shutil.copy(checkpoint.path_for(mine, 6), root / "tp-back" / "checkpoints")
    comm.barrier()
    trainer.train(gpt_cfg(d, root / "tp-back", f"parallel.tp={comm.size}", *four), log=quiet, comm=comm,
                  resume=True)
    assert_close(checkpoint.path_for(mine, 12), checkpoint.path_for(root / "tp-back", 12), rtol=1e-10, floor=1e-6)
    # sequence parallelism: the same run with the layer norms and dropout on slices of the sequence
    seq = trainer.train(gpt_cfg(d, root / "tp-sp", f"parallel.tp={comm.size}", "parallel.sequence_parallel=true",
                                *four), log=quiet, comm=comm)
    assert seq.val_loss == pytest.approx(one.val_loss, rel=1e-12)
    assert_close(checkpoint.path_for(mine, 12), checkpoint.path_for(root / "tp-sp", 12), rtol=1e-10, floor=1e-6)
    # the sliced run's checkpoint, resumed data-parallel on all ranks
    (root / "tp-dp" / "checkpoints").mkdir(parents=True, exist_ok=True)
    if comm.rank == 0:
        shutil.copy(checkpoint.path_for(root / "tp", 6), root / "tp-dp" / "checkpoints")
    comm.barrier()
    trainer.train(gpt_cfg(d, root / "tp-dp", *four), log=quiet, comm=comm, resume=True)
    assert_close(checkpoint.path_for(root / "tp", 12), checkpoint.path_for(root / "tp-dp", 12), rtol=1e-10,
                 floor=1e-6)
    if comm.size == 4:
        for name, layout in [("dp-tp", ("parallel.tp=2",)),
                             ("pp-tp", ("parallel.tp=2", "parallel.pp=2", "train.micro_batches=4")),
                             ("pp-tp-zb", ("parallel.tp=2", "parallel.pp=2", "train.micro_batches=4",
                                           "parallel.schedule=zb-h1"))]:
            grid = trainer.train(gpt_cfg(d, root / name, *layout, *four), log=quiet, comm=comm)
            assert grid.val_loss == pytest.approx(one.val_loss, rel=1e-12), name
            assert_close(checkpoint.path_for(mine, 12), checkpoint.path_for(root / name, 12), rtol=1e-10,
                         floor=1e-6)


@pytest.mark.mpi(min_size=8)
def test_data_pipeline_and_tensor_axes_together_equal_one_process():
    """dp 2 x pp 2 x tp 2 on 8 ranks (oversubscribed here: correctness only), through the
    trainer: one process's validation loss and parameters."""
    from test_checkpoint import assert_close
    from test_mpi_data import shared_data
    from test_mpi_pipeline import gpt_cfg, text_set

    from mpitrain import checkpoint
    from mpitrain import train as trainer
    from mpitrain.comm import SingleComm

    comm = world()
    if comm.size != 8:
        pytest.skip("the 2 x 2 x 2 grid")
    d = shared_data(comm, make=text_set)
    four = ("model.n_head=4", "model.bias=true")
    grid = trainer.train(gpt_cfg(d, d.parent / "cube", "parallel.tp=2", "parallel.pp=2", "train.micro_batches=4",
                                 *four), log=lambda *a: None, comm=comm)
    mine = d.parent / f"cube-one-{comm.rank}"
    one = trainer.train(gpt_cfg(d, mine, *four), log=lambda *a: None, comm=SingleComm())
    assert grid.val_loss == pytest.approx(one.val_loss, rel=1e-12)
    assert_close(checkpoint.path_for(mine, 12), checkpoint.path_for(d.parent / "cube", 12), rtol=1e-10, floor=1e-6)


@pytest.mark.mpi(min_size=2)
def test_a_column_parallel_layer_that_gathers_is_the_whole_layer():
    comm = world().dup()
    with default_dtype(np.float64):
        rng.manual_seed(1)
        whole = nn.Linear(6, 9)  # 9 columns: an uneven cut on 2, 4 and 8 ranks
    cols = np.arange(*tp.shard(9, comm.size, comm.rank))
    layer = tp.ColumnParallelLinear(whole.weight.data[:, cols], whole.bias.data[cols], comm, gather=True)
    x = Tensor(np.random.default_rng(0).standard_normal((2, 3, 6)), requires_grad=True)
    y = layer(x)
    np.testing.assert_allclose(y.data, whole(x).data, rtol=1e-13)
    g = np.random.default_rng(5).standard_normal(y.shape)
    y.backward(g)
    ref = Tensor(x.data, requires_grad=True)
    whole(ref).backward(g)
    np.testing.assert_allclose(x.grad, ref.grad, rtol=1e-12)  # f sums the ranks' parts of the input gradient
    np.testing.assert_allclose(layer.weight.grad, whole.weight.grad[:, cols], rtol=1e-12)
    comm.free()
