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

from mpitrain import cost
from mpitrain.comm.ring import chunk_bounds
from mpitrain.plan.layout import optimizer_order, zero_groups
from mpitrain.plan import peak
from mpitrain.plan.peak import cached, recomputed, split_backward
from mpitrain.plan.traffic import Call, by_axis, dp_calls, pp_calls, ring_buffers, tp_calls


@dataclass
class RankPlan:
    ranks: list  # world ranks with these figures
    stage: str  # "stage s", "server", "replica", or "" (slices of the whole model)
    parameters: int  # numbers of the part this rank holds
    memory: dict  # bytes: "parameters", "gradients", "optimizer state", "masters", "work", "buffers", "objects",
    # "reader", "activations"; a GPU's also "framework" (mpitrain.plan.gpu.framework_bytes)
    calls: list  # :class:`~mpitrain.plan.traffic.Call` per step
    flops: dict  # per step: "forward", "backward", "recompute" (executed beyond the model's)
    held: float = 0.0  # micro-batches whose activations the rank holds at its peak
    sent: dict = field(default_factory=dict)  # bytes per step by axis
    dp_calls: int = 0  # how many of ``calls`` are the data-parallel sync's (the first)
    slices: list = field(default_factory=list)  # the tensor-parallel ranks grouped here (none: not sliced)
    # activations (at least, at most) where the peak depends on messages' timing (ZeRO-2's buckets in
    # flight, a pipeline stage's last sends; ``memory["activations"]`` is the rule); (0, 0): no such range
    bounds: tuple = (0, 0)

    @property
    def state(self) -> int:
        return sum(self.memory[k] for k in ("parameters", "gradients", "optimizer state", "masters"))

    @property
    def peak(self) -> int:
        """The most it holds: model state, the optimizer's work array, the buffers kept (the
        ring's scratch, attention's causal mask), Python's objects, the reader's rounds, and
        the activations of the schedule's peak."""
        return self.state + sum(self.memory.get(k, 0) for k in ("work", "buffers", "objects", "reader", "activations",
                                                                 "framework"))

    @property
    def rest(self) -> int:
        """What it holds between steps besides the reader: model state, the optimizer's work
        array, the buffers kept (the ring's scratch, attention's causal mask), Python's objects."""
        return self.state + self.memory["work"] + self.memory["buffers"] + self.memory["objects"]

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
    :mod:`mpitrain.parallel.zero3`), of the parameters that train; the frozen ones are
    held whole besides (:meth:`~mpitrain.plan.layout.Layout.frozen`)."""
    sync, P = lay.par.sync, lay.dp
    key = ("sizes", s, r)  # the part's, the same for each of its replicas
    if key not in lay.cache:
        lay.cache[key] = [math.prod(shape) for shape in lay.parameters(s, r).values()]
    sizes = lay.cache[key]
    N, F = sum(sizes), lay.frozen(s, r)
    if sync not in ("zero1", "zero2", "zero3") or P == 1 and sync != "zero3":
        return N + F, N, list(sizes)
    pieces = _cut(_flat_groups(lay, s, r), d)
    return (N if sync != "zero3" else sum(pieces)) + F, (N if sync == "zero1" else sum(pieces)), pieces


def _flat_groups(lay, s: int, r: int) -> list[tuple]:
    """The flat arrays a ZeRO stage cuts into ``dp`` chunks (:func:`~mpitrain.plan.layout.zero_groups`),
    each kind as (its parameters' sizes, their offsets, the chunks' bounds, how many groups
    are alike) (kept: asked again for every data-parallel rank)."""
    key = ("flat groups", s, r)
    if key not in lay.cache:
        params = lay.parameters(s, r)
        names = zero_groups(lay, s, r)
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
    state = cost.model_state_bytes(held, grads, sum(pieces), lay.moments, lay.itemsize, lay.mixed)
    state["optimizer state"] += 8 * len(pieces) if lay.moments == 2 else 0  # Adam's step, an int64 per piece
    moment = 4 if lay.mixed else lay.itemsize
    work = max(pieces, default=0) * moment * lay.work_arrays  # each the largest piece's size
    d = lay.cfg.data
    reader = lay.data.reader(lay.T, lay.cfg.train.global_batch_size, lay.cfg.train.global_batch_size // lay.dp,
                             d.buffer_mb, d.prefetch)
    return {**state, "work": work, "reader": reader}


def rank_plan(lay, s: int, d: int, r: int, like: RankPlan | None = None, objects: tuple = (0.0, 0.0)) -> RankPlan:
    """Pipeline rank ``s``, data-parallel rank ``d``, tensor-parallel rank ``r``; what does
    not depend on ``d`` taken from ``like`` (the plan of another ``d``) when given;
    ``objects``: the device's bytes of Python objects, and per parameter array."""
    layers = lay.layers(s, r)
    params = lay.parameters(s, r)
    memory = model_state(lay, s, r, d)
    memory["objects"] = int(objects[0] + objects[1] * len(params))
    memory["buffers"] = like.memory["buffers"] if like is not None else ring_buffers(lay, params, layers) + cached(
        lay, layers)
    ring = lay.par.allreduce == "ring"  # each rank of a ring sends its own count
    # the stages' and slices' sums of each rank's own pieces (ZeRO's shards of a part)
    pieces = lay.par.sync in ("zero1", "zero2", "zero3") and (lay.pp > 1 or lay.tp > 1)
    if like is not None:
        memory["activations"] = like.memory["activations"]
        calls = like.calls if not (ring or pieces) else (
            (dp_calls(lay, params, layers, d, (s, r)) if ring else like.calls[:like.dp_calls])
            + (pp_calls(lay, s, r, d) + tp_calls(lay, s, r, d) if pieces else like.calls[like.dp_calls:]))
        return RankPlan([lay.rank_of(s, d, r)], like.stage, like.parameters, memory, calls, like.flops, like.held,
                        by_axis(calls) if ring or pieces else like.sent, like.dp_calls, list(like.slices),
                        like.bounds)
    samples = lay.micro_batch * lay.m
    split = split_backward(lay, s)
    held = cost.micro_batches_held(lay.par.schedule, lay.pp, lay.m, s, lay.v) if lay.pp > 1 else 1
    bounds = (0, 0)
    if lay.textbook:  # tier 1 answers the activations (mpitrain.plan.space.textbook): not NumPy's walk
        memory["activations"] = 0
    else:  # tier 1's and the corrections (peak.corrections), together peak.held's parts
        memory["activations"] = int(sum(peak.held(lay, s, r).values()))
    if (lay.par.sync in ("zero2", "zero3") or peak.sends_in_flight(lay, s)) and not lay.textbook:
        bounds = tuple(int(sum(peak.held(lay, s, r, w).values())) for w in ("none", "all"))  # the messages' timing
        bounds = (0, 0) if bounds[0] == bounds[1] else bounds
    dp = dp_calls(lay, params, layers, d, (s, r))
    calls = dp + pp_calls(lay, s, r, d) + tp_calls(lay, s, r, d)
    flops = {"forward": samples * sum(x.forward for x in layers),
             "backward": samples * sum(x.backward for x in layers),
             "recompute": samples * sum(recomputed(lay, x, split) for x in layers)}
    stage = f"stage {s}" if lay.pp > 1 else "" if lay.tp > 1 else "replica"
    N = sum(math.prod(shape) for shape in params.values()) + lay.frozen(s, r)
    return RankPlan([lay.rank_of(s, d, r)], stage, N, memory, calls, flops, held, by_axis(calls), len(dp),
                    [r] if lay.tp > 1 else [], bounds)


