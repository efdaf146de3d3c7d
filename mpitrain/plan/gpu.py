"""How a GPU framework runs a GPT's step, kernel by kernel: tier 1's compute time on a
published device (:func:`step_compute`), never mpitrain's NumPy on a GPU.

A block runs as Megatron-LM runs it (Shoeybi et al. 2019; Korthikanti et al. 2022): six
products (query-key-value, attention's scores and its weighted values, batched over the
heads, the projection, the MLP's two), each with its two products in backward (the
input's gradient and the weights', the latter accumulated into float32 gradients), and
the kernels between them that only move memory: two layer norms, two fused
bias-dropout-adds, the MLP's fused bias-GELU, attention's fused scale-mask-softmax and its
dropout (or attention as one FlashAttention kernel: Dao 2023). The head's product and its
cross-entropy in float32 on the last stage; the fused Adam update once a step.

Each kernel is a roofline (Williams et al. 2009): the longer of its arithmetic and its
bytes, and at least a kernel launch.

* **a product** of ``M x K`` by ``K x N``: output tiles of ``256 x 128`` or ``128 x 128``
  (the faster for the shape), one tile a streaming multiprocessor (SM) at a time, in waves
  over the device's SMs; a wave takes a tile's ``2 x 256 x 128 x K`` FLOPs at an SM's share
  of the rate the fastest product shape achieves, as measured (``achievable_flops``: the
  maximum achievable matmul FLOP/s, stas00/ml-engineering's search over shapes).
  Tile and wave quantisation as NVIDIA's *Matrix Multiplication Background User's Guide*
  describes them (docs.nvidia.com/deeplearning/performance). Its bytes: the three
  matrices once each;
* **a memory-bound kernel**: the bytes it reads and writes (16-bit numbers; dropout's
  masks one byte a number; the cross-entropy's float32) at the bandwidth such a kernel
  achieves (``memory_bound_gbs``: Apex's fused layer norm, measured);
* **a launch**: :data:`LAUNCH_S` at least, however small the kernel.

The catalogue (``hardware.toml``) cites each device figure; :data:`LAUNCH_S` and the
kernels' bytes cite theirs here. Nothing here is fitted to a training run:
``mpitrain bench published`` holds the result against published runs.
"""

from __future__ import annotations

import numpy as np

from mpitrain import cost

# output tiles a GEMM library picks among (rows, columns): NVIDIA's Matrix Multiplication Background User's
# Guide, "Dimension Quantization Effects" (its A100 example: 256 x 128 tiles on 108 SMs)
TILES = ((256, 128), (128, 128))
# a product of fewer rows than the guide's smallest tile (a decode step's, a few tokens): GEMM libraries run it as
# matrix-vector products (cuBLAS's gemv and split-K kernels), no rows padded to a tile: its FLOPs at the rate,
# or its bytes, whichever is longer
SKINNY_ROWS = 64
# a kernel's launch without CUDA graphs: the floor of any kernel's time (NVIDIA technical blog, "Getting
# Started with CUDA Graphs", 2019: 3.8 us a short kernel, launched one after another into a stream)
LAUNCH_S = 3.8e-6
# bytes a parameter's fused Adam update reads and writes once a step, mixed precision (Megatron-LM's
# distributed optimizer): the float32 master and both moments read and written (24), the float32 gradient read
# (4), the 16-bit weight written (2); in float32 the master is the weight (28)
UPDATE_BYTES = {"mixed": 30, "fp32": 28}
# and before it, the gradients' check for inf and NaN (mixed precision's loss scaling) and their norm
# (clipping): each float32 gradient read once more for each
CHECK_BYTES = 8
# FlashAttention-2 on A100 (Dao 2023, arXiv 2307.08691, abstract and section 4.1): 50-73% of the peak forward,
# less in backward; the middle of that range for forward and backward together, of the FLOPs it runs (a causal
# mask's half of the scores: its benchmarks count them so)
FLASH_SHARE = 0.6


def word(precision: str) -> int:
    """Bytes of a number a GPU's kernels read and write in ``precision``."""
    return {"fp64": 8, "fp32": 4, "tf32": 4}.get(precision, 2)


def sustained(device, precision: str) -> float:
    """FLOP/s the fastest product shape achieves in ``precision``: the catalogue's measured
    ``achievable_flops``, else its published ``sustained_flops``, else the peak."""
    return device.achievable.get(precision) or device.sustained.get(precision) or device.peak(precision)


