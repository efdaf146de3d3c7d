"""``mpitrain bench ddp``: what data parallelism buys, and how much communication overlap hides.

Run under ``mpiexec -n 2`` (one BLAS thread per rank). For each GPT it times, round by
round, the training step of one global batch ``B`` (AdamW, clipping at 1.0, random tokens):

* **1 rank**: rank 0 alone with all ``B`` samples (rank 1 sleeps);
* **2 ranks, no comm**: each rank steps on its ``B/2`` samples and the ranks meet once
  per step (an 8-byte allreduce) without exchanging gradients: the compute of a
  synchronous data-parallel step, waiting for the slower rank included;
* **2 ranks, ddp (off)**: :class:`~mpitrain.parallel.data_parallel.DataParallel` with
  every bucket's allreduce started after backward: no overlap;
* **2 ranks, ddp (progress)**: the buckets start during backward, progressed by ``test``
  (``Test`` calls from the gradient hooks), ``none``, or ``thread`` (a communication
  thread, only when MPI runs at thread level ``serialized`` or ``multiple``);
* **allreduce alone**: the buckets allreduced with no compute, the faster of back-to-back
  blocking calls and all started then all waited: a step's communication, its *total*.

Last, a **probe** without the model: the same buckets' allreduces started, then pieces of
matrix multiplication (about four times the allreduce's duration) with a ``Test`` after
each piece (or none), then a wait; against the multiplications alone and the allreduce
alone. Its hidden share ``(compute + allreduce - together) / allreduce`` is the most
overlap the machine allows, with little of a training step's noise.

*Exposed* communication is ``ddp - no comm``; *hidden* ``1 - exposed / total``; ``vs off``
``1 - exposed / exposed(off)``, the share of the unoverlapped step's communication that
overlap removes; ``x`` the speed-up over 1 rank. Every figure is the median of all timed
steps (the slower rank's time of each), which a step that another process interrupted
does not move; each round starts a variant with :data:`WARMUP` untimed steps.

**Across a network** (``--network RATE``, :func:`network`): run without ``mpiexec``, it
runs the bench on shared memory (``mpiexec -n 2``), then across 2 emulated nodes of one
rank linked at ``RATE`` (:mod:`mpitrain.cluster`, as root), for each allreduce algorithm,
with buckets of 2 ms of the link (:func:`~mpitrain.cluster.link_bucket_mb`) unless
``--bucket-mb`` says otherwise, and prints the two runs' figures (``--json``) side by side.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mpitrain import optim
from mpitrain.bench.measure import NANOGPT, VOCAB, gpt, interleaved, medians, seconds
from mpitrain.cluster import Cluster, describe, mpiexec
from mpitrain.comm import started_thread_level, world
from mpitrain.comm.allreduce import allreduce, iallreduce
from mpitrain.comm.ring import wire_dtype
from mpitrain.parallel.data_parallel import DataParallel
from mpitrain.runtime import huge_page_heap, limit_blas_threads, tune_allocator

# Untimed steps of a variant at the start of each round: switching variants leaves the caches
# cold, and rank 1 comes back from sleeping through the 1-rank variant.
WARMUP = 3

MODELS = {
    "gpt": dict(NANOGPT, batch=12),
    "gpt-ddp": dict(NANOGPT, batch=24),  # nanoGPT's batch per process: its DDP keeps batch_size=12 on every rank
    # 7 M parameters on 32 tokens per rank: the allreduce is a sizeable part of the step
    "wide": dict(n_layer=4, n_head=6, n_embd=384, block_size=32, batch=2),
}


def _stepper(spec: dict, comm, batch: int, dp_options: dict | None, precision: str = "fp32"):
    model, opt = gpt(spec, precision)
    dp = DataParallel(model, comm, optimizer=opt, **dp_options) if dp_options is not None else None
    x, y = np.random.default_rng(comm.rank).integers(0, VOCAB, (2, batch, spec["block_size"]))
    scale = np.float32(opt.scaler.scale if precision != "fp32" else 1.0)  # fp16's loss scale (no overflow here)
    meet = np.zeros(1)

    def step():
        model(x, y)[1].backward(scale)
        if dp is not None:
            dp.finish()
        else:
            comm.allreduce(meet)
        if precision != "fp32" and opt.check():
            raise FloatingPointError("mpitrain bench ddp: the gradients overflowed")
        optim.update(opt, model.parameters(), None, 1.0)
        opt.zero_grad()

    return step, dp


def _timed(comm, fn, steps: int, ranks: int, warmup: int = 0) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn`` on the first ``ranks`` ranks, the
    slowest rank's for each call, after ``warmup`` calls that are not timed."""
    comm.barrier()
    each = np.zeros(steps)
    if comm.rank < ranks:
        for _ in range(warmup):
            fn()
        for i in range(steps):
            tick = time.perf_counter()
            fn()
            each[i] = time.perf_counter() - tick
    comm.sleeping_barrier()
    return np.max(comm.allgather(each.tolist()), axis=0).tolist()


