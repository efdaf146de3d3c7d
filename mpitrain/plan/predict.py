"""What each rank of a layout needs per step, predicted from shapes alone: model state by
category, activations at the schedule's peak, bytes per communicator, FLOPs, the bubble.

Ranks that hold the same part alike get one :class:`RankPlan` (``ranks`` lists them); a
data-parallel rank's ZeRO shard can differ by a few numbers from its neighbour's, and so
does what mpitrain's ring sends, so every rank is computed and equal ones grouped.
Every formula is :mod:`mpitrain.cost`'s; the calls are :mod:`mpitrain.plan.traffic`'s.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

from mpitrain import cost, schedules
from mpitrain.comm.ring import chunk_bounds
from mpitrain.ops._util import BLOCK_ELEMENTS
from mpitrain.ops.conv import COLUMN_GRAD_BYTES
from mpitrain.plan.layout import buckets as buckets_of
from mpitrain.plan.layout import optimizer_order, zero3_groups
from mpitrain.plan.traffic import Call, by_axis, dp_calls, pp_calls, ring_buffers, tp_calls


@dataclass
class RankPlan:
    ranks: list  # world ranks with these figures
    stage: str  # "stage s", "server", "replica", or "" (slices of the whole model)
    parameters: int  # numbers of the part this rank holds
    memory: dict  # bytes: "parameters", "gradients", "optimizer state", "masters", "work", "buffers", "reader",
    # "activations"
    calls: list  # :class:`~mpitrain.plan.traffic.Call` per step
    flops: dict  # per step: "forward", "backward", "recompute" (executed beyond the model's)
    held: float = 0.0  # micro-batches whose activations the rank holds at its peak
    bubble: float = 0.0  # idle share of its step (pipelines)
    sent: dict = field(default_factory=dict)  # bytes per step by axis
    dp_calls: int = 0  # how many of ``calls`` are the data-parallel sync's (the first)
    slices: list = field(default_factory=list)  # the tensor-parallel ranks grouped here (none: not sliced)
    # activations (at least, at most) where the peak depends on messages' timing (ZeRO-2's buckets in
    # flight; ``memory["activations"]`` is the rule); (0, 0): no such range
    bounds: tuple = (0, 0)

    @property
    def state(self) -> int:
        return sum(self.memory[k] for k in ("parameters", "gradients", "optimizer state", "masters"))

    @property
    def peak(self) -> int:
        """The most it holds: model state, the optimizer's work array, the buffers kept (the
        ring's scratch, attention's causal mask), the reader's rounds, and the activations of
        the schedule's peak."""
        return self.state + sum(self.memory[k] for k in ("work", "buffers", "reader", "activations"))

    @property
    def rest(self) -> int:
        """What it holds between steps besides the reader: model state, the optimizer's work
        array, the buffers kept (the ring's scratch, attention's causal mask)."""
        return self.state + self.memory["work"] + self.memory["buffers"]

    @property
    def where(self) -> str:
        """"stage 1, slices 0-7", "slice 0", "replica", "server"."""
        s = self.slices
        cut = "" if not s else f"slice {s[0]}" if len(s) == 1 else f"slices {s[0]}-{s[-1]}"
        return ", ".join(w for w in (self.stage, cut) if w)

    def key(self) -> tuple:
        """What ranks alike share: the stage (or the server role) and every figure, not the slice."""
        return (self.stage, self.parameters, tuple(sorted(self.memory.items())),
                tuple(sorted(self.sent.items())), tuple(sorted(self.flops.items())))


