"""MPI tier: pipeline stages equal one process; the boundary's bytes and its adjoint;
a configuration that differs between stages is refused before the first send.

Every rank also trains the single-process reference (same seed, the whole global batch
in one pass, the same per-sample dropout streams) and compares its stage's parameters
with the reference's of the same names. GPT with its token embedding tied to the output
head (held by the first and last stage), dropout 0.1, AdamW with clipping, 20 steps.
"""

import numpy as np
import pytest
from conftest import small_text

from mpitrain import checkpoint, nn, ops, optim, rng
from mpitrain.comm import Tag
from mpitrain.comm.grid import ProcessGrid
from mpitrain.parallel.data_parallel import DataParallel
from mpitrain.parallel.local import LocalSync
from mpitrain.parallel.pipeline import Mailbox, PipelineStage, Posted, Recv, Send
from mpitrain.tensor import Tensor, default_dtype
from mpitrain.train.parts import PartSync

STEPS, B, T, SEED, CLIP = 20, 8, 8, 3, 0.5


def world():
    from mpitrain.comm import world as w

    return w()


def gpt(n_layer=2, dropout=0.1):
    rng.manual_seed(SEED)
    return nn.GPT(nn.GPTConfig(vocab_size=13, block_size=T, n_layer=n_layer, n_head=2, n_embd=16,
                               dropout=dropout))


def batches():
    g = np.random.default_rng(11)
    x = g.integers(0, 13, (STEPS, B, T))
    return [(x[s], np.roll(x[s], -1, axis=1)) for s in range(STEPS)]


def adamw(model):
    return optim.AdamW(optim.decay_groups(model.named_parameters(), 0.1), 3e-3)


def reference(dtype, n_layer, micro=1):
    """One process: each step's global batch in ``micro`` passes (1: one), dropout
    streams keyed by each sample's place in the global batch."""
    with default_dtype(dtype):
        model = gpt(n_layer)
    opt = adamw(model)
    b = B // micro
    for step, (x, y) in enumerate(batches()):
        for k in range(micro):
            part = slice(k * b, (k + 1) * b)
            with rng.sample_streams(SEED, step, np.arange(B)[part]):
                (model(x[part], y[part])[1] * (1.0 / micro)).backward()
        optim.update(opt, model.parameters(), None, CLIP)
        opt.zero_grad()
    return {n: p.data.copy() for n, p in model.named_parameters()}


def pipeline(comm, dtype, n_layer, pp, dp, schedule, m, chunks=1, clip=CLIP):
    """Train the stage of this rank on a ``dp x pp`` grid; its parameters by name."""
    g = ProcessGrid(comm, dp=dp, pp=pp)
    with default_dtype(dtype):
        model = gpt(n_layer)
    layout = checkpoint.Layout.of(model, adamw(model))
    stage = PipelineStage(model, g.pp_comm, np.zeros((1, T), dtype=np.int64), ops.cross_entropy,
                          schedule_name=schedule, micro_batches=m, chunks=chunks)
    opt = adamw(stage)
    inner = DataParallel(stage, g.dp_comm, optimizer=opt) if dp > 1 else LocalSync(stage, opt)
    sync = PartSync(inner, stage, layout, stage=stage)
    lane = B // dp
    losses = []
    for step, (x, y) in enumerate(batches()):
        places = np.arange(g.dp_rank * lane, (g.dp_rank + 1) * lane)
        streams = lambda samples, step=step: rng.sample_streams(SEED, step, samples)  # noqa: E731
        losses.append(stage.run(x[places], y[places], places, sync, streams))
        sync.finish()
        sync.step(None, clip)
        sync.zero_grad()
    params = {n: p.data.copy() for n, p in stage.named_parameters()}
    sync.close()
    g.free()
    return params, stage, losses


