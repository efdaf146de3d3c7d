"""``mpitrain bench ddp``: what data parallelism buys, and how much communication overlap hides.

Run under ``mpiexec -n 2`` (one BLAS thread per rank). For each GPT it times, interleaved
round by round so that every variant sees the same machine, the training step of one
global batch ``B`` (AdamW, clipping at 1.0, random tokens):

* **1 rank**: rank 0 alone with all ``B`` samples (rank 1 sleeps);
* **2 ranks, no comm**: each rank steps on its ``B/2`` samples with no gradient exchange:
  the compute of a data-parallel step;
* **2 ranks, ddp (progress)**: :class:`~mpitrain.parallel.data_parallel.DataParallel`
  with each way of progressing the buckets during backward: ``test`` (``Test`` calls from
  the gradient hooks), ``none``, and ``thread`` (a communication thread, only when MPI
  runs at thread level ``multiple`` or ``serialized``: ``--thread-level multiple``);
* **allreduce alone**: the same buckets allreduced back to back, no compute: the total
  communication time of a step.

*Exposed* communication is ``ddp - no comm``; *hidden* is ``1 - exposed / total``. It
can be negative: a step with a gradient exchange also makes each rank wait for the
slower one, which independent steps never do. Speed-up is the 2-rank ddp samples/s over
the 1-rank samples/s. Medians over rounds.
"""

from __future__ import annotations

import time

import numpy as np

from mpitrain import nn, optim, rng
from mpitrain.allreduce import allreduce
from mpitrain.comm import started_thread_level, world
from mpitrain.parallel.data_parallel import DataParallel
from mpitrain.runtime import limit_blas_threads, tune_allocator

MODELS = {
    "gpt": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch=12),  # nanoGPT's small CPU setting
    "wide": dict(n_layer=4, n_head=6, n_embd=384, block_size=64, batch=4),  # allreduce a large share of the step
}


def _build(spec: dict):
    rng.manual_seed(0)
    cfg = nn.GPTConfig(vocab_size=65, block_size=spec["block_size"], n_layer=spec["n_layer"],
                       n_head=spec["n_head"], n_embd=spec["n_embd"])
    model = nn.GPT(cfg)
    opt = optim.AdamW(optim.decay_groups(model.named_parameters(), 0.1), lr=1e-3, betas=(0.9, 0.99))
    return model, opt


def _stepper(spec: dict, comm, batch: int, dp_options: dict | None):
    model, opt = _build(spec)
    dp = DataParallel(model, comm, **dp_options) if dp_options is not None else None
    x, y = np.random.default_rng(comm.rank).integers(0, 65, (2, batch, spec["block_size"]))

    def step():
        model(x, y)[1].backward()
        if dp is not None:
            dp.finish()
        optim.clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return step, dp


def _timed(comm, fn, steps: int, ranks: int) -> float:
    """Seconds per step of ``fn`` on the first ``ranks`` ranks (the slowest of them)."""
    comm.barrier()
    seconds = 0.0
    if comm.rank < ranks:
        tick = time.perf_counter()
        for _ in range(steps):
            fn()
        seconds = (time.perf_counter() - tick) / steps
    comm.sleeping_barrier()
    return max(comm.allgather(seconds))


def run(models=("gpt", "wide"), rounds: int = 5, steps: int = 5, bucket_mb: float = 4.0, algorithm: str = "mpi",
        log=print) -> dict:
    comm = world()
    if comm.size != 2:
        raise SystemExit("mpitrain bench ddp: run it under 'mpiexec -n 2'")
    tune_allocator()
    level = started_thread_level()
    progress = ["test", "none"] + (["thread"] if level in ("serialized", "multiple") else [])
    log(f"mpitrain bench ddp: 2 ranks, 1 BLAS thread each, MPI thread level {level}, {algorithm} allreduce, "
        f"buckets <= {bucket_mb:g} MB; medians of {rounds} rounds of {steps} steps")
    out = {}
    with limit_blas_threads(1):
        for name in models:
            spec = MODELS[name]
            B = spec["batch"]
            single = comm.split(comm.rank, 0)  # a one-rank communicator for the 1-rank step
            variants = {"1 rank": (_stepper(spec, single, B, None)[0], 1),
                        "2 ranks, no comm": (_stepper(spec, comm, B // 2, None)[0], 2)}
            dps = {}
            for mode in progress:
                step, dps[mode] = _stepper(spec, comm, B // 2,
                                           dict(bucket_cap_mb=bucket_mb, algorithm=algorithm, progress=mode))
                variants[f"2 ranks, ddp ({mode})"] = (step, 2)
            buckets = dps["test"].buckets
            variants["allreduce alone"] = (lambda: [allreduce(b.comm, b.flat, algorithm) for b in buckets], 2)
            for fn, ranks in variants.values():  # warm up: allocator, optimizer state
                _timed(comm, fn, 2, ranks)
            times = {k: [] for k in variants}
            for _ in range(rounds):
                for k, (fn, ranks) in variants.items():
                    times[k].append(_timed(comm, fn, steps, ranks))
            med = {k: float(np.median(v)) for k, v in times.items()}
            n = sum(p.size for p in _build(spec)[0].parameters())
            grad_mb = sum(b.flat.nbytes for b in buckets) / 1e6
            log(f"{name}: GPT {spec['n_layer']}L/{spec['n_head']}H/{spec['n_embd']}C T={spec['block_size']} B={B}, "
                f"{n / 1e6:.2f} M parameters, {grad_mb:.1f} MB of gradients in {len(buckets)} bucket(s)")
            total = med["allreduce alone"]
            for k, (_, ranks) in variants.items():
                if k == "allreduce alone":
                    continue
                line = f"  {k:24} {1e3 * med[k]:8.1f} ms/step {B / med[k]:8.1f} samples/s"
                if k.startswith("2 ranks, ddp"):
                    exposed = max(0.0, med[k] - med["2 ranks, no comm"])
                    line += (f"  speed-up x{med['1 rank'] / med[k]:.2f} | comm exposed {1e3 * exposed:6.1f} ms, "
                             f"hidden {100 * (1 - exposed / total):5.1f}%")
                log(line)
            log(f"  {'allreduce alone':24} {1e3 * total:8.1f} ms/step = {100 * total / med['2 ranks, ddp (test)']:.0f}% "
                f"of the ddp (test) step")
            out[name] = med
            for dp in dps.values():
                dp.close()
            single.free()
    return out