def server_plan(lay, k: int, objects: tuple = (0.0, 0.0)) -> RankPlan:
    """Parameter server ``k``: the whole model's arrays, and the optimizer state of the
    parameters it owns (:func:`mpitrain.parallel.param_server.partition`); it answers each
    worker's pull with them and an 8-byte version."""
    from mpitrain.parallel.param_server import partition

    params = lay.parameters(0)  # what trains: the servers hold, update and send those
    order = optimizer_order(params)
    sizes = [math.prod(params[n]) for n in order]
    owner = partition(sizes, lay.servers)
    own = [n for n, o in zip(sizes, owner) if o == k]
    N, s = sum(sizes), lay.itemsize
    counters = 8 * len(own) if lay.moments == 2 else 0
    memory = cost.model_state_bytes(N + lay.frozen(0), N, sum(own), lay.moments, s)  # servers train in float32
    memory["optimizer state"] += counters
    memory.update({"activations": 0, "work": max(own, default=0) * s * lay.work_arrays, "reader": 0, "buffers": 0,
                   "objects": int(objects[0] + objects[1] * len(params))})
    calls = [Call("dp", "parameters to each worker's pull (+ version)", "send", sum(own) * s + 8, 2, lay.dp, "p2p")]
    return RankPlan([k], "server", sum(own), memory, calls, {"forward": 0, "backward": 0, "recompute": 0},
                    sent=by_axis(calls))


def rank_plans(lay, objects: tuple = (0.0, 0.0)) -> list[RankPlan]:
    """Every rank's plan, equal ones grouped (in rank order of their first); ``objects``:
    the device's bytes of a process's Python objects, and per parameter array it trains
    (:class:`~mpitrain.plan.hardware.Device`)."""
    plans = [server_plan(lay, k, objects) for k in range(lay.servers)]
    for s in range(lay.pp):
        for r in range(lay.tp):
            first = rank_plan(lay, s, 0, r, objects=objects)
            plans += [first] + [rank_plan(lay, s, d, r, first, objects) for d in range(1, lay.dp)]
    return grouped(plans)


def grouped(plans: list[RankPlan]) -> list[RankPlan]:
    """Equal plans as one, in rank order of their first."""
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