def _all_started(buckets, algorithm: str, wire=None) -> None:
    """Every bucket's allreduce started, then all waited for."""
    for request in [iallreduce(comm, flat, algorithm, wire) for comm, flat in buckets]:
        request.wait()


def _probe(comm, buckets, algorithm: str, allreduce_seconds: float, log) -> dict:
    """Overlap with no model: the buckets' allreduces against fixed matrix products."""
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)  # (256, 256)
    product = np.empty_like(a)  # (256, 256)
    pieces = max(8, int(4 * allreduce_seconds / seconds(lambda: np.matmul(a, a, out=product), 8)))

    def compute(requests=None):
        for _ in range(pieces):
            np.matmul(a, a, out=product)
            for r in requests or ():
                r.test()

    def together(test: bool):
        requests = [iallreduce(c, flat, algorithm) for c, flat in buckets]
        compute(requests if test else None)
        for r in requests:
            r.wait()

    variants = {"compute": compute, "allreduce": lambda: _all_started(buckets, algorithm),
                "test": lambda: together(True), "none": lambda: together(False)}
    med = medians(interleaved(variants, 7, lambda fn: _timed(comm, fn, 3, 2)))
    hidden = {k: (med["compute"] + med["allreduce"] - med[k]) / med["allreduce"] for k in ("test", "none")}
    log(f"  probe: allreduce {1e3 * med['allreduce']:.1f} ms, {pieces} products {1e3 * med['compute']:.1f} ms; "
        f"together {1e3 * med['test']:.1f} ms with Test (hidden {100 * hidden['test']:.0f}%), "
        f"{1e3 * med['none']:.1f} ms without (hidden {100 * hidden['none']:.0f}%)")
    return {"pieces": pieces, **med, **{f"hidden_{k}": v for k, v in hidden.items()}}


