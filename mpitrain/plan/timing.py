"""How long a step takes, predicted: compute from the device's speed at each layer's product
shape, communication from each link's alpha and beta, the pipeline's bubble, the reader.

The model (a roofline per layer, Williams et al. 2009, and the alpha-beta model of a
message, Hockney 1994):

* **compute** of a layer: its FLOPs over the device's rate at its product's shape as
  mpitrain runs it (:meth:`~mpitrain.plan.shapes.Layer.product_rows`: a convolution's in
  tiles of images; :meth:`~mpitrain.plan.hardware.Device.matmul_flops_per_s`; a published
  GPU's rate for the shape in the precision its products run in), plus, on a
  calibrated machine, mpitrain's elementwise work: the device's measured ``passes`` over
  the layer's traffic (:attr:`~mpitrain.plan.shapes.Layer.traffic`) at its streaming
  bandwidth; ranks beyond a node's cores share them.
* **communication** of a call: a ring collective on ``P`` ranks sends ``P - 1`` (reduce-
  scatter, allgather) or ``2 (P - 1)`` (allreduce) messages, ``alpha`` each, and its bytes
  at ``bandwidth``; the link is the network's if the communicator spans nodes (ranks are
  placed node by node in world order), else the node's; a network port a node is shared
  by the node's ranks (:meth:`Machine.link`), and ranks that take turns on a core pay a
  switch per call (:meth:`Machine.switches`). Parameter servers: a closed queueing
  network on the servers' links (:func:`served`).
* **exposed**: data parallelism's (and ZeRO-2's) buckets each start when backward has
  passed their parameters, one after another on the link, so what runs past the end of
  backward is exposed (:func:`bucket_overlap`); ZeRO-3's gathers and reduce-scatters run
  beside the layers they do not serve (:func:`zero3_overlap`); of a call beside compute
  only the link's ``overlap`` share can be hidden (:func:`hidden`: 1 for RDMA, calibrated
  here: a core that computes cannot also copy the bytes); every other collective blocks.
* **bubble**: a pipeline's step is its schedule simulated at the slowest stage's costs,
  each message between stages arriving its transfer's time after it left (:func:`pipelined`).
* **I/O wait**: the reader's thread reads ahead; the loop waits when reading a step's
  samples takes longer than the step.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, replace

from mpitrain import cost
from mpitrain.plan.peak import fused, recomputed, replays, split_backward
from mpitrain.plan.traffic import NAMED, Call

# a calibrated device without ``passes`` (calibrated before they were measured): mpitrain's steps' elementwise
# work, in passes over a layer's traffic; `mpitrain plan --calibrate` measures the device's own
UNCALIBRATED_PASSES = {"gpt": 18.0, "cnn": 10.0}


@dataclass(frozen=True)
class Machine:
    """Where a layout runs: a device per rank, the links, the ranks per node."""

    device: object  # :class:`~mpitrain.plan.hardware.Device`
    intra: object  # :class:`~mpitrain.plan.hardware.Link` inside a node
    inter: object  # ... between nodes
    per_node: int  # ranks per node
    memory: float = 0.0  # bytes available to one rank
    storage: float = 8e9  # bytes/s one rank's reader gets from storage
    cores: int = 0  # cores of a node (a calibrated machine: more ranks than cores share them); 0: one per rank
    switch: float = 0.0  # seconds a blocking call adds among ranks that take turns on a core (the device's)

    @property
    def share(self) -> float:
        """The share of a core each rank computes with (1, unless a node has fewer cores than ranks)."""
        return min(1.0, self.cores / self.per_node) if self.cores else 1.0

    @property
    def objects(self) -> tuple:
        """(bytes, bytes per parameter array) of a process's Python objects (the device's)."""
        return self.device.objects, self.device.objects_per_array

    def threads(self, requested: int = 0) -> int:
        """BLAS threads per rank as the trainer sets them (:func:`mpitrain.runtime.blas_threads`)."""
        if requested:
            return requested
        return max(1, self.cores // self.per_node) if self.cores else 1

    def multiplies_in(self, dtype: str, precision: str) -> str:
        """What a product of a run in ``train.dtype`` and ``precision`` computes in: a GPU's
        tensor cores in mixed precision's 16 bits; NumPy in float32 (it upcasts), or ``dtype``."""
        return precision if precision != "fp32" and not self.device.calibrated else dtype

    def rate(self, gemm: tuple, rows: int, dtype: str, threads: int = 1) -> float:
        """FLOP/s of a product of ``gemm``'s inner and outer sizes on ``rows`` rows."""
        d = self.device
        scale = self.share if d.calibrated else 1.0
        _, k, n = gemm or (1, 256, 256)
        return d.matmul_flops_per_s(max(1, rows), k, n, dtype, threads) * scale

    def switches(self, ranks: list[int]) -> float:
        """What each call of a communicator of ``ranks`` adds when two of them share a node
        whose ranks outnumber its cores: they take turns on a core, and a call waits for
        the turn of the other (:attr:`switch`)."""
        nodes = [r // self.per_node for r in ranks]
        return self.switch if self.share < 1 and len(set(nodes)) < len(nodes) else 0.0

    def link(self, ranks: list[int]):
        """The link a communicator of ``ranks`` calls over: the node's, or the network's. A
        network port a node (``per_node``) is shared: each of the node's ranks calls its own
        group's collective at the same time, and of a rank's bytes the share its partners
        off the node take (``(P - k) / (P - 1)``, ``k`` of the ``P`` on its node) goes out
        through the port beside theirs."""
        nodes = {r // self.per_node for r in ranks}
        if len(nodes) == 1:
            return self.intra
        if not self.inter.per_node or self.per_node == 1:
            return crossing(self.inter, self.intra)
        k = max(collections.Counter(r // self.per_node for r in ranks).values())
        shared = self.inter.bandwidth / cost.port_share(self.per_node, len(ranks), k)
        return crossing(replace(self.inter, bandwidth=shared), self.intra)


def crossing(network, node):
    """The link a group across nodes calls over: the ``network``'s, but no faster than the
    ``node``'s link, which its ring (and every collective's path between two of a node's
    ranks) also runs through: the node's rate where it is the slower (tier 1 takes the
    slower the same way, :func:`mpitrain.plan.space._links`)."""
    if node.p2p >= network.p2p:
        return network
    return replace(network, bandwidth=node.bandwidth, achieved=node.achieved)


# tier 2's named corrections to a step's compute (plan/README.md, "Two tiers"): what each adds beyond the
# products, and why NumPy and the runtime hold it
CORRECTIONS = {
    "elementwise": "norms, softmax, GELU, residual adds and the update: the device's passes over each layer's "
                   "traffic at its streaming bandwidth (a replayed forward: a third more)",
    "op calls": "each op's Python call and NumPy's dispatch, per layer and micro-batch",
    "update calls": "the optimizer's calls per parameter array, per layer and step",
    "mixed precision": "NumPy's casts to and from 16 bits and the float32 masters' update, per parameter",
    "ZeRO-3's replays": "mpitrain's ZeRO-3 frees a layer's gathered weights after its forward and runs the layer "
                        "again in backward: its products once more",
}


def compute_seconds(lay, plan, machine: Machine) -> float:
    """One rank's compute per step: :func:`compute_parts` together."""
    return sum(compute_parts(lay, plan, machine).values())


def compute_parts(lay, plan, machine: Machine) -> dict:
    """One rank's compute per step, by part: ``products``, its layers' products at the
    device's rate for their shapes and the rank's BLAS threads; on a calibrated machine
    also mpitrain's work beyond them (measured for whole steps, the update in them), each
    one of :data:`CORRECTIONS`: the device's ``passes`` over each layer's traffic, a
    replayed forward a third more; its time per layer and micro-batch, and per layer and
    step, that do not grow with the batch; in mixed precision its casts; on any device
    ZeRO-3's replayed forwards' products. (A GPU's plan is tier 1's: :mod:`~mpitrain.plan.gpu`.)"""
    d, b = machine.device, lay.micro_batch
    dtype = machine.multiplies_in(lay.cfg.train.dtype, lay.cfg.train.precision)
    parts = dict.fromkeys(("products", *CORRECTIONS), 0.0)
    if plan.stage == "server":
        return parts
    family = path(lay, plan)

    def figures(family: str) -> tuple:  # (passes, per layer overhead, the path's name measured)
        known = family if family in d.passes else family[:3]  # a path not measured: the fused GPT's figures
        if not d.calibrated:
            return 0.0, 0.0, known
        return d.passes.get(known, UNCALIBRATED_PASSES[known[:3]]), d.layer_overhead.get(known, 0.0), known

    passes, overhead, known = figures(family)
    plain = figures("gpt-plain") if family == "gpt" else (passes, overhead, known)  # LoRA's blocks: op by op
    threads = lay.threads
    s, r = _coords(lay, plan.ranks[0])
    if d.calibrated:
        parts["update calls"] = len(lay.layers(s, r)) * d.step_overhead.get(known, 0.0) / machine.share
    if lay.mixed and d.calibrated:  # its casts and the masters' update; a bucket's sum in float32 and back
        precision = lay.cfg.train.precision
        casts = plan.parameters * d.cast.get(precision, 0.0) if lay.dp > 1 else 0.0
        parts["mixed precision"] = (lay.m * plan.parameters * d.mixed.get(precision, 0.0) + casts) / machine.share
    split = split_backward(lay, s)
    for layer in lay.layers(s, r):
        again = recomputed(lay, layer, split) * b
        replay = 0 if layer.recompute else again  # ZeRO-3's (checkpointing's: the model's, tier 1 counts them)
        flops = (layer.forward + layer.backward) * b + again
        if flops:
            rows = layer.product_rows(b, lay.dtype_bytes, threads, lay.cfg.train.fast_paths)
            rate = machine.rate(layer.gemm, rows, dtype, threads)
            parts["products"] += lay.m * (flops - replay) / rate
            parts["ZeRO-3's replays"] += lay.m * replay / rate
        again = replays(lay, layer) / 3  # its elementwise work: a forward's, a third of a step's
        runs = 1 + again if layer.graph else 1 / 3  # no graph (fine-tuning's frozen layers first): forward alone
        p, o, _ = (passes, overhead, known) if fused(lay, layer, family == "gpt") or not layer.gelu else plain
        elementwise = p * runs * layer.traffic * b * lay.dtype_bytes
        parts["elementwise"] += lay.m * elementwise / (d.elementwise_bandwidth or d.memory_bandwidth) / machine.share
        parts["op calls"] += lay.m * o * runs / machine.share
    return parts


def path(lay, plan) -> str:
    """How a rank runs its layers (:data:`mpitrain.plan.hardware.FAMILIES`): a CNN; the GPT's
    blocks op by op through tensor slicing's layers (with sequence parallelism or not), or
    on the plain path (a zero-bubble schedule's: backward in two passes; or fast paths
    off), or fused."""
    if lay.cfg.model.name != "gpt":
        return "cnn"
    if lay.tp > 1:
        return "gpt-sequence" if lay.par.sequence_parallel else "gpt-sliced"
    if split_backward(lay, _coords(lay, plan.ranks[0])[0]):
        return "gpt-split"
    return "gpt" if lay.cfg.train.fast_paths else "gpt-plain"


def _coords(lay, rank: int) -> tuple[int, int]:
    """(pipeline rank, tensor-parallel rank) of a world rank."""
    rest, r = divmod(rank - lay.servers, lay.tp)
    return rest // lay.dp, r


def call_seconds(call, link) -> float:
    """A call's time on ``link``: its messages' latency and its bytes at the bandwidth."""
    if call.ranks == 1:
        return 0.0
    return cost.alpha_beta_seconds(call.collective, call.ranks, call.sent, link.alpha, link.bandwidth, call.count)


def group(lay, plan, axis: str) -> list[int] | range:
    """The world ranks of this rank's communicator on ``axis``: :meth:`~mpitrain.plan.layout.Layout.rank_of`
    with one coordinate running, an arithmetic sequence (a ``range``: a data-parallel
    group of a thousand ranks is not a list)."""
    rank = plan.ranks[0] - lay.servers
    rest, r = divmod(rank, lay.tp)
    s, d = divmod(rest, lay.dp)
    first, step, n = {"dp": (lay.rank_of(s, 0, r), lay.tp, lay.dp),
                      "pp": (lay.rank_of(0, d, r), lay.dp * lay.tp, lay.pp),
                      "tp": (lay.rank_of(s, d, 0), 1, lay.tp)}[axis]
    members = range(first, first + n * step, step)
    if axis == "dp" and lay.servers:
        return list(members) + list(range(lay.servers))
    return members


def hidden(beside: float, link, calls: dict) -> float:
    """What ``beside`` seconds of compute hide of nonblocking ``calls`` ({collective:
    seconds}) on ``link``: all of it at most, and never more than the link's share of each
    (:meth:`~mpitrain.plan.hardware.Link.hides`; the rest runs in the wait that ends it:
    :func:`mpitrain.plan.probes.overlap`)."""
    return min(max(0.0, beside), sum(link.hides(kind) * seconds for kind, seconds in calls.items()))


def bucket_overlap(plan, link, backward: float) -> float:
    """Seconds of a rank's data-parallel calls that backward does not hide: each gradient
    bucket is ready once backward has passed its parameters (its share of the bytes, in
    order) and its call starts then, or when the link is free of the one before, and
    backward hides what it can of it (:func:`hidden`); the rest runs after backward, and so
    does every other call (clipping's sum, ZeRO-2's gathers after the step)."""
    buckets = [c for c in plan.calls if c.axis == "dp" and c.what.startswith("gradient bucket")]
    rest = sum(call_seconds(c, link) for c in plan.calls if c.axis == "dp" and not c.what.startswith("gradient bucket"))
    total, done, free = sum(c.nbytes for c in buckets) or 1, 0, 0.0
    for c in buckets:
        done += c.nbytes
        start = max(free, backward * done / total)
        seconds = call_seconds(c, link)
        during = hidden(backward - start, link, {c.collective: seconds})
        free, rest = start + during, rest + seconds - during
    return rest


def zero3_overlap(lay, plan, link, compute: float) -> float:
    """Seconds of ZeRO-3's calls that compute does not hide, per micro-batch walked layer by
    layer (each layer's share of ``compute`` by its FLOPs: a quarter forward, the replay and
    backward the rest): forward gathers the next layer's weights while this one runs, the
    first one exposed; backward gathers the previous layer's and reduce-scatters the next
    one's while this one runs, the first gather and the last reduce-scatter exposed; every
    other call (clipping's sum) is exposed too."""
    s, r = _coords(lay, plan.ranks[0])
    layers = lay.layers(s, r)
    call = lambda kind, x: call_seconds(Call("dp", "", kind, x.size * lay.itemsize, lay.dp), link)  # noqa: E731
    gather, reduce = [call("allgather", x) for x in layers], [call("reduce_scatter", x) for x in layers]
    flops = [x.forward * 2 + x.backward for x in layers]
    work = [compute / lay.m * f / (sum(flops) or 1) for f in flops]  # one micro-batch's, layer by layer
    exposed = gather[0] + gather[-1] + reduce[0]
    for k, w in enumerate(work):
        ahead = gather[k + 1] if k + 1 < len(layers) else 0.0
        behind = (gather[k - 1] if k else 0.0), (reduce[k + 1] if k + 1 < len(layers) else 0.0)
        exposed += ahead - hidden(w / 4, link, {"allgather": ahead})
        exposed += sum(behind) - hidden(3 * w / 4, link, {"allgather": behind[0], "reduce_scatter": behind[1]})
    rest = sum(call_seconds(c, link) for c in plan.calls if c.axis == "dp" and c.collective == "allreduce")
    return lay.m * exposed + rest


def served(lay, plan, machine: Machine, compute: float) -> tuple[float, float]:
    """Parameter servers: (seconds per global batch's worth of gradients applied, each
    worker's communication in all, uncontended). A worker's cycle is its compute
    (``parallel.slow_factor`` times it for the straggler), its pushes and its pulls.
    Across nodes the servers' node's links are shared: every remote worker's push enters
    through it and its pull leaves through it, one station each, which the workers visit
    with a cycle's think time between (a closed queueing network: :func:`queued`).
    Synchronous workers push together, then pull together, once per step; asynchronous
    ones each at their own pace (Downpour); bounded ones at the slowest one's pace, which
    the others may lead but never leave behind."""
    par, S, W = lay.par, lay.servers, lay.dp
    push, pull = (b / S for b in cost.parameter_server_bytes(plan.parameters * lay.itemsize, S))
    think, demands, comm = [], [], 0.0
    for w in range(W):
        talk, visits = 0.0, {}  # its time on uncontended links; its demand at each shared station
        for s in range(S):  # the servers' links: their stations, shared as the queues have it
            node = s // machine.per_node
            link = machine.intra if node == (S + w) // machine.per_node else machine.inter
            talk += 2 * link.alpha
            if link is machine.intra:
                talk += (push + pull) / link.bandwidth
            else:
                visits[("in", node)] = visits.get(("in", node), 0.0) + push / link.bandwidth
                visits[("out", node)] = visits.get(("out", node), 0.0) + pull / link.bandwidth
        comm = max(comm, talk + sum(visits.values()))
        think.append(compute * (par.slow_factor if w == par.slow_worker else 1.0) + talk)
        demands.append(visits)
    if par.staleness == 0:  # every push through a station one after another, then every pull
        stations = {k for d in demands for k in d}
        queue = {way: max((sum(d.get(k, 0.0) for d in demands) for k in stations if k[0] == way), default=0.0)
                 for way in ("in", "out")}
        return max(think) + queue["in"] + queue["out"], comm
    rates = queued(think, demands)  # worker steps per second, each worker's
    per_second = sum(rates) if par.staleness < 0 else W * min(rates)
    return W / per_second, comm


def queued(think: list, demands: list) -> list:
    """Steps per second of each customer of a closed queueing network, one customer a
    class: ``think`` seconds away from the stations, then ``demands[c][station]`` seconds
    of service at each. Mean-value analysis with Bard and Schweitzer's approximation
    (Schweitzer 1979): a customer finds at a station the others' mean queues there."""
    queue = [{k: 0.0 for k in d} for d in demands]
    rates = [1.0 / max(z, 1e-12) for z in think]
    for _ in range(500):
        seen = {k: sum(q.get(k, 0.0) for q in queue) for d in demands for k in d}
        times = [{k: x * (1 + seen[k] - queue[c][k]) for k, x in d.items()} for c, d in enumerate(demands)]
        new = [1.0 / max(z + sum(t.values()), 1e-12) for z, t in zip(think, times)]
        queue = [{k: r * x for k, x in t.items()} for r, t in zip(new, times)]
        if max(abs(a - b) / b for a, b in zip(new, rates)) < 1e-9:
            return new
        rates = new
    return rates


def pipelined(lay, workers, rows, machine: Machine) -> float:
    """A pipeline's step, its schedule simulated (:func:`mpitrain.schedules.simulate`) at
    the slowest stage's costs of a micro-batch (:func:`_stage_costs`); a pass's output goes
    to the next stage by ``Isend`` beside the compute that follows, and arrives its
    message's time later; then the pipeline's own collectives (a tied weight's gradient,
    clipping's sum) after it."""
    from mpitrain import schedules

    F, B, W, latency, after = _stage_costs(lay, workers, rows, machine)
    ranks = [schedules.schedule(lay.par.schedule, lay.pp, lay.m, r, lay.v) for r in range(lay.pp)]
    return schedules.simulate(ranks, lay.pp, lay.v, schedules.costs_of(F, B, W, lay.v), latency).makespan + after


def _stage_costs(lay, workers, rows, machine: Machine) -> tuple:
    """(F, B, W, a message's latency, the collectives after the schedule) of the slowest
    stage: a micro-batch's compute and tensor-parallel calls split into forward, input- and
    weight-gradient passes by their FLOPs (a product each per layer for B and W)."""
    k = max(range(len(rows)), key=lambda j: rows[j][0] + rows[j][2]["tp"])
    p, (compute, _, comm) = workers[k], rows[k][:3]
    link = machine.link(group(lay, p, "pp"))
    sends = [c for c in p.calls if c.axis == "pp" and c.collective == "send"]
    send = max((call_seconds(c, link) / c.count for c in sends), default=0.0)
    after = comm["pp"] - sum(call_seconds(c, link) for c in sends)  # the stages' collectives
    flops = p.flops["forward"] + p.flops["backward"] + p.flops["recompute"]
    one = (compute + comm["tp"]) / lay.m  # a micro-batch's passes on this stage
    F = one * p.flops["forward"] / flops
    return F, (one - F) / 2, (one - F) / 2, send + machine.switches(group(lay, p, "pp")), after


def _rows(lay, workers, machine: Machine) -> list[tuple]:
    """Per worker (compute, exposed communication, {axis: its calls' seconds}, the turns
    on its cores in them, its named calls' seconds): what :func:`step_parts` takes the
    slowest of."""
    rows = []
    for p in workers:
        compute = compute_seconds(lay, p, machine)
        groups = {axis: group(lay, p, axis) for axis in ("dp", "pp", "tp")}
        links = {axis: machine.link(ranks) for axis, ranks in groups.items()}
        turns = {axis: machine.switches(ranks) * sum(c.count for c in p.calls if c.axis == axis)
                 for axis, ranks in groups.items()}
        comm = {axis: turns[axis] + sum(call_seconds(c, links[axis]) for c in p.calls if c.axis == axis)
                for axis in links}
        named = sum(call_seconds(c, links[c.axis]) for c in p.calls if c.axis != "pp" and c.what.startswith(NAMED))
        overlaps = lay.par.sync in ("ddp", "zero2") and lay.par.progress != "off"
        dp = turns["dp"] + bucket_overlap(p, links["dp"], compute * 2 / 3) if overlaps else comm["dp"]
        if lay.par.sync == "zero3":
            dp = min(dp, turns["dp"] + zero3_overlap(lay, p, links["dp"], compute))
        if lay.servers:
            step, comm["dp"] = served(lay, p, machine, compute)
            dp = step - compute
        rows.append((compute, dp + comm["tp"], comm, turns["dp"] + turns["tp"], named))
    return rows


def step_parts(lay, plans, machine: Machine) -> dict:
    """The step's predicted seconds: compute (the slowest rank's), exposed communication,
    the bubble, the I/O wait, and the total; with the communication in total and per
    axis."""
    workers = [p for p in plans if p.stage != "server"]
    rows = _rows(lay, workers, machine)
    compute = max(r[0] for r in rows)
    exposed = max(r[1] for r in rows)
    total_comm = max(sum(r[2].values()) for r in rows)
    bubble = 0.0
    if lay.pp > 1:
        bubble = pipelined(lay, workers, rows, machine) - compute - max(r[2]["tp"] for r in rows)
    step = compute + exposed + bubble
    wait = io_wait(lay, machine, step)
    return {"compute": compute, "exposed": exposed, "bubble": bubble, "io_wait": wait,
            "step": step + wait, "comm_total": total_comm}


# tier 2's named corrections to tier 1's step (:func:`step_corrections`): the compute's (:data:`CORRECTIONS`,
# the products' shapes) and these
STEP_CORRECTIONS = {
    "ranks taking turns": "more ranks than cores: each blocking call waits for the other rank's turn on a core",
    "named calls": "clipping's sums, the cross-entropy's sums, the replicated weights' sums (tier 1 counts none)",
    "overlap walked": "the buckets' overlap walked bucket by bucket, ZeRO-3's layer by layer, each call as the "
                      "trainer sends it (float32 words in mixed precision, ZeRO's pieces), against tier 1's "
                      "whole-backward overlap",
    "bubble of the corrections": "the closed-form bubble at tier 2's costs of a micro-batch, not tier 1's",
    "schedule simulated": "the schedule simulated with each message's time and the ranks' turns, against the "
                          "closed form",
    "I/O wait": "the reader's share of a step it cannot hide",
}


def step_corrections(plan, textbook: dict) -> dict:
    """Tier 2's step (``plan.time``) as tier 1's ``textbook`` one
    (:func:`mpitrain.plan.space.of_layout`) plus named corrections, seconds: the products'
    ``shapes`` and :data:`CORRECTIONS` of the rank whose compute the step takes, then
    :data:`STEP_CORRECTIONS` (the exposed communication's of the rank whose exposed time
    it takes, the bubble's of the slowest stage). Their sum is the difference."""
    lay, machine, t = plan.layout, plan.machine, plan.time
    workers = [p for p in plan.ranks if p.stage != "server"]
    rows = _rows(lay, workers, machine)
    parts = compute_parts(lay, workers[max(range(len(rows)), key=lambda j: rows[j][0])], machine)
    out = {"shapes": parts.pop("products") - textbook["compute"], **parts}
    _, exposed, _, turns, named = max(rows, key=lambda row: row[1])
    out.update({"ranks taking turns": turns, "named calls": named,
                "overlap walked": exposed - turns - named - textbook["exposed"]})
    closed = 0.0
    if lay.pp > 1:
        F, B, W, latency, after = _stage_costs(lay, workers, rows, machine)
        closed = cost.pipeline_idle(lay.par.schedule, lay.pp, lay.m, lay.v, F, B, W) + 2 * (lay.pp - 1) * latency
        closed += after
    out.update({"bubble of the corrections": closed - textbook["bubble"], "schedule simulated": t["bubble"] - closed,
                "I/O wait": t["io_wait"]})
    return out


def io_wait(lay, machine: Machine, step: float) -> float:
    """Seconds a step waits for its samples: reading a replica's share of the batch at the
    storage's rate, less the ``step`` the reader's thread reads beside."""
    read = lay.data.bytes_per_sample(lay.T, lay.cfg.data.sampling == "random") * lay.cfg.train.global_batch_size
    return max(0.0, read / max(1, lay.dp) / machine.storage - step)
