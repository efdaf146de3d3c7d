"""The training loop: build data, model and optimizer from a Config, train, evaluate.

The same loop runs on one process or on ``P`` MPI ranks. With ``P`` ranks every rank
builds the same model from the seed, the strategy of ``parallel.strategy`` wraps it
(``ddp``: :class:`~mpitrain.parallel.data_parallel.DataParallel`; ``zero1``:
:class:`~mpitrain.parallel.zero.Zero1`) on the data-parallel communicator of a
:class:`~mpitrain.topology.ProcessGrid`, and each rank reads its ``B/P`` slice of the
same global batches. The loop per step: take the batch, forward, backward (buckets of
gradients start their allreduce as they complete), finish the gradient exchange,
optional global-norm clipping, set the scheduled learning rate, optimizer step, zero
the gradients. Progress lines (rank 0) report the loss averaged over ranks, learning
rate, samples/s and achieved GFLOP/s (FLOPs counted from the model's shapes on the first
step, see :mod:`mpitrain.observe.flops`); each epoch prints the per-rank I/O table, and
the end of the run the per-rank split of step time into compute, communication
(exposed and total), I/O and waiting, with bytes sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mpitrain import checkpoint, nn, ops, optim, rng
from mpitrain.comm import SingleComm, started_thread_level
from mpitrain.config import Config, ConfigError, check_ranks
from mpitrain.data import DataError, Dataset, ShardReader, open_dataset
from mpitrain.data.loader import SAMPLING, normalize, random_shift, shifts
from mpitrain.observe.flops import FlopCount
from mpitrain.observe.io import io_row, io_table
from mpitrain.observe.metrics import MetricsLog
from mpitrain.observe.timeline import Timeline
from mpitrain.observe.timing import time_table
from mpitrain.parallel.data_parallel import DataParallel
from mpitrain.parallel.param_server import UNBOUNDED, ParameterServer
from mpitrain.parallel.zero import Zero1
from mpitrain.runtime import blas_threads, huge_page_heap, limit_blas_threads, tune_allocator
from mpitrain.tensor import Tensor, default_dtype, no_grad, observe_ops
from mpitrain.topology import ProcessGrid
from mpitrain.watchdog import Watchdog

EVAL_BATCH_PER_RANK = 250  # images per rank per evaluation batch
HEAP_WARMUP_STEPS = 3  # training steps after which the heap has its size (runtime.huge_page_heap)


# ---------------------------------------------------------------- building
def open_data(cfg: Config, comm, log) -> Dataset:
    """Open the dataset of ``cfg.data`` on every rank: an embedded default is built by
    rank 0 on first use; every shard's structure is checked on every rank, and with
    ``data.verify`` each shard's content is re-hashed by one rank. A problem anywhere
    raises the same DataError on every rank."""
    d = cfg.data
    if d.path:
        path = d.path
    else:
        from mpitrain_datasets import embedded

        comm.agree(lambda: embedded.ensure(d.name, log) if comm.rank == 0 else None)
        path = embedded.location(d.name)
    dataset = comm.agree(open_dataset, path)
    if d.verify:
        def check():
            problems = dataset.verify(comm.rank, comm.size)
            if problems:
                raise DataError(problems[0])
        comm.agree(check)
    return dataset


def check_config_against_data(cfg: Config, data: Dataset) -> None:
    """The checks that need the data: raise ConfigError naming the field."""
    text_model = cfg.model.name == "gpt"
    if text_model != (data.kind == "text"):
        raise ConfigError(f"data.path: {data.path} holds {data.kind} data ({data.name}), but model.name "
                          f"{cfg.model.name!r} trains on {'text' if text_model else 'images'}")
    if text_model:
        if "data.shift" in cfg.given:
            raise ConfigError("data.shift: augmentation applies to image data only")
        shortest = min(s.count for s in data.splits.values())
        if cfg.model.block_size + 1 > shortest:
            raise ConfigError(f"model.block_size: windows of block_size + 1 = {cfg.model.block_size + 1} "
                              f"tokens do not fit the {shortest}-token split of {data.name}")
        for split in ("train", "val"):
            data.split(split)
        return
    train = data.split("train")
    data.split("test")
    if cfg.train.global_batch_size > train.count:
        raise ConfigError(f"train.global_batch_size: must be at most the {train.count} training images of "
                          f"{data.name}, got {cfg.train.global_batch_size}")
    if len(train.sample_shape) != 3 or train.sample_shape[0] != train.sample_shape[1]:
        raise ConfigError(f"data.path: the CNNs expect square (H, W, C) images, {data.name} has "
                          f"{train.sample_shape}")


def build_model(cfg: Config, data) -> nn.Module:
    """The model of ``cfg.model`` for ``data``, initialised from the global seed."""
    m = cfg.model
    with default_dtype(cfg.train.dtype):
        if m.name == "gpt":
            gcfg = nn.GPTConfig(vocab_size=len(data.vocab), block_size=m.block_size, n_layer=m.n_layer,
                                n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias,
                                checkpoint_activations=m.checkpoint_activations)
            return nn.GPT(gcfg)
        h, _, c = data.split("train").sample_shape
        kinds = {"lenet": lambda: nn.LeNet(c, h, len(data.classes), m.channels, m.hidden, m.dropout),
                 "convnet": lambda: nn.ConvNet(c, h, len(data.classes), m.channels),
                 "resnet": lambda: nn.ResNet(c, h, len(data.classes), m.widths, m.blocks)}
        return kinds[m.name]()


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
                       buffer_mb=cfg.data.buffer_mb, prefetch=cfg.data.prefetch)


def build_schedule(cfg: Config, total_steps: int):
    o = cfg.optim
    if o.schedule == "constant":
        return optim.Constant(o.lr, o.warmup_steps)
    return optim.WarmupCosine(o.lr, min(o.warmup_steps, total_steps), total_steps, o.min_lr)


# ------------------------------------------------------------------ steps
def image_loss(model: nn.Module, x: np.ndarray, y: np.ndarray) -> Tensor:
    return ops.cross_entropy(model(Tensor(x)), y)


def text_loss(model: nn.Module, x: np.ndarray, y: np.ndarray) -> Tensor:
    return model(x, y)[1]


def backward(model: nn.Module, loss_fn, x, y, timeline=None) -> float:
    """Forward and backward on this rank's part of one batch (with data parallelism the
    buckets' allreduces start during backward); returns this rank's loss."""
    loss = loss_fn(model, x, y)
    if timeline is not None:
        timeline.backward_starts()
    loss.backward()
    return loss.item()


def layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers as the timeline shows them: a GPT's embedding, blocks and
    head; a CNN's top-level modules."""
    if isinstance(model, nn.GPT):
        return [("embed", model.embed), *((f"block {i}", b) for i, b in enumerate(model.blocks)),
                ("head", model.head)]
    return [(name, m) for name, m in model._modules.items()]


