"""``mpitrain bench ps``: what asynchrony buys when one worker is slow.

Run under ``mpiexec -n 4``: rank 0 is the parameter server, ranks 1-3 the workers (one
BLAS thread each). A LeNet-style CNN trains on random 28x28 images, 16 per worker per
step, until ``3 x steps`` gradients have been applied: the same number of samples in
every mode. Worker 0 is a straggler: after each step's compute it sleeps twice that
long, so its steps take three times as long. Timed, interleaved round by round:

* **sync** (``staleness=0``): every step waits for all three workers;
* **bounded s=2**: a worker may run at most 2 steps ahead of the slowest;
* **async** (unbounded): nobody waits; the fast workers take the straggler's share;
* **sync, no straggler**: the same run with three equal workers, for scale;
* **..., moving**: the straggler moves: at its step ``t`` worker ``t mod 3`` is the slow
  one, so every worker is slow one step in three (a transient slowdown, the case
  Stale Synchronous Parallel was designed for).

Each line gives the time to the last applied gradient (the slowest rank's), samples/s,
the speed-up over sync with the straggler, the steps each worker took and the largest
staleness seen. With 4 ranks on 2 cores the workers share cores; the straggler sleeps,
so it frees its core while it lags.
"""

from __future__ import annotations

import time

import numpy as np

from mpitrain import nn, ops, optim, rng
from mpitrain.bench.measure import interleaved, medians
from mpitrain.comm import world
from mpitrain.parallel.param_server import UNBOUNDED, ParameterServer
from mpitrain.runtime import limit_blas_threads, tune_allocator
from mpitrain.tensor import Tensor

MODES = {  # staleness, slow-down, whether the straggler moves from worker to worker
    "sync": (0, 3.0, False), "bounded s=2": (2, 3.0, False), "async": (UNBOUNDED, 3.0, False),
    "sync, no straggler": (0, 1.0, False),
    "sync, moving": (0, 3.0, True), "bounded s=2, moving": (2, 3.0, True), "async, moving": (UNBOUNDED, 3.0, True),
}


def _run(comm, staleness: int, slow: float, moving: bool, steps: int, batch: int) -> dict:
    rng.manual_seed(0)
    model = nn.LeNet(1, 28, 10, (16, 32), 128)
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    W = comm.size - 1
    ps = ParameterServer(model, opt, comm, servers=1, staleness=staleness,
                         max_updates=None if staleness == 0 else steps * W)
    g = np.random.default_rng(comm.rank)
    x = g.standard_normal((batch, 28, 28, 1)).astype(np.float32)  # (b, 28, 28, 1)
    y = g.integers(0, 10, batch)
    comm.barrier()
    tick = time.perf_counter()
    taken = 0
    if ps.is_server:
        ps.serve()
    else:
        while ps.pull_wait() and not (staleness == 0 and taken == steps):
            start = time.perf_counter()
            ops.cross_entropy(model(Tensor(x)), y).backward()
            straggler = taken % W if moving else 0
            if ps.worker == straggler and slow > 1:
                time.sleep((slow - 1) * (time.perf_counter() - start))
            ps.push(taken)
            taken += 1
        ps.leave()
    seconds = max(comm.allgather(time.perf_counter() - tick))
    taken_by = comm.allgather(taken)[1:]
    histogram = ps.staleness_histogram()
    ps.close()
    return {"seconds": seconds, "steps": taken_by, "max_staleness": max(histogram) if histogram else 0}


def run(steps: int = 40, rounds: int = 3, batch: int = 16, log=print) -> dict:
    comm = world()
    if comm.size != 4:
        raise SystemExit("mpitrain bench ps: run it under 'mpiexec -n 4' (1 server + 3 workers)")
    tune_allocator()
    samples = steps * 3 * batch
    log(f"mpitrain bench ps: 1 server + 3 workers, LeNet on 28x28 images, {batch} per worker per step, "
        f"{steps * 3} gradients ({samples:,} samples) per run; worker 0 slowed 3x; median of {rounds} rounds")
    last = {}  # each mode's last round, for its steps and staleness

    def timed(name):
        last[name] = _run(comm, *MODES[name], steps, batch)
        return last[name]["seconds"]

    with limit_blas_threads(1):
        med = medians(interleaved({name: name for name in MODES}, rounds, timed))
    for name in MODES:
        r = last[name]
        log(f"  {name:20} {med[name]:7.2f} s  {samples / med[name]:8.0f} samples/s  "
            f"x{med['sync'] / med[name]:.2f} vs sync | steps per worker {r['steps']} | "
            f"largest staleness {r['max_staleness']}")
    return med
