"""Inference planned: what drawing tokens from a GPT needs per rank, and how long it takes
(``mpitrain plan RUN_OR_CONFIG --inference``, printed by :mod:`mpitrain.plan.serving`); held
against ``mpitrain sample``'s own figures by ``--validate`` (:mod:`mpitrain.plan.serving_check`).

**Memory** per rank of ``t`` tensor-parallel ranks: the weights (a slice's,
:func:`mpitrain.plan.shapes.gpt`), the key-value cache (:func:`mpitrain.cost.kv_cache_bytes`
of the context it holds, a slice's heads), the prefill's work arrays (the largest live
set of a block: the residual stream, the packed q, k and v, the scores where attention
keeps them, the MLP's hidden units; :func:`work_bytes`); on a GPU the framework's
allowance (:func:`mpitrain.plan.gpu.framework_bytes`).

**Time.** The prefill is compute-bound: each block's products on ``B x P`` rows. A decode
step is one token a sequence: each product reads its whole weight for ``B`` rows, and
attention reads the cache, so the step is bound by bytes, not FLOPs (Pope et al. 2022).
On a GPU each kernel is :mod:`mpitrain.plan.gpu`'s roofline (a product's weights at the
memory-bound bandwidth; every kernel at least a launch). On this machine, where a small
model's step is mostly its Python calls and NumPy's transcendental functions (GELU's
tanh), a block is profiled at the request's shapes and composed (:func:`profile`). Tensor
parallelism adds two allreduces of the step's activations per block (a latency each, on
small arrays).

Time to first token: the prefill and its draw. Time per output token: a step at the mean
context of the request's steps (a step grows linearly with the context it reads).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np

from mpitrain import cost
from mpitrain.plan import gpu, shapes


@dataclass(frozen=True)
class Request:
    """``batch`` sequences, each a prompt of ``prompt`` tokens and ``tokens`` new ones, on ``tp`` ranks."""

    batch: int = 1
    prompt: int = 1
    tokens: int = 256
    tp: int = 1

    def context(self, block_size: int) -> int:
        """Positions the cache holds: the prompt and the new tokens, at most the model's context."""
        return min(block_size, self.prompt + self.tokens)


