"""MPI tier: data parallelism and ZeRO-1 equal single-process training; byte counts.

Every rank also trains the single-process reference (same seed, whole global batch),
so each rank compares its own replica with it. 20 steps; relative difference of the
parameters (L2 norm over all of them) at most 1e-10 in float64, 1e-5 in float32."""

import numpy as np
import pytest

from mpitrain import cost, nn, ops, optim, rng
from mpitrain.comm import SingleComm
from mpitrain.comm.allreduce import allreduce, iallreduce
from mpitrain.comm.ring import chunk_bounds
from mpitrain.tensor import Tensor, default_dtype

STEPS, B = 20, 8


def world():
    from mpitrain.comm import world as w

    return w()


def gpt():
    return nn.GPT(nn.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16))


def cnn():
    return nn.LeNet(1, 8, 5, channels=(3, 4), hidden=8)


def resnet():
    return nn.ResNet(2, 8, 5, widths=(4, 6), blocks=1)


def batches(kind, dtype):
    """STEPS global batches, the same on every rank."""
    g = np.random.default_rng(7)
    if kind == "gpt":
        x = g.integers(0, 11, (STEPS, B, 8))
        return [(x[s], np.roll(x[s], -1, axis=1)) for s in range(STEPS)]
    c = 2 if kind == "resnet" else 1
    return [(g.standard_normal((B, 8, 8, c)).astype(dtype), g.integers(0, 5, B)) for _ in range(STEPS)]


def loss_of(kind, model, x, y):
    if kind == "gpt":
        return model(x, y)[1]
    return ops.cross_entropy(model(Tensor(x)), y)


def build(kind, dtype, opt_name):
    rng.manual_seed(5)
    with default_dtype(dtype):
        model = {"gpt": gpt, "cnn": cnn, "resnet": resnet}[kind]()
    groups = optim.decay_groups(model.named_parameters(), 0.1)
    opt = optim.AdamW(groups, 3e-3) if opt_name == "adamw" else optim.SGD(groups, 0.1, momentum=0.9)
    return model, opt