def relative(mine: dict, ref: dict) -> float:
    a = np.concatenate([mine[n].reshape(-1) for n in sorted(mine)]).astype(np.float64)
    b = np.concatenate([ref[n].reshape(-1) for n in sorted(mine)]).astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def grids(size):
    """(pp, dp) of the grids this world can hold: every rank a stage, and dp x pp."""
    return [(size, 1)] + ([(2, size // 2)] if size >= 4 and size % 2 == 0 else [])


CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule,chunks", CASES)
def test_each_schedule_equals_one_process_float64(schedule, chunks):
    comm = world()
    for pp, dp in grids(comm.size):
        if dp > 1 and schedule == "gpipe":
            continue  # dp x pp: GPipe's order of passes is 1F1B's with the forwards first
        n_layer = max(2, pp * chunks - 2)  # embed + blocks + head: a layer per chunk at least
        m = 4
        mine, stage, _ = pipeline(comm, np.float64, n_layer, pp, dp, schedule, m, chunks)
        ref = reference(np.float64, n_layer)
        assert set(mine) <= set(ref) and len(mine) < len(ref)  # a part of the model
        err = relative(mine, ref)
        assert err < 1e-12, f"pp {pp} x dp {dp} {schedule}: relative difference {err:.2e}"
        assert err > 0 or m == 1  # the summation order differs: equal values would mean no test


@pytest.mark.mpi(min_size=2)
def test_float32_is_bitwise_where_the_sums_are_in_the_same_order():
    """With one micro-batch, no clipping and two stages, every gradient is summed in the
    same order as in one process (the tied weight's two parts are added once, and a + b
    = b + a): bitwise. With m > 1 the tied weight's gradient is (sum of the embedding's
    parts) + (sum of the head's) on the stages, but the sum over micro-batches of (head's
    + embedding's) in one process; and clipping adds the stages' squares in another order."""
    comm = world()
    if comm.size != 2:
        pytest.skip("two stages")
    mine, _, _ = pipeline(comm, np.float32, 2, 2, 1, "1f1b", 1, clip=0.0)
    with default_dtype(np.float32):
        model = gpt(2)
    opt = adamw(model)
    for step, (x, y) in enumerate(batches()):
        with rng.sample_streams(SEED, step, np.arange(B)):
            model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        if n in mine:
            np.testing.assert_array_equal(mine[n], p.data, err_msg=n)


@pytest.mark.mpi(min_size=2)
def test_the_loss_is_the_global_batch_mean_on_the_last_stage():
    comm = world()
    _, stage, losses = pipeline(comm, np.float64, 2 * comm.size - 2, comm.size, 1, "1f1b", 4)
    if stage.rank != comm.size - 1:
        assert losses == [None] * STEPS
        return
    with default_dtype(np.float64):
        model = gpt(2 * comm.size - 2)
    x, y = batches()[0]
    with rng.sample_streams(SEED, 0, np.arange(B)):
        first = model(x, y)[1].item()
    assert losses[0] == pytest.approx(first, rel=1e-12)


@pytest.mark.mpi(min_size=2)
def test_bytes_per_boundary_per_micro_batch():
    """Each boundary carries b/m x T x C x itemsize forward and the same backward."""
    comm = world()
    m = 4
    g = ProcessGrid(comm, dp=1, pp=comm.size)
    stage = PipelineStage(gpt(2 * comm.size - 2), g.pp_comm, np.zeros((1, T), dtype=np.int64), ops.cross_entropy,
                          micro_batches=m)
    opt = adamw(stage)
    sync = LocalSync(stage, opt)
    x, y = batches()[0]
    b = B // m
    before = g.pp_comm.stats.bytes_sent
    stage.run(x, y, np.arange(B), sync)
    per = b * T * 16 * np.dtype(np.float32).itemsize
    directions = (stage.rank > 0) + (stage.rank < comm.size - 1)  # gradients back, activations on
    assert g.pp_comm.stats.bytes_sent - before == m * per * directions
    g.free()


@pytest.mark.mpi(min_size=2)
def test_send_and_receive_are_adjoint():
    """<F x, y> = <x, F* y> for F: rank 0's x onto rank 1 (forward), F*: rank 1's
    gradient back onto rank 0 (backward)."""
    comm = world().dup()
    g = np.random.default_rng(comm.rank)
    shape = (3, 5)
    if comm.rank == 0:
        x = Tensor(g.standard_normal(shape), requires_grad=True)
        box = Mailbox([])
        token = Send.apply(x, box, comm, 1)
        box.grad = Posted(comm, shape, np.float64, 1, Tag.PP_GRADIENT)
        token.backward()
        comm.waitall([r for r, _ in box.sends])
        mine = float(np.sum(x.data * x.grad))  # <x, F* y>
    elif comm.rank == 1:
        y = g.standard_normal(shape)
        box = Mailbox([])
        box.act = Posted(comm, shape, np.float64, 0, Tag.PP_ACTIVATION)
        z = Recv.apply(Tensor(np.zeros(()), requires_grad=True), box)
        (z * Tensor(y)).sum().backward()
        comm.waitall([comm.isend(box.input_grad, 0, Tag.PP_GRADIENT)])
        mine = float(np.sum(z.data * y))  # <F x, y>
    else:
        mine = None
    both = comm.allgather(mine)
    assert both[0] == pytest.approx(both[1], rel=1e-14)
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_a_configuration_that_differs_between_stages_is_refused_before_any_send():
    comm = world()
    g = ProcessGrid(comm, dp=1, pp=comm.size)
    m = 4 if comm.rank == 0 else 2
    with pytest.raises(ValueError, match="rank 1.*micro-batches"):
        PipelineStage(gpt(2 * comm.size - 2), g.pp_comm, np.zeros((1, T), dtype=np.int64), ops.cross_entropy,
                      micro_batches=m)
    assert g.pp_comm.stats.bytes_sent == 0
    g.free()


# ------------------------------------------------------------------ the trainer
def text_set(d):
    small_text(d, 2000)


def gpt_cfg(data, run_dir, *overrides):
    from mpitrain import config

    return config.from_dict({
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "dropout": 0.1},
        "data": {"path": str(data)},
        "optim": {"name": "adamw", "lr": 3e-3, "grad_clip": 1.0, "warmup_steps": 2},
        "train": {"global_batch_size": 8, "steps": 12, "log_interval": 4, "eval_interval": 6, "eval_batches": 2,
                  "sample_tokens": 0, "threads": 1, "dtype": "float64"},
        "run": {"dir": str(run_dir), "checkpoint_interval": 6, "keep": 5}}, list(overrides))


def lenet_cfg(data, run_dir, *overrides):
    """LeNet (convolutions, pools, a classifier with dropout), augmented, float64, 8 steps."""
    from mpitrain import config

    return config.from_dict({
        "model": {"name": "lenet", "channels": [2, 4], "hidden": 8, "dropout": 0.25},
        "data": {"path": str(data), "shift": 1},
        "optim": {"name": "adamw", "lr": 3e-3, "grad_clip": 1.0},
        "train": {"global_batch_size": 32, "steps": 8, "log_interval": 4, "threads": 1, "dtype": "float64"},
        "run": {"dir": str(run_dir)}}, list(overrides))


@pytest.mark.mpi(min_size=2)
def test_the_trainer_on_a_pipeline_equals_one_process_and_its_checkpoint_resumes_on_one():
    """``mpitrain train`` with pp = all ranks (1F1B, 4 micro-batches, dropout, float64)
    reaches the parameters and validation loss of one process; its step-6 checkpoint,
    resumed by one process, ends where the pipeline ended, and the one process's, resumed
    on the pipeline, where the one process ended (the layouts are the same)."""
    from test_checkpoint import assert_close
    from test_mpi_data import shared_data

    from mpitrain import checkpoint, train
    from mpitrain.comm import SingleComm

    comm = world()
    d = shared_data(comm, make=text_set)
    root = d.parent
    p = comm.size
    lines = []
    piped = train.train(gpt_cfg(d, root / "pp", f"parallel.pp={p}", "parallel.dp=1", "train.micro_batches=4"),
                        log=lines.append, comm=comm)
    if comm.rank == 0:  # the header: the schedule, its bubble by the formula, the cut
        parallel = next(line for line in lines[0].splitlines() if line.startswith("parallel: "))
        assert parallel.startswith(f"parallel: dp 1 x pp {p} x tp 1; pipeline: {p} stages, 4 micro-batches, "
                                   f"schedule 1f1b, bubble "), parallel
        assert "stage 0 (rank 0): embed" in parallel and "head, " in parallel, parallel
    mine = root / f"one-{comm.rank}"
    one = train.train(gpt_cfg(d, mine, "train.micro_batches=4"), log=lambda *a: None, comm=SingleComm())
    assert piped.val_loss == pytest.approx(one.val_loss, rel=1e-12)
    assert piped.final_loss == pytest.approx(one.final_loss, rel=1e-12)
    assert_close(checkpoint.path_for(mine, 12), checkpoint.path_for(root / "pp", 12), rtol=1e-11, floor=1e-6)
    resumed = root / f"resumed-{comm.rank}"
    (resumed / "checkpoints").mkdir(parents=True)
    import shutil

    shutil.copy(checkpoint.path_for(root / "pp", 6), resumed / "checkpoints")
    train.train(gpt_cfg(d, resumed, "train.micro_batches=4"), log=lambda *a: None, comm=SingleComm(), resume=True)
    assert_close(checkpoint.path_for(root / "pp", 12), checkpoint.path_for(resumed, 12), rtol=1e-11, floor=1e-6)
    # and the other way: the one process's step-6 checkpoint, resumed on the pipeline
    (root / "back" / "checkpoints").mkdir(parents=True, exist_ok=True)
    if comm.rank == 0:
        shutil.copy(checkpoint.path_for(mine, 6), root / "back" / "checkpoints")
    comm.barrier()
    train.train(gpt_cfg(d, root / "back", f"parallel.pp={p}", "parallel.dp=1", "train.micro_batches=4"),
                log=lambda *a: None, comm=comm, resume=True)
    assert_close(checkpoint.path_for(mine, 12), checkpoint.path_for(root / "back", 12), rtol=1e-11, floor=1e-6)
    if p % 2 == 0 and p > 2:  # dp x pp, ZB-H1: each stage's replicas average, the stages pipeline
        grid = train.train(gpt_cfg(d, root / "grid", "parallel.pp=2", "train.micro_batches=2",
                                   "parallel.schedule=zb-h1"), log=lambda *a: None, comm=comm)
        assert grid.val_loss == pytest.approx(one.val_loss, rel=1e-12)
        assert_close(checkpoint.path_for(mine, 12), checkpoint.path_for(root / "grid", 12), rtol=1e-11, floor=1e-6)


@pytest.mark.mpi(min_size=2)
def test_batch_norm_sees_each_micro_batch_on_a_pipeline_as_in_accumulation():
    """A ResNet cut into stages: each micro-batch is normalised with its own statistics
    and the running statistics are updated once per micro-batch, as when one process
    accumulates the same micro-batches (not as one pass over the whole batch)."""
    comm = world()
    m, steps = 2, 5
    g = np.random.default_rng(4)
    data = [(g.standard_normal((B, 8, 8, 2)), g.integers(0, 5, B)) for _ in range(steps)]

    def resnet():
        rng.manual_seed(SEED)
        with default_dtype(np.float64):
            return nn.ResNet(2, 8, 5, widths=(4, 6), blocks=2)

    grid = ProcessGrid(comm, dp=1, pp=comm.size)
    stage = PipelineStage(resnet(), grid.pp_comm, np.zeros((1, 8, 8, 2)), ops.cross_entropy, micro_batches=m)
    sync = LocalSync(stage, optim.SGD(stage.parameters(), 0.05, momentum=0.9))
    whole = resnet()
    opt = optim.SGD(whole.parameters(), 0.05, momentum=0.9)
    b = B // m
    for x, y in data:
        stage.run(Tensor(x), y, np.arange(B), sync)
        sync.step(None, 0.0)
        sync.zero_grad()
        for k in range(m):
            (ops.cross_entropy(whole(Tensor(x[k * b:(k + 1) * b])), y[k * b:(k + 1) * b]) * (1.0 / m)).backward()
        opt.step()
        opt.zero_grad()
    ref = whole.state_dict()
    mine = stage.state_dict()
    assert any(comm.allgather(any("running_mean" in n for n in mine)))  # some stage normalises
    for n, a in mine.items():
        np.testing.assert_allclose(a, ref[n], rtol=1e-12, atol=1e-14, err_msg=n)
    grid.free()


@pytest.mark.mpi(min_size=2)
def test_a_cnn_cut_into_stages_trains_as_one_process():
    """LeNet's layer list (convolutions, pools, the classifier with dropout) cut over all
    ranks, through the trainer, with augmentation and evaluation of each image and its
    mirror (every stage runs both): one process's figures."""
    from test_checkpoint import assert_close
    from test_mpi_data import shared_data

    from mpitrain import checkpoint, train
    from mpitrain.comm import SingleComm

    comm = world()
    d = shared_data(comm, n=480, test=64)
    both = ["train.micro_batches=4", "data.flip=true", "train.eval_flip=true"]
    piped = train.train(lenet_cfg(d, d.parent / "lenet-pp", *both, f"parallel.pp={comm.size}", "parallel.dp=1",
                                  "parallel.schedule=gpipe"), log=lambda *a: None, comm=comm)
    mine = d.parent / f"lenet-one-{comm.rank}"
    one = train.train(lenet_cfg(d, mine, *both), log=lambda *a: None, comm=SingleComm())
    assert piped.test_accuracy == one.test_accuracy
    assert piped.test_loss == pytest.approx(one.test_loss, rel=1e-12)
    assert_close(checkpoint.path_for(mine, 8), checkpoint.path_for(d.parent / "lenet-pp", 8), rtol=1e-11, floor=1e-6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", [["parallel.pp=2", "train.micro_batches=4"],
                                    ["parallel.pp=2", "train.micro_batches=2", "parallel.schedule=zb-h1"],
                                    ["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"]],
                         ids=["pp 1f1b", "pp zb-h1", "tp", "tp sequence-parallel"])
def test_activation_checkpointing_on_stages_and_slices_equals_one_process(layout):
    """``model.checkpoint_activations`` on pipeline stages and on sliced blocks (dropout
    on, float64): the parameters of one process that keeps its activations, to 1e-11."""
    from test_checkpoint import assert_close
    from test_mpi_data import shared_data

    from mpitrain import checkpoint, train
    from mpitrain.comm import SingleComm

    comm = world()
    if comm.size % 2:
        pytest.skip("the layouts take ranks in pairs")
    d = shared_data(comm, make=text_set)
    root = d.parent
    name = "-".join(layout).replace("=", "")
    run = train.train(gpt_cfg(d, root / f"ckpt{name}", "model.checkpoint_activations=true", *layout),
                      log=lambda *a: None, comm=comm)
    mine = root / f"plain{name}-{comm.rank}"
    micro = [o for o in layout if o.startswith("train.micro_batches")]
    one = train.train(gpt_cfg(d, mine, *micro), log=lambda *a: None, comm=SingleComm())
    assert run.val_loss == pytest.approx(one.val_loss, rel=1e-11)
    assert_close(checkpoint.path_for(mine, 12), checkpoint.path_for(root / f"ckpt{name}", 12), rtol=1e-11, floor=1e-6)