def shards(lay, s: int, r: int, d: int) -> tuple[int, int, list]:
    """(parameters held, gradients held, the optimizer's pieces' sizes) of data-parallel
    rank ``d`` on pipeline rank ``s``'s slice ``r``: the whole part with data parallelism;
    ZeRO's shards as each stage cuts them (:mod:`mpitrain.parallel.zero`,
    :mod:`mpitrain.parallel.zero3`)."""
    sync, P = lay.par.sync, lay.dp
    params = lay.parameters(s, r)
    N = sum(math.prod(shape) for shape in params.values())
    if sync not in ("zero1", "zero2", "zero3") or P == 1 and sync != "zero3":
        return N, N, [math.prod(shape) for shape in params.values()]
    pieces = _cut(_flat_groups(lay, s, r), d)
    return (N if sync != "zero3" else sum(pieces)), (N if sync == "zero1" else sum(pieces)), pieces


def _flat_groups(lay, s: int, r: int) -> list[tuple]:
    """The flat arrays a ZeRO stage cuts into ``dp`` chunks, each kind as (its parameters'
    sizes, their offsets, the chunks' bounds, how many groups are alike): stage 1 one array
    in the optimizer's order, stage 2 each bucket, stage 3 each layer's group (kept: asked
    again for every data-parallel rank)."""
    key = ("flat groups", s, r)
    if key not in lay.cache:
        params = lay.parameters(s, r)
        names = {"zero1": lambda: [optimizer_order(params)],
                 "zero2": lambda: [list(reversed(g)) for g in buckets_of(lay, params)],
                 "zero3": lambda: zero3_groups(params, lay.layers(s, r))}[lay.par.sync]()
        alike: dict = {}  # a model's blocks make many groups alike: each kind cut once
        for group in names:
            sizes = tuple(math.prod(params[n]) for n in group)
            alike[sizes] = alike.get(sizes, 0) + 1
        lay.cache[key] = [(sizes, list(itertools.accumulate(sizes, initial=0)), chunk_bounds(sum(sizes), lay.dp), n)
                          for sizes, n in alike.items()]
    return lay.cache[key]


def _cut(groups: list, d: int) -> list[int]:
    """The sizes of the pieces of each parameter inside chunk ``d`` of each group
    (:func:`_flat_groups`; :func:`mpitrain.comm.ring.chunk_bounds`)."""
    pieces = []
    for sizes, offsets, bounds, alike in groups:
        lo, hi = int(bounds[d]), int(bounds[d + 1])
        i = max(0, bisect.bisect_right(offsets, lo) - 1)  # the parameter the chunk begins in
        while i < len(sizes) and offsets[i] < hi:
            inside = min(hi, offsets[i + 1]) - max(lo, offsets[i])
            if inside > 0:
                pieces += [inside] * alike
            i += 1
    return pieces


def model_state(lay, s: int, r: int, d: int) -> dict:
    """Bytes of model state of data-parallel rank ``d`` on pipeline rank ``s``'s slice ``r``
    (:func:`mpitrain.cost.bytes_per_parameter`'s categories, ZeRO's shards exactly):
    weights and gradients of ``itemsize``, the optimizer's moments of each piece it
    updates (Adam's with an 8-byte step count each) and in mixed precision their float32
    masters."""
    held, grads, pieces = shards(lay, s, r, d)
    if lay.servers:  # a worker: its servers keep the optimizer's state
        pieces = []
    own = sum(pieces)
    moment = 4 if lay.mixed else lay.itemsize
    counters = 8 * len(pieces) if lay.moments == 2 else 0  # Adam's step, an int64 per piece
    work = max(pieces, default=0) * moment * lay.work_arrays  # each the largest piece's size
    d = lay.cfg.data
    reader = lay.data.reader(lay.T, lay.cfg.train.global_batch_size, lay.cfg.train.global_batch_size // lay.dp,
                             d.buffer_mb, d.prefetch)
    return {"parameters": held * lay.itemsize, "gradients": grads * lay.itemsize,
            "optimizer state": lay.moments * own * moment + counters, "masters": 4 * own if lay.mixed else 0,
            "work": work, "reader": reader}


