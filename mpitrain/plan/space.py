"""Tier 1 over every layout at once: how ``mpitrain plan --search`` ranks a GPU cluster's
layouts of a GPT before the fastest go through the trainer's checks
(:mod:`~mpitrain.plan.search`); and a GPU's plan (:func:`textbook`).

A layout is a grid ``dp x pp x tp`` of the job's ranks, a pipeline's chunks, and a value of
each knob of :data:`KNOBS`. A :class:`Space` holds one row per layout, each column a NumPy
array. :func:`evaluate` answers every row at once with tier 1's formulas
(:mod:`~mpitrain.plan.estimate`, :mod:`mpitrain.cost`): each categorical knob's value
(a sync, a schedule, a precision, recomputation, sequence parallelism) is applied to all
the rows that hold it, the numbers (ranks, micro-batches, bucket sizes) as arrays.

Where a pipeline cuts the model, the trainer's cut says what each stage holds
(:func:`mpitrain.plan.layout.stage_layers`): one table per cut and slicing, made once.

Per layout, tier 1 gives the peak memory of its largest stage (model state, and the
activations its schedule keeps; on a GPU as its frameworks hold it, with their allowance)
and the step of its slowest one: a GPU's kernels (:mod:`~mpitrain.plan.gpu`; a device
without a GPU model: its products at its peak for the precision), the tensor-parallel
sums of each block (four allreduces of a micro-batch's activations, six with
recomputation) and of the embedding and the head, the gradients' collectives (their
bytes at the bus bandwidth measured for their arrays' size) hidden as the sync allows,
the bubble, the tied embedding's sum between the first and last stage. What tier 1
leaves out is tier 2's to add
(``plan/README.md``, "Two tiers").
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from mpitrain import cost
from mpitrain.plan import estimate, gpu, shapes
from mpitrain.plan.layout import moments_of, stage_layers

# what ``mpitrain plan --search`` tries: each knob's values (chunks: an interleaved pipeline rank's)
KNOBS = {"sync": ("ddp", "zero1", "zero2", "zero3"), "schedule": ("gpipe", "1f1b", "zb-h1", "interleaved"),
         "precision": ("fp32", "bf16"), "recompute": (False, True), "sequence": (False, True),
         "micro_batches": (1, 2, 4, 8), "bucket_mb": (1.0, 4.0), "chunks": (2,)}
# a space as wide as the published searches' (Calculon's 13B model on 64 GPUs: about 1.2 million layouts):
# every number of micro-batches that divides a replica's batch, more bucket sizes and chunks, fp16 too
WIDE = {**KNOBS, "precision": ("fp32", "bf16", "fp16"), "micro_batches": tuple(range(1, 4097)),
        "bucket_mb": (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 64.0), "chunks": (2, 3, 4, 6, 8)}


@dataclass(frozen=True)
class Gpt:
    """A GPT's shape and batch, as tier 1 needs them."""

    V: int
    T: int
    L: int
    H: int
    C: int
    batch: int  # samples per step, all replicas together
    bias: bool = False
    itemsize: int = 4  # bytes of a number in float32 training
    moments: int = 2  # the optimizer's arrays per parameter (Adam 2)
    threads: int = 0  # BLAS threads a rank asks for (train.threads; 0: the machine's share)
    ffn: int = 0  # the MLP's width (0: 4C)
    kv: int = 0  # key and value heads (0: H)
    gated: bool = False  # a gated MLP (SwiGLU)
    tied: bool = True  # the head's weight is the embedding's
    positions: bool = True  # learned positions
    selective: bool = False  # attention's scores and softmax recomputed, not kept
    dropout: bool = False  # dropout in the blocks
    flash: bool = False  # attention as one fused kernel (FlashAttention)
    overlapped: bool = True  # ddp's buckets start during backward (parallel.progress "off": after it)
    accumulation: str = "fused"  # how a GPU framework sums micro-batches' weight gradients (train.accumulation)

    @classmethod
    def of(cls, cfg, data) -> "Gpt":
        m = cfg.model
        return cls(m.vocab_size or data.ids, m.block_size, m.n_layer, m.n_head, m.n_embd, cfg.train.global_batch_size,
                   m.bias, np.dtype(cfg.train.dtype).itemsize, moments_of(cfg.optim), cfg.train.threads, m.ffn_hidden,
                   m.n_kv_head, m.gated_mlp, m.tie_embeddings, m.position_embedding, m.selective_recompute,
                   m.dropout > 0, m.flash_attention, cfg.parallel.progress != "off", cfg.train.accumulation)