def update(model: nn.Module, opt: optim.Optimizer, parallel, lr: float, grad_clip: float) -> None:
    """The optimizer step after :func:`backward` (Zero1 owns it: reduce-scatter, update
    of this rank's shard, allgather), then zero the gradients."""
    if isinstance(parallel, Zero1):
        parallel.step(lr, grad_clip)
        parallel.zero_grad()
        return
    if grad_clip > 0:
        optim.clip_grad_norm(model.parameters(), grad_clip)
    opt.set_lr(lr)
    opt.step()
    opt.zero_grad()


def discard(opt: optim.Optimizer, parallel) -> None:
    """Drop the gradients of a step that is skipped."""
    if isinstance(parallel, Zero1):
        parallel.zero_grad()
    else:
        opt.zero_grad()


def wrap(cfg: Config, model: nn.Module, opt: optim.Optimizer, dp_comm):
    """The strategy of ``cfg.parallel`` around ``model`` on ``dp_comm``."""
    par = cfg.parallel
    if par.strategy == "zero1":
        return Zero1(model, opt, dp_comm, algorithm=par.allreduce)
    return DataParallel(model, dp_comm, bucket_cap_mb=par.bucket_mb, algorithm=par.allreduce,
                        progress=par.progress)


def evaluate_images(model: nn.Module, data: Dataset, cfg: Config, comm) -> tuple[float, float]:
    """(accuracy, mean loss) on the whole test split, each rank scoring its share."""
    split = data.split("test")
    reader = ShardReader(split, rank=comm.rank, size=comm.size, global_batch=EVAL_BATCH_PER_RANK * comm.size,
                         seed=cfg.train.seed, shuffle=False, drop_last=False, prefetch=1)
    model.eval()
    correct, total_loss, n = 0, 0.0, 0
    with no_grad():
        for batch in reader.epoch(0):
            if not len(batch.y):
                continue
            logits = model(Tensor(normalize(batch.x, data.mean, data.std, cfg.train.dtype)))
            total_loss += ops.cross_entropy(logits, batch.y, reduction="sum").item()
            correct += int((logits.data.argmax(axis=-1) == batch.y).sum())
            n += len(batch.y)
    model.train()
    sums = np.sum(comm.allgather((correct, total_loss, n)), axis=0)
    return sums[0] / sums[2], sums[1] / sums[2]