def run(models=("gpt", "wide"), rounds: int = 5, steps: int = 5, bucket_mb: float = 4.0, algorithm: str = "mpi",
        warmup: int = WARMUP, wire: str = "fp32", precision: str = "fp32", log=print) -> dict:
    comm = world()
    if comm.size != 2:
        raise SystemExit("mpitrain bench ddp: run it under 'mpiexec -n 2'")
    tune_allocator()
    level = started_thread_level()
    progress = ["off", "test", "none"] + (["thread"] if level in ("serialized", "multiple") else [])
    numbers = wire_dtype(wire)
    numbers_named = wire if precision == "fp32" else f"{precision} (mixed precision)"
    log(f"mpitrain bench ddp: 2 ranks, 1 BLAS thread each, MPI thread level {level}, {algorithm} allreduce in "
        f"{numbers_named}, buckets <= {bucket_mb:g} MB; median step of {rounds} rounds of {steps} after {warmup} "
        "untimed")
    out = {}
    with limit_blas_threads(1):
        for name in models:
            spec = MODELS[name]
            B = spec["batch"]
            single = comm.split(comm.rank, 0)  # a one-rank communicator for the 1-rank step
            variants = {"1 rank": (_stepper(spec, single, B, None, precision)[0], 1),
                        "2 ranks, no comm": (_stepper(spec, comm, B // 2, None, precision)[0], 2)}
            dps, options = {}, dict(bucket_cap_mb=bucket_mb, algorithm=algorithm, wire=wire)
            for mode in progress:
                step, dps[mode] = _stepper(spec, comm, B // 2, dict(options, progress=mode), precision)
                variants[f"2 ranks, ddp ({mode})"] = (step, 2)
            buckets = list(zip(dps["test"].comms, dps["test"].flats))  # (communicator, gradients) of each
            variants["allreduce alone (blocking)"] = (
                lambda: [allreduce(c, flat, algorithm, numbers) for c, flat in buckets], 2)
            variants["allreduce alone (started)"] = (lambda: _all_started(buckets, algorithm, numbers), 2)
            for fn, ranks in variants.values():  # warm up: allocator, optimizer state
                _timed(comm, fn, 2, ranks)
            huge_page_heap()  # as the trainer does after its first steps
            med = medians(interleaved(variants, rounds, lambda v: _timed(comm, v[0], steps, v[1], warmup)))
            total = _table(name, spec, med, buckets, log)
            out[name] = dict(med, total=total, buckets=len(buckets), probe=_probe(comm, buckets, algorithm, total, log))
            for dp in dps.values():
                dp.close()
            single.free()
    return out


def _table(name: str, spec: dict, med: dict, buckets, log) -> float:
    """The lines of one model's variants (``med``: median seconds per step of each);
    returns the communication of a step alone, its total."""
    B = spec["batch"]
    n = sum(p.size for p in gpt(spec)[0].parameters())
    grad_mb = sum(flat.nbytes for _, flat in buckets) / 1e6
    log(f"{name}: GPT {spec['n_layer']}L/{spec['n_head']}H/{spec['n_embd']}C T={spec['block_size']} B={B}, "
        f"{n / 1e6:.2f} M parameters, {grad_mb:.1f} MB of gradients in {len(buckets)} bucket(s)")
    alone = {k: v for k, v in med.items() if k.startswith("allreduce alone")}
    total = min(alone.values())
    exposed = {k: max(0.0, v - med["2 ranks, no comm"]) for k, v in med.items() if k.startswith("2 ranks, ddp")}
    for k in [k for k in med if k not in alone]:
        line = f"  {k:26} {1e3 * med[k]:8.1f} ms/step {B / med[k]:8.1f} samples/s"
        if k in exposed:
            off = exposed["2 ranks, ddp (off)"]
            line += (f"  x{med['1 rank'] / med[k]:.2f} | exposed {1e3 * exposed[k]:6.1f} ms, "
                     f"hidden {100 * (1 - exposed[k] / total):4.0f}%")
            if k != "2 ranks, ddp (off)":
                line += f", vs off {100 * (1 - exposed[k] / off):4.0f}%" if off > 0 else ", vs off     -"
        log(line)
    for k, v in alone.items():
        log(f"  {k:26} {1e3 * v:8.1f} ms/step")
    log(f"  total communication {1e3 * total:.1f} ms = {100 * total / (med['2 ranks, no comm'] + total):.0f}% "
        f"of a step that does not overlap it")
    return total


def network(rate: str, mtu: int, options: list[str], algorithms, log=print) -> int:
    """``--network RATE`` (above): each run's output as it comes, then the two side by
    side. ``options`` are the bench's own (models, rounds, steps, warmup, bucket size)."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="mpitrain-bench-ddp-") as tmp:

        def each_algorithm(link: str, launch) -> int:
            for algorithm in algorithms:
                path = Path(tmp) / f"{len(results)}.json"
                log(f"== {link}, {algorithm} allreduce")
                sys.stdout.flush()  # before the ranks' lines
                code = launch([sys.executable, "-m", "mpitrain", "bench", "ddp", *options,
                               "--allreduce", algorithm, "--json", str(path)])
                if code != 0:
                    log(f"mpitrain bench ddp --network: the run on {link} ({algorithm}) ended with exit status {code}")
                    return code
                results[link, algorithm] = json.loads(path.read_text())[algorithm]
            return 0

        code = each_algorithm("shared memory",
                              lambda argv: subprocess.run([mpiexec(), "-n", "2", *argv], check=False).returncode)
        if code == 0:
            with Cluster(nodes=2, ranks=1, rate=rate, mtu=mtu) as cluster:
                log(describe(cluster))
                code = each_algorithm(f"2 nodes, {rate}", cluster.run)
    if code == 0:
        _side_by_side(results, log)
    return code


def _side_by_side(results: dict, log) -> None:
    log("\noverlap on shared memory and across the network (hidden = 1 - exposed / total communication)")
    log(f"{'model':8} {'allreduce':9} {'link':16} | {'no comm':>7} | {'comm':>5} {'of step':>7} | {'off':>5} | "
        f"{'test':>5} {'hidden':>6} | {'none':>5} {'hidden':>6}   (ms per step)")
    for (link, algorithm), out in results.items():
        for name, med in out.items():
            nocomm, total = med["2 ranks, no comm"], med["total"]
            hidden = {m: 100 * (1 - max(0.0, med[f"2 ranks, ddp ({m})"] - nocomm) / total) for m in ("test", "none")}
            log(f"{name:8} {algorithm:9} {link:16} | {1e3 * nocomm:7.1f} | {1e3 * total:5.1f} "
                f"{100 * total / (nocomm + total):6.0f}% | {1e3 * med['2 ranks, ddp (off)']:5.1f} | "
                f"{1e3 * med['2 ranks, ddp (test)']:5.1f} {hidden['test']:5.0f}% | "
                f"{1e3 * med['2 ranks, ddp (none)']:5.1f} {hidden['none']:5.0f}%")
