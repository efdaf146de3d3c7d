"""The trainer: :func:`train` runs a config on one process or on ``P`` MPI ranks.

Its modules, in the order a run meets them (``mpitrain/README.md`` maps them all):
:mod:`~.build` stacks this rank's part of the ``dp x pp x tp`` grid in one sequence
(:func:`~.build.build_role`) and is the only reader of strategy names; :mod:`~.parts`
is the sync of a rank that holds a part of the model; :mod:`~.schedule` owns the
micro-batches; :mod:`~.loop` runs the steps; :mod:`~.resume`, :mod:`~.evaluate` and
:mod:`~.report` continue, score and finish runs.

A run: check the grid against the ranks; build; resume from the newest usable
checkpoint if asked; run the loop (a parameter server serves instead); the role's end
(the servers hand out the final parameters); then the last checkpoint, the final
evaluation and the report: where each rank's time went (compute, communication exposed
and total, I/O, waiting) and a check that every replica holds the same parameters.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from mpitrain import checkpoint, ops
from mpitrain.comm import SingleComm, alone, library, started_thread_level
from mpitrain.config import Config, ConfigError, check_ranks
from mpitrain.data import DataError
from mpitrain.dtypes import dtype_of
from mpitrain.observe.memory import HeapTrace
from mpitrain.observe.timing import Traffic
from mpitrain.parallel import GradSync
from mpitrain.runtime import blas_threads, emulated_cluster, launcher, limit_blas_threads, tune_allocator
from mpitrain.train import identity, resume
from mpitrain.train.build import Role, Run, build_run, describe, prepare_run_dir
from mpitrain.train.loop import Loop
from mpitrain.train.signals import StopSignals, unsaved_stop
from mpitrain.train.report import Outputs, Result, data_identity, finish, time_row

__all__ = ["GradSync", "Result", "Role", "train"]


def train(cfg: Config, log=print, comm=None, resume: bool = False, warn=None, start_over: bool = False,
          config_from: Path | None = None, reconfigure=None, origin: Path | None = None) -> Result:
    """Train as ``cfg`` says, printing progress through ``log`` and warnings through
    ``warn`` (rank 0 only); returns the figures. ``comm`` is the world communicator
    (:func:`mpitrain.comm.world`); without one the run is a single process with no MPI
    at all. With ``resume`` the run continues from the newest usable checkpoint of this
    run in ``run.dir`` (starting if the directory has none; if none is usable it stops,
    unless ``start_over``): :mod:`mpitrain.train.resume`. ``config_from``: the checkpoint
    ``cfg`` was read from (the command line's resume); if that one turns out damaged,
    ``reconfigure(saved config, checkpoint)`` gives the config of the one resumed.
    ``origin``: a checkpoint (of any run) whose model weights a new run starts from."""
    comm = comm or SingleComm()
    warn = warn or _stderr
    loud = log is print  # the command line: a parameter server's worker 0 prints its progress too
    if comm.rank != 0:
        log = warn = _silent
    try:
        check_ranks(cfg, comm.size)
    except ConfigError as e:
        if not resume:
            raise
        g = cfg.parallel
        raise ConfigError(f"{e} (a resumed run keeps its saved layout, dp {g.dp} x pp {g.pp} x tp {g.tp}; change "
                          f"it for these {comm.size} ranks with --set, e.g. --set parallel.pp=1)") from None
    for note in cfg.notes:
        warn(note)
    comm.agree(prepare_run_dir, cfg, resume)
    chosen, ours = _choose(cfg, comm, warn, start_over) if resume else (None, None)
    cfg = _config_of(chosen, cfg, config_from, reconfigure, log)
    threads = blas_threads(cfg.train.threads, comm.node_size())
    tune_allocator()
    with limit_blas_threads(threads), ops.fast_paths(cfg.train.fast_paths):
        for number_format in (cfg.train.precision, cfg.parallel.wire):  # a half format's library is loaded
            dtype_of(number_format)  # before the heap is traced: its import is not the run's
        heap = HeapTrace(cfg.run.trace_memory)  # from before the model exists
        try:
            run = build_run(cfg, comm, check_ranks(cfg, comm.size), log)
        except BaseException:
            heap.stop()
            raise
        try:
            log(_header(run, threads))
            if comm.rank == 0 and comm.size > 1 and (note := unsaved_stop(launcher(), library())):
                log(note)
            first = _resume(run, chosen, log, warn) if chosen else 0
            if chosen is None and resume:
                log(f"resume: no usable checkpoint in {checkpoint.directory(cfg.run.dir)}, starting at step 0")
            came = _start_from(run, origin, log, warn) if origin is not None else None
            run.identity = ours or comm.bcast(identity.new(cfg, data_identity(run.data), came))
            # the loop speaks through its leading rank (with parameter servers, worker 0: not rank 0)
            elsewhere = run.role.leads and comm.rank != 0 and loud
            with alone(DataError):  # a shard found damaged by this rank's reader, mid-run
                return _work(run, first, heap, log, print if elsewhere else log, _stderr if elsewhere else warn)
        finally:
            heap.stop()
            run.close()


def _choose(cfg: Config, comm, warn, start_over: bool):
    return resume.choose(cfg.run.dir, comm, warn, start_over, cfg.to_dict())


def _config_of(chosen, cfg: Config, config_from: Path | None, reconfigure, log) -> Config:
    """The config of the run: ``cfg``, unless the command line read it from a checkpoint
    that is not the one chosen (its header verified, its arrays did not: moved aside)."""
    if chosen is None or config_from is None or Path(config_from) == chosen[0]:
        return cfg
    path = chosen[0]
    if reconfigure is None:
        raise checkpoint.CheckpointError(f"{config_from}: this run's config was read from it, but its content is "
                                         f"damaged (moved aside, above); resume from {path} with the config "
                                         "saved there")
    again = reconfigure(chosen[1]["json"]["config"], path)
    if again.parallel.thread_level != cfg.parallel.thread_level:  # MPI has started at the other level
        raise ConfigError(f"parallel.thread_level: {path} was saved with {again.parallel.thread_level!r}, MPI "
                          f"started with {cfg.parallel.thread_level!r} from {config_from} (moved aside): run the "
                          "same command again")
    log(f"resume: the config saved in {path} (the checkpoint resumed)")
    return again


def _work(run: Run, first: int, heap: HeapTrace, log, loop_log, loop_warn) -> Result:
    """This rank's part: the loop or serving, the role's end, the end of the run."""
    role, world, cfg = run.role, run.world, run.cfg
    result = Result(start_step=first)
    if cfg.run.dir:  # the directory's record of whose it is, before anything else goes in
        world.agree(lambda: identity.write(cfg.run.dir, run.identity) if world.rank == 0 else None,
                    share=checkpoint.CheckpointWriteError)
    out = Outputs(cfg, world, role.leads, first, heap, loop_warn)
    try:
        return _run_and_finish(run, first, result, out, log, loop_log, loop_warn)
    finally:
        out.close()


def _run_and_finish(run: Run, first: int, result: Result, out: Outputs, log, loop_log, loop_warn) -> Result:
    role, world, cfg = run.role, run.world, run.cfg
    out.metrics.write("start", step=first, total_steps=run.total, steps_per_epoch=run.reader.steps_per_epoch,
                      ranks=world.size, threads=blas_threads(cfg.train.threads, world.node_size()),
                      config=cfg.to_dict(), cluster=emulated_cluster(), run=run.identity)
    start = time.perf_counter()
    loop = None
    # the handlers stay until the end: a Ctrl-C during the last checkpoint's write must
    # not interrupt it (with checkpoint_interval = 0 it is the run's only one)
    with StopSignals(loud=world.rank == 0, launcher=launcher() if world.rank == 0 else None) as signals:
        if role.serve is not None:
            traffic = Traffic(role.axes)
            traffic.begin()
            _agreed(world, role.sync, lambda: role.serve(trace=None if out.timeline is None else _trace(out.timeline)))
            traffic.end()
            times = time_row(world.rank, time.perf_counter() - start, traffic, run.reader, serves=True)
        else:
            loop = Loop(run, first, result, out, signals, loop_log, loop_warn)
            _agreed(world, role.sync, loop.execute)
            times = loop.times()
        steps = role.sync.end()
        figures = None if loop is None else loop.figures(time.perf_counter() - start)
        figures = world.bcast(figures, root=world.allgather(role.leads).index(True))
        result.steps = figures["steps"] if steps is None else steps  # a server ran no loop: the leading rank's
        result.stopped = figures["stopped"]
        return finish(run, result, times, figures, out, log)


def _agreed(world, sync: GradSync, work) -> None:
    """Run this rank's ``work`` (the loop, or serving); then, however it ended, the sync
    hears that this rank's loop is over (a parameter-server worker says goodbye, so that
    the servers finish too). A loss that is not finite raises FloatingPointError where
    the loop runs: every rank raises the same one (servers included)."""
    def work_then_leave():
        try:
            work()
        except BaseException:
            with contextlib.suppress(Exception):  # the error that ended the loop is the one to report
                sync.leave()
            raise
        sync.leave()
    world.agree(work_then_leave, share=FloatingPointError)


def _header(run: Run, threads: int) -> str:
    cfg, reader, t = run.cfg, run.reader, run.cfg.train
    what = "windows" if run.data.kind == "text" else "samples"
    micro = f" in {t.micro_batches} micro-batches per rank" if t.micro_batches > 1 else ""
    level = f"; {library()}, thread level {started_thread_level()}" if run.world.size > 1 else ""
    where = (f"run directory: {cfg.run.dir} (checkpoints, metrics.jsonl)" if cfg.run.dir else
             "run directory: none (run.dir = \"\"): nothing is saved")
    return (f"{where}\nmodel {cfg.model.name}: {run.parameters:,} parameters; data {run.data.name} "
            f"({run.data.path}), {reader.n:,} training {what}, {reader.steps_per_epoch} steps per epoch; "
            f"{run.total} steps of {t.global_batch_size}{micro}; {threads} BLAS thread(s) per rank; "
            f"{run.optimizer.describe() if t.precision != 'fp32' else t.dtype}"
            f"{'' if t.fast_paths else '; fast paths off'}"
            f"{f'; training labels smoothed by {t.label_smoothing:g}' if t.label_smoothing else ''}\n"
            f"{run.tuning + chr(10) if run.tuning else ''}"
            f"parallel: {describe(run.cfg, run.role)}{level}")


def _resume(run: Run, chosen: tuple[Path, dict], log, warn) -> int:
    """Load the checkpoint :func:`resume.choose` picked; its step."""
    cfg = run.cfg
    path, attrs = chosen
    resume.check_data(path, attrs["header"].get("data"), data_identity(run.data), warn)
    with run.role.sync.whole_model(masters=True):  # a mixed-precision run's are float32
        attrs = checkpoint.restore(path, model=run.model, optimizer=run.optimizer, sync=run.role.sync,
                                   comm=run.world, layout=run.layout,
                                   check_config=lambda saved: resume.check_config(path, saved, cfg, warn))
    first = int(attrs["step"])
    old = "" if attrs["format_version"] >= 2 else \
        f"; format version {attrs['format_version']}: its metadata has no checksum"
    log(f"resumed from {path} at step {first} (saved by {attrs['ranks']} rank(s), {attrs['strategy']}, "
        f"mpitrain {attrs['mpitrain_version']}{old})")
    if first > run.total:
        raise ConfigError(f"train.steps: the checkpoint is at step {first}, beyond this run's {run.total} steps")
    return first


def _start_from(run: Run, origin: Path, log, warn) -> dict:
    """Load the model weights of the checkpoint ``origin`` (of any run) into a new run;
    what the run's identity records of them."""
    origin = Path(origin)
    fields = run.world.agree(checkpoint.header, origin)
    with run.role.sync.whole_model(masters=True):
        attrs = checkpoint.restore(origin, model=run.model, optimizer=run.optimizer, sync=run.role.sync,
                                   comm=run.world, layout=run.layout, weights_only=True)
    came = identity.of(fields) or {}
    resume.check_data(origin, fields.get("data"), data_identity(run.data), warn)
    log(f"started from the weights of {origin} (step {attrs['step']}"
        f"{', run ' + came['id'] if came else ''}); the optimizer, the step count and the data order start afresh")
    return {"checkpoint": str(origin.resolve()), "step": int(attrs["step"]), "run": came.get("id"),
            "file_sha256": fields.get("file_sha256")}


def _trace(timeline):
    """A server's events on its compute track."""
    return lambda name, category, start, end: timeline.add(name, category, "compute", start, end)


def _silent(*args) -> None:
    pass


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
