"""The training loop of one rank: batches in, optimizer steps out, evaluations and
checkpoints in between.

It knows no strategy. A step (:meth:`Loop.train_step`) reads::

    sync.begin_step()                    # before the first forward
    role.schedule.run(x, y, lanes, sync) # forward and backward of each micro-batch
    sync.finish()                        # the gradients of the step are complete
    agree on the loss and stop signals   # one small allreduce over the loop's ranks
    sync.step(lr, grad_clip)             # unless the loss is not finite, or a gradient overflowed
    sync.zero_grad()

where ``sync`` is the role's :class:`~mpitrain.parallel.GradSync` and ``role.schedule``
owns the micro-batches and runs them (:mod:`mpitrain.train.schedule`: the whole model,
or a pipeline stage's). Each micro-batch's forward draws its dropout masks from per-sample streams
(:func:`mpitrain.rng.sample_streams`), so they do not depend on how the global batch is
split. The loop's ranks (``role.loop_comm``) agree on every step, so a stop signal or a
non-finite loss ends them all at the same step. In mixed precision
(:mod:`mpitrain.precision`) the same allreduce carries whether any rank's gradients
overflowed: then every rank skips the step, and the loss scale halves on every rank.
Progress lines (the leading rank) report the loss averaged over ranks, the learning
rate, samples/s and achieved GFLOP/s (FLOPs counted from the model's shapes on the
first step, :mod:`mpitrain.observe.flops`); each epoch prints the per-rank I/O table.
What each step sent and waited for is read from the communicators' counters
(:class:`~mpitrain.observe.timing.Traffic`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import numpy as np
from tqdm import tqdm

from mpitrain import checkpoint, rng
from mpitrain.comm import launcher_rank, trace_operations
from mpitrain.data.loader import flips, normalize, random_flip, random_shift, shifts
from mpitrain.observe.flops import FlopCount
from mpitrain.observe.io import io_row, io_table
from mpitrain.observe.timing import Traffic
from mpitrain.observe.watchdog import Watchdog
from mpitrain.precision import MixedPrecision
from mpitrain.runtime import huge_page_heap
from mpitrain.tensor import observe_ops
from mpitrain.train import evaluate, report
from mpitrain.train.signals import StopSignals

HEAP_WARMUP_STEPS = 3  # training steps after which the heap has its size (runtime.huge_page_heap)
AGREEING = "agreeing on the step"  # the loop's own wait, for the stall watchdog


class Loop:
    """One rank's loop over ``run`` from step ``first``, filling ``result``; ``out`` holds
    the metrics file and timeline, ``signals`` the stop signals received."""

    def __init__(self, run, first: int, result, out, signals, log, warn):
        self.run, self.cfg, self.first, self.result = run, run.cfg, first, result
        self.out, self.signals, self.log, self.warn = out, signals, log, warn
        self.role, self.sync, self.comm = run.role, run.role.sync, run.role.loop_comm
        mixed = self.sync.optimizer  # the one that holds the step's gradients: under ZeRO, the shard's
        self.mixed = mixed if isinstance(mixed, MixedPrecision) else None
        self.waits = self.sync.waits  # call -> the name of its wait
        self.traffic = Traffic(run.role.axes)
        self.flops = FlopCount()
        self.counted = False  # the FLOPs of a step are counted on the first one (the same on every rank)
        self.train_seconds = 0.0  # optimizer steps only, without data and evaluation
        self.epoch_seconds: dict[int, float] = {}
        self.window = [0.0, 0, 0.0]  # since the last progress line: loss sum, steps, seconds
        self.watchdog = self.bar = None
        self.lr = 0.0

    # --------------------------------------------------------------- the loop
    def execute(self):
        """Train from ``first`` to the run's last step (or until a stop signal, or the
        sync says stop); returns the result."""
        run, t = self.run, self.cfg.train
        spe = run.reader.steps_per_epoch
        step = self.first
        epoch = max(0, step - 1) // spe  # a boundary just passed still evaluates
        self.watchdog = Watchdog(self.comm, self.cfg.run.stall_warn_s, self.cfg.run.stall_abort_s,
                                 waits=[AGREEING, *self.waits.values()])  # prints on every rank
        batches = run.reader.batches(step // spe, first_step=step % spe)
        self.out.heap.reader = run.reader if self.out.heap.tracing else None
        # a value past float's range is the loss check's to find (run.on_nan), said once, not NumPy's warnings
        with self.watchdog, contextlib.closing(batches), self._progress_bar(), \
                self._instrumented(), np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            if step and step != run.total and t.eval_interval and step % t.eval_interval == 0:
                self.evaluate(step)  # the killed run evaluated after its checkpoint; maybe not before it died
            waiting = time.perf_counter()
            for batch in batches:
                self.out.add("data wait", "io", waiting)
                if self.sync.lockstep and step >= run.total:
                    break
                if batch.epoch != epoch:
                    self.report_io(epoch)
                    epoch = batch.epoch
                    if not t.eval_interval and run.data.kind != "text":
                        self.evaluate(step)
                tick = time.perf_counter()  # the step's time includes waiting to begin it (a pull)
                self.traffic.begin()
                with self.call(step, "begin"):
                    go = self.sync.begin_step()
                if not go:  # an asynchronous worker learned that the run is over: its wait for that
                    self.traffic.end()  # answer is counted as communication, so it is step time too
                    self.train_seconds += time.perf_counter() - tick
                    break
                stopping = self.train_step(step, batch, tick)
                step += 1
                self.out.heap.after_step(step - self.first)
                self.progress(step, batch.epoch)
                if stopping:
                    self.result.stopped = stopping
                    break
                self.between_steps(step)
                waiting = time.perf_counter()
        self.report_io(epoch)
        self.result.steps = step
        return self.result

    def train_step(self, step: int, batch, tick: float) -> str | None:
        """One optimizer step on this rank's part of ``batch``, timed from ``tick``;
        returns the name of a stop signal that any rank of the loop received (None: none)."""
        cfg = self.cfg
        # a pipeline's later stages only cut the raw batch into micro-batches: no augmented, normalised copy
        x, y = inputs(cfg, self.run.data, batch) if self.role.takes_input else (batch.x, batch.y)
        self.lr = self.run.lr(step)
        counting = not self.counted
        with observe_ops(self.flops) if counting else contextlib.nullcontext(), self.watchdog.phase(step, None):
            loss = self.role.schedule.run(x, y, batch.lanes, self.sync, streams(cfg.train.seed, step),
                                          self.out.backward_starts)
        with self.call(step, "finish"):
            self.sync.finish()
        if counting:  # after finish: a data-parallel communication thread may be in MPI before it
            self.flops, self.counted = self.rank_mean(self.flops), True
        overflow = self.mixed is not None and self.mixed.check()  # this rank's gradients
        with self.watchdog.phase(step, AGREEING):
            loss, stopping, overflow = agree_on_step(self.comm, loss, self.signals.received, overflow)
        if not np.isfinite(loss):
            self.non_finite(step, loss)
        elif overflow:  # any rank's: skipped on every rank, the scale halved on every rank
            self.mixed.scaler.update(overflow=True)
        else:
            with self.out.traced(self.waits.get("step", "optimizer"), "optimizer"), \
                    self.watchdog.phase(step, self.waits.get("step")):
                self.sync.step(self.lr, cfg.optim.grad_clip)
            if self.mixed is not None:
                self.mixed.scaler.update(overflow=False)
        self.sync.zero_grad()
        self.traffic.end()
        seconds = time.perf_counter() - tick
        self.train_seconds += seconds
        self.epoch_seconds[batch.epoch] = self.epoch_seconds.get(batch.epoch, 0.0) + seconds
        if np.isfinite(loss):
            self.window[0] += loss
            self.window[1] += 1
        self.window[2] += seconds
        self.result.final_loss = loss
        return stopping

    def rank_mean(self, flops: FlopCount) -> FlopCount:
        """The FLOPs of a step per rank, averaged over the loop's ranks (pipeline stages
        differ): times the grid's ranks, the step's."""
        if self.comm.size == 1:
            return flops
        both = np.array([flops.forward, flops.backward], dtype=np.float64)
        self.comm.allreduce(both)
        return FlopCount(*(both / self.comm.size))

    def non_finite(self, step: int, loss: float) -> None:
        """``run.on_nan``: skip the update, or stop naming the last good checkpoint."""
        run = self.cfg.run
        if run.on_nan == "skip":
            self.result.skipped += 1
            self.warn(f"warning: step {step}: loss is {loss}, update skipped (run.on_nan = 'skip')")
            return
        saved = checkpoint.listed(run.dir) if run.dir else []
        # the record of how the run ended (a loss that is not a JSON number, as text)
        self.out.metrics.write("diverged", step=step, loss=str(loss), checkpoint=str(saved[-1]) if saved else None)
        raise FloatingPointError(f"loss is {loss} at step {step}; last good checkpoint: "
                                 f"{saved[-1] if saved else 'none'}; lower optim.lr or set optim.grad_clip")

    # ---------------------------------------------------------- around steps
    def progress(self, step: int, epoch: int) -> None:
        """After a step: the progress bar, and every ``train.log_interval`` steps a line
        and a metrics record (averaged since the last one)."""
        if step == self.first + HEAP_WARMUP_STEPS:
            huge_page_heap()
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {self.result.final_loss:.4f}", refresh=False)
            self.bar.update(1)
        t, total = self.cfg.train, self.run.total
        if step % t.log_interval and step != total:
            return
        loss_sum, steps, seconds = self.window
        if steps:
            rate = steps * t.global_batch_size / seconds
            gflops = steps * self.flops.total * self.role.grid.size / seconds / 1e9
            prefix = "" if self.sync.lockstep else "worker 0: "  # asynchronous workers each run alone
            self.log(f"{prefix}step {step}/{total} | loss {loss_sum / steps:.4f} | lr {self.lr:.2e} | "
                     f"{rate:,.0f} samples/s | {gflops:.1f} GFLOP/s")
            self.out.metrics.write("train", step=step, epoch=epoch, loss=loss_sum / steps, lr=self.lr,
                                   samples_per_s=rate, gflops_per_s=gflops,
                                   ranks=report.per_rank(self.comm.gather(self.times())))
        self.window = [0.0, 0, 0.0]

    def between_steps(self, step: int) -> None:
        t, run, total = self.cfg.train, self.cfg.run, self.run.total
        if run.dir and run.checkpoint_interval and step % run.checkpoint_interval == 0 and step != total:
            # collective over the world: the loop's ranks are all of it whenever checkpoints are taken during
            # the run (parameter servers write theirs at the end only; the config refuses an interval)
            self.sync.sync_buffers()  # one set of batch-norm statistics, the same that any rank would save
            report.save(self.run, step, f"every {run.checkpoint_interval} steps", self.result, self.out, self.log)
        if t.eval_interval and step % t.eval_interval == 0 and step != total:
            self.evaluate(step)

    def evaluate(self, step: int) -> None:
        """Score the model over the loop's ranks (not during a run whose ranks go their
        own ways: the end of the run scores it)."""
        if not self.sync.lockstep:
            return
        with self.out.traced("evaluate", "evaluate"), self.sync.whole_model():
            self.sync.sync_buffers()
            evaluate.score(self.run, self.comm, step, self.result, self.out.metrics, self.log)
        huge_page_heap()  # evaluation batches may have grown the heap

    def report_io(self, epoch: int) -> None:
        """The per-rank I/O table of ``epoch`` (collective over the loop's ranks)."""
        reader = self.run.reader
        if epoch not in reader.stats:  # nothing read in it by this process (a resumed run)
            return
        rows = self.comm.gather(io_row(self.run.world.rank, reader.stats[epoch], self.epoch_seconds.get(epoch, 0.0)))
        if self.comm.rank == 0:
            self.log(io_table(f"I/O epoch {epoch + 1}", rows, reader.sample_bytes))
            self.result.io.append(rows)

    def figures(self, wall_seconds: float) -> dict:
        """The loop's totals, for the end of the run."""
        stall = sum(s.stall_seconds for s in self.run.reader.epoch_stats())
        return {"steps": self.result.steps, "done": self.result.steps - self.first, "stall": stall,
                "train_seconds": self.train_seconds, "final_loss": self.result.final_loss, "flops": self.flops.total,
                "wall_seconds": wall_seconds, "stopped": self.result.stopped}

    def times(self) -> tuple:
        """This rank's row of the time table (:func:`~mpitrain.train.report.time_row`)."""
        return report.time_row(self.run.world.rank, self.train_seconds, self.traffic, self.run.reader)

    @contextlib.contextmanager
    def call(self, step: int, which: str):
        """Around the sync's call ``which``: if the sync names it a wait, the watchdog and
        the timeline show it under that name."""
        name = self.waits.get(which)
        with self.out.traced(name, "communication") if name else contextlib.nullcontext(), \
                self.watchdog.phase(step, name):
            yield

    @contextlib.contextmanager
    def _instrumented(self):
        """Timeline events for each layer's forward and backward, the schedule's actions
        (a pipeline stage's: its diagram), each read of the reader's thread, and every
        collective from its start to its completion."""
        timeline = self.out.timeline
        if timeline is None:
            yield
            return
        timeline.instrument(self.run.model.named_layers())  # a GPT's embedding, blocks, head
        self.run.reader.on_read = lambda start, end, nbytes: timeline.add("read", "io", "io", start, end,
                                                                          bytes=nbytes)
        self.role.schedule.trace = timeline.add
        with trace_operations(lambda name, start, end, nbytes: timeline.add(
                name, "communication", "communication", start, end, bytes=nbytes)):
            yield

    @contextlib.contextmanager
    def _progress_bar(self):
        """On a terminal, the leading rank shows a progress bar, the lines above it
        (:func:`show_bar` says when)."""
        if self.log is not print or not show_bar(self.cfg.run.progress, terminal=_terminal(),
                                                 launched=launcher_rank() is not None):
            yield
            return
        with tqdm(total=self.run.total, initial=self.first, unit="step", dynamic_ncols=True, file=sys.stdout,
                  leave=False) as self.bar:
            self.log = self.bar.write
            try:
                yield
            finally:
                self.log, self.bar = print, None


# ------------------------------------------------------------------ helpers
def streams(seed: int, step: int):
    """``streams(samples)``: the dropout streams of a micro-batch, keyed by its samples'
    places in the step's global batch, so they do not depend on how it is split."""
    return lambda samples: rng.sample_streams(seed, step, samples)


def inputs(cfg, data, batch) -> tuple[np.ndarray, np.ndarray]:
    """Model inputs of a reader batch: token windows as they are; images augmented
    (rank-count independent draws) and normalised."""
    if data.kind == "text":
        return batch.x, batch.y
    x = batch.x
    if cfg.data.shift:
        dy, dx = shifts(cfg.train.seed, batch.epoch, batch.step, cfg.train.global_batch_size, cfg.data.shift,
                        batch.lanes)
        x = random_shift(x, dy, dx, cfg.data.shift)
    if cfg.data.flip:
        x = random_flip(x, flips(cfg.train.seed, batch.epoch, batch.step, cfg.train.global_batch_size, batch.lanes))
    return normalize(x, data.mean, data.std, cfg.train.dtype), batch.y


def agree_on_step(comm, loss: float | None, received: int | None, overflow: bool = False
                  ) -> tuple[float, str | None, bool]:
    """The global batch's loss (each rank that computes one has the mean over equally many
    samples; None on a rank that computes none: a pipeline's other stages), the name of
    a stop signal any rank received (None: none) and whether any rank's gradients
    ``overflow``-ed, in one allreduce of the loss and a count of the ranks that have
    one, a count per stop signal (a scheduler signals every rank: counts, not signal
    numbers, survive the sum) and a count of overflows."""
    signals = len(StopSignals.SIGNALS)
    buf = np.zeros(3 + signals)
    buf[0], buf[1], buf[-1] = loss or 0.0, loss is not None, overflow
    if received is not None:
        buf[2 + StopSignals.SIGNALS.index(signal.Signals(received).name)] = 1
    if comm.size > 1:
        comm.allreduce(buf)
        buf[0] /= buf[1]
    seen = [name for name, count in zip(StopSignals.SIGNALS, buf[2 : 2 + signals]) if count > 0]
    return float(buf[0]), (seen[0] if seen else None), bool(buf[-1] > 0)


def _terminal() -> bool:
    """Whether stdout is a terminal with a width (not a log file, not SLURM's output)."""
    try:
        return sys.stdout.isatty() and os.get_terminal_size(sys.stdout.fileno()).columns > 0
    except (OSError, ValueError):
        return False


def show_bar(setting: str, terminal: bool, launched: bool) -> bool:
    """Whether the leading rank draws a progress bar (its carriage returns would garble a
    log file). ``setting`` is ``run.progress``: ``bar`` and ``lines`` decide; ``auto`` draws
    it on a ``terminal`` not ``launched`` by mpiexec or srun, since a launched rank cannot
    tell where its output goes: MPICH's Hydra hands it a pipe even from a terminal, Open
    MPI a pseudo-terminal even into a file (open-mpi/ompi#7868)."""
    if setting != "auto":
        return setting == "bar"
    return terminal and not launched