@dataclass(frozen=True)
class Shape:
    """A GPT's shape as inference needs it (:class:`mpitrain.plan.space.Gpt`'s fields) and
    the bytes of a number it computes in."""

    V: int
    T: int
    L: int
    H: int
    C: int
    itemsize: int
    ffn: int = 0
    kv: int = 0
    gated: bool = False
    tied: bool = True
    positions: bool = True
    bias: bool = False
    flash: bool = False

    @classmethod
    def of(cls, model, itemsize: int) -> "Shape":
        return cls(model.V, model.T, model.L, model.H, model.C, itemsize, model.ffn, model.kv, model.gated,
                   model.tied, model.positions, model.bias, model.flash)

    @property
    def F(self) -> int:
        return self.ffn or 4 * self.C

    @property
    def kv_width(self) -> int:
        """Numbers of a key (or a value) per position: ``C``, or fewer with grouped-query attention."""
        return (self.kv or self.H) * (self.C // self.H)

    def weights(self, t: int) -> int:
        """Parameters a slice of ``t`` holds (the first, the largest)."""
        return _weights(self, t)


@functools.lru_cache(maxsize=None)
def _weights(s: Shape, t: int) -> int:
    shape = shapes.gpt(s.V, s.T, s.L, s.H, s.C, s.bias, t=t, ffn=s.ffn, kv=s.kv, gated=s.gated, tied=s.tied,
                       positions=s.positions)
    return shape.count(shape.layers)


def work_bytes(s: Shape, B: int, P: int, t: int) -> int:
    """The prefill's largest live set of work arrays on a slice of ``t``, in bytes: in
    attention the residual stream and its norm, the packed q, k and v, the scores (kept
    unless attention is one fused kernel) and the heads' output; in the MLP the stream,
    its norm, the hidden units and their activation; then the head's logits of the last
    positions, gathered, and their draw's float64 copies."""
    W, heads = s.C // t, s.H // t
    scores = 0 if s.flash else heads * P
    attention = B * P * (2 * s.C + W + 2 * s.kv_width // t + scores + W)
    mlp = B * P * (3 * s.C + 2 * ((2 if s.gated else 1) * s.F // t))
    return s.itemsize * max(attention, mlp) + B * s.V * (s.itemsize + 3 * 8)


@functools.lru_cache(maxsize=None)
def numpy_work(C: int, H: int, itemsize: int, t: int, P: int, B: int) -> tuple[int, int]:
    """(bytes, bytes more a prompt) of the prefill's work arrays for ``B`` prompts of ``P``
    tokens, as mpitrain's NumPy ops allocate them (temporaries inside the ops included; a
    fast path's blocks grow with the batch up to a fixed size), measured now:
    ``tracemalloc``'s peak over the prefill of one block ``C / t`` wide with ``H / t`` heads
    (a vocabulary of 8: the logits are counted apart) for ``B`` prompts and for ``2 B``:
    exact at ``B``, a line through both beside it. Blocks run one after another: one is the peak."""
    import tracemalloc

    from mpitrain import nn, ops, rng
    from mpitrain.nn import kv_cache
    from mpitrain.tensor import default_dtype

    with default_dtype(np.float64 if itemsize == 8 else np.float32):
        rng.manual_seed(0)
        model = nn.GPT(nn.GPTConfig(vocab_size=8, block_size=P, n_layer=1, n_head=H // t, n_embd=C // t)).eval()
    peaks = []
    with ops.fast_paths(True):
        for n in (B, 2 * B):
            kv = kv_cache.KVCache.for_model(model, n, P)
            ids, lengths = kv_cache.windows([np.zeros(P, dtype=np.int64)] * n, P)
            kv_cache.prefill(model, ids, lengths, kv)  # warm: caches of masks and constants
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                kv_cache.prefill(model, ids, lengths, kv)
                peaks.append(tracemalloc.get_traced_memory()[1] - base)
            finally:
                tracemalloc.stop()
    each = max(0, peaks[1] - peaks[0]) / B
    return max(0, peaks[0] - B * each), each


def memory(s: Shape, r: Request, device=None, communicators: int = 0, probed: int | None = None) -> dict:
    """Bytes per rank by category: ``weights``, ``kv_cache``, ``work``; on a GPU ``framework``.
    On this machine (a calibrated device) the work is mpitrain's NumPy's (:func:`numpy_work`,
    measured at a batch of ``probed``, default ``r.batch``), on a GPU the framework's
    (:func:`work_bytes`)."""
    P = min(r.prompt, s.T)
    if device is not None and device.calibrated:
        fixed, each = numpy_work(s.C, s.H, s.itemsize, r.tp, P, probed or r.batch)
        work = fixed + r.batch * (each + s.V * (s.itemsize + 3 * 8))
    else:
        work = work_bytes(s, r.batch, P, r.tp)
    out = {"weights": s.weights(r.tp) * s.itemsize,
           "kv_cache": cost.kv_cache_bytes(s.L, r.batch, r.context(s.T), s.kv_width // r.tp, s.itemsize),
           "work": work}
    if device is not None and device.sms:
        out["framework"] = gpu.framework_bytes(communicators, sum(out.values()))
    return out


def prefill_flops(s: Shape, B: int, P: int, t: int) -> float:
    """A slice's FLOPs of the prefill: every block on ``B x P`` tokens, and the logits of the
    last positions."""
    block = cost.gpt_block_flops(B, P, s.C, s.ffn, s.kv_width if s.kv else 0, s.gated) / t
    return s.L * block + cost.matmul_flops(B, s.C, s.V) / t


def decode_flops(s: Shape, B: int, n: int, t: int) -> float:
    """A slice's FLOPs of a decode step at a context of ``n``: every block on ``B`` tokens,
    each query against ``n`` keys and values, and the logits."""
    block = cost.gpt_block_flops(B, 1, s.C, s.ffn, s.kv_width if s.kv else 0, s.gated) / t
    attention = cost.decode_attention_flops(B, n, s.C) / t
    return s.L * (block - cost.attention_flops(B, 1, s.C) / t + attention) + cost.matmul_flops(B, s.C, s.V) / t


def _products(s: Shape, t: int) -> list[tuple[int, int]]:
    """(inner, outer) of a block's products on a slice: q, k and v; the projection; the MLP's two (three gated)."""
    W, F = s.C // t, s.F // t
    qkv = (s.C, W + 2 * s.kv_width // t)
    return [qkv, (W, s.C), (s.C, (2 if s.gated else 1) * F), (F, s.C)]


# --------------------------------------------------------------------------- this machine
PROFILE_REPEATS = 9  # timed runs of each profiled shape, the median kept (a request's one prefill is a typical one)


@functools.lru_cache(maxsize=None)
def profile(V: int, C: int, H: int, L: int, itemsize: int, threads: int, B: int, P: int, contexts: tuple) -> dict:
    """A block's cost on this machine at a request's shapes, profiled now (Vidur's way:
    profile the operators at their shapes, compose the request, Agrawal et al. 2024): GPTs
    of 1 block and of ``min(L, 4)`` (at least 2), ``C`` wide with ``H`` heads and the
    vocabulary ``V`` (weights drawn: a time is its shapes'), run as ``mpitrain sample``
    runs them (the run's BLAS threads, the fast paths), taking turns so that both see the
    same machine: the prefill of ``B`` prompts of ``P`` tokens and its draw, then decode
    steps at each of ``contexts``. Each ``(the rest: embedding, head, draw and fixed costs,
    seconds a block)``, a block's the difference of the two models' over their blocks'."""
    from mpitrain import nn, ops, rng
    from mpitrain.nn import kv_cache
    from mpitrain.runtime import limit_blas_threads
    from mpitrain.tensor import default_dtype
    from mpitrain.train import sampling

    capacity, depths = max(P, *contexts) + 1, (1, max(2, min(L, 4)))
    models = {}
    for layers in depths:
        with default_dtype(np.float64 if itemsize == 8 else np.float32):
            rng.manual_seed(0)
            models[layers] = nn.GPT(nn.GPTConfig(vocab_size=V, block_size=capacity, n_layer=layers, n_head=H,
                                                 n_embd=C)).eval()
    prompts, tokens, gens = [np.arange(P) % V] * B, np.zeros(B, dtype=np.int64), sampling.streams(0, range(B))
    seconds = {(layers, key): [] for layers in depths for key in ("prefill", *contexts)}
    for _ in range(PROFILE_REPEATS + 1):  # the first warms the caches
        for layers, model in models.items():
            # as a request runs: its BLAS threads set (their pool woken by the first product), a prefill, steps
            with limit_blas_threads(threads), ops.fast_paths(True):
                began = time.perf_counter()
                kv = kv_cache.KVCache.for_model(model, B, capacity)
                sampling.draw(kv_cache.prefill(model, *kv_cache.windows(prompts, capacity), kv), 1.0, None, gens)
                seconds[layers, "prefill"].append(time.perf_counter() - began)
                for n in contexts:
                    kv.lengths[:] = n - 1  # the new token at position n - 1: a context of n
                    began = time.perf_counter()
                    sampling.draw(kv_cache.decode(model, tokens, kv), 1.0, None, gens)
                    seconds[layers, n].append(time.perf_counter() - began)
    times = {k: float(np.median(v[1:])) for k, v in seconds.items()}
    out = {}
    one, more = depths
    for key in ("prefill", *contexts):
        block = max(0.0, (times[more, key] - times[one, key]) / (more - one))
        out[key] = (max(0.0, times[one, key] - one * block), block)
    return out


def cpu_seconds(machine, s: Shape, B: int, P: int, n: float, t: int, threads: int = 1) -> dict:
    """(seconds of the prefill of ``B`` prompts of ``P`` tokens, of a decode step at a
    context of ``n``) on this machine: :func:`profile`'s
    block at these shapes (a slice's: ``C / t`` wide, ``H / t`` heads) times the blocks, and
    its rest; a decode step's block by the line through two contexts; with slices, each
    block's two allreduces of the step's activations on the link."""
    lo, hi = max(1, P + 1), max(P + 2, int(math.ceil(n)) + 1, min(s.T, P + 8))
    measured = profile(s.V // t, s.C // t, s.H // t, s.L, s.itemsize, threads, B, P, (lo, hi))
    rest, block = measured["prefill"]
    out = {"prefill": rest + s.L * block + _collectives(machine, s, t, B * P, B)}
    (r0, b0), (_, b1) = measured[lo], measured[hi]
    slope = (b1 - b0) / (hi - lo)
    out["decode"] = r0 + s.L * (b0 + slope * (n - lo)) + _collectives(machine, s, t, B, B)
    return out


def _collectives(machine, s: Shape, t: int, tokens: int, B: int) -> float:
    """A pass's calls over ``t`` slices (:mod:`mpitrain.parallel.tensor_parallel`): each
    block's two allreduces of its ``tokens`` activations, the embedding's sum, the gather of
    the logits of the ``B`` last positions, and the ranks' agreement on a stop (one number)."""
    if t == 1:
        return 0.0
    activations = tokens * s.C * s.itemsize
    link = machine.link(list(range(t)))
    gather = cost.alpha_beta_seconds("allgather", t, cost.collective_bytes("allgather", B * s.V * s.itemsize, t),
                                     link.alpha, link.bandwidth) + machine.switches(list(range(t)))
    return ((2 * s.L + 1) * _allreduce(machine, t, activations) + gather
            + _allreduce(machine, t, 8))


def _allreduce(machine, t: int, nbytes: float) -> float:
    if t == 1:
        return 0.0
    link = machine.link(list(range(t)))
    return cost.alpha_beta_seconds("allreduce", t, cost.collective_bytes("allreduce", nbytes, t), link.alpha,
                                   link.bandwidth) + machine.switches(list(range(t)))


# --------------------------------------------------------------------------- a GPU
def gpu_seconds(machine, s: Shape, precision: str, B: int, P: int, n: int, t: int) -> dict:
    """(seconds of the prefill, of a decode step at a context of ``n``) on a GPU of the
    catalogue, kernel by kernel (:mod:`mpitrain.plan.gpu`)."""
    d, w = machine.device, s.itemsize
    block = gpu.block_seconds(d, precision, B, P, s.C, s.H, t, ffn=s.ffn, kv=s.kv, gated=s.gated, dropout=False,
                              flash=s.flash)["forward"]
    head = gpu.gemm_seconds(d, precision, B, s.C, s.V / t)
    prefill = s.L * block + head + gpu.embedding_seconds(d, precision, B, P, s.C)["forward"]
    products = sum(gpu.gemm_seconds(d, precision, B, k, m) for k, m in _products(s, t))
    cache = 2 * B * n * s.kv_width / t * w  # the keys and the values a step's attention reads
    attention = (gpu.moved_seconds(d, cache / 2) * 2  # scores from the keys, the output from the values
                 + gpu.moved_seconds(d, 2 * B * s.H / t * n * w))  # the softmax of B x heads x n scores
    elementwise = (4 * gpu.moved_seconds(d, 3 * B * s.C * w)  # two norms and two residual adds
                   + gpu.moved_seconds(d, 2 * B * s.F / t * w))  # the activation
    decode = s.L * (products + attention + elementwise) + head + gpu.embedding_seconds(d, precision, B, 1, s.C)[
        "forward"]
    if t > 1:
        prefill += 2 * s.L * _gpu_allreduce(machine.intra, t, B * P * s.C * w)
        decode += 2 * s.L * _gpu_allreduce(machine.intra, t, B * s.C * w)
    return {"prefill": float(prefill), "decode": float(decode)}


def _gpu_allreduce(link, t: int, nbytes: float) -> float:
    """An allreduce of ``nbytes`` on ``t`` GPUs: at the bus bandwidth NCCL measured for
    arrays of its size (the curve's times hold the latency); an array smaller than the
    curve's smallest (a decode step's few tokens) pays the link's latency a message of the
    ring and its bytes at that smallest array's rate."""
    sent = cost.collective_bytes("allreduce", nbytes, t)
    if link.measured and nbytes >= link.achieved[0][0]:
        return float(sent / link.busbw(nbytes))
    rate = link.achieved[0][1] if link.achieved else link.bandwidth
    return cost.alpha_beta_seconds("allreduce", t, sent, link.alpha, rate)


# --------------------------------------------------------------------------- the answer
def answer(machine, s: Shape, r: Request, precision: str = "fp32", threads: int = 1) -> dict:
    """Everything ``--inference`` prints for ``r`` on ``machine``: memory by category and its
    peak, the prefill's and a decode step's FLOPs and seconds, time to first token, time per
    output token, tokens a second. Step ``k`` of the ``N - 1`` after the first token reads
    a context of ``P + k``; past the model's context each step is a prefill of its window
    (:mod:`mpitrain.nn.kv_cache`), as recomputation's."""
    context, P = r.context(s.T), min(r.prompt, s.T)
    steps = r.tokens - 1
    decodes = max(0, min(steps, s.T - P))  # steps with room in the cache; the rest slide
    mean = P + (decodes + 1) / 2 if decodes else P + 1
    seconds = _seconds(machine, s, precision, r.batch, P, mean, r.tp, threads)
    sliding = _seconds(machine, s, precision, r.batch, s.T, s.T, r.tp, threads)["prefill"] if steps > decodes else 0
    tpot = (decodes * seconds["decode"] + (steps - decodes) * sliding) / steps if steps else 0.0
    last = sliding if steps > decodes else _seconds(machine, s, precision, r.batch, P, P + decodes, r.tp,
                                                    threads)["decode"]
    mem = memory(s, r, machine.device, communicators=int(r.tp > 1))
    total = seconds["prefill"] + steps * tpot
    weights_read = s.weights(r.tp) * s.itemsize
    return {"memory": mem, "peak": sum(mem.values()), "fits": sum(mem.values()) <= machine.memory,
            "context": context, "prefill_flops": prefill_flops(s, r.batch, P, r.tp),
            "decode_flops": decode_flops(s, r.batch, mean, r.tp), "ttft": seconds["prefill"], "tpot": tpot,
            "decode": seconds["decode"], "tpot_last": last, "sliding": steps - decodes,
            "decode_bytes": weights_read + cost.kv_cache_bytes(s.L, r.batch, mean, s.kv_width // r.tp, s.itemsize),
            "weights_read": weights_read, "tokens_per_s": r.batch * r.tokens / total,
            "tokens_per_s_per_sequence": r.tokens / total, "seconds": total}


def _seconds(machine, s: Shape, precision: str, B: int, P: int, n: float, t: int, threads: int) -> dict:
    if machine.device.sms:
        return gpu_seconds(machine, s, precision, B, P, n, t)
    return cpu_seconds(machine, s, B, P, n, t, threads)


def largest_batch(machine, s: Shape, r: Request, precision: str = "fp32", limit: int = 1 << 20) -> int:
    """The most sequences of ``r``'s shape whose peak fits in a rank's memory (0: not one)."""
    def fits(B: int) -> bool:
        return sum(memory(s, Request(B, r.prompt, r.tokens, r.tp), machine.device, int(r.tp > 1),
                          probed=r.batch).values()) <= machine.memory
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def concurrent(machine, s: Shape, r: Request, ttft: float | None, tpot: float | None, precision: str = "fp32",
               threads: int = 1) -> tuple[int, dict | None]:
    """(the most requests served at once, each ``r``'s prompt and tokens, whose time to first
    token and time per output token meet the targets and whose memory fits; their answer)."""
    most = largest_batch(machine, s, r, precision)

    def meets(B: int) -> dict | None:
        a = answer(machine, s, Request(B, r.prompt, r.tokens, r.tp), precision, threads)
        ok = (ttft is None or a["ttft"] <= ttft) and (tpot is None or a["tpot"] <= tpot)
        return a if ok else None
    if most == 0 or meets(1) is None:
        return 0, None
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid - 1)
    return lo, meets(lo)


def duration(text: str) -> float:
    """A duration in seconds, or with its unit (``ms``, ``us``, ``s``): seconds."""
    import argparse
    import re

    m = re.fullmatch(r"\s*([0-9.]+(?:e-?[0-9]+)?)\s*(ms|s|us)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration such as 200ms, 0.5s or 0.2, got {text!r}")
    try:
        value = float(m.group(1)) * {"ms": 1e-3, "us": 1e-6, "s": 1.0, None: 1.0}[m.group(2)]
    except ValueError:  # "1.2.3"
        raise argparse.ArgumentTypeError(f"expected a duration such as 200ms, 0.5s or 0.2, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be above zero, got {text!r}")
    return value