def reference(kind, dtype, opt_name, ghost=1):
    """One process, whole batch; with ``ghost`` > 1 the batch goes through the model in
    that many equal groups (batch norm then sees the groups, as the ranks do)."""
    model, opt = build(kind, dtype, opt_name)
    for x, y in batches(kind, dtype):
        for k in range(ghost):
            part = slice(k * B // ghost, (k + 1) * B // ghost)
            (loss_of(kind, model, x[part], y[part]) * (1.0 / ghost)).backward()
        opt.step()
        opt.zero_grad()
    return [p.data.copy() for p in model.parameters()]


def relative(params, ref) -> float:
    a = np.concatenate([p.data.reshape(-1) for p in params]).astype(np.float64)
    b = np.concatenate([r.reshape(-1) for r in ref]).astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def train_dp(kind, dtype, opt_name, comm, micro=1, **dp_options):
    from mpitrain.parallel.data_parallel import DataParallel

    if B % comm.size:
        pytest.skip(f"the global batch of {B} does not split evenly over {comm.size} ranks")
    model, opt = build(kind, dtype, opt_name)
    dp = DataParallel(model, comm, **dp_options)
    b = B // comm.size
    for x, y in batches(kind, dtype):
        x, y = x[comm.rank * b : (comm.rank + 1) * b], y[comm.rank * b : (comm.rank + 1) * b]
        m = b // micro
        for k in range(micro):
            loss = loss_of(kind, model, x[k * m : (k + 1) * m], y[k * m : (k + 1) * m]) * (1.0 / micro)
            if k < micro - 1:
                with dp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        dp.finish()
        opt.step()
        opt.zero_grad()
    dp.check_replicas()
    dp.close()
    return model, dp


CASES = [(kind, alg, cap) for kind in ("gpt", "cnn") for alg in ("mpi", "ring", "hierarchical") for cap in (1e-3, 25.0)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind,algorithm,cap", CASES)
def test_ddp_equals_one_process_float64(kind, algorithm, cap):
    comm = world()
    ref = reference(kind, "float64", "sgd")
    model, dp = train_dp(kind, "float64", "sgd", comm, bucket_cap_mb=cap, algorithm=algorithm)
    assert (len(dp.flats) > 3) == (cap < 1)
    assert relative(model.parameters(), ref) <= 1e-10


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["gpt", "cnn"])
def test_ddp_equals_one_process_float32(kind):
    ref = reference(kind, "float32", "adamw")
    model, _ = train_dp(kind, "float32", "adamw", world(), bucket_cap_mb=1e-3)
    assert relative(model.parameters(), ref) <= 1e-5


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("progress", ["none", "thread", "off"])
def test_ddp_progress_modes_give_the_same_result(progress):
    from mpitrain.comm import started_thread_level

    if progress == "thread" and started_thread_level() not in ("serialized", "multiple"):
        pytest.skip("the communication thread needs MPI thread level serialized or multiple")
    ref = reference("gpt", "float64", "sgd")
    model, _ = train_dp("gpt", "float64", "sgd", world(), bucket_cap_mb=1e-3, progress=progress)
    assert relative(model.parameters(), ref) <= 1e-10


@pytest.mark.mpi(min_size=2)
def test_no_sync_accumulation_equals_one_process():
    ref = reference("cnn", "float64", "sgd")
    model, _ = train_dp("cnn", "float64", "sgd", world(), micro=2, bucket_cap_mb=1e-3)
    assert relative(model.parameters(), ref) <= 1e-10


@pytest.mark.mpi(min_size=2)
def test_batch_norm_uses_each_ranks_statistics():
    """Local statistics: equal to one process that normalises in P groups of B/P."""
    comm = world()
    ref = reference("resnet", "float64", "sgd", ghost=comm.size)
    model, dp = train_dp("resnet", "float64", "sgd", comm, bucket_cap_mb=1e-3)
    assert relative(model.parameters(), ref) <= 1e-10
    dp.sync_buffers()
    means = comm.allgather(np.concatenate([b.reshape(-1) for _, b in model.named_buffers()]))
    assert all(np.array_equal(m, means[0]) for m in means)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind,algorithm", [("gpt", "mpi"), ("gpt", "ring"), ("cnn", "ring")])
def test_zero1_equals_ddp_with_adamw(kind, algorithm):
    from mpitrain.parallel.zero import Zero1

    comm = world()
    ddp, _ = train_dp(kind, "float64", "adamw", comm, bucket_cap_mb=1e-3, algorithm=algorithm)
    model, opt = build(kind, "float64", "adamw")
    zero = Zero1(model, opt, comm, algorithm=algorithm)
    b = B // comm.size
    for x, y in batches(kind, "float64"):
        loss_of(kind, model, x[comm.rank * b : (comm.rank + 1) * b], y[comm.rank * b : (comm.rank + 1) * b]).backward()
        zero.step()
        zero.zero_grad()
    assert relative(model.parameters(), [p.data for p in ddp.parameters()]) <= 1e-10
    assert relative(model.parameters(), reference(kind, "float64", "adamw")) <= 1e-10
    n = sum(p.size for p in model.parameters())
    mine = np.diff(chunk_bounds(n, comm.size))[comm.rank]
    pieces = sum(len(g["params"]) for g in zero.optimizer.param_groups)
    # two moments of my shard, a step count per piece
    assert zero.optimizer.memory()["optim_bytes"] == 2 * mine * 8 + pieces * 8


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [1, 7, 1001, 4096 + 3])
def test_ring_sends_2_p_minus_1_over_p_of_the_gradient(n):
    comm = world().dup()
    P, r = comm.size, comm.rank
    x = np.full(n, float(r + 1), dtype=np.float32)
    allreduce(comm, x, "ring")
    assert np.all(x == P * (P + 1) / 2)
    assert comm.stats.bytes_sent == cost.ring_elements(n, P, r) * 4  # every chunk but two
    assert sum(comm.allgather(comm.stats.bytes_sent)) == 2 * (P - 1) * n * 4  # 2(P-1)/P x n per rank
    if n % P == 0:
        assert comm.stats.bytes_sent == cost.collective_bytes("allreduce", n * 4, P)
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("in_place_from", [1 << 20, 0])
@pytest.mark.parametrize("n", [3, 1001, 65537])
def test_ring_equals_mpi_with_partial_sums_in_work_arrays_or_in_place(monkeypatch, in_place_from, n):
    """Both ways of keeping partial sums (see comm/ring.py), repeated so the work arrays
    are reused, and the reduce-scatter half alone."""
    import mpitrain.comm.ring as ar

    monkeypatch.setattr(ar, "IN_PLACE_CHUNK_BYTES", in_place_from)
    comm = world().dup()
    P, r = comm.size, comm.rank
    for seed in range(3):
        x = np.random.default_rng(100 * seed + r).standard_normal(n)
        expected = x.copy()
        comm.allreduce(expected)
        ring = x.copy()
        request = ar.Ring(comm, ring)
        assert request.in_place == (in_place_from == 0)
        request.wait()
        assert np.allclose(ring, expected, rtol=1e-12, atol=1e-12)
        shard = x.copy()
        ar.Ring(comm, shard, ("reduce_scatter",)).wait()
        b = chunk_bounds(n, P)
        assert np.allclose(shard[b[r] : b[r + 1]], expected[b[r] : b[r + 1]], rtol=1e-12, atol=1e-12)
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [1, 7, 1001, 65537])
def test_two_ranks_exchange_equals_mpi_bit_for_bit_and_is_the_ring_across_nodes(n):
    """The one-round allreduce of two ranks (comm/ring.py, "Two ranks"): each rank adds
    the other's buffer to its own, a + b on one and b + a on the other, the same bits;
    by wait() or test(); n elements sent per rank, the ring's 2 (P-1)/P x n. The ring
    takes it when the two ranks are on different nodes (under tests/test_cluster.py)."""
    import mpitrain.comm.ring as ar

    comm = world()
    if comm.size != 2:
        pytest.skip("an exchange is between 2 ranks")
    comm = comm.dup()
    for seed, finish in enumerate(("wait", "test", "wait")):  # twice wait: the scratch array is reused
        x = np.random.default_rng(10 * seed + comm.rank).standard_normal(n)
        expected = x.copy()
        comm.allreduce(expected)
        sent = comm.stats.bytes_sent
        request = ar.Exchange(comm, x)
        if finish == "wait":
            request.wait()
        else:
            while not request.test():
                pass
        assert np.array_equal(x, expected) and comm.stats.bytes_sent - sent == n * 8
        assert comm.allgather(x.tobytes()) == [x.tobytes()] * 2
    across = comm.node_size() == 1
    request = iallreduce(comm, np.ones(n), "ring")
    assert isinstance(request, ar.Exchange if across else ar.Ring)
    request.wait()
    with pytest.raises(ValueError, match="between 2 ranks"):
        ar.Exchange(SingleComm(), np.zeros(1))
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [1, 7, 1001, 65537])
def test_the_node_aware_allreduce_equals_mpis_and_sends_each_byte_over_the_network_once_per_node(n):
    """Nodes of 2 consecutive ranks (of 1 with an odd rank count): the sum equals MPI's,
    and each rank sends the ring's bytes inside its node and, across nodes, 2 (N-1)/N of
    its slice (MPI's allreduce, counted by the formula)."""
    from mpitrain.comm.hierarchical import HierarchicalAllreduce, hierarchy

    comm = world().dup()
    L = 2 if comm.size % 2 == 0 else 1
    N = comm.size // L
    x = np.random.default_rng(comm.rank).standard_normal(n)
    expected = x.copy()
    comm.allreduce(expected)
    request = HierarchicalAllreduce(comm, x, ranks_per_node=L)
    while not request.test():  # as a bucket in backward is advanced
        pass
    assert np.allclose(x, expected, rtol=1e-12, atol=1e-12)
    h = hierarchy(comm)
    assert (h.node.size, h.cross.size) == (L, N)
    lr, c = h.node.rank, np.diff(chunk_bounds(n, L))
    intra = cost.ring_elements(n, L, lr) * 8 if L > 1 else 0
    inter = int(cost.collective_bytes("allreduce", c[lr] * 8, N))
    assert (h.node.stats.bytes_sent, h.cross.stats.bytes_sent) == (intra, inter)  # shared memory, network
    y = np.full(n, float(comm.rank))
    HierarchicalAllreduce(comm, y, ranks_per_node=L).wait()
    assert np.all(y == comm.size * (comm.size - 1) / 2)
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_ddp_counts_its_bytes_by_the_formula():
    comm = world()
    _, dp = train_dp("cnn", "float32", "sgd", comm, bucket_cap_mb=25.0, algorithm="ring")
    (bucket,) = dp.flats
    P, r, n = comm.size, comm.rank, bucket.size
    sent = sum(c.stats.bytes_sent for c in dp.comms)  # the buckets' allreduces (not the first broadcast)
    assert sent == STEPS * cost.ring_elements(n, P, r) * 4
    assert sum(comm.allgather(sent)) == STEPS * 2 * (P - 1) * n * 4
    assert cost.collective_bytes("allreduce", n * 4, P) * P == 2 * (P - 1) * n * 4


