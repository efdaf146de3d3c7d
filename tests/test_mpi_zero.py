"""MPI tier: ZeRO-2 and ZeRO-3 equal data parallelism (AdamW, clipping, micro-batches;
ZeRO-2's both ways), keep only their shards, and send the bytes of their formulas."""

import contextlib
import shutil

import numpy as np
import pytest
from test_mpi_parallel import STEPS, B, batches, build, loss_of, world

from mpitrain import cost, nn, optim, rng
from mpitrain.comm import SingleComm
from mpitrain.comm.ring import chunk_bounds
from mpitrain.observe.memory import model_state
from mpitrain.tensor import default_dtype

CLIP = 0.05  # small enough that clipping acts on most steps


def distance(a, b) -> float:
    """Relative L2 distance of two lists of parameter arrays."""
    x, y = (np.concatenate([v.reshape(-1) for v in vs]) for vs in (a, b))
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def build_model(kind, dropout):
    """test_mpi_parallel's model and AdamW; the GPT with ``dropout`` if given."""
    if not dropout:
        return build(kind, "float64", "adamw")
    rng.manual_seed(5)
    with default_dtype(np.float64):
        model = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=dropout))
    return model, optim.AdamW(optim.decay_groups(model.named_parameters(), 0.1), 3e-3)


def backward(kind, model, sync, comm, x, y, micro):
    """This rank's B/P samples of the global batch (x, y) through forward and backward in
    ``micro`` micro-batches, all but the last inside ``sync.no_sync()``."""
    b = B // comm.size
    x, y = x[comm.rank * b : (comm.rank + 1) * b], y[comm.rank * b : (comm.rank + 1) * b]
    m = b // micro
    for k in range(micro):
        loss = loss_of(kind, model, x[k * m : (k + 1) * m], y[k * m : (k + 1) * m]) * (1.0 / micro)
        with sync.no_sync() if k < micro - 1 else contextlib.nullcontext():
            loss.backward()


def train(kind, comm, sync, micro=1, clip=CLIP, dropout=0.0, **options):
    """STEPS steps of AdamW on ``comm`` with ``sync`` ("ddp", "zero2" or "zero3"), each
    rank its B/P samples in ``micro`` micro-batches; returns (the trained parameters, the
    sync object)."""
    from mpitrain.parallel.data_parallel import DataParallel
    from mpitrain.parallel.zero import Zero2
    from mpitrain.parallel.zero3 import Zero3

    if B % (comm.size * micro):
        pytest.skip(f"the global batch of {B} does not split into {comm.size} x {micro}")
    model, opt = build_model(kind, dropout)
    if sync == "ddp":
        s = DataParallel(model, comm, optimizer=opt, bucket_cap_mb=1e-3)
    elif sync == "zero2":
        s = Zero2(model, opt, comm, bucket_cap_mb=1e-3, **options)
    else:
        s = Zero3(model, opt, comm, **options)
    clipped = 0
    for x, y in batches(kind, "float64"):
        backward(kind, model, s, comm, x, y, micro)
        s.finish()
        if sync != "ddp":
            assert all(p.grad is None for p in model.parameters())  # only the shard is kept
            clipped += s.step(None, clip) > clip
        else:
            s.step(None, clip)
        s.zero_grad()
    assert sync == "ddp" or clip == 0 or clipped >= STEPS // 2  # the clipping is tested too
    s.check_replicas()
    if sync == "zero3":
        return whole(s), s
    return [p.data for p in model.parameters()], s


def whole(zero3) -> list:
    """ZeRO-3's parameters, gathered whole (a collective), in the model's order."""
    with zero3.whole_model():
        return [p.data.copy() for p in zero3.model.parameters()]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind,algorithm,micro,accumulate", [
    ("gpt", "mpi", 1, "sharded"), ("gpt", "ring", 1, "sharded"), ("cnn", "mpi", 1, "sharded"),
    ("gpt", "mpi", 2, "sharded"), ("gpt", "ring", 2, "full"), ("cnn", "mpi", 2, "full")])
def test_zero2_equals_ddp_with_adamw_and_clipping(kind, algorithm, micro, accumulate):
    comm = world()
    ddp, d = train(kind, comm, "ddp", micro)
    zero, z = train(kind, comm, "zero2", micro, algorithm=algorithm, accumulate=accumulate)
    assert distance(zero, ddp) <= 1e-12
    d.close()
    z.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