def gemm_seconds(device, precision: str, M, K, N, batch=1, accumulate: bool = False):
    """Seconds of ``batch`` products of ``M x K`` by ``K x N`` in ``precision`` (scalars or
    arrays): waves of output tiles over the SMs at the fastest shape's rate (fewer than
    :data:`SKINNY_ROWS` rows: no tiles, the FLOPs at that rate), or the matrices'
    bytes at a memory-bound kernel's bandwidth (``accumulate``: into a float32 output, read
    and written), whichever is longer; a launch at least."""
    size = word(precision)
    per_sm = sustained(device, precision) / device.sms
    arithmetic = np.inf
    for rows, columns in TILES:
        tiles = batch * np.ceil(M / rows) * np.ceil(N / columns)
        arithmetic = np.minimum(arithmetic, np.ceil(tiles / device.sms) * cost.matmul_flops(rows, K, columns) / per_sm)
    arithmetic = np.where(np.asarray(M) < SKINNY_ROWS, batch * cost.matmul_flops(M, K, N) / (per_sm * device.sms),
                          arithmetic)
    moved = batch * (size * (M * K + K * N) + (8 if accumulate else size) * M * N)
    return np.maximum(np.maximum(arithmetic, moved / device.stream_bandwidth), LAUNCH_S)


def trained_gemm(device, precision: str, M, K, N, batch=1, weights: bool = True, fused: bool = True) -> tuple:
    """(forward, backward) seconds of a layer's product ``M x K`` by ``K x N`` and its two
    in backward: the input's gradient (``M x N`` by ``N x K``) and the weights' (``K x M``
    by ``M x N``, accumulated into float32 gradients where ``fused``, else written; a
    product of two activations, not ``weights``: a second input's gradient instead)."""
    forward = gemm_seconds(device, precision, M, K, N, batch)
    other = gemm_seconds(device, precision, K, M, N, batch, accumulate=weights and fused)
    return forward, gemm_seconds(device, precision, M, N, K, batch) + other


def moved_seconds(device, nbytes):
    """Seconds of a memory-bound kernel that reads and writes ``nbytes``: at the bandwidth
    such a kernel achieves (``memory_bound_gbs``), a launch at least."""
    return np.maximum(nbytes / device.stream_bandwidth, LAUNCH_S)


def block_seconds(device, precision: str, b, T: int, C: int, H: int, tp, *, ffn: int = 0, kv: int = 0,
                  gated: bool = False, sequence: bool = False, dropout: bool = True, flash: bool = False,
                  fused: bool = True) -> dict:
    """Seconds of one block on one of ``tp`` ranks for a micro-batch of ``b`` samples of
    ``T`` tokens (``C`` wide, ``H`` heads; ``ffn``, ``kv``, ``gated`` as
    :func:`mpitrain.cost.gpt_block_flops`'s; ``fused``: :func:`trained_gemm`'s): ``forward``,
    ``backward``, and ``attention``, the forward of attention's core (its scores, softmax,
    dropout and weighted values), which selective recomputation runs again."""
    w = word(precision)
    ffn, kv = ffn or 4 * C, kv or H
    d, heads = C // H, H / tp
    M = b * T
    stream = b * T * C / np.where(sequence, tp, 1)  # numbers of the residual stream a rank's norms touch
    mask = 1.0 * dropout  # dropout's mask: a byte a number
    fwd, bwd = {}, {}
    for name, (k, n) in {"qkv": (C, (C + 2 * kv * d) / tp), "projection": (C / tp, C),
                         "up": (C, (2 if gated else 1) * ffn / tp), "down": (ffn / tp, C)}.items():
        fwd[name], bwd[name] = trained_gemm(device, precision, M, k, n, fused=fused)
    # memory-bound kernels (bytes forward, bytes backward): a norm reads its input, writes its output; backward
    # reads the input and the gradient, writes the input's gradient; a bias-dropout-add reads the output and
    # the residual, writes the sum and the mask; backward reads the gradient and the mask, writes one
    for name, f, g in (("norms", 2 * (2 * w * stream), 2 * (3 * w * stream)),
                       ("dropout-adds", 2 * (3 * w + mask) * stream, 2 * (2 * w + mask) * stream),
                       ("gelu", ((2 if gated else 1) + 1) * w * M * ffn / tp,
                        ((2 if gated else 1) * 2 + 1) * w * M * ffn / tp)):
        fwd[name], bwd[name] = moved_seconds(device, f), moved_seconds(device, g)
    if flash:  # one kernel: the causal half of its products at FlashAttention's share of the peak; backward 2.5 x
        flops = b * cost.attention_flops(1, T, C) / tp / 2
        fwd["attention"] = np.maximum(flops / (FLASH_SHARE * device.peak(precision)), LAUNCH_S)
        bwd["attention"] = 2.5 * fwd["attention"]
    else:  # scores and weighted values batched over the heads, softmax and dropout between them
        scores = b * heads * T * T
        f1, b1 = trained_gemm(device, precision, T, d, T, b * heads, weights=False)
        f2, b2 = trained_gemm(device, precision, T, T, d, b * heads, weights=False)
        softmax = moved_seconds(device, 2 * w * scores), moved_seconds(device, 3 * w * scores)
        drop = (moved_seconds(device, (2 * w + 1) * scores), moved_seconds(device, (2 * w + 1) * scores))
        fwd["attention"] = f1 + f2 + softmax[0] + dropout * drop[0]
        bwd["attention"] = b1 + b2 + softmax[1] + dropout * drop[1]
    return {"forward": sum(fwd.values()), "backward": sum(bwd.values()), "attention": fwd["attention"]}