def split_backward(lay, s: int) -> bool:
    """Whether pipeline rank ``s`` splits backward in two passes (a zero-bubble schedule),
    which runs its layers on the plain path (:class:`mpitrain.parallel.pipeline.PipelineStage`)."""
    return lay.pp > 1 and any(isinstance(x, schedules.BackwardInput)
                              for x in schedules.schedule(lay.par.schedule, lay.pp, lay.m, s, lay.v))


def replays(lay, layer) -> bool:
    """Whether ``layer`` runs forward again in backward: activation checkpointing's blocks,
    and under ZeRO-3 every layer with parameters (it frees its gathered weights)."""
    return layer.recompute or (lay.par.sync == "zero3" and bool(layer.params))


def recomputed(lay, layer, split: bool) -> int:
    """FLOPs per sample ``layer`` runs again in backward: a replayed layer's forward; and in
    a backward split in two passes (``split``) a checkpointed block's node, which ignores
    the split, runs whole in both (:func:`mpitrain.autograd.backward_split`): its forward and
    backward once more."""
    if not replays(lay, layer):
        return 0
    return layer.forward + (layer.forward + layer.backward if split and layer.recompute else 0)


def activations(lay, layers: list, held: float, first_input: int, split: bool = False, received: int = 0,
                in_flight: str = "last") -> int:
    """Bytes of activations a stage holds at its peak: ``held`` micro-batches' worth of what
    its layers keep for backward and of the inputs it ``received`` (numbers per sample; the
    pipeline keeps each until its backward), the last of them at the moment of its forward,
    or of its backward, that holds most (:func:`_moments`; ``in_flight``: ZeRO-2's buckets
    still in flight then, :func:`_zero2_held`)."""
    kept, most = _moments(lay, layers, first_input, split, in_flight)
    inputs = received * lay.micro_batch * lay.dtype_bytes
    return int((held - 1) * (kept + inputs) + most + inputs)