@pytest.mark.parametrize("micro,accumulate", [(1, "sharded"), (2, "sharded"), (2, "full")])
def test_zero2_sends_its_formula_and_keeps_a_shard(algorithm, micro, accumulate):
    """(m + 1)(P-1)/P (sharded micro-batches) or 2(P-1)/P x parameter bytes per step,
    summed over the ranks (the ring's exactly); model state (parameters, gradient shard, Adam's two
    moments) 4 + 12/P bytes per float32 parameter, to the shard rounding."""
    from mpitrain.parallel.zero import Zero2

    comm = world()
    model, opt = build("gpt", "float64", "adamw")
    z = Zero2(model, opt, comm, algorithm=algorithm, bucket_cap_mb=1e-3, accumulate=accumulate)
    start = z.comm.stats.bytes_sent  # after the broadcast of rank 0's parameters
    for x, y in batches("gpt", "float64")[:3]:
        backward("gpt", model, z, comm, x, y, micro)
        z.finish()
        z.step(None, 0.0)
        z.zero_grad()
    P = comm.size
    n = sum(p.size for p in model.parameters())
    per_step = (micro + 1 if accumulate == "sharded" else 2) * (P - 1) * n * 8
    assert cost.zero_bytes(2, n * 8, P, micro, accumulate == "sharded") * P == pytest.approx(per_step, rel=1e-12)
    calls = 3 * (micro + 1) * len(z.ranges)  # MPI's collectives count whole bytes: <1 lost per call
    total = sum(comm.allgather(z.comm.stats.bytes_sent - start))
    assert abs(total - 3 * per_step) < P * calls
    if algorithm == "ring":  # counted as sent, byte for byte
        assert total == 3 * per_step
    mine = sum(int(np.diff(chunk_bounds(bk.hi - bk.lo, P))[comm.rank]) for bk in z.ranges)
    assert z.grad_shard.size == mine and abs(mine - n / P) <= len(z.ranges)
    pieces = sum(len(g["params"]) for g in z.optimizer.param_groups)
    state = z.optimizer.memory()["optim_bytes"]
    assert state == 2 * mine * 8 + pieces * 8
    model_state = z.flat_params.nbytes + z.grad_shard.nbytes + state - pieces * 8
    assert model_state == pytest.approx((8 + 24 / P) * n, abs=24 * len(z.ranges))  # float64: 2 x (4 + 12/P)
    z.close()


def test_zero2_on_one_rank_trains_like_ddp():
    """Unit tier: one rank, micro-batches both ways, equals data parallelism on one rank."""
    for micro, accumulate in ((1, "sharded"), (2, "sharded"), (2, "full")):
        ddp, _ = train("gpt", SingleComm(), "ddp", micro)
        zero, _ = train("gpt", SingleComm(), "zero2", micro, accumulate=accumulate)
        assert distance(zero, ddp) <= 1e-14


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind,algorithm,micro,dropout", [
    ("gpt", "mpi", 1, 0.0), ("gpt", "ring", 2, 0.0), ("gpt", "mpi", 2, 0.2), ("cnn", "mpi", 2, 0.0),
    ("resnet", "mpi", 1, 0.0), ("resnet", "ring", 1, 0.0)])
def test_zero3_equals_ddp_with_adamw_and_clipping(kind, algorithm, micro, dropout):
    """The GPT's tied embedding, dropout (its masks replayed in backward), batch norm's
    statistics (replayed, updated once), micro-batches."""
    comm = world()
    ddp, d = train(kind, comm, "ddp", micro, dropout=dropout)
    zero, z = train(kind, comm, "zero3", micro, dropout=dropout, algorithm=algorithm)
    assert distance(zero, ddp) <= 1e-12
    d.sync_buffers()
    z.sync_buffers()
    mine, theirs = ([b for _, b in s.model.named_buffers()] for s in (z, d))
    assert len(mine) == (12 if kind == "resnet" else 0) and (not mine or distance(mine, theirs) <= 1e-12)
    d.close()
    z.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