def test_one_rank_wrappers_train_like_plain_training():
    """Unit tier: with a one-rank communicator the wrappers change nothing."""
    from mpitrain.parallel.zero import Zero1

    ref = reference("cnn", "float64", "adamw")
    model, _ = train_dp("cnn", "float64", "adamw", SingleComm(), bucket_cap_mb=1e-3)
    assert relative(model.parameters(), ref) == 0.0
    model, opt = build("cnn", "float64", "adamw")
    zero = Zero1(model, opt, SingleComm())
    for x, y in batches("cnn", "float64"):
        loss_of("cnn", model, x, y).backward()
        zero.step()
        zero.zero_grad()
    assert relative(model.parameters(), ref) == 0.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sync", ["ddp", "zero1", "zero2", "zero3"])
def test_the_trainers_micro_batches_equal_one_pass_on_p_ranks_and_one_process(sync):
    """`train.micro_batches = 4` on P ranks (one sample per micro-batch) against 1, and
    against one process: float64 GPT, AdamW with clipping, model and optimizer state
    within 1e-12 after 6 steps."""
    from test_checkpoint import arrays, assert_close
    from test_data import text_set
    from test_mpi_data import shared_data

    from mpitrain import checkpoint, config, train

    comm = world()
    root = shared_data(comm, text_set).parent

    def run(micro, name, on):
        cfg = config.from_dict({
            "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
            "data": {"path": str(root / "d")}, "optim": {"name": "adamw", "grad_clip": 1.0},
            "train": {"global_batch_size": 4 * comm.size, "steps": 6, "micro_batches": micro, "dtype": "float64",
                      "eval_batches": 1, "sample_tokens": 0, "threads": 1},
            "parallel": {"sync": sync}, "run": {"dir": str(root / name)}})
        train.train(cfg, log=lambda *a: None, comm=on)
        return checkpoint.path_for(root / name, 6)

    four, one = run(4, f"{sync}-4", comm), run(1, f"{sync}-1", comm)
    if comm.rank == 0:
        alone = run(1, f"{sync}-alone", SingleComm())
        assert_close(four, one, rtol=1e-12, floor=1.0)
        assert_close(four, alone, rtol=1e-12, floor=1.0)
        a, b = arrays(four), arrays(one)
        assert not all(np.array_equal(a[k], b[k]) for k in a)  # the micro-batches did sum in another order
    comm.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("wire,tolerance", [("bf16", 2.0**-8), ("fp16", 2.0**-11)])
