"""``mpitrain bench pipeline``: each schedule's step, its bubble against the formula, and
the activation memory each stage holds.

Run under ``mpiexec -n 2`` (one rank per core; ``-n 4`` oversubscribed shows the shape of
the figures only). The model is ``4 p`` identical GPT blocks (two per chunk of the
interleaved schedule) cut into equal stages, trained on random activations with the mean
square of the output as the loss, so that every stage does the same work: the condition
of the bubble formulas. For each schedule and ``m`` it times the schedule's run (forward
and backward of one global batch; no optimizer) round by round, and prints (the first
three: medians over the rounds):

* **step ms**: the slowest rank's run;
* **bubble**: the busiest rank's idle share of the step (idle: blocked waiting for a
  neighbour's activation or gradient or for its own sends, as ``pp_comm``'s counter
  says, and waiting for the last stage to finish, since the step ends for all ranks
  together; starting sends and receives is work). The busiest rank idles only while the
  pipeline fills and drains; the others also wait for it:
* **imbalance**: that wait, the mean rank's idle share minus the busiest's: stages equal
  on paper differ in practice (the last computes the loss, the first receives nothing);
* **formula**: the schedule's idle share (:func:`mpitrain.cost.bubble_fraction`), for
  ZB-H1 at this run's measured F, B and W per micro-batch; **meas/formula**: bubble / it;
* **held MB**: per stage, the most activation memory held at the end of a forward: the
  Python heap (``tracemalloc``, in a separate untimed run) above its level before the
  step. 1F1B's stage 0 holds ``min(m, p)`` micro-batches, GPipe's ``m``.

Zero-bubble schedules run the blocks' plain path (see ``PipelineStage.forward_chunk``),
whose step is slower than the fused one: compare bubbles, not step times, across them.
"""

from __future__ import annotations

import tracemalloc

import numpy as np

from mpitrain import nn, optim, rng
from mpitrain.bench.measure import seconds
from mpitrain.comm import world
from mpitrain.comm.grid import ProcessGrid
from mpitrain.nn.models import Block
from mpitrain.parallel import pipeline as pl
from mpitrain.parallel.local import LocalSync
from mpitrain.runtime import limit_blas_threads, tune_allocator
from mpitrain.cost import bubble_fraction, micro_batches_held
from mpitrain.tensor import Tensor

VARIANTS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
C, T, HEADS = 128, 64, 4


def _stage(comm, schedule: str, chunks: int, m: int, blocks: int):
    rng.manual_seed(0)
    cfg = nn.GPTConfig(vocab_size=2, block_size=T, n_layer=1, n_head=HEADS, n_embd=C)
    model = nn.Sequential(*[Block(cfg) for _ in range(blocks)])
    stage = pl.PipelineStage(model, comm, np.zeros((1, T, C), dtype=np.float32), lambda out, y: (out * out).mean(),
                             schedule_name=schedule, micro_batches=m, chunks=chunks)
    return stage, LocalSync(stage, optim.SGD(stage.parameters(), 0.0))


class _Clock:
    """The stage's trace: each kind of pass's seconds in one run; with ``memory``, the
    heap held after each forward."""

    def __init__(self, memory: bool = False):
        self.kinds, self.memory, self.held = {}, memory, 0

    def __call__(self, name, category, track, start, end, **args):
        if category in ("forward", "backward", "backwardinput", "backwardweight"):
            self.kinds.setdefault(category, []).append(end - start)
            if self.memory and category == "forward":
                self.held = max(self.held, tracemalloc.get_traced_memory()[0])


def _once(comm, stage, sync, x, clock) -> tuple[float, float]:
    """(seconds of the run on the batch ``x``, seconds of it spent waiting) on this rank."""
    stage.trace = clock
    waited = comm.stats.seconds
    comm.barrier()
    wall = seconds(lambda: stage.run(x, np.zeros(len(x)), np.arange(len(x)), sync))
    sync.zero_grad()
    stage.trace = None
    return wall, comm.stats.seconds - waited


