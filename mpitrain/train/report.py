"""What a run leaves behind: its result, metrics, timeline, checkpoints and the end-of-run
report (the per-rank time table, the replica check, a text sample)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpitrain import checkpoint, launch
from mpitrain.cost import bytes_per_parameter
from mpitrain.data.loader import SAMPLING
from mpitrain.nn.lora import merged
from mpitrain.runtime import launcher
from mpitrain.observe.memory import CATEGORIES, HeapTrace, heap_line, model_state, state_line
from mpitrain.observe.metrics import MetricsLog
from mpitrain.observe.tensorboard import Board
from mpitrain.observe.timeline import Timeline
from mpitrain.observe.timing import time_table
from mpitrain.observe.prediction import end_of_run
from mpitrain.precision import MixedPrecision
from mpitrain.train import evaluate
from mpitrain.train.build import grid_line, resume_hint


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
    states: list = field(default_factory=list)  # per rank: (model state, heap figures or None) at the end (rank 0)
    flops: float = 0.0  # FLOPs of one step of one rank, counted on the first step, the mean over the loop's ranks


TIME_FIELDS = ("rank", "step_s", "comm_exposed_s", "comm_total_s", "read_s", "wait_s", "bytes_sent", "bubble_s",
               "serves", "axes")


class Outputs:
    """What a run writes besides checkpoints: ``metrics.jsonl`` (by the rank that leads
    the loop) and ``timeline.json`` (every rank's events, with ``run.timeline``); what it
    measures of itself beside them: the heap of its first steps (``run.trace_memory``)."""

    def __init__(self, cfg, world, leads: bool, first: int, heap: HeapTrace | None = None, warn=None):
        run = cfg.run
        self.heap = heap or HeapTrace(enabled=False)  # the heap over the first steps (the loop says when)
        board = Board(Path(run.dir) / "tensorboard", first) if run.tensorboard and run.dir and leads else None
        self.metrics = MetricsLog(Path(run.dir) / "metrics.jsonl" if run.dir and leads else None, first, board,
                                  warn)
        self.timeline = Timeline(world) if run.timeline and run.dir else None

    def close(self) -> None:
        if self.metrics.mirror is not None:
            self.metrics.mirror.close()

    def traced(self, name: str, category: str):
        """A timeline span on the compute track around a block (nothing without a timeline)."""
        return self.timeline.span(name, category) if self.timeline is not None else contextlib.nullcontext()

    def add(self, name: str, category: str, since: float) -> None:
        if self.timeline is not None:
            self.timeline.add(name, category, "compute", since, time.perf_counter())

    def backward_starts(self) -> None:
        if self.timeline is not None:
            self.timeline.backward_starts()

    def write_timeline(self, run_dir: str, log) -> None:
        """Gather every rank's events into ``run_dir/timeline.json`` (collective)."""
        if self.timeline is None:
            return
        self.timeline.close()
        if (where := self.timeline.write(Path(run_dir) / "timeline.json")) is not None:
            log(f"timeline: {where} (open it in https://ui.perfetto.dev or chrome://tracing)")


def save(run, step: int, why: str, result: Result, out: Outputs, log) -> None:
    """Write the checkpoint of ``step`` (collective over the world; nothing without a run directory)."""
    cfg = run.cfg
    if not cfg.run.dir:
        return
    epoch, epoch_step = divmod(step, run.reader.steps_per_epoch)
    with out.traced("checkpoint", "checkpoint"), run.role.sync.whole_model(masters=True):
        path = checkpoint.save(cfg.run.dir, step, model=run.model, optimizer=run.optimizer, sync=run.role.sync,
                               cfg=cfg, comm=run.world, keep=cfg.run.keep, epoch=epoch, epoch_step=epoch_step,
                               strategy=f"{cfg.parallel.sync}, {grid_line(cfg, run.role)}", layout=run.layout,
                               data=data_identity(run.data), run=run.identity, warn=log)
    result.checkpoint = str(path)
    out.metrics.write("checkpoint", step=step, path=str(path), why=why)
    log(f"step {step}: checkpoint {path} ({why})")


def data_identity(data) -> dict:
    """What a checkpoint records of the dataset it was trained on."""
    return {"name": data.name, "manifest_sha256": data.manifest.get("manifest_sha256", "")}


def per_rank(rows) -> list[dict]:
    """Gathered time rows as metrics records (``rows`` is None on ranks that did not gather)."""
    return [dict(zip(TIME_FIELDS, row)) for row in rows or ()]


def time_row(rank: int, seconds: float, traffic, reader, serves: bool = False) -> tuple:
    """One rank's row of the time table (:data:`TIME_FIELDS`): seconds of steps (or of
    serving), communication exposed and in total, reading, waiting for data; bytes sent;
    the pipeline bubble; whether it served (a parameter server); bytes and seconds per
    communicator of the grid, from ``traffic`` (:class:`~mpitrain.observe.timing.Traffic`)."""
    exposed, total, bubble = traffic.seconds()
    stats = reader.epoch_stats()
    read = sum(s.read_seconds for s in stats)
    stall = sum(s.stall_seconds for s in stats)
    axes = traffic.by_axis()
    return rank, seconds, exposed, total, read, stall, sum(v[0] for v in axes.values()), bubble, serves, axes


def finish(run, result: Result, times: tuple, figures: dict, out: Outputs, log) -> Result:
    """The end of a run on every rank, after the loop (or serving) and the role's end:
    the last checkpoint; unless stopped by a signal, the final evaluation, the time
    table, the replica check, a text sample; the metrics' last record. ``times`` is this
    rank's time row, ``figures`` the loop's totals (the same on every rank)."""
    cfg, world, step = run.cfg, run.world, result.steps
    whole = run.role.grid.whole_model
    if result.stopped or step > result.start_step:
        save(run, step, result.stopped or "end of training", result, out, log)
    if result.stopped:
        how = resume_hint(cfg, cfg.run.dir, world.size, launcher(), through=bool(os.environ.get(launch.ENV))) \
            if cfg.run.dir else "nothing was saved: no run.dir"
        log(f"stopped by {result.stopped} after step {step}; {how}")
        out.metrics.write("stopped", step=step, signal=result.stopped)
        out.write_timeline(cfg.run.dir, log)
        return result
    with out.traced("evaluate", "evaluate"), run.role.sync.whole_model():
        evaluate.score(run, world, step, result, out.metrics, log)
    out.write_timeline(cfg.run.dir, log)
    digest = run.role.sync.check_replicas()
    rows = world.allgather(times)  # rank 0 prints them, the leading rank records them
    out.heap.stop()
    states = world.allgather((model_state(run.role.sync.model, run.role.sync.optimizer), out.heap.figures()))
    lines, result.staleness = run.role.sync.summary()
    done = figures["done"]
    if world.rank == 0:
        result.timing, result.states = rows, states
        if done:  # a resumed run that was already finished has no steps to show
            log(time_table(rows, done))
        if world.size > 1 and whole:
            log(f"replicas identical on all {world.size} ranks (parameters sha256 {digest[:16]})")
        elif world.size > 1:
            log(f"the parts' replicas identical; the whole model's parameters, gathered from its parts: "
                f"sha256 {digest[:16]}")
        for line in lines + state_lines(run, states):
            log(line)
        if done:
            for line in end_of_run(cfg, world.size, figures["train_seconds"] / done, states):
                log(line)
    if run.data.kind == "text" and cfg.train.sample_tokens:
        with run.role.sync.whole_model():  # entered by every rank: ZeRO-3 gathers the model
            if world.rank == 0 and whole:
                result.sample = sample_text(run)
                log("sample:\n" + result.sample)
            elif world.rank == 0:
                log("sample: none (the model is cut over ranks; sample from the final checkpoint on one process)")
    return _totals(run, result, figures, rows, out, log)


def _totals(run, result: Result, figures: dict, rows, out: Outputs, log) -> Result:
    """The run's totals into ``result``, the metrics' ``end`` record and the last line."""
    seconds, done = figures["train_seconds"], figures["done"]
    result.seconds, result.final_loss, result.flops = figures["wall_seconds"], figures["final_loss"], figures["flops"]
    steps = done  # of the global batch
    if result.staleness:  # parameter servers: a worker's step is B / workers samples, and workers differ in
        servers = run.cfg.parallel.servers  # steps when asynchronous; every server counted each gradient
        steps = sum(result.staleness.values()) / servers / (run.world.size - servers)
    result.samples_per_s = steps * run.cfg.train.global_batch_size / seconds if seconds else 0.0
    result.gflops_per_s = steps * figures["flops"] * run.role.grid.size / seconds / 1e9 if seconds else 0.0
    result.stall_fraction = figures["stall"] / (seconds + figures["stall"]) if seconds else 0.0
    out.metrics.write("end", step=run.total, steps_timed=done, steps_per_epoch=run.reader.steps_per_epoch,
                      seconds=result.seconds, samples_per_s=result.samples_per_s, gflops_per_s=result.gflops_per_s,
                      stall_fraction=result.stall_fraction, staleness=result.staleness, ranks=per_rank(rows))
    log(f"done: {done} steps in {result.seconds:.1f} s; training steps {seconds:.1f} s, "
        f"{result.samples_per_s:,.0f} samples/s, {result.gflops_per_s:.1f} GFLOP/s; "
        f"waited for data {figures['stall']:.2f} s ({100 * result.stall_fraction:.2f}% of step time)")
    return result


def state_lines(run, states: list) -> list[str]:
    """The end of a run's lines on memory (:mod:`mpitrain.observe.memory`), of the rank
    that holds the most (``states``: every rank's ``(model state, heap figures)``, the
    latter None where nothing was traced): its model state counted beside ZeRO's formula
    for the parameters of its part, the heap measured, and in mixed precision the loss
    scale."""
    cfg, lines = run.cfg, []
    o, mixed = cfg.optim, isinstance(run.optimizer, MixedPrecision)
    moments = 2 if o.name in ("adam", "adamw") else int(o.momentum > 0)
    formula = bytes_per_parameter(cfg.parallel.sync, run.role.lane[1], moments, np.dtype(cfg.train.dtype).itemsize,
                                  mixed)
    top = max((c for c, _ in states), key=lambda c: sum(c[key] for key, _ in CATEGORIES))
    lines.append(state_line(top, top["parameters"], formula))
    traced = [(c, h) for c, h in states if h is not None]
    if traced:
        c, h = max(traced, key=lambda ch: ch[1]["rest"])
        lines.append(heap_line(h, c, c["parameters"], formula))
    if mixed:
        scaler = run.optimizer.scaler
        lines.append(f"mixed precision {run.optimizer.precision}: loss scale {scaler.scale:g}"
                     f"{f' (2^{math.log2(scaler.scale):g})' if scaler.dynamic else ''}; {scaler.skipped} step(s) "
                     f"skipped for overflowing gradients")
    return lines


def sample_text(run) -> str:
    """Characters generated after the first held-out one, from the seed's own stream."""
    t = run.cfg.train
    prompt_split = run.data.split("val")
    first_char = np.empty(1, dtype=prompt_split.x_dtype)
    prompt_split.read("x", 0, 1, first_char)
    prompt = first_char[None, :].astype(np.int64)  # (1, 1): the first held-out character
    with merged(run.model):  # LoRA's adapters folded into their weights
        ids = run.model.generate(prompt, t.sample_tokens, temperature=0.8, top_k=None,
                                 generator=np.random.default_rng((t.seed, SAMPLING)))
    return run.data.decode(ids[0, 1:])
