"""Everything a run trains with, built from a Config: data, model, optimizer, and the role
of this rank on the process grid.

The one place where strategy names are read: ``parallel.sync`` picks a gradient sync
(:data:`SYNCS`, each following :class:`~mpitrain.train.sync.GradSync`) over the
data-parallel communicator of a ``dp x pp x tp`` :class:`~mpitrain.comm.grid.ProcessGrid`;
``ps`` splits the ranks into parameter servers and workers instead
(:func:`_ps_role`); with ``parallel.pp > 1`` each rank keeps a pipeline stage of the
model, whose replicas the sync joins (:func:`_pipeline_role`). What comes out is a
:class:`Role`: the loop and the end of the run read only that.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mpitrain import checkpoint, nn, ops, optim, rng
from mpitrain.comm import SingleComm
from mpitrain.comm.grid import ProcessGrid
from mpitrain.config import Config, ConfigError, check_against_data
from mpitrain.data import DataError, Dataset, ShardReader, open_dataset
from mpitrain.data.loader import normalize
from mpitrain.parallel import tensor_parallel
from mpitrain.parallel.data_parallel import DataParallel
from mpitrain.parallel.local import LocalSync
from mpitrain.parallel.param_server import ParameterServer
from mpitrain.parallel.pipeline import PipelineStage, PipelineSync
from mpitrain.parallel.tensor_parallel import TensorParallelSync
from mpitrain.parallel.zero import Zero1, Zero2
from mpitrain.parallel.zero3 import Zero3
from mpitrain.precision import MixedPrecision
from mpitrain.tensor import default_dtype
from mpitrain.train import schedule
from mpitrain.train.sync import GradSync

# parallel.sync -> its gradient sync over dp_comm ("ps" is a role split: _ps_role)
SYNCS = {
    "local": lambda cfg, model, opt, dp_comm: LocalSync(model, opt),
    "ddp": lambda cfg, model, opt, dp_comm: DataParallel(
        model, dp_comm, optimizer=opt, bucket_cap_mb=cfg.parallel.bucket_mb, algorithm=cfg.parallel.allreduce,
        progress=cfg.parallel.progress, wire=cfg.parallel.wire),
    "zero1": lambda cfg, model, opt, dp_comm: Zero1(model, opt, dp_comm, algorithm=cfg.parallel.allreduce),
    "zero2": lambda cfg, model, opt, dp_comm: Zero2(model, opt, dp_comm, algorithm=cfg.parallel.allreduce,
                                                    bucket_cap_mb=cfg.parallel.bucket_mb,
                                                    accumulate=cfg.parallel.accumulate),
    "zero3": lambda cfg, model, opt, dp_comm: Zero3(model, opt, dp_comm, algorithm=cfg.parallel.allreduce),
}


@dataclass
class Role:
    """What one rank does in the run: run the training loop with ``sync``, or serve."""

    sync: GradSync
    model: nn.Module  # what this rank trains: the model, or its pipeline stage
    optimizer: optim.Optimizer  # over model's parameters
    schedule: Callable  # schedule(micro, sync, context, before_backward) -> this rank's loss of the step
    loop_comm: object  # the ranks that run the loop in step: they agree on each step, evaluate and save together
    leads: bool  # this rank speaks for the loop: progress lines and metrics.jsonl
    lane: tuple[int, int]  # (lane, lanes): this rank's part of every global batch
    ranks: int  # the ranks that train together (the grid): the loop's figures are scaled to them
    layout: str  # the grid, for the log and checkpoints
    serve: Callable | None = None  # a server's work instead of the loop: serve(trace)
    # the loop's ranks take every step together, for the configured steps, evaluating on the way; False
    # (asynchronous workers): each runs alone until begin_step() says stop, and is scored at the end only
    lockstep: bool = True
    prefix: str = ""  # before the loop's progress lines
    guard: Callable = lambda work: work()  # runs the loop or serve()
    end: Callable = lambda: None  # after them, on every rank: the steps the run has taken (None: the loop's)
    resume_hint: str = "resume with: mpitrain train --resume {dir}"  # after a stop by a signal
    summary: Callable = lambda: ([], {})  # lines for rank 0 and figures, after end() (collective)
    closers: list = field(default_factory=list)
    loss_ranks: int | None = None  # the loop's ranks that compute a loss (None: all; a pipeline: its last stages)
    forward: Callable | None = None  # evaluation: x -> the model's output, None where it ends elsewhere (None: model)
    eval_lane: tuple | None = None  # (lane, lanes) of the evaluation data (None: the communicator's rank, size)
    whole: bool = True  # this rank holds the whole model (it can sample text at the end)
    trace_to: Callable = lambda trace: None  # hands the schedule's recorder trace(name, category, track, start, end)
    bubble: Callable = lambda: 0.0  # seconds this rank has waited inside its schedule for other stages
    text_loss: Callable | None = None  # evaluation: (x, y) -> mean loss, None where it ends elsewhere (None: model's)
    parts: dict = field(default_factory=dict)  # name -> this rank's slice of a parameter sliced over ranks
    axes: Callable | None = None  # () -> {"dp" | "pp" | "tp": (bytes sent, seconds)} (None: all the sync's, dp)

    def close(self) -> None:
        for close in self.closers:
            close()


@dataclass
class Run:
    cfg: Config
    world: object
    data: Dataset
    model: nn.Module  # what this rank trains (role.model)
    optimizer: optim.Optimizer
    role: Role
    reader: ShardReader
    total: int  # optimizer steps of the run
    lr: Callable[[int], float]  # the learning rate at a step
    layout: checkpoint.Layout  # the whole model and optimizer, as checkpoints hold them

    def close(self) -> None:
        self.data.close()
        self.role.close()


def build_run(cfg: Config, world, grid: tuple[int, int, int], log) -> Run:
    """Every rank builds the same model from the seed, then its role on ``grid``
    (``(dp, pp, tp)``, from :func:`mpitrain.config.check_ranks`). Collective."""
    data = open_data(cfg, world, log)
    try:
        check_against_data(cfg, data)
        rng.manual_seed(cfg.train.seed)
        model = build_model(cfg, data)
        opt = build_optimizer(cfg, model)
        layout = checkpoint.Layout.of(model, opt)
        same_everywhere(cfg, model, world)
        t = cfg.train
        total = t.steps or t.epochs * train_reader(cfg, data, 0, 1).steps_per_epoch  # as many on every lane
        lr = build_lr_schedule(cfg, total)
        if cfg.parallel.sync == "ps":
            role = _ps_role(cfg, world, grid, model, opt, lr, total, data)
        else:
            role = _replica_role(cfg, world, grid, model, opt, data, layout)
    except BaseException:
        data.close()
        raise
    return Run(cfg, world, data, role.model, role.optimizer, role, train_reader(cfg, data, *role.lane), total, lr,
               layout.with_parts(role.parts))


def _replica_role(cfg: Config, world, grid, model, opt, data, layout) -> Role:
    """Every rank runs the loop; the model's replicas (or its stage's) synchronise over
    ``dp_comm``. Data parallelism over one rank has nothing to exchange: the local sync."""
    g = ProcessGrid(world, *grid)
    name = "local" if cfg.parallel.sync == "ddp" and g.dp_size == 1 else cfg.parallel.sync
    if g.pp_size > 1:
        return _pipeline_role(cfg, world, grid, g, model, name, data, layout)
    if g.tp_size > 1:
        return _tensor_role(cfg, world, grid, g, model, name, layout)
    if cfg.train.precision != "fp32":  # the model's weights become half precision, the optimizer keeps float32
        opt = MixedPrecision(opt, cfg.train.precision)
    sync = SYNCS[name](cfg, model, opt, g.dp_comm)
    run_schedule = schedule.whole_model(model, data.kind == "text", cfg.train.micro_batches,
                                        getattr(opt, "scaler", None))
    return Role(sync, model, opt, run_schedule, loop_comm=world, leads=world.rank == 0, lane=(g.dp_rank, g.dp_size),
                ranks=world.size, layout=_shape(grid), end=sync.sync_buffers, closers=[sync.close, g.free])


def _tensor_role(cfg: Config, world, grid, g: ProcessGrid, model, sync_name: str, layout) -> Role:
    """This rank keeps its slices of every block, of the vocabulary and of the head
    (:func:`~mpitrain.parallel.tensor_parallel.slice_gpt` over ``tp_comm``), with an
    optimizer of its own; the slices' replicas synchronise over ``dp_comm``. The ranks
    of a tensor-parallel group read the same batches (their lane) and compute the same
    loss."""
    sequence = cfg.parallel.sequence_parallel
    tensor_parallel.slice_gpt(model, g.tp_comm, sequence)
    opt = build_optimizer(cfg, model)
    wholes = tensor_parallel.Wholes(model.config, g.tp_comm, {n: s for n, (s, _) in layout.arrays.items()})
    sync = TensorParallelSync(SYNCS[sync_name](cfg, model, opt, g.dp_comm), model, g.tp_comm, wholes, sequence)
    run_schedule = schedule.whole_model(model, True, cfg.train.micro_batches)
    return Role(sync, model, opt, run_schedule, loop_comm=world, leads=world.rank == 0, lane=(g.dp_rank, g.dp_size),
                ranks=world.size, layout=_shape(grid), end=sync.sync_buffers, closers=[sync.close, g.free],
                eval_lane=(g.dp_rank, g.dp_size), whole=False,
                parts=tensor_parallel.parts(model.config, g.tp_size, g.tp_rank), axes=sync.by_axis)


def _pipeline_role(cfg: Config, world, grid, g: ProcessGrid, model, sync_name: str, data, layout) -> Role:
    """This rank keeps its stage of the model (:class:`PipelineStage` over ``pp_comm``)
    and trains it with an optimizer of its own; the stage's replicas synchronise over
    ``dp_comm``. Every stage of a lane reads the lane's batches (the first needs the
    inputs, the last the targets); the last stages' losses are the step's."""
    par, t = cfg.parallel, cfg.train
    sizes = [sum(q.size for q in layer.parameters()) for _, layer in model.named_layers()]  # cut the whole model
    wholes, parts, counted, across = None, {}, None, None
    if g.tp_size > 1:  # the layers sliced first, then the stage cut from them
        tensor_parallel.slice_gpt(model, g.tp_comm)
        wholes = tensor_parallel.Wholes(model.config, g.tp_comm, {n: s for n, (s, _) in layout.arrays.items()})
        parts = tensor_parallel.parts(model.config, g.tp_size, g.tp_rank)
        sliced = tensor_parallel.sliced_parameters(model)
        counted, across = (lambda q: id(q) in sliced or g.tp_rank == 0), g.tp_comm
    loss = model.head.loss if cfg.model.name == "gpt" else ops.cross_entropy  # a sliced head's loss is its own
    try:
        stage = PipelineStage(model, g.pp_comm, example_input(cfg, data), loss, schedule_name=par.schedule,
                              micro_batches=t.micro_batches, chunks=par.chunks, sizes=sizes, whole=wholes)
    except ValueError as e:
        g.free()
        raise ConfigError(f"{'parallel.chunks' if par.chunks > 1 else 'parallel.pp'}: {e}") from None
    opt = build_optimizer(cfg, stage)
    sync = PipelineSync(SYNCS[sync_name](cfg, stage, opt, g.dp_comm), stage, [n for n, _ in layout.params],
                        counted, across)
    return Role(sync, stage, opt, stage.run, loop_comm=world, leads=world.rank == 0, lane=(g.dp_rank, g.dp_size),
                ranks=world.size, layout=_shape(grid), end=sync.sync_buffers, closers=[sync.close, g.free],
                loss_ranks=g.dp_size * g.tp_size, forward=stage.forward_only, eval_lane=(g.dp_rank, g.dp_size),
                whole=False, trace_to=lambda trace: setattr(stage, "trace", trace), bubble=lambda: stage.waited,
                text_loss=stage.loss_only, parts=parts, axes=sync.by_axis)


def _ps_role(cfg: Config, world, grid, model, opt, lr, total, data) -> Role:
    """Parameter servers: the first ``parallel.servers`` ranks serve, the others are the
    grid's workers and run the loop with the server object as their sync. Synchronous
    workers run in step (the loop's collectives span the workers); asynchronous ones
    each run alone, until the servers have applied ``total x workers`` gradients."""
    par = cfg.parallel
    S, W = par.servers, world.size - par.servers
    lockstep = par.staleness == 0

    def lr_at(at):  # synchronously at a step; asynchronously at a version: W updates (one per worker) a step
        return lr(at if lockstep else min(at // W, total - 1))

    slow = par.slow_factor if 0 <= par.slow_worker == world.rank - S else 1.0
    ps = ParameterServer(model, opt, world, servers=S, staleness=par.staleness, lr_at=lr_at,
                         max_updates=None if lockstep else total * W, slow=slow)
    g = None if ps.is_server else ProcessGrid(ps.workers, *grid)
    run_schedule = schedule.whole_model(model, data.kind == "text", cfg.train.micro_batches)
    role = Role(ps, model, opt, run_schedule, loop_comm=ps.workers if lockstep else SingleComm(), leads=ps.worker == 0,
                lane=(0, W) if g is None else (g.dp_rank, g.dp_size), ranks=W,  # a server reads no batch
                layout=f"{S} server(s), workers on {_shape(grid)}", serve=ps.serve if ps.is_server else None,
                lockstep=lockstep, prefix="" if lockstep else "worker 0: ", end=ps.end, summary=ps.summary,
                resume_hint="its checkpoint resumes with ddp or zero1: mpitrain train --resume {dir} --set "
                            "parallel.sync=ddp",
                closers=[ps.close] + ([] if g is None else [g.free]))

    def guard(work):
        """A loss that is not finite stops the workers (synchronous ones all at the same
        step: they agree on it): the servers must still hear every goodbye, and then every
        rank raise the same error."""
        def work_then_goodbye():
            try:
                result = work()
            except FloatingPointError:
                ps.stop()
                raise
            ps.stop()
            return result
        return world.agree(work_then_goodbye, share=FloatingPointError)

    role.guard = guard
    return role


def _shape(grid) -> str:
    return "dp {} x pp {} x tp {}".format(*grid)


# ---------------------------------------------------------------- the parts
def open_data(cfg: Config, comm, log) -> Dataset:
    """Open the dataset of ``cfg.data`` on every rank: an embedded default is built by
    rank 0 on first use; the manifest's checksum and every shard's metadata and
    structure are checked on every rank. Then, each shard by one rank: with
    ``data.verify`` its content is re-hashed and its labels (text: token ids) checked;
    without, every label is still checked (a byte a sample), and a text's evaluation
    split's token ids, so that a bad one surfaces before step 0 rather than at the
    final evaluation (a text's training tokens are checked as they are read). A problem
    anywhere raises the same DataError on every rank."""
    d = cfg.data
    if d.path:
        path = d.path
    else:
        from mpitrain_datasets import embedded

        comm.agree(lambda: embedded.ensure(d.name, log) if comm.rank == 0 else None)
        path = embedded.location(d.name)
    dataset = comm.agree(open_dataset, path)

    def check():
        if d.verify:
            problems = dataset.verify(comm.rank, comm.size)
        else:  # "val": what train.evaluate scores of a text
            names = dataset.splits if dataset.kind == "image" else [n for n in ("val",) if n in dataset.splits]
            problems = [p for name in names for p in dataset.check_values(name, comm.rank, comm.size)]
        if problems:
            raise DataError(problems[0])

    try:
        comm.agree(check)
    except BaseException:
        dataset.close()
        raise
    return dataset


def build_model(cfg: Config, data) -> nn.Module:
    """The model of ``cfg.model`` for ``data``, initialised from the global seed."""
    m = cfg.model
    with default_dtype(cfg.train.dtype):
        if m.name == "gpt":
            gcfg = nn.GPTConfig(vocab_size=len(data.vocab), block_size=m.block_size, n_layer=m.n_layer,
                                n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias,
                                checkpoint_activations=m.checkpoint_activations, gelu=m.gelu)
            return nn.GPT(gcfg)
        h, _, c = data.split("train").sample_shape
        kinds = {"lenet": lambda: nn.LeNet(c, h, len(data.classes), m.channels, m.hidden, m.dropout),
                 "convnet": lambda: nn.ConvNet(c, h, len(data.classes), m.channels),
                 "resnet": lambda: nn.ResNet(c, h, len(data.classes), m.widths, m.blocks)}
        return kinds[m.name]()


def example_input(cfg: Config, data) -> object:
    """One input sample with its batch axis, as the model sees it: ``(1, T)`` token ids
    or ``(1, H, W, C)`` normalised images (a pipeline derives its boundaries from it)."""
    if data.kind == "text":
        return np.zeros((1, cfg.model.block_size), dtype=np.int64)
    split = data.split("train")
    return normalize(np.zeros((1, *split.sample_shape), dtype=split.x_dtype), data.mean, data.std, cfg.train.dtype)


def build_optimizer(cfg: Config, model: nn.Module) -> optim.Optimizer:
    o = cfg.optim
    groups = optim.decay_groups(model.named_parameters(), o.weight_decay)
    if o.name == "sgd":
        return optim.SGD(groups, o.lr, momentum=o.momentum, nesterov=o.nesterov)
    cls = optim.AdamW if o.name == "adamw" else optim.Adam
    return cls(groups, o.lr, betas=o.betas, eps=o.eps)


def train_reader(cfg: Config, data: Dataset, rank: int, size: int) -> ShardReader:
    """Lane ``rank`` of ``size`` of the training split's global batches."""
    text = cfg.model.name == "gpt"
    return ShardReader(data.split("train"), rank=rank, size=size, global_batch=cfg.train.global_batch_size,
                       seed=cfg.train.seed, window=cfg.model.block_size if text else None,
                       sampling=cfg.data.sampling, buffer_mb=cfg.data.buffer_mb, prefetch=cfg.data.prefetch)


def build_lr_schedule(cfg: Config, total_steps: int):
    o = cfg.optim
    if o.schedule == "constant":
        return optim.Constant(o.lr, o.warmup_steps)
    return optim.WarmupCosine(o.lr, min(o.warmup_steps, total_steps), total_steps, o.min_lr)


def same_everywhere(cfg: Config, model: nn.Module, comm) -> None:
    """Raise ConfigError on every rank unless all ranks run the same config, the same
    mpitrain version and the same parameter shapes (different files or installs on
    different nodes would otherwise train nonsense or hang in mismatched collectives)."""
    import mpitrain

    mine = {"config": json.dumps(cfg.to_dict(), sort_keys=True), "mpitrain version": mpitrain.__version__,
            "model shapes": json.dumps([(n, p.shape) for n, p in model.named_parameters()])}
    digest = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in mine.items()}
    everyone = comm.allgather(digest)
    for rank, theirs in enumerate(everyone):
        differ = [k for k in digest if theirs[k] != everyone[0][k]]
        if differ:
            raise ConfigError(f"rank {rank} differs from rank 0 in its {' and '.join(differ)}: every rank must "
                              "read the same config and run the same mpitrain")


def prepare_run_dir(cfg: Config, resume: bool) -> None:
    """Refuse to mix two runs' checkpoints in one directory. (It is created when the
    loop starts, after every check: a refused run leaves nothing behind.)"""
    if resume and cfg.parallel.sync == "ps":
        raise ConfigError("parallel.sync: a parameter-server run cannot be resumed (its final checkpoint "
                          "can, with parallel.sync = 'ddp' or 'zero1')")
    run = cfg.run.dir
    if not run:
        if resume:
            raise ConfigError("run.dir: resuming needs the run directory that holds the checkpoints")
        return
    if not resume and checkpoint.listed(run):
        raise ConfigError(f"run.dir: {run} already holds the checkpoints of a run; resume it (--resume) "
                          "or choose another run directory")
