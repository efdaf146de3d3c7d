"""Everything a run trains with, built from a Config: data, model, optimizer, and this
rank's part of the ``dp x pp x tp`` grid, its :class:`Role`.

The one place where strategy names are read. :func:`build_role` stacks the grid in one
sequence, the order in which the axes wrap the model: every rank builds the whole model
from the seed; ``tp`` swaps each layer for this rank's slice of it
(:func:`~mpitrain.parallel.tensor_parallel.slice_gpt`); ``pp`` keeps this rank's stage
of the layers (:class:`~mpitrain.parallel.pipeline.PipelineStage`); ``dp`` wraps the
replicas' gradient sync of ``parallel.sync`` (:data:`SYNCS`) around what is left, and a
rank holding a part of the model adds the whole model's view over the other axes
(:class:`~mpitrain.train.parts.PartSync`). ``ps`` splits the ranks into parameter
servers and workers instead (:func:`_ps_role`). The loop and the end of the run read
only the Role.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mpitrain import checkpoint, cost, flat, nn, ops, optim, rng
from mpitrain.comm import SingleComm
from mpitrain.comm.grid import GridShape, ProcessGrid
from mpitrain.config import Config, ConfigError, check_against_data, cut_refused
from mpitrain.data import DataError, Dataset, ShardReader, open_dataset
from mpitrain.data.loader import normalize
from mpitrain.output import unwritable
from mpitrain.parallel import GradSync, tensor_parallel
from mpitrain.parallel.data_parallel import DataParallel
from mpitrain.parallel.local import LocalSync
from mpitrain.parallel.param_server import ParameterServer
from mpitrain.parallel.pipeline import PipelineStage
from mpitrain.parallel.zero import Zero1, Zero2
from mpitrain.parallel.zero3 import Zero3
from mpitrain.precision import MixedPrecision
from mpitrain.tensor import default_dtype
from mpitrain.train import finetune
from mpitrain.train.parts import PartSync, shared_kind, slices
from mpitrain.train.schedule import WholeModel

# parallel.sync -> its gradient sync over dp_comm ("ps" is a role split: _ps_role)
SYNCS = {
    "local": lambda cfg, model, opt, dp_comm, kind: LocalSync(model, opt, dp_comm),
    "ddp": lambda cfg, model, opt, dp_comm, kind: DataParallel(
        model, dp_comm, optimizer=opt, bucket_cap_mb=cfg.parallel.bucket_mb, algorithm=cfg.parallel.allreduce,
        progress=cfg.parallel.progress, wire=cfg.parallel.wire),
    "zero1": lambda cfg, model, opt, dp_comm, kind: Zero1(model, opt, dp_comm, algorithm=cfg.parallel.allreduce,
                                                          kind=kind),
    "zero2": lambda cfg, model, opt, dp_comm, kind: Zero2(model, opt, dp_comm, algorithm=cfg.parallel.allreduce,
                                                          bucket_cap_mb=cfg.parallel.bucket_mb,
                                                          accumulate=cfg.parallel.accumulate, kind=kind),
    "zero3": lambda cfg, model, opt, dp_comm, kind: Zero3(model, opt, dp_comm, algorithm=cfg.parallel.allreduce,
                                                          kind=kind, gather=cfg.parallel.gather),
}  # kind: a parameter -> the whole model's sum it owes (train.parts.shared_kind), for a sharded part


@dataclass
class Role:
    """What one rank does in the run: run the training loop with ``sync`` and ``schedule``, or serve."""

    sync: GradSync
    model: nn.Module  # what this rank trains: the model, its slices, or its pipeline stage
    optimizer: optim.Optimizer  # over model's parameters
    schedule: object  # how a lane's batch becomes gradients (train.schedule.WholeModel, or the PipelineStage)
    grid: GridShape  # the ranks that train together, dp x pp x tp
    axes: dict  # "dp" | "pp" | "tp" -> the counter of this rank's communicator on that axis
    loop_comm: object  # the ranks that run the loop in step: they agree on each step, evaluate and save together
    lane: tuple[int, int]  # (lane, lanes): this rank's part of every global batch
    leads: bool  # this rank speaks for the loop: progress lines and metrics.jsonl
    takes_input: bool = True  # its model reads the batch's inputs (a pipeline's later stages: activations)
    serve: Callable | None = None  # a server's work instead of the loop: serve(trace)
    closers: list = field(default_factory=list)

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
    identity: dict | None = None  # the run's (mpitrain.train.identity), set once it is known
    parameters: int = 0  # the whole model's
    tuning: str = ""  # what trains of it, when not everything does (finetune.describe)

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
        whole, tuning = sum(q.size for q in model.parameters()), finetune.describe(model, cfg)
        layout = checkpoint.Layout.of(model, build_optimizer(cfg, model))
        same_everywhere(cfg, model, world)
        t = cfg.train
        total = t.steps or t.epochs * train_reader(cfg, data, 0, 1).steps_per_epoch  # as many on every lane
        lr = build_lr_schedule(cfg, total)
        if cfg.parallel.sync == "ps":
            role = _ps_role(cfg, world, grid, model, lr, total, data)
        else:
            role, layout = build_role(cfg, world, grid, model, data, layout)
    except BaseException:
        data.close()
        raise
    return Run(cfg, world, data, role.model, role.optimizer, role, train_reader(cfg, data, *role.lane), total, lr,
               layout, parameters=whole, tuning=tuning)


def build_role(cfg: Config, world, grid, model, data, layout: checkpoint.Layout) -> tuple[Role, checkpoint.Layout]:
    """This rank's part of the grid, in the order the axes wrap the whole ``model``: its
    slice of every layer (tp), its stage of the layers (pp), the replicas' sync (dp).
    Returns the role, and ``layout`` with the slices this rank holds."""
    par, t = cfg.parallel, cfg.train
    g = ProcessGrid(world, *grid)
    sizes = [sum(q.size for q in layer.parameters()) for _, layer in model.named_layers()]  # the cut: whole layers
    stage, everyone = None, None
    if g.tp_size > 1:  # tp: this rank's slice of every layer
        trained = [n for n, q in model.named_parameters() if q.requires_grad]
        tensor_parallel.slice_gpt(model, g.tp_comm, par.sequence_parallel)
        finetune.freeze(model, trained)  # the slices are new parameters, under the whole model's names
        everyone = [slices(model.config, g.tp_size, r) for r in range(g.tp_size)]
        layout = layout.with_parts(everyone[g.tp_rank])
    if g.pp_size > 1:  # pp: this rank's stage of the layers
        whole = model.named_layers()
        model = stage = _stage(cfg, g, model, data, sizes)
        _first_stage_trains(whole[stage.bounds[0] : stage.bounds[1]], g)
    opt = build_optimizer(cfg, model)
    order = [q for group in opt.param_groups for q in group["params"]]
    if t.precision != "fp32":  # the model's weights become half precision, the optimizer keeps float32
        opt = MixedPrecision(opt, t.precision)
        for q in model.parameters():  # a frozen weight has no float32 master: it is held in 16 bits too
            if not q.requires_grad:
                q.data = q.data.astype(opt.dtype)
        if stage is not None:
            stage.scaler = opt.scaler  # the last stage's loss is scaled (WholeModel's is scaled alike)
    kind = shared_kind(model, stage, par.sequence_parallel and everyone is not None)
    sync = SYNCS["local" if par.sync == "ddp" and g.dp_size == 1 else par.sync](cfg, model, opt, g.dp_comm, kind)
    if stage is not None or everyone is not None:  # the whole model's sums, norm and checkpoints over the parts
        sync = PartSync(sync, model, layout, stage, g.tp_comm if everyone else None, everyone,
                        par.sequence_parallel, order)
    schedule = stage or WholeModel(model, t.micro_batches, data.kind == "text", getattr(opt, "scaler", None),
                                   t.label_smoothing)
    axes = {"dp": g.dp_comm.stats, **{name: comm.stats for name, comm, size in
                                      (("pp", g.pp_comm, g.pp_size), ("tp", g.tp_comm, g.tp_size)) if size > 1}}
    role = Role(sync, model, opt, schedule, g.shape, axes, loop_comm=world, lane=(g.dp_rank, g.dp_size),
                leads=world.rank == 0, takes_input=g.pp_rank == 0, closers=[sync.close, g.free])
    return role, layout


def _stage(cfg: Config, g: ProcessGrid, model, data, sizes: list[int]) -> PipelineStage:
    """This rank's pipeline stage of ``model``'s layers (``sizes``: the whole layers' parameter
    counts, which the cut balances); a schedule the shapes cannot run is a config error."""
    loss = model.head.loss if cfg.model.name == "gpt" else ops.cross_entropy  # a sliced head's loss is its own
    try:
        return PipelineStage(model, g.pp_comm, example_input(cfg, data), loss, schedule_name=cfg.parallel.schedule,
                             micro_batches=cfg.train.micro_batches, chunks=cfg.parallel.chunks, sizes=sizes,
                             label_smoothing=cfg.train.label_smoothing)
    except ValueError as e:
        g.free()
        raise cut_refused(cfg, e) from None


def _first_stage_trains(first: list, g: ProcessGrid) -> None:
    """Refuse (on every rank alike) a fine-tuning pipeline whose first stage trains
    nothing: its output needs no gradient, so its backward could not start."""
    if not any(q.requires_grad for _, layer in first for q in layer.parameters()):
        g.free()
        raise ConfigError(f"train.trainable: the first pipeline stage ({_span([n for n, _ in first], 0, len(first))}) "
                          "trains nothing, which a pipeline's backward cannot start from: train one of its "
                          "parameters, or cut fewer stages (parallel.pp)")


def _ps_role(cfg: Config, world, grid, model, lr, total, data) -> Role:
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
    opt = build_optimizer(cfg, model)
    ps = ParameterServer(model, opt, world, servers=S, staleness=par.staleness, lr_at=lr_at,
                         max_updates=None if lockstep else total * W, slow=slow)
    g = None if ps.is_server else ProcessGrid(ps.workers, *grid)
    schedule = WholeModel(model, cfg.train.micro_batches, data.kind == "text",
                          label_smoothing=cfg.train.label_smoothing)
    return Role(ps, model, opt, schedule, GridShape(*grid),
                {"dp": ps.comm.stats}, loop_comm=ps.workers if lockstep else SingleComm(),
                lane=(0, W) if g is None else (g.dp_rank, g.dp_size), leads=ps.worker == 0,  # a server reads no batch
                serve=ps.serve if ps.is_server else None, closers=[ps.close] + ([] if g is None else [g.free]))


# ---------------------------------------------------------------- what it says
def describe(cfg: Config, role: Role) -> str:
    """The start of a run's line on its grid: what each axis splits, and the bytes one rank
    sends per step by the formulas (:mod:`mpitrain.cost`); the time table at the end of
    the run gives what its communicators counted."""
    par, pp, tp = cfg.parallel, role.grid.pp, role.grid.tp
    if par.sync == "ps":
        S, W = par.servers, role.grid.size
        mode = {0: "synchronous"}.get(par.staleness, "asynchronous, unbounded" if par.staleness == -1
                                      else f"asynchronous, at most {par.staleness} step(s) ahead")
        nbytes = sum(q.data.nbytes for q in role.model.parameters() if q.requires_grad)
        return (f"{grid_line(cfg, role)}; ps, {S} server(s) + {W} worker(s), {mode}; per worker per step "
                f"{sum(cost.parameter_server_bytes(nbytes, S)) / 1e6:.2f} MB (push + pull)")
    line = _replicas(cfg, role)
    if tp > 1:
        C, nh = cfg.model.n_embd, cfg.model.n_head
        line = (f"tensor parallel over {tp} ranks{', sequence parallel' if par.sequence_parallel else ''}: "
                f"{nh // tp} of {nh} heads and about {4 * C // tp} of {4 * C} hidden units and 1/{tp} of the "
                f"vocabulary per rank; replicas: {line}")
    if pp > 1:
        s, m, v, inner = role.schedule, cfg.train.micro_batches, par.chunks, ("slices" if tp > 1 else "replicas")
        cut = "; ".join(f"stage {k} (rank {k % pp}): {_span(s.names, s.bounds[k], s.bounds[k + 1])}, "
                        f"{sum(s.sizes[s.bounds[k] : s.bounds[k + 1]]):,} params" for k in range(pp * v))
        line = (f"pipeline: {pp} stages, {m} micro-batches, schedule {par.schedule}"
                f"{f' with {v} chunks per rank' if v > 1 else ''}, bubble "
                f"{100 * cost.bubble_fraction(par.schedule, pp, m, v):.1f}% by the formula; {cut}; {inner}: {line}")
    return f"{grid_line(cfg, role)}; {line}"


def grid_line(cfg: Config, role: Role) -> str:
    """The grid the ranks train on, as the log and checkpoints name it."""
    grid = f"dp {role.grid.dp} x pp {role.grid.pp} x tp {role.grid.tp}"
    return f"{cfg.parallel.servers} server(s), workers on {grid}" if cfg.parallel.sync == "ps" else grid


def _replicas(cfg: Config, role: Role) -> str:
    """The data-parallel sync's part of the line: its layout and bytes per rank per step."""
    par, P, m = cfg.parallel, role.grid.dp, cfg.train.micro_batches
    params = [q for q in role.model.parameters() if q.requires_grad]
    nbytes = sum(q.data.nbytes for q in params)
    buckets = len(flat.buckets(reversed(params), int(par.bucket_mb * 2**20)))
    if par.sync in ("local", "ddp") and P == 1:
        return "local: one data-parallel rank, no gradient exchange"
    if par.sync == "ddp":
        what = (f"ddp over {P} rank(s): {buckets} bucket(s) of <= {par.bucket_mb:g} MB, {par.allreduce} allreduce"
                f"{'' if par.wire == 'fp32' else ' in ' + par.wire}, progress '{par.progress}'")
        sent = cost.data_parallel_bytes(sum(q.size for q in params), P, params[0].data.itemsize,
                                        2 if par.wire != "fp32" else None, par.allreduce)
    elif par.sync == "zero1":
        what = (f"zero1 over {P} rank(s): optimizer state sharded, {par.allreduce} reduce-scatter + allgather of "
                f"{nbytes / 1e6:.2f} MB")
        sent = cost.zero_bytes(1, nbytes, P)
    elif par.sync == "zero2":
        what = (f"zero2 over {P} rank(s): gradients and optimizer state sharded, {buckets} bucket(s) of <= "
                f"{par.bucket_mb:g} MB reduce-scattered during backward ({par.allreduce}; micro-batches "
                f"{par.accumulate}), parameters allgathered after the update")
        sent = cost.zero_bytes(2, nbytes, P, m, par.accumulate == "sharded")
    else:
        what = (f"zero3 over {P} rank(s): parameters, gradients and optimizer state sharded, gathered "
                f"{'layer by layer' if par.gather == 'layer' else 'once a step and kept'} over "
                f"{len(role.model.named_layers())} layer(s) ({par.allreduce})")
        sent = cost.zero_bytes(3, nbytes, P, m, gather=par.gather, split=par.pp > 1 and par.schedule == "zb-h1")
    return f"{what}; {sent / 1e6:.2f} MB sent per rank per step"