@dataclass
class Space:
    """Layouts as columns: each a NumPy array of one value per layout; ``grid`` indexes the
    table of grids (:func:`grids`), the categorical knobs are indices into :data:`KNOBS`'s."""

    grid: np.ndarray
    sync: np.ndarray
    schedule: np.ndarray
    precision: np.ndarray
    recompute: np.ndarray
    sequence: np.ndarray
    micro_batches: np.ndarray
    bucket_mb: np.ndarray

    def __len__(self) -> int:
        return len(self.grid)

    def row(self, i: int, table: dict, knobs: dict = KNOBS) -> dict:
        """Layout ``i`` as a dict of plain values."""
        g = int(self.grid[i])
        return {"dp": int(table["dp"][g]), "pp": int(table["pp"][g]), "tp": int(table["tp"][g]),
                "chunks": int(table["v"][g]), **{k: knobs[k][int(getattr(self, k)[i])]
                                                 for k in ("sync", "schedule", "precision", "recompute", "sequence")},
                "micro_batches": int(self.micro_batches[i]), "bucket_mb": float(self.bucket_mb[i])}


def whole_training(cfg) -> None:
    """Refuse a fine-tuning config (ConfigError naming its fields): tier 1's columns count
    every parameter's gradient, optimizer state and exchange, and a block's backward as
    twice its forward; what a frozen parameter or LoRA's adapters change is counted layout
    by layout (:mod:`mpitrain.plan.shapes`, :meth:`~mpitrain.plan.shapes.ModelShape.tuned`)."""
    from mpitrain.config import ConfigError

    fields = [f for f, on in (("train.trainable", cfg.train.trainable), ("model.lora_rank", cfg.model.lora_rank)) if on]
    if fields:
        full = " ".join(f"--set {f}={'[]' if f == 'train.trainable' else 0}" for f in fields)
        raise ConfigError(f"--search: {' and '.join(fields)}: a fine-tuning config is not searched on a GPU (tier 1 "
                          "counts every parameter as training); plan one layout of it at a time (mpitrain plan CONFIG "
                          f"--set parallel.dp=...), or search it as full training with {full}")