def _moments(lay, layers: list, first_input: int, split: bool, in_flight: str = "last") -> tuple[int, int]:
    """(bytes one micro-batch keeps, the most it holds at one moment). A layer keeps its
    kept numbers, and in mixed precision the float32 copies of the weights its products
    read (:func:`mpitrain.dtypes.upcast`); one that runs again in backward keeps its input
    only (``first_input``: the stage's input's numbers per sample). While a layer runs
    forward it also holds its scratch (:func:`scratch_numbers`; ``split``: a zero-bubble
    schedule's plain path) and its convolution's columns (:func:`conv_work`), under ZeRO-3
    its and the next layer's gathered weights, and under ZeRO-2 from the second micro-batch
    on what the previous one's backward left (:func:`_zero2_held`: its buckets in flight,
    each freed once a test during backward has seen it done, so how many depends on the
    messages' timing, ``in_flight``; or the whole gradient, accumulated in full). While it
    runs backward, what the layers before it keep, its whole set, the gradients of its
    output and of its input (none for data), its convolution's columns and their gradient, and its largest part's
    weight gradients; a layer that ran again keeps its input beside its set, and its
    weight gradients come from its private graph, a second copy until the engine has added
    them (so under ZeRO-2, whose parameters have no ``.grad`` to add into); under ZeRO-3
    also its and the previous layer's gathered weights and the whole gradient of the layer
    after it with its shard (its reduce-scatter in flight:
    :meth:`mpitrain.parallel.zero3.Zero3._progress` frees each once its sum is in), under
    ZeRO-2 the later layers' gradients it holds, and at most the previous micro-batch's
    buckets not yet started again (:func:`_zero2_held`). Fused backward
    passes write their gradients over the arrays they read last, which is why a layer's
    backward adds no more than this."""
    b, a, s = lay.micro_batch, lay.dtype_bytes, lay.itemsize
    fast = lay.cfg.train.fast_paths and not split
    zero3 = lay.par.sync == "zero3"
    buckets = _zero2_held(lay, layers, 0, in_flight) if lay.m > 1 else 0
    # ZeRO-2 frees each .grad once packed: a gradient is a new array (but accumulated in full, a sum)
    fresh = lay.par.sync == "zero2" and not (lay.m > 1 and lay.par.accumulate == "full")
    kept, inp, most, before, inputs = 0, first_input, 0, [], []
    data = lay.models[0].layers[0].name  # the model's first layer, whose input (data) has no gradient
    for i, layer in enumerate(layers):
        inputs.append(0 if layer.name == data else inp)
        mine = (inp if replays(lay, layer) else layer.kept) * b * a
        mine += 4 * layer.size if lay.mixed and layer.forward else 0
        gathered = sum(x.size for x in layers[i : i + 2]) * s if zero3 else 0
        work = scratch_numbers(lay, layer, fast) + conv_work(lay, layer, fast)[0]
        most = max(most, kept + mine + work * a + gathered + buckets)
        before.append(kept)
        kept += mine
        inp = math.prod(layer.out)
    before.append(kept)
    for i, layer in enumerate(layers):
        again = replays(lay, layer)  # its graph is private: its weight gradients are returned, then added
        whole = (layer.full or layer.kept) * b * a + (before[i + 1] - before[i] if again else 0)
        copies = 2 if again or fresh else 1
        grads = (b * (math.prod(layer.out) + inputs[i]) + conv_work(lay, layer, fast)[1]) * a
        grads += copies * (layer.part or layer.size) * s
        if zero3:
            grads += sum(x.size for x in layers[max(0, i - 1) : i + 1]) * s
            grads += sum(x.size + -(-x.size // lay.dp) for x in layers[i + 1 : i + 2]) * s
        most = max(most, before[i] + whole + grads + _zero2_held(lay, layers, i + 1, in_flight, lay.m > 1))
    return kept, max(most, kept)


def _zero2_held(lay, layers: list, after: int, in_flight: str, later: bool = False) -> int:
    """Bytes of gradients ZeRO-2 holds beyond its shard once backward has passed the layers
    from ``after`` on (0: a whole backward, the previous micro-batch's): accumulated in full,
    the whole gradient; else the gradients of a bucket not yet full, and the buckets started
    with their received shards while in flight: each is freed when a hook sees it done, so
    "all" of them at most, "none" at least, and as a rule the "last" one started (a
    reduce-scatter ends while the next layer's backward runs). In a ``later`` micro-batch's
    backward, "all" also counts the previous micro-batch's buckets that this one has not
    started again: a rank ahead of the others tests them in vain until its own bucket's
    start waits for them (:meth:`mpitrain.parallel.zero.Zero2._start`)."""
    if lay.par.sync != "zero2":
        return 0
    model, s = lay.models[0], lay.itemsize
    if lay.m > 1 and lay.par.accumulate == "full":
        return model.count(layers) * s
    key = ("zero2 buckets", tuple(layer.name for layer in layers))  # asked once for every layer of a walk
    if key not in lay.cache:
        params = model.parameters(layers)
        lay.cache[key] = params, buckets_of(lay, params)
    params, groups = lay.cache[key]
    ready = set(model.parameters(layers[after:]))
    started = [all(name in ready for name in group) for group in groups]
    last = max((k for k, done in enumerate(started) if done), default=-1)
    held = 0
    for k, group in enumerate(groups):
        n = sum(math.prod(params[name]) for name in group if name in ready)
        if n and (not started[k] or in_flight == "all" or (in_flight == "last" and k == last)):
            held += n + (-(-n // lay.dp) if started[k] else 0)
        if later and in_flight == "all" and not started[k]:
            whole = sum(math.prod(params[name]) for name in group)
            held += whole + -(-whole // lay.dp)
    return held * s


def scratch_numbers(lay, layer, fast: bool) -> int:
    """Numbers a layer's forward holds for a moment beyond what it keeps, for one
    micro-batch: its ``scratch`` (a block's input and its first half's output, the
    head's logits), and a GELU's work: on the fast paths two arrays of one block of
    elements (:func:`mpitrain.ops.elementwise.gelu_blocks`), else three of the whole
    (``gelu_plain``: ``x^2``, ``h``, and the temporaries of its expressions, one at a
    time beyond its outputs); op by op (tensor slicing, a zero-bubble schedule) its input
    too, which the fused block's GELU overwrites."""
    b = lay.micro_batch
    if not layer.gelu:
        return layer.scratch * b
    work = 2 * min(layer.gelu * b, BLOCK_ELEMENTS) if fast else 3 * layer.gelu * b
    fused = fast and lay.tp == 1
    return layer.scratch * b + work + (0 if fused else layer.gelu * b)


def cached(lay, layers: list) -> int:
    """Bytes the layers' ops keep cached between steps, once in a process: attention's causal
    mask, one for all blocks, and for batch norm's column sums a vector of ones for each
    length of rows it sums (:func:`mpitrain.ops._util.cached_full`): ``ones`` per sample of a
    micro-batch (an evaluation at another batch adds its own)."""
    mask = max((layer.cache for layer in layers), default=0)
    ones = {layer.ones for layer in layers if layer.ones}
    return (mask + sum(ones) * lay.micro_batch) * lay.dtype_bytes


def conv_work(lay, layer, fast: bool) -> tuple[int, int]:
    """Numbers a layer's largest convolution (its ``gemm``) holds for a moment in (forward,
    backward), for one micro-batch: the column matrix, on the fast path one tile's
    (:class:`mpitrain.ops.conv.TiledConv2d` reuses one work array for every tile), which
    backward builds again for the weight gradient, beside a sub-tile of the column gradient
    (``COLUMN_GRAD_BYTES``; none where the input is data, whose gradient nobody needs); on the
    plain path (:class:`~mpitrain.ops.conv.Conv2d`) the whole micro-batch's columns, kept
    from forward to backward, and there their gradient as large."""
    if not layer.tiled:
        return 0, 0
    per_image = layer.gemm[0] * layer.gemm[1]  # (Ho Wo) x (k k C_in)
    rows = layer.product_rows(lay.micro_batch, lay.dtype_bytes, lay.threads, fast)
    columns = rows * layer.gemm[1]
    needs_input = layer.backward > layer.forward  # its backward has the input gradient's product too
    if not fast:
        return columns, columns * (1 + needs_input)
    sub = max(1, min(rows // layer.gemm[0], COLUMN_GRAD_BYTES // (per_image * lay.dtype_bytes)))
    return columns, columns + needs_input * sub * per_image


def rank_plan(lay, s: int, d: int, r: int, like: RankPlan | None = None) -> RankPlan:
    """Pipeline rank ``s``, data-parallel rank ``d``, tensor-parallel rank ``r``; what does
    not depend on ``d`` taken from ``like`` (the plan of another ``d``) when given."""
    layers = lay.layers(s, r)
    params = lay.parameters(s, r)
    memory = model_state(lay, s, r, d)
    memory["buffers"] = like.memory["buffers"] if like is not None else ring_buffers(lay, params, layers) + cached(
        lay, layers)
    ring = lay.par.allreduce == "ring"  # each rank of a ring sends its own count
    if like is not None:
        memory["activations"] = like.memory["activations"]
        calls = dp_calls(lay, params, layers, d) + like.calls[like.dp_calls:] if ring else like.calls
        return RankPlan([lay.rank_of(s, d, r)], like.stage, like.parameters, memory, calls, like.flops, like.held,
                        like.bubble, by_axis(calls) if ring else like.sent, like.dp_calls, list(like.slices),
                        like.bounds)
    held = cost.micro_batches_held(lay.par.schedule, lay.pp, lay.m, s, lay.v) if lay.pp > 1 else 1
    samples = lay.micro_batch * lay.m
    k = lay.bounds[s]  # the stage's first layer in the whole list
    first = math.prod(lay.models[r].layers[k - 1].out) if k else math.prod(lay.models[r].sample)
    split = split_backward(lay, s)
    model, p = lay.models[r].layers, lay.pp
    received = sum(math.prod(model[lay.bounds[c * p + s] - 1].out) for c in range(lay.v)  # inputs sent to it
                   if c * p + s and not replays(lay, model[lay.bounds[c * p + s]]))  # (a replayed layer keeps it)
    # the first stage's images as the loop hands them over, augmented and normalised: a copy in train.dtype
    images = first * samples * lay.dtype_bytes if lay.data.kind == "image" and k == 0 else 0
    memory["activations"] = images + activations(lay, layers, held, first, split, received, "last")
    bounds = (0, 0)
    if lay.par.sync == "zero2":  # how many buckets are in flight depends on the messages' timing
        bounds = tuple(images + activations(lay, layers, held, first, split, received, w) for w in ("none", "all"))
        bounds = (0, 0) if bounds[0] == bounds[1] else bounds
    dp = dp_calls(lay, params, layers, d)
    calls = dp + pp_calls(lay, s, r) + tp_calls(lay, s, r)
    flops = {"forward": samples * sum(x.forward for x in layers),
             "backward": samples * sum(x.backward for x in layers),
             "recompute": samples * sum(recomputed(lay, x, split) for x in layers)}
    bubble = cost.bubble_fraction(lay.par.schedule, lay.pp, lay.m, lay.v) if lay.pp > 1 else 0.0
    stage = f"stage {s}" if lay.pp > 1 else "" if lay.tp > 1 else "replica"
    N = sum(math.prod(shape) for shape in params.values())
    return RankPlan([lay.rank_of(s, d, r)], stage, N, memory, calls, flops, held, bubble, by_axis(calls), len(dp),
                    [r] if lay.tp > 1 else [], bounds)


def server_plan(lay, k: int) -> RankPlan:
    """Parameter server ``k``: the whole model's arrays, and the optimizer state of the
    parameters it owns (:func:`mpitrain.parallel.param_server.partition`); it answers each
    worker's pull with them and an 8-byte version."""
    from mpitrain.parallel.param_server import partition

    params = lay.models[0].parameters()
    order = optimizer_order(params)
    sizes = [math.prod(params[n]) for n in order]
    owner = partition(sizes, lay.servers)
    own = [n for n, o in zip(sizes, owner) if o == k]
    N, s = sum(sizes), lay.itemsize
    counters = 8 * len(own) if lay.moments == 2 else 0
    memory = {"parameters": N * s, "gradients": N * s, "optimizer state": lay.moments * sum(own) * s + counters,
              "masters": 0, "activations": 0, "work": max(own, default=0) * s * lay.work_arrays, "reader": 0,
              "buffers": 0}
    calls = [Call("dp", "parameters to each worker's pull (+ version)", "send", sum(own) * s + 8, 2, lay.dp, "p2p")]
    return RankPlan([k], "server", sum(own), memory, calls, {"forward": 0, "backward": 0, "recompute": 0},
                    sent=by_axis(calls))


def rank_plans(lay) -> list[RankPlan]:
    """Every rank's plan, equal ones grouped (in rank order of their first)."""
    plans = [server_plan(lay, k) for k in range(lay.servers)]
    for s in range(lay.pp):
        for r in range(lay.tp):
            first = rank_plan(lay, s, 0, r)
            plans += [first] + [rank_plan(lay, s, d, r, first) for d in range(1, lay.dp)]
    grouped: dict = {}
    for p in plans:
        if p.key() not in grouped:
            grouped[p.key()] = p
            continue
        first = grouped[p.key()]
        first.ranks += p.ranks
        first.slices = sorted(set(first.slices + p.slices))  # slices alike: "stage 1, slices 0-7"
    for p in grouped.values():
        p.ranks.sort()
    return sorted(grouped.values(), key=lambda p: p.ranks[0])