def run(rounds: int = 5, ms: tuple = (2, 4, 8), batch: int = 64, log=print) -> list[dict]:
    """Measure every schedule at every ``m``; the rows, printed on rank 0 through ``log``."""
    tune_allocator()
    comm = world()
    p = comm.size
    grid = ProcessGrid(comm, dp=1, pp=p)
    pp = grid.pp_comm
    blocks = 4 * p
    data = np.random.default_rng(0).standard_normal((batch, T, C)).astype(np.float32)  # (B, T, C), on every rank
    rows = []
    with limit_blas_threads(1):
        variants = [(s, v, m) for m in ms for s, v in VARIANTS if s != "interleaved" or m % p == 0]
        built = {key: _stage(pp, *key, blocks) for key in variants}
        kept = {key: [] for key in variants}  # each round's (step, bubble, imbalance)
        kinds = {key: {} for key in variants}
        for r in range(rounds + 1):  # round 0 warms up
            for key in variants:
                clock = _Clock()
                wall, waited = _once(pp, *built[key], Tensor(data), clock)
                if r:
                    step = max(pp.allgather(wall))  # the step ends when its last stage does
                    idles = np.array(pp.allgather(waited + step - wall)) / step
                    kept[key].append((step, idles.min(), idles.mean() - idles.min()))
                    for kind, spans in clock.kinds.items():
                        kinds[key].setdefault(kind, []).extend(spans)
        for key in variants:
            step, bubble, imbalance = (float(v) for v in np.median(kept[key], axis=0))
            rows.append({**_row(pp, key, *built[key], data, step, bubble, kinds[key]), "imbalance": imbalance})
    if pp.rank == 0:
        log(_table(rows, p, blocks, batch, rounds))
    grid.free()
    return rows


def _row(pp, key, stage, sync, data, step: float, bubble: float, kinds) -> dict:
    schedule, v, m = key
    F, B, W = (float(np.median(pp.allgather(np.median(kinds.get(k, [0.0]))))) * v
               for k in ("forward", "backwardinput" if schedule == "zb-h1" else "backward", "backwardweight"))
    passes = (F, B, W) if schedule == "zb-h1" else ()  # ZB-H1's formula at the passes measured
    formula = bubble_fraction(schedule, pp.size, m, v, *passes)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    clock = _Clock(memory=True)
    _once(pp, stage, sync, Tensor(data), clock)
    tracemalloc.stop()
    return {"schedule": schedule if v == 1 else f"{schedule} v={v}", "m": m,
            "step_ms": 1e3 * step, "bubble": bubble, "formula": formula,
            "held_mb": [h / 1e6 for h in pp.allgather(clock.held - base)], "F_B_W_ms": (1e3 * F, 1e3 * B, 1e3 * W)}


def _table(rows, p, blocks, batch, rounds) -> str:
    lines = [f"mpitrain bench pipeline: {p} stages, {blocks} GPT blocks (C={C}, T={T}), global batch {batch}, "
             f"medians of {rounds} rounds; 1 BLAS thread per rank",
             "  schedule         m   step ms   bubble  formula  meas/formula  imbalance   held MB per stage"]
    for r in rows:
        held = " ".join(f"{h:6.2f}" for h in r["held_mb"])
        lines.append(f"  {r['schedule']:<15} {r['m']:2d}  {r['step_ms']:8.1f}  {100 * r['bubble']:6.1f}%  "
                     f"{100 * r['formula']:6.1f}%  {r['bubble'] / r['formula']:12.3f}  {100 * r['imbalance']:8.1f}%"
                     f"   {held}")
    for m in sorted({r["m"] for r in rows}):
        by = {r["schedule"]: r for r in rows if r["m"] == m}
        if "gpipe" in by and "1f1b" in by:
            ratio = by["1f1b"]["held_mb"][0] / by["gpipe"]["held_mb"][0]
            lines.append(f"  m={m}: stage 0 holds {ratio:.3f} of GPipe's activations under 1F1B "
                         f"(formula min(m, p)/m = {micro_batches_held('1f1b', p, m, 0) / m:.3f})")
    return "\n".join(lines)
