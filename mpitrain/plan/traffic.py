"""What a rank sends per training step, call by call, on each communicator of the grid.

Each :class:`Call` is one kind of message a rank makes (its collective, the array's bytes,
the communicator's ranks, how many times a step); its bytes are counted exactly as the
communicators count them (:class:`mpitrain.comm.CommStats`: a point-to-point message's
bytes, an MPI collective by :func:`mpitrain.cost.collective_bytes` rounded down call by
call, mpitrain's ring by what it sends, :func:`mpitrain.cost.ring_elements`). The calls
are those the strategies make, as their module docstrings state them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpitrain import cost
from mpitrain.plan.layout import buckets, held, zero3_groups, zero_groups
from mpitrain.plan.peak import replays, takes_data

# the calls tier 1 does not count, by the start of their names (tier 2's named calls: plan/README.md)
NAMED = ("clipping", "cross-entropy", "replicated weights")
NORM = 8  # one float64: a rank's sum of squares of its gradients, for clipping by the global norm


@dataclass(frozen=True)
class Call:
    axis: str  # "dp", "pp" or "tp": the communicator it is counted on
    what: str  # what it carries
    collective: str  # allreduce | reduce_scatter | allgather | send
    nbytes: int  # the array of one call
    ranks: int  # the communicator's size
    count: int = 1  # calls per step
    algorithm: str = "mpi"  # "mpi", or "ring": mpitrain's (exact per rank), "p2p"
    rank: int = 0  # this rank's index in the communicator (the ring's chunks differ by rank)
    itemsize: int = 4  # bytes of a number it carries

    @property
    def sent(self) -> int:
        """Bytes the counters count for this call's ``count`` calls."""
        if self.collective in ("send", "recv") or self.ranks == 1:
            return self.count * (self.nbytes if self.collective == "send" else 0)
        if self.algorithm == "ring":
            n, P, r = self.nbytes // self.itemsize, self.ranks, self.rank
            chunk = [n * (i + 1) // P - n * i // P for i in range(P)]
            one = {"allreduce": cost.ring_elements(n, P, r), "reduce_scatter": n - chunk[r],
                   "allgather": n - chunk[(r + 1) % P]}[self.collective]
            return self.count * one * self.itemsize
        return self.count * int(cost.collective_bytes(self.collective, self.nbytes, self.ranks))


def dp_calls(lay, params: dict, layers: list, d: int, part: tuple = (0, 0)) -> list[Call]:
    """The data-parallel sync's calls of rank ``d`` of ``dp_comm`` on a part holding
    ``params`` (``part``: its pipeline rank and slice)."""
    par, P, s, m = lay.par, lay.dp, lay.itemsize, lay.m
    N = sum(math.prod(shape) for shape in params.values())
    if par.sync == "ps":
        push, pull = cost.parameter_server_bytes(N * s, lay.servers)
        return [Call("dp", "push gradients (+ headers)", "send", int(push), 2, algorithm="p2p"),
                Call("dp", "pull parameters (+ versions)", "recv", 0, 2, algorithm="p2p")]
    if P == 1 or par.sync == "local":
        return []
    algo = par.allreduce if par.allreduce != "hierarchical" else "mpi"
    clip = [Call("dp", "clipping: sum of squares", "allreduce", NORM, P)] if lay.cfg.optim.grad_clip > 0 else []
    if par.sync == "ddp":
        wire = lay.sum_bytes(2 if par.wire != "fp32" else None, algo)
        return [Call("dp", f"gradient bucket {i}", "allreduce", n * wire, P, algorithm=algo, rank=d, itemsize=wire)
                for i, n in enumerate(_bucket_sizes(lay, params))]
    rs = lay.sum_bytes(None, algo)  # a reduce-scatter's bytes per number (16-bit through MPI: a float32 copy's)
    if par.sync == "zero1":  # each run of one kind on its own (plan.layout.zero_groups)
        runs = _alike([sum(math.prod(params[k]) for k in run) for run in zero_groups(lay, *part)])
        return ([Call("dp", _what("gradients", runs), "reduce_scatter", n * rs, P, k, algo, d, rs) for n, k in runs]
                + clip + [Call("dp", _what("parameters", runs), "allgather", n * s, P, k, algo, d, s)
                          for n, k in runs])
    if par.sync == "zero2":
        buckets = _bucket_sizes(lay, params)
        times = m if par.accumulate == "sharded" else 1
        return ([Call("dp", f"gradient bucket {i}", "reduce_scatter", n * rs, P, times, algo, d, rs)
                 for i, n in enumerate(buckets)] + clip
                + [Call("dp", f"parameter bucket {i}", "allgather", n * s, P, 1, algo, d, s)
                   for i, n in enumerate(buckets)])
    calls = []
    for names, first, last in zero3_groups(lay, params, layers, units=True):
        gathers, reduces = zero3_gathers(lay, m, data_only=takes_data(lay, layers[last]))
        n = sum(math.prod(params[k]) for k in names)
        what = names[0].rsplit(".", 2)[0] if len(names) > 1 else names[0]
        calls += [Call("dp", f"{what}: parameters gathered", "allgather", n * s, P, gathers, algo, d, s),
                  Call("dp", f"{what}: gradients", "reduce_scatter", n * rs, P, reduces, algo, d, rs)]
    return calls + clip


def zero3_gathers(lay, m: int, data_only: bool = False) -> tuple[int, int]:
    """How many times a step gathers each ZeRO-3 group and reduce-scatters its gradients
    (:mod:`mpitrain.parallel.zero3`): per micro-batch, in forward and again in backward (a
    zero-bubble pipeline's backward is two passes, each gathering, but for a group only the
    data's layer uses, ``data_only``: its input pass has nothing to do), and reduced once;
    with ``parallel.gather = "step"``, once per step each (:func:`mpitrain.cost.zero3_passes`)."""
    return cost.zero3_passes(m, lay.par.gather, lay.pp > 1 and lay.par.schedule == "zb-h1" and not data_only)


def _alike(sizes: list[int]) -> list[tuple[int, int]]:
    """(size, how many) of each size, in order of first appearance."""
    counts: dict = {}
    for n in sizes:
        counts[n] = counts.get(n, 0) + 1
    return list(counts.items())


def _what(what: str, runs: list) -> str:
    return what if len(runs) == 1 and runs[0][1] == 1 else f"{what}, a run of one kind"


def ring_buffers(lay, params: dict, layers: list) -> int:
    """Bytes mpitrain's ring keeps between steps on this rank's data-parallel communicators
    (:func:`mpitrain.comm.ring._work`, one scratch array per communicator, each as large as
    its largest ring asked): each of data parallelism's and ZeRO-2's buckets has its own
    communicator, ZeRO-3's groups two (gathers, reduce-scatters), ZeRO-1 one; a ring of
    ``n`` numbers on ``P`` ranks keeps :func:`mpitrain.comm.ring.work_numbers` of chunks of
    ``ceil(n / P)``. (Two ranks across nodes exchange instead of ringing: not counted here.)"""
    from mpitrain.comm.ring import work_numbers

    par, P, s = lay.par, lay.dp, lay.itemsize
    if par.allreduce != "ring" or P == 1 or par.sync not in ("ddp", "zero1", "zero2", "zero3"):
        return 0
    wire = par.sync == "ddp" and par.wire != "fp32"

    def work(n: int) -> int:
        return work_numbers(-(-n // P), s, wire) * (2 if wire else s)

    if par.sync == "zero1":
        return work(sum(math.prod(shape) for shape in params.values()))
    if par.sync == "zero3":
        return sum(2 * work(sum(math.prod(params[k]) for k in names)) for names in zero3_groups(lay, params, layers))
    return sum(work(n) for n in _bucket_sizes(lay, params))


def _bucket_sizes(lay, params: dict) -> list[int]:
    return [sum(math.prod(params[n]) for n in names) for names in buckets(lay, params)]


def pp_calls(lay, s: int, r: int, d: int = 0) -> list[Call]:
    """Pipeline rank ``s``'s sends per step: each micro-batch's activation to the next
    stage and gradient to the previous one, chunk by chunk; the tied weight's gradient
    summed with the other stage that holds it (data-parallel rank ``d``'s piece of it under
    ZeRO, :func:`~mpitrain.plan.layout.held`); the clipping norm."""
    if lay.pp == 1:
        return []
    calls, b, a, last = [], lay.micro_batch, lay.dtype_bytes, lay.pp * lay.v - 1
    for c, chunk in enumerate(lay.chunks(s, r)):
        k = c * lay.pp + s  # the stage's index in the whole pipeline
        if k < last:
            calls.append(Call("pp", f"activations of chunk {c}", "send", b * math.prod(chunk[-1].out) * a, lay.pp,
                              lay.m, "p2p", itemsize=a))
        if k > 0:
            before = lay.models[r].layers[lay.bounds[k] - 1]
            calls.append(Call("pp", f"their gradients, chunk {c}", "send", b * math.prod(before.out) * a, lay.pp,
                              lay.m, "p2p", itemsize=a))
    tied = lay.models[r].tied
    mine = lay.parameters(s, r)
    for name in sorted(tied & mine.keys()):
        holders = {t for t in range(lay.pp) if name in lay.parameters(t, r)}
        if len(holders) > 1:
            calls.append(Call("pp", f"tied {name}'s gradient", "allreduce",
                              held(lay, s, r, d, [name]) * lay.sum_bytes(), len(holders), itemsize=lay.sum_bytes()))
    if lay.cfg.optim.grad_clip > 0:
        calls.append(Call("pp", "clipping: sum of squares", "allreduce", NORM, lay.pp))
    return calls


def tp_calls(lay, s: int, r: int, d: int = 0) -> list[Call]:
    """Tensor-parallel rank ``r``'s collectives per step (Shoeybi et al. 2019; with
    sequence parallelism, Korthikanti et al. 2022), per micro-batch: the embedding's sum,
    each block's two sums forward and two backward, the head's backward sum, the
    vocabulary-parallel cross-entropy's three sums of a number per token; a layer that
    runs forward again in backward (:func:`~mpitrain.plan.peak.replays`: checkpointed
    blocks, every layer under ZeRO-3) makes its forward's sums again; per step the
    replicated weights' gradients (sequence parallelism) and the clipping norm."""
    t = lay.tp
    if t == 1:
        return []
    b, T, C, a, m = lay.micro_batch, lay.T, lay.cfg.model.n_embd, lay.dtype_bytes, lay.m
    act = b * T * C * a
    sp = lay.par.sequence_parallel
    layers = lay.layers(s, r)
    names = {layer.name for layer in layers}
    blocks = sum(1 for layer in layers if layer.name.startswith("block"))

    def pair(what, count):  # a sum, or (sequence parallel) its reduce-scatter and allgather halves
        if sp:
            return [Call("tp", what + " (reduce-scatter)", "reduce_scatter", act, t, count, itemsize=a),
                    Call("tp", what + " (allgather)", "allgather", act, t, count, itemsize=a)]
        return [Call("tp", what, "allreduce", act, t, count, itemsize=a)]

    def again(prefix):  # micro-batches times the layers of that name replayed
        return m * sum(1 for layer in layers if layer.name.startswith(prefix) and replays(lay, layer))

    calls = []
    if "embed" in names:  # forward: the sum (sequence parallel: its reduce-scatter)
        calls += pair("embedding's rows", m)
        if again("embed"):
            calls.append(Call("tp", "embedding's rows, replayed", "reduce_scatter" if sp else "allreduce", act, t,
                              again("embed"), itemsize=a))
    if blocks:
        calls += pair("blocks' attention and MLP, forward and backward", 4 * blocks * m)
        if again("block"):
            calls += pair("blocks' attention and MLP, replayed forward", 2 * again("block"))
    if "head" in names:  # backward: the input's sum (sequence parallel: forward its allgather)
        calls += pair("head's input", m)
        if sp and again("head"):
            calls.append(Call("tp", "head's input, replayed (allgather)", "allgather", act, t, again("head"),
                              itemsize=a))
        calls.append(Call("tp", "cross-entropy: max, target logit, sum", "allreduce", b * T * a, t, 3 * m))
    if sp:
        whole = held(lay, s, r, d, lay.replicated & lay.parameters(s, r).keys())
        if whole:
            calls.append(Call("tp", "replicated weights' gradients", "allreduce", whole * lay.sum_bytes(),
                              t))
    if lay.cfg.optim.grad_clip > 0:
        calls.append(Call("tp", "clipping: sum of squares", "allreduce", NORM, t))
    return calls


# tier 2's named corrections to tier 1's bytes (:func:`corrections`; plan/README.md, "Two tiers")
BYTES_CORRECTIONS = {
    "named calls": "clipping's, the vocabulary-parallel cross-entropy's and the replicated weights' sums",
    "float32 words": "in mixed precision NumPy's activations, and MPI's sums of 16-bit gradients, in 4 bytes; the "
                     "textbook's in 2",
    "ZeRO-3's replays": "mpitrain's ZeRO-3 runs each layer forward again in backward: a slice makes its forward's "
                        "sums again",
    "ZeRO's pieces": "under ZeRO, the tied weight's gradient summed as each rank's own piece of it, after the "
                     "reduce-scatter; the textbook sums it whole",
    "uneven slices": "a vocabulary that does not divide over the slices: the tied weight's rows of this slice, not "
                     "the even share",
}


def corrections(lay, calls: list[Call], r: int = 0) -> dict:
    """{axis: {correction: bytes}}: what tensor-parallel rank ``r``'s ``calls`` send beyond
    tier 1's count (:func:`mpitrain.plan.estimate.of_layout`), by :data:`BYTES_CORRECTIONS`:
    tier 1's bytes on an axis plus its corrections are the calls' bytes."""
    word = cost.word_bytes(lay.mixed, lay.dtype_bytes)  # the textbook's number
    params, ckpt = lay.models[r].parameters(), lay.cfg.model.checkpoint_activations
    out = {axis: dict.fromkeys(BYTES_CORRECTIONS, 0.0) for axis in ("dp", "pp", "tp")}
    for c in calls:
        fix = out[c.axis]
        if c.what.startswith(NAMED):
            fix["named calls"] += c.sent
        elif "replayed" in c.what and lay.par.sync == "zero3" and not (ckpt and c.what.startswith("blocks")):
            fix["ZeRO-3's replays"] += c.sent  # (a checkpointed block's replay tier 1 counts)
        elif c.what.startswith("tied "):  # summed: this slice's whole weight; even: the textbook's share of it
            name = c.what[len("tied "):].split("'s gradient")[0]
            summed, even = (cost.collective_bytes(c.collective, n * c.itemsize, c.ranks) * c.count for n in (
                math.prod(params[name]), sum(math.prod(x.parameters()[name]) for x in lay.models) / lay.tp))
            fix["ZeRO's pieces"] += c.sent - summed
            fix["uneven slices"] += summed - even
            fix["float32 words"] += even * (c.itemsize - word) / c.itemsize
        else:
            fix["float32 words"] += c.sent * (c.itemsize - word) / c.itemsize
    return out


def by_axis(calls: list[Call]) -> dict:
    out = {}
    for c in calls:
        out[c.axis] = out.get(c.axis, 0) + c.sent
    return out