def evaluate_text(model: nn.Module, data: Dataset, cfg: Config, comm) -> float:
    """Mean loss per token over the validation windows (all of them, or the first
    ``train.eval_batches`` global batches)."""
    reader = ShardReader(data.split("val"), rank=comm.rank, size=comm.size,
                         global_batch=cfg.train.global_batch_size, seed=cfg.train.seed, shuffle=False,
                         drop_last=False, window=cfg.model.block_size, prefetch=1)
    limit = cfg.train.eval_batches or reader.steps_per_epoch
    model.eval()
    total, n = 0.0, 0
    with no_grad():
        for batch in reader.epoch(0):
            if batch.step >= limit:
                break
            if len(batch.x):
                total += text_loss(model, batch.x, batch.y).item() * len(batch.x)
                n += len(batch.x)
    model.train()
    sums = np.sum(comm.allgather((total, n)), axis=0)
    return sums[0] / sums[1]


# ------------------------------------------------------------------- loop
@dataclass
class Result:
    steps: int = 0
    seconds: float = 0.0  # wall time of the loop, evaluations included
    samples_per_s: float = 0.0  # of the training steps alone
    gflops_per_s: float = 0.0
    final_loss: float = float("nan")
    test_accuracy: float | None = None
    test_loss: float | None = None
    val_loss: float | None = None
    sample: str | None = None
    stall_fraction: float = 0.0  # share of step time spent waiting for batches
    history: list = field(default_factory=list)
    io: list = field(default_factory=list)  # per epoch, the rows of the I/O table (rank 0)
    timing: list = field(default_factory=list)  # per rank: the rows of the time table (rank 0)
    start_step: int = 0  # where this run began (a resumed run: its checkpoint's step)
    checkpoint: str | None = None  # the last checkpoint written
    stopped: str | None = None  # the signal that stopped the run early
    skipped: int = 0  # steps whose update was skipped for a non-finite loss (run.on_nan = "skip")
    staleness: dict = field(default_factory=dict)  # ps: applied gradients by staleness


def train(cfg: Config, log=print, comm=None, resume: bool = False, warn=None) -> Result:
    """Train as ``cfg`` says, printing progress through ``log`` and warnings through
    ``warn`` (rank 0 only); returns the figures. ``comm`` is the world communicator
    (:func:`mpitrain.comm.world`); without one the run is a single process with no MPI
    at all. With ``resume`` the run continues from the newest readable checkpoint in
    ``run.dir`` (or starts if there is none)."""
    comm = comm or SingleComm()
    check_ranks(cfg, comm.size)
    warn = warn or _stderr
    loud = log is print  # the command line: a parameter server's worker 0 prints its progress too
    if comm.rank != 0:
        log = warn = _silent
    comm.agree(_prepare_run_dir, cfg, resume)
    t = cfg.train
    threads = blas_threads(t.threads, comm.node_size())
    tune_allocator()
    with limit_blas_threads(threads):
        grid = ProcessGrid(comm)
        data = open_data(cfg, comm, log)
        check_config_against_data(cfg, data)
        rng.manual_seed(t.seed)
        model = build_model(cfg, data)
        opt = build_optimizer(cfg, model)
        same_everywhere(cfg, model, comm)
        if cfg.parallel.strategy == "ps":
            grid.free()
            try:
                return _train_ps(cfg, model, opt, data, comm, threads, log, print if loud else _silent)
            finally:
                data.close()
        parallel = wrap(cfg, model, opt, grid.dp_comm)
        is_text = cfg.model.name == "gpt"
        reader = train_reader(cfg, data, grid.dp_rank, grid.dp_size)
        total = t.steps or t.epochs * reader.steps_per_epoch
        schedule = build_schedule(cfg, total)
        log(f"model {cfg.model.name}: {model.num_parameters():,} parameters; data {data.name} ({data.path}), "
            f"{reader.n:,} training {'windows' if is_text else 'samples'}, {reader.steps_per_epoch} steps per "
            f"epoch; {total} steps of {t.global_batch_size}; {threads} BLAS thread(s) per rank; {t.dtype}")
        log(_describe(cfg, parallel, comm))
        try:
            first = 0
            if resume:
                path = checkpoint.latest(cfg.run.dir, comm, warn)
                if path is None:
                    log(f"resume: no checkpoint in {checkpoint.directory(cfg.run.dir)}, starting at step 0")
                else:
                    attrs = checkpoint.restore(path, cfg=cfg, model=model, optimizer=opt, parallel=parallel,
                                               comm=comm, warn=warn)
                    first = int(attrs["step"])
                    log(f"resumed from {path} at step {first} (saved by {attrs['ranks']} rank(s), "
                        f"{attrs['strategy']}, mpitrain {attrs['mpitrain_version']})")
                    if first > total:
                        raise ConfigError(f"train.steps: the checkpoint is at step {first}, beyond this run's "
                                          f"{total} steps")
            return _loop(cfg, model, opt, parallel, schedule, data, reader, total, first, comm, log, warn)
        finally:
            data.close()
            if isinstance(parallel, DataParallel):
                parallel.close()
            grid.free()


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