def head_seconds(device, precision: str, b, T: int, C: int, V: int, tp) -> dict:
    """Seconds of the head on one of ``tp`` ranks (its slice of the vocabulary): its product
    and the cross-entropy over the logits in float32, four passes forward (the cast, the
    largest logit, the exponentials' sum, the probabilities) and two backward, each reading
    and writing every logit."""
    f, g = trained_gemm(device, precision, b * T, C, V / tp)
    logits = b * T * V / tp * 8.0
    return {"forward": f + 4 * moved_seconds(device, logits), "backward": g + 2 * moved_seconds(device, logits)}


def embedding_seconds(device, precision: str, b, T: int, C: int) -> dict:
    """Seconds of the embedding: its rows and positions read and added, written (forward);
    the gradient read and added into the table's rows (backward)."""
    moved = moved_seconds(device, 3 * word(precision) * b * T * C)
    return {"forward": moved, "backward": moved}


def update_seconds(device, precision: str, parameters):
    """Seconds of the fused Adam update of ``parameters`` (a rank's share): :data:`UPDATE_BYTES`
    and :data:`CHECK_BYTES` each at a memory-bound kernel's bandwidth."""
    moved = UPDATE_BYTES["fp32" if precision == "fp32" else "mixed"] + CHECK_BYTES
    return parameters * moved / device.stream_bandwidth


def accumulation_seconds(device, precision: str, parameters, m, main: bool = False):
    """Seconds of adding ``m`` micro-batches' weight gradients of ``parameters`` where the
    products do not (before Megatron-LM's gradient accumulation fusion, NVIDIA/Megatron-LM
    83b1e42f30, 2022): into float32 sums (``main``, :func:`main_grads`) each micro-batch's
    gradient read and the sum read and written; else PyTorch's autograd adds each new
    gradient to the sum from the second micro-batch on, reading both and writing the sum."""
    w = word(precision)
    per = m * (w + 8) if main else np.maximum(m - 1, 0) * 3 * w
    return per * parameters / device.stream_bandwidth


def main_grads(sync: str, precision: str, accumulation: str = "fused") -> bool:
    """Whether a GPU framework keeps float32 gradients beside 16-bit weights
    (:func:`as_frameworks_hold`): in mixed precision with ddp or ZeRO-1, unless it sums
    micro-batches' gradients in 16 bits (``accumulation``, ``train.accumulation``)."""
    return precision in ("bf16", "fp16") and sync in ("ddp", "zero1") and accumulation != "16-bit"


def synced_word(sync: str, precision: str, accumulation: str = "fused") -> int:
    """Bytes of a gradient a GPU framework's data parallelism sums: in bf16, float32 where
    it keeps float32 gradients (:func:`main_grads`: Megatron-LM sets
    ``accumulate_allreduce_grads_in_fp32`` for bf16; DeepSpeed's bf16 optimizer reduces its
    float32 gradients, ``_bf16_reduce_grads``); else a product's word (Megatron-LM's
    default in fp16)."""
    return 4 if precision == "bf16" and main_grads(sync, precision, accumulation) else word(precision)


def sends_waited(m, v, send):
    """Seconds a pipeline stage waits on its sends in a step of ``m`` micro-batches through
    ``v`` chunks: Megatron-LM's schedule waits on each exchange with its neighbours
    (``p2p_communication``: the requests of ``batch_isend_irecv`` waited on at once), each
    chunk's activations out and their gradient back, ``send`` seconds each."""
    return m * 2 * v * send


def gathered_again(blocks, activation, tp):
    """Bytes a rank sends in backward gathering the norms' outputs again, with sequence
    parallelism (Megatron-LM keeps its slice of each, not the gathered whole: Korthikanti
    et al. 2022, section 4.2.2; Calculon's ``seq_par_ag_redo``): two allgathers of a
    micro-batch's ``activation`` bytes in each of ``blocks`` (a block of each micro-batch)."""
    return blocks * 2 * cost.collective_bytes("allgather", activation, tp)