def test_zero3_sends_3_p_minus_1_over_p_and_keeps_16_over_p(algorithm):
    """Two gathers and a reduce-scatter of the parameters per pass, the tied embedding once;
    model state at rest 16/P bytes per float32 parameter (float64 here: twice), no
    parameter whole between steps."""
    from mpitrain.parallel.zero3 import Zero3

    comm = world()
    model, opt = build("gpt", "float64", "adamw")
    z = Zero3(model, opt, comm, algorithm=algorithm)
    start = z.comm.stats.bytes_sent
    for x, y in batches("gpt", "float64")[:3]:
        backward("gpt", model, z, comm, x, y, 1)
        z.finish()
        z.step(None, 0.0)
        z.zero_grad()
    P, n = comm.size, sum(p.size for p in model.parameters())
    per_step = 3 * (P - 1) * n * 8
    assert cost.zero_bytes(3, n * 8, P) * P == pytest.approx(per_step, rel=1e-12)
    total = sum(comm.allgather(z.comm.stats.bytes_sent - start))
    if algorithm == "ring":
        assert total == 3 * per_step
    else:
        assert abs(total - 3 * per_step) < P * 3 * 3 * len(z.groups)
    assert all(p.data.strides == (0,) * p.ndim for p in model.parameters())  # placeholders: no memory
    pieces = sum(len(g["params"]) for g in z.optimizer.param_groups)
    m = model_state(z.model, z.optimizer)
    state = m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] - pieces * 8  # less the pieces' step counts
    assert state == pytest.approx(2 * 16 * n / P, abs=32 * len(z.groups))
    z.close()


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (pip install mpich)")
def test_bench_memory_measures_each_stages_formula():
    """Unit tier (it starts its own ranks): on 2 ranks the heap each rank holds between
    steps is its sync's formula (16, 8 + 8/P, 4 + 12/P, 16/P bytes per parameter) within
    5%, and on one rank mixed precision's (2 + 2 + 12), and the arrays counted by category
    are the formula's to the byte, less the optimizer's per-piece step counts."""
    from mpitrain.bench import memory
    from mpitrain.cost import bytes_per_parameter

    quiet = lambda *a: None  # noqa: E731
    rows = memory.run(ranks=(2,), precisions=("fp32",), as_json=True, log=quiet)
    assert {(r["sync"], r["rank"]) for r in rows} == {(s, r) for s in memory.SYNCS for r in (0, 1)}
    mixed = memory.run(ranks=(1,), syncs=("ddp",), precisions=("bf16", "fp16"), as_json=True, log=quiet)
    assert [r["precision"] for r in mixed] == ["bf16", "fp16"]
    for r in rows + mixed:
        formula = bytes_per_parameter(r["sync"], r["ranks"], mixed=r["precision"] != "fp32") * r["parameters"]
        measured = r["rest"] - r["work_bytes"]
        assert formula <= measured <= 1.05 * formula, r
        counted = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        assert abs(counted - formula) <= 8 * 200 + 4 * len(memory.SYNCS), r  # step counts; chunk rounding


def test_bench_memory_activations_follow_their_formula_both_ways():
    """Unit tier: the GPT's activations held after forward are the saved arrays' formula
    within 2%, plain (L blocks' worth) and checkpointed (L block inputs)."""
    from mpitrain.bench import memory

    out = memory.activations(rounds=1, log=lambda *a: None)
    for name in ("plain", "checkpointed"):
        assert out[name]["formula"] <= out[name]["held"] <= 1.02 * out[name]["formula"], (name, out[name])
    assert out["checkpointed"]["held"] < 0.1 * out["plain"]["held"]


@pytest.mark.mpi(min_size=2)
def test_the_zero_stages_are_bitwise_equal_in_float32_on_two_ranks():
    """float32, AdamW with clipping, 2 ranks: ZeRO-1, -2 and -3 end with the same bits
    (each sums a shard of two ranks' gradients, which is order-free, and clips by the
    same shard-wise norm); ddp agrees to rounding only (its norm adds the squares in
    another order)."""
    from mpitrain.parallel.zero import Zero1, Zero2
    from mpitrain.parallel.zero3 import Zero3

    comm = world()
    if comm.size != 2:
        pytest.skip("a sum of two is order-free; of more, MPI's order may differ between the stages")
    ends = []
    for make in (lambda m, o: Zero1(m, o, comm), lambda m, o: Zero2(m, o, comm, bucket_cap_mb=1e-3),
                 lambda m, o: Zero3(m, o, comm)):
        model, opt = build("gpt", "float32", "adamw")
        z = make(model, opt)
        for x, y in batches("gpt", "float32"):
            backward("gpt", model, z, comm, x, y, 1)
            z.finish()
            z.step(None, CLIP)
            z.zero_grad()
        ends.append(whole(z) if isinstance(z, Zero3) else [p.data.copy() for p in model.parameters()])
        z.close()
    for other in ends[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(ends[0], other))