def _prepare_run_dir(cfg: Config, resume: bool) -> None:
    """Refuse to mix two runs' checkpoints in one directory. (It is created when the
    loop starts, after every check: a refused run leaves nothing behind.)"""
    if resume and cfg.parallel.strategy == "ps":
        raise ConfigError("parallel.strategy: a parameter-server run cannot be resumed (its final checkpoint "
                          "can, with parallel.strategy = 'ddp' or 'zero1')")
    run = cfg.run.dir
    if not run:
        if resume:
            raise ConfigError("run.dir: resuming needs the run directory that holds the checkpoints")
        return
    if not resume and checkpoint.listed(run):
        raise ConfigError(f"run.dir: {run} already holds the checkpoints of a run; resume it (--resume) "
                          "or choose another run directory")


def _train_ps(cfg: Config, model, opt, data: Dataset, comm, threads: int, log, progress) -> Result:
    """The parameter-server strategy: servers serve, workers pull, compute, push; then
    every rank takes the final parameters and evaluates its share of the test split.
    Rank 0 is a server and sees no loss: worker 0 prints the progress lines through
    ``progress``."""
    par, t = cfg.parallel, cfg.train
    S, W = par.servers, comm.size - par.servers
    is_text = data.kind == "text"
    loss_fn = text_loss if is_text else image_loss
    reader = train_reader(cfg, data, max(0, comm.rank - S), W)  # servers build one for its plan only
    total = t.steps or t.epochs * reader.steps_per_epoch
    schedule = build_schedule(cfg, total)
    if par.staleness == 0:
        lr_at = schedule  # one update per global step
    else:
        def lr_at(version):  # W updates (one per worker) per global step
            return schedule(min(version // W, total - 1))
    # asynchronously the run ends after total x W applied gradients (the samples of `total`
    # global batches), whoever computed them: a fast worker takes more steps than a slow one
    ps = ParameterServer(model, opt, comm, servers=S, staleness=par.staleness, lr_at=lr_at,
                         max_updates=None if par.staleness == 0 else total * W)
    mode = {0: "synchronous"}.get(par.staleness, "asynchronous, unbounded" if par.staleness == UNBOUNDED
                                  else f"asynchronous, at most {par.staleness} step(s) ahead")
    log(f"model {cfg.model.name}: {model.num_parameters():,} parameters; data {data.name} ({data.path}); "
        f"{total} steps of {t.global_batch_size} ({t.global_batch_size // W} per worker); {threads} BLAS thread(s) "
        f"per rank; {t.dtype}")
    log(f"parallel: ps, {S} server(s) + {W} worker(s), {mode}; per worker per step "
        f"{sum(ps.bytes_per_worker_step()) / 1e6:.2f} MB (push + pull)")
    result = Result()
    # worker 0 writes the metrics: the servers never see a loss, and workers do not wait for each other
    writes = cfg.run.dir and ps.worker == 0
    if writes:
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    metrics = MetricsLog(Path(cfg.run.dir) / "metrics.jsonl" if writes else None)
    metrics.write("start", step=0, total_steps=total, steps_per_epoch=reader.steps_per_epoch, ranks=comm.size,
                  config=cfg.to_dict())
    timeline = Timeline(comm) if cfg.run.timeline and cfg.run.dir else None
    traced = timeline.span if timeline is not None else _untraced
    start = time.perf_counter()
    if ps.is_server:
        ps.serve(trace=None if timeline is None else
                 lambda name, category, a, b: timeline.add(name, category, "compute", a, b))
    else:
        slow = ps.worker == par.slow_worker and par.slow_factor > 1
        window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        step = 0
        with contextlib.closing(reader.batches()) as batches:
            for batch in batches:
                with traced("pull (wait for the servers' replies)", "communication"):
                    go = ps.pull_wait()
                if not go or (par.staleness == 0 and step == total):
                    break
                x, y = _inputs(cfg, data, batch)
                tick = time.perf_counter()
                with traced("forward and backward", "backward"):
                    loss = backward(model, loss_fn, x, y)
                if slow:  # a straggler: this worker computes slow_factor times as long
                    with traced("straggling", "compute"):
                        time.sleep((par.slow_factor - 1) * (time.perf_counter() - tick))
                with traced("push", "communication"):
                    ps.push(step)
                window_loss += loss
                window_steps += 1
                result.final_loss = loss
                step += 1
                if step == HEAP_WARMUP_STEPS:
                    huge_page_heap()
                if ps.worker == 0 and step % t.log_interval == 0:
                    rate = window_steps * t.global_batch_size // W / (time.perf_counter() - window_start)
                    progress(f"worker 0: step {step} | loss {window_loss / window_steps:.4f} | "
                             f"lr {schedule(min(step, total - 1)):.2e} | {rate:,.0f} samples/s on this worker")
                    # samples/s: worker 0's rate times the workers, exact when synchronous
                    metrics.write("train", step=step, loss=window_loss / window_steps,
                                  lr=schedule(min(step, total - 1)), samples_per_s=rate * W)
                    window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        ps.stop()
        result.steps = step
    train_seconds = time.perf_counter() - start
    sent, received = ps.bytes_sent, ps.bytes_received
    waited = ps.comm.stats.seconds  # in Waitany, Recv, and waiting for replies and sends
    stats = reader.epoch_stats()
    read = sum(st.read_seconds for st in stats)
    stall = sum(st.stall_seconds for st in stats)
    rows = comm.gather((comm.rank, train_seconds, waited, waited, read, stall, sent), root=S)
    ps.gather_parameters()
    ps.gather_buffers(model)
    histogram = ps.staleness_histogram()
    _write_timeline(timeline, cfg.run.dir, log)
    slowest = max(comm.allgather(train_seconds))
    steps = comm.allgather(result.steps)[S:]  # each worker's
    result.final_loss = comm.bcast(result.final_loss, root=S)
    result.steps, result.staleness = total, histogram
    result.samples_per_s = total * t.global_batch_size / slowest
    _evaluate(model, data, cfg, comm, total, result, metrics, log)
    if cfg.run.dir:  # the servers write their parameters' optimizer state: the trainer's format
        if comm.rank == 0:
            Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        epoch, epoch_step = divmod(total, reader.steps_per_epoch)
        path = checkpoint.save(cfg.run.dir, total, model=model, optimizer=opt, parallel=ps, cfg=cfg, comm=comm,
                               keep=cfg.run.keep, epoch=epoch, epoch_step=epoch_step)
        result.checkpoint = str(path)
        metrics.write("checkpoint", step=total, path=str(path), why="end of training")
        log(f"step {total}: checkpoint {path} (end of training; resume it with ddp or zero1)")
    if histogram:
        log("staleness of the applied gradients (server version - version computed on): " +
            ", ".join(f"{k}: {v}" for k, v in histogram.items()))
    traffic = comm.gather((comm.rank, sent, received))
    if comm.rank == 0:
        push, pull = ps.bytes_per_worker_step()
        for (rank, out, into), n in zip(traffic[S:], steps):
            log(f"worker {rank - S}: {n} steps, sent {out / 1e6:.2f} MB, received {into / 1e6:.2f} MB; per step "
                f"{(out - 16 * S) / max(n, 1) / 1e6:.3f} + {(into - pull) / max(n, 1) / 1e6:.3f} MB "
                f"(formula: {push / 1e6:.3f} + {pull / 1e6:.3f})")
    result.seconds = time.perf_counter() - start
    metrics.write("end", step=total, steps_timed=total, steps_per_epoch=reader.steps_per_epoch, seconds=result.seconds,
                  samples_per_s=result.samples_per_s, gflops_per_s=0.0,
                  stall_fraction=stall / (train_seconds + stall) if train_seconds else 0.0, staleness=histogram,
                  ranks=_per_rank(rows))
    log(f"done: {total} steps in {slowest:.1f} s of training, {result.samples_per_s:,.0f} samples/s")
    ps.close()
    return result


def _describe(cfg: Config, parallel, comm) -> str:
    par = cfg.parallel
    P = parallel.comm.size
    level = f", MPI thread level {started_thread_level()}" if comm.size > 1 else ""
    if isinstance(parallel, Zero1):
        what = (f"zero1 over {P} rank(s): optimizer state sharded, {par.allreduce} reduce-scatter + allgather "
                f"of {parallel.flat_grads.nbytes / 1e6:.2f} MB")
    else:
        what = (f"ddp over {P} rank(s): {len(parallel.buckets)} bucket(s) of <= {par.bucket_mb:g} MB, "
                f"{par.allreduce} allreduce, progress '{par.progress}'")
    return f"parallel: {what}{level}; {parallel.bytes_per_step() / 1e6:.2f} MB sent per rank per step"


def _silent(*args) -> None:
    pass


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _agree_on_step(comm, loss: float, received: int | None) -> tuple[float, str | None]:
    """The global batch's loss (each rank's is the mean over equally many samples) and
    the name of a stop signal any rank received (None: none), in one allreduce of the
    loss and a count per stop signal (a scheduler signals every rank: counts, not
    signal numbers, survive the sum)."""
    buf = np.zeros(1 + len(_StopSignals.SIGNALS))
    buf[0] = loss
    if received is not None:
        buf[1 + _StopSignals.SIGNALS.index(signal.Signals(received).name)] = 1
    if comm.size > 1:
        comm.allreduce(buf)
        buf[0] /= comm.size
    seen = [name for name, count in zip(_StopSignals.SIGNALS, buf[1:]) if count > 0]
    return float(buf[0]), (seen[0] if seen else None)


def _inputs(cfg: Config, data: Dataset, batch) -> tuple[np.ndarray, np.ndarray]:
    """Model inputs of a reader batch: token windows as they are; images augmented
    (rank-count independent draws) and normalised."""
    if data.kind == "text":
        return batch.x, batch.y
    x = batch.x
    if cfg.data.shift:
        dy, dx = shifts(cfg.train.seed, batch.epoch, batch.step, cfg.train.global_batch_size, cfg.data.shift,
                        batch.lanes)
        x = random_shift(x, dy, dx, cfg.data.shift)
    return normalize(x, data.mean, data.std, cfg.train.dtype), batch.y


def _loop(cfg: Config, model, opt, parallel, schedule, data: Dataset, reader: ShardReader, total: int, first: int,
          comm, log, warn) -> Result:
    t, o, run = cfg.train, cfg.optim, cfg.run
    is_text = data.kind == "text"
    loss_fn = text_loss if is_text else image_loss
    result = Result(start_step=first)
    flops = FlopCount()
    if run.dir and comm.rank == 0:
        Path(run.dir).mkdir(parents=True, exist_ok=True)
    metrics = MetricsLog(Path(run.dir) / "metrics.jsonl" if run.dir and comm.rank == 0 else None, first)
    timeline = Timeline(comm) if run.timeline and run.dir else None
    if timeline is not None:
        timeline.instrument(layers(model))
        reader.on_read = lambda start, end, nbytes: timeline.add("read", "io", "io", start, end, bytes=nbytes)
        if isinstance(parallel, DataParallel):
            parallel.on_bucket = lambda i, start, end, nbytes: timeline.add(
                f"allreduce bucket {i}", "communication", "communication", start, end, bytes=nbytes)
    traced = timeline.span if timeline is not None else _untraced
    metrics.write("start", step=first, total_steps=total, steps_per_epoch=reader.steps_per_epoch, ranks=comm.size,
                  config=cfg.to_dict())
    window_loss, window_steps, window_time = 0.0, 0, 0.0
    train_seconds = 0.0  # optimizer steps only, without data and evaluation
    epoch_seconds: dict[int, float] = {}
    start = time.perf_counter()

    def evaluate(step: int) -> None:
        with traced("evaluate", "evaluate"):
            parallel.sync_buffers()
            _evaluate(model, data, cfg, comm, step, result, metrics, log)
        huge_page_heap()  # evaluation batches may have grown the heap

    def report_io(epoch: int) -> None:
        if epoch not in reader.stats:  # nothing read in it by this process (a resumed run)
            return
        row = io_row(comm.rank, reader.stats[epoch], epoch_seconds.get(epoch, 0.0))
        rows = comm.gather(row)
        if comm.rank == 0:
            log(io_table(f"I/O epoch {epoch + 1}", rows, reader.sample_bytes))
            result.io.append(rows)

    def times() -> tuple:
        """This rank's seconds so far: steps, communication exposed and total, reading,
        waiting for data; and bytes sent."""
        exposed, comm_total = parallel.comm_seconds()
        stats = reader.epoch_stats()
        read = sum(s.read_seconds for s in stats)
        stall = sum(s.stall_seconds for s in stats)
        return comm.rank, train_seconds, exposed, comm_total, read, stall, parallel.bytes_sent

    def save(step: int, why: str) -> None:
        if not run.dir:
            return
        parallel.sync_buffers()  # one set of batch-norm statistics, the same that any rank would save
        epoch, epoch_step = divmod(step, reader.steps_per_epoch)
        with traced("checkpoint", "checkpoint"):
            path = checkpoint.save(run.dir, step, model=model, optimizer=opt, parallel=parallel, cfg=cfg, comm=comm,
                                   keep=run.keep, epoch=epoch, epoch_step=epoch_step)
        result.checkpoint = str(path)
        metrics.write("checkpoint", step=step, path=str(path), why=why)
        log(f"step {step}: checkpoint {path} ({why})")

    bar = None
    if log is print and _terminal():  # rank 0 on a terminal: a progress bar, the lines above it
        bar = tqdm(total=total, initial=first, unit="step", dynamic_ncols=True, file=sys.stdout, leave=False)
        log = bar.write
    stop = _StopSignals()
    step = first
    epoch = max(0, first - 1) // reader.steps_per_epoch  # a boundary just passed still evaluates
    first_epoch, first_step = divmod(first, reader.steps_per_epoch)
    batches = reader.batches(first_epoch, first_step=first_step)
    waiting = time.perf_counter()
    watchdog = Watchdog(comm, run.stall_warn_s, run.stall_abort_s)  # prints on every rank
    if first and first != total and t.eval_interval and first % t.eval_interval == 0:
        evaluate(first)  # the killed run evaluated after its checkpoint; maybe not before it died
    with stop, contextlib.closing(watchdog), contextlib.closing(batches), bar or contextlib.nullcontext():
        for batch in batches:
            if timeline is not None:
                timeline.add("data wait", "io", "compute", waiting, time.perf_counter())
            if step >= total:
                break
            if batch.epoch != epoch:
                report_io(epoch)
                epoch = batch.epoch
                if not t.eval_interval and not is_text:
                    evaluate(step)
            x, y = _inputs(cfg, data, batch)
            lr = schedule(step)
            tick = time.perf_counter()
            with observe_ops(flops) if not flops.total else contextlib.nullcontext(), watchdog.phase(step, "computing"):
                loss = backward(model, loss_fn, x, y, timeline)
            if isinstance(parallel, DataParallel):
                with traced("finish", "communication"), watchdog.phase(step, "gradient exchange"):
                    parallel.finish()  # wait for the buckets, average
            with watchdog.phase(step, "agreeing on the step"):
                loss, stopping = _agree_on_step(comm, loss, stop.received)
            if np.isfinite(loss):
                with traced("optimizer", "optimizer"), watchdog.phase(
                        step, "ZeRO-1 update" if isinstance(parallel, Zero1) else "computing"):
                    update(model, opt, parallel, lr, o.grad_clip)
            elif run.on_nan == "skip":
                discard(opt, parallel)
                result.skipped += 1
                warn(f"warning: step {step}: loss is {loss}, update skipped (run.on_nan = 'skip')")
            else:
                saved = checkpoint.listed(run.dir) if run.dir else []
                raise FloatingPointError(f"loss is {loss} at step {step}; last good checkpoint: "
                                         f"{saved[-1] if saved else 'none'}; lower optim.lr or set optim.grad_clip")
            seconds = time.perf_counter() - tick
            window_time += seconds
            train_seconds += seconds
            epoch_seconds[batch.epoch] = epoch_seconds.get(batch.epoch, 0.0) + seconds
            if np.isfinite(loss):
                window_loss += loss
                window_steps += 1
            result.final_loss = loss
            step += 1
            if step == first + HEAP_WARMUP_STEPS:
                huge_page_heap()
            if bar is not None:
                bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
                bar.update(1)
            if step % t.log_interval == 0 or step == total:
                if window_steps:
                    rate = window_steps * t.global_batch_size / window_time
                    gflops = window_steps * flops.total * comm.size / window_time / 1e9
                    log(f"step {step}/{total} | loss {window_loss / window_steps:.4f} | lr {lr:.2e} | "
                        f"{rate:,.0f} samples/s | {gflops:.1f} GFLOP/s")
                    metrics.write("train", step=step, epoch=batch.epoch, loss=window_loss / window_steps, lr=lr,
                                  samples_per_s=rate, gflops_per_s=gflops,
                                  ranks=_per_rank(comm.gather(times())))
                window_loss, window_steps, window_time = 0.0, 0, 0.0
            if stopping:
                result.stopped = stopping
                save(step, result.stopped)
                break
            if step == total:
                save(step, "end of training")
            elif run.checkpoint_interval and step % run.checkpoint_interval == 0:
                save(step, f"every {run.checkpoint_interval} steps")
            if t.eval_interval and step % t.eval_interval == 0 and step != total:
                evaluate(step)
            waiting = time.perf_counter()
    if bar is not None:  # closed: lines go straight out again
        log = print
    report_io(epoch)

    result.steps = step
    if result.stopped:
        how = f"resume with --resume (run directory {run.dir})" if run.dir else "nothing was saved: no run.dir"
        log(f"stopped by {result.stopped} after step {step}; {how}")
        metrics.write("stopped", step=step, signal=result.stopped)
        _write_timeline(timeline, run.dir, log)
        return result

    evaluate(total)
    _write_timeline(timeline, run.dir, log)
    result.seconds = time.perf_counter() - start
    done = total - first
    result.samples_per_s = done * t.global_batch_size / train_seconds if train_seconds else 0.0
    result.gflops_per_s = done * flops.total * comm.size / train_seconds / 1e9 if train_seconds else 0.0
    stall = sum(s.stall_seconds for s in reader.epoch_stats())
    result.stall_fraction = stall / (train_seconds + stall) if train_seconds else 0.0
    digest = parallel.check_replicas()
    rows = comm.gather(times())
    if comm.rank == 0:
        result.timing = rows
        if done:  # a resumed run that was already finished has no steps to show
            log(time_table(rows, done))
        if comm.size > 1:
            log(f"replicas identical on all {comm.size} ranks (parameters sha256 {digest[:16]})")
    if is_text and t.sample_tokens and comm.rank == 0:
        prompt_split = data.split("val")
        first_char = np.empty(1, dtype=prompt_split.x_dtype)
        prompt_split.read("x", 0, 1, first_char)
        prompt = first_char[None, :].astype(np.int64)  # (1, 1): the first held-out character
        ids = model.generate(prompt, t.sample_tokens, temperature=0.8, top_k=None,
                             generator=np.random.default_rng((t.seed, SAMPLING)))
        result.sample = data.decode(ids[0, 1:])
        log("sample:\n" + result.sample)
    metrics.write("end", step=total, steps_timed=done, steps_per_epoch=reader.steps_per_epoch,
                  seconds=result.seconds, samples_per_s=result.samples_per_s,
                  gflops_per_s=result.gflops_per_s, stall_fraction=result.stall_fraction,
                  ranks=_per_rank(rows))
    log(f"done: {done} steps in {result.seconds:.1f} s; training steps {train_seconds:.1f} s, "
        f"{result.samples_per_s:,.0f} samples/s, {result.gflops_per_s:.1f} GFLOP/s; "
        f"waited for data {stall:.2f} s ({100 * result.stall_fraction:.2f}% of step time)")
    return result


def _evaluate(model: nn.Module, data: Dataset, cfg: Config, comm, step: int, result: Result, metrics: MetricsLog,
              log) -> None:
    """Score the model on the held-out split (collective), print the figure and record
    it in ``result`` and the metrics file."""
    if data.kind == "text":
        result.val_loss = evaluate_text(model, data, cfg, comm)
        log(f"step {step}: val loss {result.val_loss:.4f}")
    else:
        result.test_accuracy, result.test_loss = evaluate_images(model, data, cfg, comm)
        log(f"step {step}: test accuracy {100 * result.test_accuracy:.2f}%, test loss {result.test_loss:.4f}")
    record = {"step": step, "val_loss": result.val_loss, "test_accuracy": result.test_accuracy}
    result.history.append(record)
    metrics.write("eval", test_loss=result.test_loss, **record)


def _write_timeline(timeline: Timeline | None, run_dir: str, log) -> None:
    """Gather every rank's events into ``run_dir/timeline.json`` (collective; no-op
    without a timeline)."""
    if timeline is None:
        return
    timeline.close()
    where = timeline.write(Path(run_dir) / "timeline.json")
    if where is not None:
        log(f"timeline: {where} (open it in https://ui.perfetto.dev or chrome://tracing)")


TIME_FIELDS = ("rank", "step_s", "comm_exposed_s", "comm_total_s", "read_s", "wait_s", "bytes_sent")


def _per_rank(rows) -> list[dict]:
    """Gathered time rows as metrics records (``rows`` is None on ranks that did not gather)."""
    return [dict(zip(TIME_FIELDS, row)) for row in rows or ()]


@contextlib.contextmanager
def _untraced(*args, **kwargs):
    yield


def _terminal() -> bool:
    """Whether stdout is a terminal with a width (not a log file, not SLURM's output)."""
    try:
        return sys.stdout.isatty() and os.get_terminal_size(sys.stdout.fileno()).columns > 0
    except (OSError, ValueError):
        return False


class _StopSignals:
    """SIGTERM and SIGUSR1 (a scheduler's notice: SLURM sends them before preemption
    or the time limit) only set a flag; the loop finishes the step, saves a checkpoint
    and returns. Installed in the main thread only, and put back on exit."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        self.received = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                if hasattr(signal, name):
                    sig = getattr(signal, name)
                    self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