def stage_seconds(device, model, precision: str, b, m, tp, blocks, first, last, N, updated, recompute: bool,
                  sequence: bool, sync: str = "ddp") -> tuple:
    """(seconds of its micro-batches, forward's share of them, seconds once a step) of a
    pipeline stage's compute on a GPU, kernel by kernel, for a GPT of ``model``'s shape
    (:class:`mpitrain.plan.space.Gpt`): ``m`` micro-batches of ``b`` samples through its
    ``blocks`` (each forward once more with ``recompute``, or attention's core with
    selective recomputation), the embedding on the ``first`` stage and the head on the
    ``last``; its ``N`` parameters' gradients added up over the micro-batches where the
    products do not (into the gradients ``sync`` keeps: :func:`accumulation_seconds`); once
    a step the update of its ``updated`` ones."""
    T, C, H, V = model.T, model.C, model.H, model.V
    precision = "fp64" if model.itemsize == 8 and precision == "fp32" else precision  # a float64 run's products
    fused = model.accumulation == "fused"
    block = block_seconds(device, precision, b, T, C, H, tp, ffn=model.ffn, kv=model.kv, gated=model.gated,
                          sequence=sequence, dropout=model.dropout, flash=model.flash, fused=fused)
    head, embed = head_seconds(device, precision, b, T, C, V, tp), embedding_seconds(device, precision, b, T, C)
    again = block["forward"] if recompute else block["attention"] if model.selective else 0
    forward = m * (blocks * block["forward"] + last * head["forward"] + first * embed["forward"])
    backward = m * (blocks * (block["backward"] + again) + last * head["backward"] + first * embed["backward"])
    main = main_grads(sync, precision, model.accumulation)
    added = 0 if fused else accumulation_seconds(device, precision, N, m, main)
    total = forward + backward + added
    return total, forward / total, update_seconds(device, precision, updated)


# ------------------------------------------------------------------ what a GPU framework holds
# beyond the model state and the activations, per GPU (the plan's "framework" column):
# the CUDA context with lazy module loading, PyTorch's default (NVIDIA's ptrblck, pytorch/pytorch#109888:
# "around 400MB if CUDA >= 11.7")
CONTEXT_BYTES = 400e6
# NCCL's buffers per communicator a rank belongs to: 544-688 MB measured per communicator on 4 A100s with
# NVLink (NVIDIA/nccl#964); the larger
NCCL_BYTES = 688e6
# cuBLAS's workspace, one per stream (PyTorch's CublasHandlePool.cpp: 32 MiB on Hopper, 8.125 MiB before;
# Hopper's taken for every GPU, an upper bound)
WORKSPACE_BYTES = 32 * 2**20
# Megatron-LM's own allowance for "optimizer and miscellaneous temporaries", 5% of the model state and the
# activations (megatron/training/theoretical_memory_usage.py); no allocator fragmentation is added
TEMPORARIES = 0.05


def framework_bytes(communicators: int, held):
    """Bytes a GPU framework's rank holds beyond ``held`` (its model state and activations):
    the CUDA context, NCCL's buffers for each of its ``communicators``, cuBLAS's workspace,
    and Megatron-LM's temporaries' share of ``held``."""
    return CONTEXT_BYTES + NCCL_BYTES * communicators + WORKSPACE_BYTES + TEMPORARIES * held


def held(memory: dict, sync: str, mixed: bool, communicators, accumulation: str = "fused") -> dict:
    """A rank's ``memory`` by category (tier 1's) as a GPU framework holds it
    (:func:`as_frameworks_hold`), with its ``"framework"`` allowance (:func:`framework_bytes`
    for its ``communicators``)."""
    memory = as_frameworks_hold(memory, sync, mixed, accumulation)
    return {**memory, "framework": framework_bytes(communicators, sum(memory.values()))}


def as_frameworks_hold(memory: dict, sync: str, mixed: bool, accumulation: str = "fused") -> dict:
    """Model state as GPU frameworks hold it: in mixed precision with data parallelism or
    ZeRO-1 (Megatron-LM's distributed optimizer) the gradients in float32, its "main_grad"
    buffer: 18 bytes a parameter, 6 + 12/d distributed (Megatron-LM's
    docs/user-guide/features/dist_optimizer.md); ZeRO-2 and -3 as DeepSpeed's (Rajbhandari
    et al. 2020), the gradients in 16 bits; and where a framework sums micro-batches'
    gradients in 16 bits (``accumulation``, PyTorch's autograd), those too."""
    if main_grads(sync, "bf16" if mixed else "fp32", accumulation):
        return {**memory, "gradients": 2 * memory["gradients"]}
    return memory