def grids(model: Gpt, P: int, chunks: tuple = KNOBS["chunks"]) -> dict:
    """The table of every grid of ``P`` ranks that the model's shape allows (``tp`` divides
    the heads; ``pp`` times the chunks at most the layers), with one chunk a pipeline rank
    and with each of ``chunks``: per grid, its ``dp``, ``pp``, ``tp``, ``v``, and per
    pipeline rank (padded to the longest pipeline) the parameters and blocks of its tensor
    slice, and whether it holds the embedding and the head."""
    rows = []
    for pp in (d for d in range(1, P + 1) if P % d == 0):
        for tp in (d for d in range(1, P // pp + 1) if (P // pp) % d == 0):
            if model.H % tp or (model.kv or model.H) % tp:  # whole heads, and key and value heads, on a slice
                continue
            for v in ((1, *chunks) if pp > 1 else (1,)):
                if pp * v <= model.L + 2:
                    rows.append((P // (pp * tp), pp, tp, v))
    return table_of(model, rows)


def table_of(model: Gpt, rows: list[tuple]) -> dict:
    """:func:`grids`'s table of the grids ``rows``, each ``(dp, pp, tp, v)``."""
    most = max(r[1] for r in rows)
    table = {k: np.array([r[j] for r in rows]) for j, k in enumerate(("dp", "pp", "tp", "v"))}
    for k in ("N", "blocks", "first", "last"):
        table[k] = np.zeros((len(rows), most), dtype=bool if k in ("first", "last") else float)
    table["stage"] = np.arange(most)[None, :] < table["pp"][:, None]
    for g, (_, pp, tp, v) in enumerate(rows):
        for k, x in zip(("N", "blocks", "first", "last"), _stages(model, pp, tp, v)):
            table[k][g, :pp] = x
    return table


@lru_cache(maxsize=None)
def _stages(model: Gpt, pp: int, tp: int, v: int) -> tuple:
    """(parameters, blocks, embedding, head) of each pipeline rank's first tensor slice, as
    the trainer cuts."""
    shape = shapes.gpt(model.V, model.T, model.L, model.H, model.C, model.bias, t=tp, ffn=model.ffn, kv=model.kv,
                       gated=model.gated, tied=model.tied, positions=model.positions)
    parts = [stage_layers(shape, pp, v, s) for s in range(pp)]
    return ([shape.count(layers) for layers in parts],
            [sum(x.name.startswith("block") for x in layers) for layers in parts],
            [any(x.name == "embed" for x in layers) for layers in parts],
            [any(x.name == "head" for x in layers) for layers in parts])


def build(model: Gpt, table: dict, knobs: dict = KNOBS) -> Space:
    """Every layout of the grids of ``table`` and the values of ``knobs``, one row each, but
    those the arithmetic rules out: ZeRO on one replica, a schedule without a pipeline
    (``pp = 1`` takes the first), chunks without interleaving, sequence parallelism without
    slices, bucket sizes where nothing is bucketed (only ddp and ZeRO-2 on more than one
    replica bucket: the others get one row, bucket 0), micro-batches that do not divide a
    replica's share of the batch, and ZeRO-3 with recomputation (the trainer refuses it:
    ZeRO-3 replays each layer in backward)."""
    dp, pp, tp, v = table["dp"], table["pp"], table["tp"], table["v"]
    cols = {k: [] for k in Space.__dataclass_fields__}
    names = ("sync", "schedule", "precision", "recompute", "sequence")
    for combo in itertools.product(*(range(len(knobs[k])) for k in names)):
        sync, schedule, _, recompute, sequence = (knobs[k][c] for k, c in zip(names, combo))
        if sync == "zero3" and recompute:
            continue
        keep = ((dp > 1) | (sync == "ddp")) & ((tp > 1) | (not sequence))
        keep &= np.where(pp == 1, combo[1] == 0, (v > 1) == (schedule == "interleaved"))
        bucketed = (dp > 1) & (sync in ("ddp", "zero2"))
        for g, buckets in ((keep & bucketed, knobs["bucket_mb"]), (keep & ~bucketed, (0.0,))):
            G, M = (a.ravel() for a in np.meshgrid(np.flatnonzero(g), knobs["micro_batches"], indexing="ij"))
            ok = model.batch % (dp[G] * M) == 0
            n = int(ok.sum()) * len(buckets)
            for k, c in zip(names, combo):
                cols[k].append(np.full(n, c, dtype=np.int8))
            cols["grid"].append(np.repeat(G[ok], len(buckets)))
            cols["micro_batches"].append(np.repeat(M[ok], len(buckets)))
            cols["bucket_mb"].append(np.tile(np.asarray(buckets, dtype=float), n // len(buckets)))
    return Space(**{k: np.concatenate(c) for k, c in cols.items()})


def evaluate(model: Gpt, table: dict, space: Space, machine, knobs: dict = KNOBS, chunk: int = 1 << 16) -> dict:
    """Tier 1's answer for every layout of ``space`` on ``machine``
    (:class:`~mpitrain.plan.timing.Machine`): arrays ``peak`` (bytes of the largest stage)
    and the step's parts in seconds (:func:`mpitrain.plan.estimate.step_seconds`)."""
    out = {k: np.empty(len(space)) for k in ("peak", "compute", "exposed", "bubble", "step", "communication")}
    names = ("sync", "schedule", "precision", "recompute", "sequence")
    codes = np.stack([getattr(space, k) for k in names], axis=1)
    combos, which = np.unique(codes, axis=0, return_inverse=True)
    for c, combo in enumerate(combos):
        rows = np.flatnonzero(which.ravel() == c)
        knob = {k: knobs[k][int(i)] for k, i in zip(names, combo)}
        for lo in range(0, len(rows), chunk):
            idx = rows[lo:lo + chunk]
            parts = _answer(model, table, space.grid[idx], space.micro_batches[idx], space.bucket_mb[idx],
                            machine, **knob)
            for k, x in parts.items():
                out[k][idx] = x
    return out


def of_layout(lay, machine) -> dict:
    """Tier 1's answer (:func:`evaluate`) for the one layout of a
    :class:`~mpitrain.plan.layout.Layout` (a CNN's: :func:`of_cnn`); None where tier 1 has
    none (parameter servers, ``local`` sync)."""
    par, train = lay.par, lay.cfg.train
    if par.sync not in KNOBS["sync"]:
        return None
    if lay.cfg.model.name != "gpt":
        return of_cnn(lay, machine)
    model = Gpt.of(lay.cfg, lay.data)
    table = table_of(model, [(lay.dp, lay.pp, lay.tp, lay.v)])
    knobs = {"sync": (par.sync,), "schedule": (par.schedule,), "precision": (train.precision,),
             "recompute": (lay.cfg.model.checkpoint_activations,), "sequence": (lay.tp > 1 and par.sequence_parallel,)}
    one = Space(np.zeros(1, dtype=int), *(np.zeros(1, dtype=np.int8) for _ in range(5)), np.array([lay.m]),
                np.array([par.bucket_mb if par.sync in ("ddp", "zero2") and lay.dp > 1 else 0.0]))
    return {k: float(x[0]) for k, x in evaluate(model, table, one, machine, knobs).items()}


def of_cnn(lay, machine) -> dict:
    """Tier 1's answer for a CNN's layout, as :func:`_answer`'s for a GPT's: the peak of its
    largest pipeline rank (:func:`mpitrain.plan.estimate.of_cnn`) and the step of the one
    with the most FLOPs, its products at the rate of its heaviest layer's product."""
    answers = [estimate.of_cnn(lay, s) for s in range(lay.pp)]
    s = max(range(lay.pp), key=lambda k: sum(answers[k][1].values()))
    memory, flops, sent = answers[s]
    heavy = max(lay.layers(s), key=lambda x: x.forward)
    b = lay.micro_batch
    rows = heavy.product_rows(b, lay.dtype_bytes, lay.threads, lay.cfg.train.fast_paths)
    dtype = machine.multiplies_in(lay.cfg.train.dtype, lay.cfg.train.precision)
    compute = sum(flops.values()) / machine.rate(heavy.gemm, rows, dtype, lay.threads)
    N = sum(math.prod(shape) for shape in lay.parameters(s).values())
    number = lay.itemsize  # the textbook's words: 16 bits in mixed precision
    units = sum(1 for x in lay.layers(s) if x.params)  # ZeRO-3 gathers and reduce-scatters each layer with weights
    kind, calls = _sync_calls(lay.par.sync, N * number, lay.par.bucket_mb, lay.m, units)
    message = _sync_message(lay.par.sync, N * number, lay.par.bucket_mb, units)
    alpha, bandwidth, hides = _links(machine, 1, lay.dp, kind, message=message)
    dp_seconds = cost.alpha_beta_seconds(kind, lay.dp, sent["dp"], alpha, bandwidth, calls) if lay.dp > 1 else 0.0
    alpha, bandwidth, _ = _links(machine, lay.dp, lay.pp, message=None)
    model = lay.models[0].layers  # the largest message between two stages: the widest cut's activations
    boundary = max((math.prod(model[k - 1].out) for k in lay.bounds[1:-1]), default=0) * b * number
    parts = estimate.step_seconds(compute, 0.0, dp_seconds, alpha + boundary / bandwidth, 0.0, sync=lay.par.sync,
                                  schedule=lay.par.schedule, p=lay.pp, m=lay.m, v=lay.v,
                                  forward_share=flops["forward"] / sum(flops.values()), hides=float(hides),
                                  last=_last_bucket(lay.par.sync, N * number, lay.par.bucket_mb, lay.m))
    memories = [m for m, _, _ in answers]
    if machine.device.sms:  # as GPU frameworks hold it, and what they hold besides
        axes = sum(n > 1 for n in (lay.dp, lay.pp, lay.tp))
        memories = [gpu.held(m, lay.par.sync, lay.mixed, axes, lay.cfg.train.accumulation) for m in memories]
    return {"peak": float(max(sum(m.values()) for m in memories)), **{k: float(x) for k, x in parts.items()}}


def _buckets(grads, bucket_mb):
    """The buckets ``grads`` bytes of gradients fill at ``bucket_mb`` each (one at least)."""
    return np.maximum(np.ceil(grads / np.maximum(bucket_mb, 1e-9) / 2**20), 1)


def _last_bucket(sync: str, grads, bucket_mb, m=1):
    """The share of a sync's sums that starts when the last backward ends, and no compute
    hides: ddp's last bucket, ZeRO-2's last of its ``m`` micro-batches' (0: ZeRO-1's and -3's)."""
    return {"ddp": 1 / _buckets(grads, bucket_mb), "zero2": 1 / (m * _buckets(grads, bucket_mb))}.get(sync, 0.0)


def _sync_message(sync: str, grads, bucket_mb, layers):
    """The array each of a sync's calls sums or gathers, in bytes (what a collective's bus
    bandwidth depends on): a bucket (ddp, ZeRO-2), the gradients whole (ZeRO-1), a layer's
    share of them (ZeRO-3, its ``layers``)."""
    bucket = np.minimum(grads, np.maximum(bucket_mb, 1e-9) * 2**20)
    return {"ddp": bucket, "zero1": grads, "zero2": bucket, "zero3": grads / layers}[sync]


def _sync_calls(sync: str, grads, bucket_mb, m, layers):
    """(the collective whose latencies a sync's calls pay, how many calls a step): ddp's
    buckets (``bucket_mb`` each: the gradients' ``grads`` bytes), ZeRO-1's two exchanges,
    ZeRO-2's reduce-scatters of each micro-batch's buckets and its gather, ZeRO-3's
    gathers and reduce-scatters of each of its ``layers`` in each micro-batch."""
    buckets = _buckets(grads, bucket_mb)
    kind = "allreduce" if sync == "ddp" else "reduce_scatter"
    return kind, {"ddp": buckets, "zero1": 2, "zero2": m * buckets + 1, "zero3": 3 * m * layers}[sync]


def textbook(lay, plans: list, machine) -> tuple[list, dict]:
    """A plan on a device that computes as GPU frameworks do (``lay.textbook``): each rank's
    memory tier 1's (:func:`mpitrain.plan.estimate.of_layout` of its part; no NumPy work
    arrays, buffers, objects or reader on the device), its calls and FLOPs tier 2's but the
    recomputed ones, tier 1's (a GPU framework replays what checkpointing or selective
    recomputation drops, not mpitrain's ZeRO-3 and zero-bubble replays); the step tier 1's
    (:func:`of_layout`) and the reader's wait. (ranks regrouped, time)."""
    from mpitrain.plan.predict import grouped
    from mpitrain.plan.timing import _coords, io_wait

    communicators = sum(n > 1 for n in (lay.dp, lay.pp, lay.tp))
    for p in plans:
        memory, flops, _ = estimate.of_layout(lay, *_coords(lay, p.ranks[0]))
        if machine.device.sms:  # as GPU frameworks hold it, and what they hold besides
            memory = gpu.held(memory, lay.par.sync, lay.mixed, communicators, lay.cfg.train.accumulation)
        p.memory = {"framework": 0, **memory, "work": 0, "buffers": 0, "objects": 0, "reader": 0}
        p.flops = {**p.flops, "recompute": flops["recompute"]}  # what the step's time (of_layout) replays
    t = of_layout(lay, machine)
    wait = io_wait(lay, machine, t["step"])
    parts = {"compute": t["compute"], "exposed": t["exposed"], "bubble": t["bubble"], "io_wait": wait,
             "step": t["step"] + wait, "comm_total": t["communication"]}
    return grouped([replace(p, ranks=[r]) for p in plans for r in p.ranks]), parts


def _answer(model: Gpt, table: dict, G, m, bucket_mb, machine, *, sync, schedule, precision, recompute,
            sequence) -> dict:
    """:func:`evaluate` for rows of one value of each categorical knob."""
    dp, pp, tp, v = (table[k][G] for k in ("dp", "pp", "tp", "v"))
    T, C, H, V = model.T, model.C, model.H, model.V
    b = model.batch // (dp * m)
    number = cost.word_bytes(precision != "fp32", model.itemsize)
    # memory: every pipeline rank's, the largest kept
    S = table["stage"].shape[1]
    if schedule == "interleaved":  # its rows' chunks (a formula of one number of chunks: each in turn)
        held = np.ones((len(G), S))
        for c in np.unique(v):
            held[v == c] = cost.micro_batches_held(schedule, pp[v == c, None], m[v == c, None], np.arange(S), int(c))
    else:
        held = np.where(pp[:, None] > 1, cost.micro_batches_held(schedule, pp[:, None], m[:, None], np.arange(S)), 1)
    memory = estimate.gpt_memory(table["N"][G], table["blocks"][G], T, C, H, V, b=b[:, None], held=held, sync=sync,
                                 dp=dp[:, None], tp=tp[:, None], precision=precision, itemsize=model.itemsize,
                                 moments=model.moments, sequence=sequence, recompute=recompute,
                                 last=table["last"][G], ffn=model.ffn, kv=model.kv or H, gated=model.gated,
                                 selective=(model.selective or model.flash) and not recompute)
    if machine.device.sms:  # as GPU frameworks hold it, and what they hold besides
        communicators = (dp > 1) * 1 + (pp > 1) + (tp > 1)
        memory = gpu.held(memory, sync, precision != "fp32", communicators[:, None], model.accumulation)
    peak = np.where(table["stage"][G], sum(memory.values()), -np.inf).max(axis=1)
    # time: the pipeline rank with the most FLOPs (recomputed blocks weigh more than the head)
    every = estimate.gpt_flops(table["blocks"][G], T, C, V, samples=(b * m)[:, None], tp=tp[:, None],
                               recompute=recompute, last=table["last"][G], ffn=model.ffn,
                               kvw=(model.kv or H) * C // H, gated=model.gated,
                               selective=model.selective and not recompute)
    slowest = np.where(table["stage"][G], sum(every.values()), -np.inf).argmax(axis=1)
    rows = np.arange(len(G))
    N, blocks, first, last = (table[k][G, slowest] for k in ("N", "blocks", "first", "last"))
    flops = {k: (x[rows, slowest] if np.ndim(x) == 2 else x) for k, x in every.items()}
    once = 0.0  # compute once a step, after the schedule: a GPU's update
    if machine.device.sms:  # a GPU: its kernels (mpitrain.plan.gpu)
        compute, forward, once = gpu.stage_seconds(machine.device, model, precision, b, m, tp, blocks, first, last, N,
                                          cost.state_shares(sync, dp)[2] * N, recompute, sequence, sync)
    else:
        compute = sum(flops.values()) / _rate(machine, model, precision, b)
        forward = flops["forward"] / sum(flops.values())
    sent = estimate.gpt_bytes(N, blocks, T, C, V, b=b, m=m, sync=sync, dp=dp, pp=pp, tp=tp, v=v, precision=precision,
                              itemsize=model.itemsize, recompute=recompute, sequence=sequence, first=first,
                              last=last, tied=model.tied)
    alpha, bandwidth, _ = _links(machine, 1, tp, message=b * T * C * number)
    sums = m * ((6 if recompute else 4) * blocks + 1 * first + 1 * last)  # the calls, each a latency
    tp_bytes = sent["tp"]
    if machine.device.sms and sequence and not recompute:  # Megatron-LM gathers a norm's output again in backward
        tp_bytes = tp_bytes + gpu.gathered_again(m * blocks, b * T * C * number, tp)
        sums = sums + 2 * m * blocks
    tp_seconds = cost.alpha_beta_seconds("allreduce", tp, tp_bytes, alpha, bandwidth, sums)
    grads, dp_bytes = (_kept_sums(model, sync, precision, N, number, dp, m) if machine.device.sms
                       else (N * number, sent["dp"]))
    kind, calls = _sync_calls(sync, grads, bucket_mb, m, blocks + 2)
    message = _sync_message(sync, grads, bucket_mb, blocks + 2)
    alpha, bandwidth, hides = _links(machine, tp, dp, kind, message=message)
    hides = hides * (model.overlapped or sync != "ddp")
    dp_seconds = np.where(dp > 1, cost.alpha_beta_seconds(kind, dp, dp_bytes, alpha, bandwidth, calls), 0.0)
    send, tied, waited = _between_stages(machine, b * T * C * number, V * C / tp * number, m, v, dp, pp, tp, sequence)
    parts = estimate.step_seconds(compute, tp_seconds, dp_seconds, send, np.where(pp > 1, tied, 0.0) * model.tied,
                                  sync=sync, schedule=schedule, p=pp, m=m, v=v, forward_share=forward, hides=hides,
                                  waited=waited, once=once, last=_last_bucket(sync, grads, bucket_mb, m))
    return {"peak": peak, **parts}


def _kept_sums(model: Gpt, sync: str, precision: str, N, number: int, dp, m) -> tuple:
    """(the gradients' bytes a GPU framework's data parallelism sums, the bytes a rank
    sends for them): in the word it keeps them in (:func:`mpitrain.plan.gpu.synced_word`),
    ddp's allreduce or ZeRO-1's reduce-scatter of those and its gather of the weights."""
    grads = N * gpu.synced_word(sync, precision, model.accumulation)
    if sync == "zero1":
        return grads, cost.collective_bytes("reduce_scatter", grads, dp) + cost.collective_bytes("allgather",
                                                                                                  N * number, dp)
    return grads, estimate.sync_bytes(grads, sync, dp, m)


def _between_stages(machine, whole, embedding, m, v, dp, pp, tp, sequence: bool) -> tuple:
    """(one send's seconds, the tied embedding's sum, what a stage waits on its sends in a
    step) between pipeline stages: a micro-batch's activations (``whole`` bytes) sent,
    a slice's share of them with sequence parallelism and on a GPU always (Megatron-LM's
    scatter-gather: each slice sends its share, the next stage gathers them over NVLink;
    Narayanan et al. 2021), which a GPU framework waits on in each micro-batch; the first
    and last stage's sum of the ``embedding`` bytes of a tied weight's gradient."""
    gpu_model = bool(machine.device.sms)
    alpha, bandwidth, _ = _links(machine, dp * tp, pp, message=None)  # a message between two: no collective's
    send = alpha + whole / np.where(sequence or gpu_model, tp, 1) / bandwidth
    alpha, bandwidth, _ = _links(machine, dp * tp, pp, message=embedding)
    tied = cost.alpha_beta_seconds("allreduce", 2, cost.collective_bytes("allreduce", embedding, 2), alpha, bandwidth)
    if not gpu_model:
        return send, tied, 0.0
    alpha, bandwidth, _ = _links(machine, 1, tp, "allgather", message=whole)
    gathered = cost.collective_bytes("allgather", whole, tp)
    gather = 0.0 if sequence else cost.alpha_beta_seconds("allgather", tp, gathered, alpha, bandwidth)
    return send, tied, np.where(pp > 1, gpu.sends_waited(m, v, send + gather), 0.0)


def _rate(machine, model: Gpt, precision: str, b):
    """FLOP/s of the device's products (for micro-batches of ``b`` samples, an array):
    :meth:`~mpitrain.plan.timing.Machine.rate` of a block's MLP product of a micro-batch,
    in what the device multiplies in, with the rank's BLAS threads."""
    dtype = machine.multiplies_in("float64" if model.itemsize == 8 else "float32", precision)
    sizes, where = np.unique(b, return_inverse=True)
    mlp, threads = (model.T, model.C, 4 * model.C), machine.threads(model.threads)
    return np.asarray([machine.rate(mlp, int(k) * model.T, dtype, threads) for k in sizes])[where.ravel()]


def _links(machine, stride, size, kind: str = "allreduce", message=None) -> tuple:
    """(alpha, bandwidth, share of a nonblocking ``kind`` call that compute hides) of the
    communicators of ``size`` ranks ``stride`` apart (ranks are placed node by node): the
    node's link if the group fits on one node, else the network's, its port shared as
    :meth:`~mpitrain.plan.timing.Machine.link` shares it, and never faster than the node's
    link (:func:`mpitrain.plan.timing.crossing`); the bus bandwidth a collective on
    arrays of ``message`` bytes achieves (:meth:`~mpitrain.plan.hardware.Link.busbw`); None:
    a message between two ranks (:meth:`~mpitrain.plan.hardware.Link.p2p`)."""
    per, inner, outer = machine.per_node, machine.intra, machine.inter
    off = stride * size > per
    def rate(link):
        return link.p2p if message is None else link.busbw(message)

    bandwidth = rate(outer)
    if outer.per_node and per > 1:
        bandwidth = bandwidth / cost.port_share(per, size, np.clip(per // stride, 1, size))
    # a measured curve's times have the latency in them
    alpha = [0.0 if link.measured and message is not None else link.alpha for link in (outer, inner)]
    return (np.where(off, *alpha), np.where(off, np.minimum(bandwidth, rate(inner)), rate(inner)),
            np.where(off, outer.hides(kind), inner.hides(kind)))