@pytest.mark.parametrize("n", [1, 1001, 65537])
def test_the_ring_in_half_precision_sends_half_the_bytes_and_agrees_on_every_rank(wire, tolerance, n):
    """16-bit numbers on the wire, added in float32: the same bits on every rank, half
    the fp32 ring's bytes, the float64 sum to ``P`` roundings of the largest partial sum;
    the two-rank exchange too."""
    from mpitrain.comm.ring import Exchange, Ring, wire_dtype

    comm = world().dup()
    P, r = comm.size, comm.rank
    x = np.random.default_rng(100 + r).standard_normal(n).astype(np.float32)
    exact, size = x.astype(np.float64), np.abs(x).astype(np.float64)
    comm.allreduce(exact)
    comm.allreduce(size)  # the sum of magnitudes bounds every partial sum
    requests = [lambda b, w: Ring(comm, b, wire=w)] + ([lambda b, w: Exchange(comm, b, w)] if P == 2 else [])
    for start in requests:
        half, full = x.copy(), x.copy()
        before = comm.stats.bytes_sent
        start(half, wire_dtype(wire)).wait()
        middle = comm.stats.bytes_sent
        start(full, None).wait()
        assert 2 * (middle - before) == comm.stats.bytes_sent - middle
        assert len(set(comm.allgather(half.tobytes()))) == 1
        assert np.all(np.abs(half - exact) <= P * tolerance * size)
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_ddp_with_half_precision_gradients_on_the_wire(wire):
    """The replicas stay identical (train_dp checks), the bytes are half of fp32's, and
    20 steps of AdamW end near the fp32 exchange's parameters."""
    comm = world()
    full, dp32 = train_dp("gpt", "float32", "adamw", comm, bucket_cap_mb=1e-3, algorithm="ring")
    half, dp16 = train_dp("gpt", "float32", "adamw", comm, bucket_cap_mb=1e-3, algorithm="ring", wire=wire)
    sent = [sum(c.stats.bytes_sent for c in dp.comms) for dp in (dp16, dp32)]  # the buckets' allreduces
    assert 2 * sent[0] == sent[1]
    assert relative(half.parameters(), [p.data for p in full.parameters()]) <= 2e-2