def _span(names: list[str], lo: int, hi: int) -> str:
    return names[lo] if hi - lo == 1 else f"{names[lo]}..{names[hi - 1]}"


def resume_hint(cfg: Config, run_dir: str, ranks: int = 1, launcher: str | None = None,
                through: bool = False) -> str:
    """What the stop line says to resume a run on its ``ranks``, with the ``launcher``
    that started it (:func:`mpitrain.runtime.launcher`; None: none found), ``through``
    ``mpitrain launch`` if it was."""
    ps = cfg.parallel.sync == "ps"
    command = f"mpitrain train --resume {run_dir}" + (" --set parallel.sync=ddp" if ps else "")
    if launcher:
        command = f"{'mpitrain launch ' if through else ''}{launcher} -n {ranks} {command}"
    elif ranks > 1:
        command += f" (on {ranks} ranks, with the launcher that started this run)"
    return f"its checkpoint resumes with ddp or zero1: {command}" if ps else f"resume with: {command}"


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
    """The model of ``cfg.model`` for ``data``, initialised from the global seed, with the
    adapters and the frozen parameters of a fine-tuning config (:mod:`~mpitrain.train.finetune`)."""
    m = cfg.model
    with default_dtype(cfg.train.dtype):
        if m.name == "gpt":
            gcfg = nn.GPTConfig(vocab_size=len(data.vocab), block_size=m.block_size, n_layer=m.n_layer,
                                n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias,
                                checkpoint_activations=m.checkpoint_activations, gelu=m.gelu)
            model = nn.GPT(gcfg)
        else:
            h, _, c = data.split("train").sample_shape
            kinds = {"lenet": lambda: nn.LeNet(c, h, len(data.classes), m.channels, m.hidden, m.dropout),
                     "convnet": lambda: nn.ConvNet(c, h, len(data.classes), m.channels),
                     "resnet": lambda: nn.ResNet(c, h, len(data.classes), m.widths, m.blocks)}
            model = kinds[m.name]()
        finetune.prepare(cfg, model)  # LoRA's adapters (drawn after the weights), and what is frozen
        return model


def example_input(cfg: Config, data) -> object:
    """One input sample with its batch axis, as the model sees it: ``(1, T)`` token ids
    or ``(1, H, W, C)`` normalised images (a pipeline derives its boundaries from it)."""
    if data.kind == "text":
        return np.zeros((1, cfg.model.block_size), dtype=np.int64)
    split = data.split("train")
    return normalize(np.zeros((1, *split.sample_shape), dtype=split.x_dtype), data.mean, data.std, cfg.train.dtype)


def build_optimizer(cfg: Config, model: nn.Module) -> optim.Optimizer:
    """The optimizer of ``cfg.optim`` over the parameters of ``model`` that train."""
    o = cfg.optim
    groups = optim.decay_groups(((n, q) for n, q in model.named_parameters() if q.requires_grad), o.weight_decay)
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
    if (why := unwritable(run, folder=True)) is not None:  # before the model is built, not at its first write
        raise ConfigError(f"run.dir: {why}")
    if not resume and checkpoint.listed(run):
        raise ConfigError(f"run.dir: {run} already holds the checkpoints of a run; resume it (--resume) "
                          "or choose another run directory")
