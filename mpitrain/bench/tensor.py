"""``mpitrain bench tensor``: transformer blocks sliced over the ranks against one rank.

Run under ``mpiexec -n 2`` (one rank per core). A stack of GPT blocks (the plain path)
runs forward and backward on random activations of ``(B, T, C)``, round by round:

* **1 rank**: rank 0 alone with the whole blocks (the others wait);
* **tp = P**: every rank with its slices (:func:`~mpitrain.parallel.tensor_parallel.slice_block`:
  ``n_head / P`` heads and ``4C / P`` hidden units each), four allreduces per block;
* **tp = P, sequence**: the same with sequence parallelism: each rank's blocks take and
  give its slice of the sequence, a reduce-scatter and an allgather for each allreduce.

Printed, medians over rounds: each variant's step and its speed-up over one rank; per
block and step, the seconds inside the allreduces and the bytes each rank sent, against
the formula (:func:`mpitrain.cost.tensor_parallel_bytes`); and the activation memory each
rank holds at the end of the forward (the Python heap above its level before,
``tracemalloc``, in separate untimed runs), in MB and as a share of one rank's, beside
Korthikanti et al.'s count adapted to single precision
(:func:`mpitrain.cost.sliced_activation_ratios`: what the slices divide and what stays
whole on every rank).
"""

from __future__ import annotations

import tracemalloc

import numpy as np

from mpitrain import cost, nn, ops, rng
from mpitrain.bench.measure import slowest
from mpitrain.comm import world
from mpitrain.nn.models import Block
from mpitrain.parallel.tensor_parallel import slice_block
from mpitrain.runtime import limit_blas_threads, tune_allocator
from mpitrain.tensor import Tensor


def _blocks(cfg: nn.GPTConfig, n: int, comm=None, sequence: bool = False) -> nn.Sequential:
    rng.manual_seed(0)
    blocks = [Block(cfg) for _ in range(n)]
    return nn.Sequential(*(blocks if comm is None else [slice_block(b, comm, sequence) for b in blocks]))


def _step(blocks, x: np.ndarray) -> None:
    blocks(Tensor(x, requires_grad=True)).mean().backward()
    for q in blocks.parameters():
        q.grad = None


def _held(blocks, x: np.ndarray) -> int:
    """Bytes held at the end of one forward (its graph alive), above the heap before it."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    h = blocks(Tensor(x, requires_grad=True))
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del h
    return held


def run(rounds: int = 5, steps: int = 3, batch: int = 8, n_blocks: int = 4, n_embd: int = 256, n_head: int = 8,
        seq: int = 128, log=print) -> dict:
    tune_allocator()
    comm = world()
    tp = comm.dup()
    P = tp.size
    cfg = nn.GPTConfig(vocab_size=2, block_size=seq, n_layer=n_blocks, n_head=n_head, n_embd=n_embd)
    x = np.random.default_rng(0).standard_normal((batch, seq, n_embd)).astype(np.float32)  # (B, T, C)
    whole, sliced, slim = _blocks(cfg, n_blocks), _blocks(cfg, n_blocks, tp), _blocks(cfg, n_blocks, tp, True)
    part = seq // P
    mine = np.ascontiguousarray(x[:, tp.rank * part : (tp.rank + 1) * part])  # (B, T / P, C): this rank's slice
    kept = []  # each round's (1 rank, tp, sequence, allreduce seconds, bytes sent), the last two per block
    with limit_blas_threads(1), ops.fast_paths(False):  # the plain block on one rank too: the slices' path
        for r in range(rounds + 1):  # round 0 warms up
            alone = slowest(comm, lambda: _step(whole, x), steps, ranks=1)
            seconds_before, bytes_before = tp.stats.seconds, tp.stats.bytes_sent
            together = slowest(comm, lambda: _step(sliced, x), steps)
            comm_seconds, comm_bytes = tp.stats.seconds - seconds_before, tp.stats.bytes_sent - bytes_before
            sequence = slowest(comm, lambda: _step(slim, mine), steps)
            if r:
                kept.append((alone, together, sequence, comm_seconds / steps / n_blocks, comm_bytes / steps / n_blocks))
        held_whole = _held(whole, x) if comm.rank == 0 else 0
        held = comm.allgather(_held(sliced, x))
        held_sp = comm.allgather(_held(slim, mine))
    one, tp_s, sp_s, comm_s, sent = (float(v) for v in np.median(kept, axis=0))
    figures = {"one_ms": 1e3 * one, "tp_ms": 1e3 * tp_s, "allreduce_ms_per_block": 1e3 * comm_s,
               "bytes_per_block": sent,
               "formula_bytes_per_block": cost.tensor_parallel_bytes(batch, seq, n_embd, x.itemsize, P),
               "held_whole_mb": comm.bcast(held_whole) / 1e6, "held_mb": [h / 1e6 for h in held],
               "sp_ms": 1e3 * sp_s, "held_sp_mb": [h / 1e6 for h in held_sp],
               "korthikanti": cost.sliced_activation_ratios(P, n_head, seq, n_embd)}
    if comm.rank == 0:
        log(_table(figures, P, cfg, batch, rounds))
    tp.free()
    return figures


def _table(f: dict, P: int, cfg: nn.GPTConfig, batch: int, rounds: int) -> str:
    held = " ".join(f"{h:.1f}" for h in f["held_mb"])
    held_sp = " ".join(f"{h:.1f}" for h in f["held_sp_mb"])
    tp_k, sp_k = f["korthikanti"]
    return "\n".join([
        f"mpitrain bench tensor: {cfg.n_layer} GPT blocks (C={cfg.n_embd}, {cfg.n_head} heads, T={cfg.block_size}), "
        f"batch {batch}, forward + backward; medians of {rounds} rounds; 1 BLAS thread per rank",
        f"  1 rank            {f['one_ms']:8.1f} ms/step",
        f"  tp = {P}            {f['tp_ms']:8.1f} ms/step   speed-up x{f['one_ms'] / f['tp_ms']:.2f}",
        f"  tp = {P}, sequence  {f['sp_ms']:8.1f} ms/step   speed-up x{f['one_ms'] / f['sp_ms']:.2f}",
        f"  per block, step:  allreduces {f['allreduce_ms_per_block']:.2f} ms; "
        f"sent {f['bytes_per_block'] / 1e6:.3f} MB per rank, formula 8 (P-1)/P B T C itemsize = "
        f"{f['formula_bytes_per_block'] / 1e6:.3f} MB (x{f['bytes_per_block'] / f['formula_bytes_per_block']:.3f})",
        f"  activations held after forward: 1 rank {f['held_whole_mb']:.1f} MB; tp = {P}, per rank: {held} MB "
        f"(x{f['held_mb'][0] / f['held_whole_mb']:.3f} of one rank's; formula x{tp_k:.3f}); with sequence "
        f"parallelism {held_sp} MB (x{f['held_sp_mb'][0] / f['held_whole_mb']:.3f}; formula x{sp_k:.3f})"])
