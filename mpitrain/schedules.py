"""Schedules as data: the order of each rank's forward and backward passes in one step of
a pipeline, a simulator that runs them in time, and the cut of a model's layers into
stages (:func:`balance`). No MPI: the pipeline runs these, and a planner can read them.

For ``p`` stages and ``m`` micro-batches a schedule is, per rank, an ordered list of
actions (:func:`schedule`): ``Forward``, ``Backward`` (or its two halves for zero bubble:
``BackwardInput`` then ``BackwardWeight``), and the point-to-point ``RecvActivation`` /
``SendActivation`` (forward) and ``RecvGrad`` / ``SendGrad`` (backward). :func:`simulate`
runs the lists with given F/B/W costs and reports each rank's idle time and peak
micro-batches held. The schedules (costs per stage and micro-batch F, B, W; a full
backward is B + W):

=================  ==========================================  ==============================
schedule           idle per rank (bubble)                      micro-batches held on stage r
=================  ==========================================  ==============================
GPipe              (p-1)(F+B+W): (p-1)/(m+p-1) of the step     m
1F1B               (p-1)(F+B+W), the same                      min(m, p - r)
interleaved, v     (p-1)(F+B+W)/v: (p-1)/(v m) of the work     (2(p-r-1) + (v-1)p + 1) / v
ZB-H1              (p-1)(F+B-W) for m >= p                     at most p (1F1B's stage 0)
=================  ==========================================  ==============================

(Held: micro-batches whose activations a stage keeps at its peak, a chunk's counting 1/v;
the interleaved figure for m v above the warm-up. The simulator's figures are these
formulas, :func:`mpitrain.cost.pipeline_idle` and :func:`mpitrain.cost.micro_batches_held`,
tested for p up to 8 and m up to 16.)

GPipe (Huang et al. 2019) runs every forward, then every backward. 1F1B, PipeDream-Flush
(Narayanan et al. 2021): after ``p - r - 1`` warm-up forwards, stage r alternates one
forward and one backward, so a micro-batch's activations are freed ``p - r`` forwards
later instead of at the end. Interleaved 1F1B (Narayanan et al., SC21) gives each rank
``v`` chunks, so a micro-batch crosses the ranks v times in stages v times shorter; the
warm-up and drain shrink by v (``m`` must be a multiple of ``p``, as in Megatron-LM).
ZB-H1 (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism") splits each backward
into the input gradient B, which the previous stage waits for, and the weight gradient
W, which nobody waits for: B is sent upstream at once and W fills the drain's idle time.

The lists are plain data: :mod:`mpitrain.parallel.pipeline` runs them on a stage (its
header says what crosses the wire and when), :mod:`mpitrain.train.schedule` the
one-stage list (gradient accumulation) on a rank that holds the whole model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


# ----------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class Action:
    mb: int  # micro-batch
    chunk: int = 0  # which of the rank's model chunks (interleaved schedules)

    def __str__(self) -> str:
        tail = f".{self.chunk}" if self.chunk else ""
        return f"{self.code}{self.mb}{tail}"


@dataclass(frozen=True)
class Forward(Action):
    code = "F"


@dataclass(frozen=True)
class Backward(Action):
    """Input and weight gradients in one pass."""
    code = "B"


@dataclass(frozen=True)
class BackwardInput(Action):
    """The input gradient only (zero bubble's B); its weight gradients wait for W."""
    code = "I"


@dataclass(frozen=True)
class BackwardWeight(Action):
    """The weight gradients of a micro-batch whose :class:`BackwardInput` ran (W)."""
    code = "W"


@dataclass(frozen=True)
class RecvActivation(Action):
    code = "ra"


@dataclass(frozen=True)
class SendActivation(Action):
    code = "sa"


@dataclass(frozen=True)
class RecvGrad(Action):
    code = "rg"


@dataclass(frozen=True)
class SendGrad(Action):
    code = "sg"


COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
FREES = (Backward, BackwardWeight)  # the actions after which a micro-batch's activations are gone


# ----------------------------------------------------------------------------- schedules
def schedule(name: str, p: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """Rank ``rank``'s actions for one step of ``m`` micro-batches on ``p`` stages."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    check(name, p, m, v)
    if name == "gpipe":
        compute = [Forward(i) for i in range(m)] + [Backward(i) for i in range(m)]
    elif name == "1f1b":
        compute = _one_f_one_b(p, m, rank)
    elif name == "interleaved":
        compute = _interleaved(p, m, v, rank)
    else:
        compute = _zb_h1(p, m, rank)
    return with_comm(compute, p, v, rank)


def check(name: str, p: int, m: int, v: int = 1) -> None:
    """Refuse shapes a schedule cannot run, with the reason."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline needs p, m, v >= 1 (p={p}, m={m}, v={v})")
    if v > 1 and p == 1:
        raise ValueError(f"{v} chunks per rank need at least 2 pipeline stages (chunks interleave across ranks)")
    if v > 1 and name != "interleaved":
        raise ValueError(f"{v} chunks per rank need the interleaved schedule, not {name!r}")
    if name == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) to be a multiple "
                         f"of the pipeline stages ({p}), as in Megatron-LM")


def micro_batches(arrays: tuple, m: int) -> list[tuple]:
    """``arrays`` (a lane's batch: inputs, targets, the samples' places in the global
    batch) cut along their first axis into ``m`` equal consecutive micro-batches."""
    b = len(arrays[0]) // m
    return [tuple(a[i * b : (i + 1) * b] for a in arrays) for i in range(m)]


def _one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    """PipeDream-Flush: ``p - rank - 1`` warm-up forwards, then one forward and one backward
    in turn, then the backwards left."""
    warm = min(p - rank - 1, m)
    out = [Forward(i) for i in range(warm)]
    for i in range(m - warm):
        out += [Forward(warm + i), Backward(i)]
    return out + [Backward(i) for i in range(m - warm, m)]


def _interleaved(p: int, m: int, v: int, rank: int) -> list[Action]:
    """Megatron's interleaved 1F1B: forwards go through the chunks in groups of ``p``
    micro-batches (chunk 0 for micro-batches 0..p-1, chunk 1 for the same, ...), backwards
    the same with the chunks reversed; the warm-up is ``2(p - rank - 1) + (v - 1)p``."""
    if v == 1:
        return _one_f_one_b(p, m, rank)
    total = m * v

    def nth(k: int, kind):
        group, chunk = divmod(k, p * v)[0], (k // p) % v
        mb = group * p + k % p
        return kind(mb, chunk if kind is Forward else v - 1 - chunk)

    warm = min(2 * (p - rank - 1) + (v - 1) * p, total)
    out = [nth(k, Forward) for k in range(warm)]
    for i in range(total - warm):
        out += [nth(warm + i, Forward), nth(i, Backward)]
    return out + [nth(k, Backward) for k in range(total - warm, total)]


def _zb_h1(p: int, m: int, rank: int) -> list[Action]:
    """ZB-H1: 1F1B's order of forwards and input-gradient passes; stage r runs the weight
    pass of micro-batch ``i - r`` after the input gradient of ``i``, so it holds at most
    ``p`` micro-batches (1F1B's peak, on stage 0), and ends with ``r + 1`` weight passes
    that fill the time the last input gradients take to travel up to stage 0. The idle
    time is (p-1)(F+B-W) for ``m >= p``; below that no schedule fills the warm-up."""
    warm = min(p - rank - 1, m)
    out: list[Action] = [Forward(i) for i in range(warm)]
    for i in range(m):
        out += [Forward(warm + i)] if warm + i < m else []
        out += [BackwardInput(i)] + ([BackwardWeight(i - rank)] if i >= rank else [])
    return out + [BackwardWeight(i) for i in range(max(0, m - rank), m)]


def with_comm(compute: list[Action], p: int, v: int, rank: int) -> list[Action]:
    """Add the point-to-point actions: a receive before each forward (backward) that needs
    a neighbour's activation (gradient), a send after each that produces one."""
    last = p * v - 1
    out: list[Action] = []
    for a in compute:
        stage = a.chunk * p + rank  # this chunk's place among all p * v
        if isinstance(a, Forward):
            out += [RecvActivation(a.mb, a.chunk)] if stage > 0 else []
            out += [a] + ([SendActivation(a.mb, a.chunk)] if stage < last else [])
        elif isinstance(a, (Backward, BackwardInput)):
            out += [RecvGrad(a.mb, a.chunk)] if stage < last else []
            out += [a] + ([SendGrad(a.mb, a.chunk)] if stage > 0 else [])
        else:
            out.append(a)
    return out


def balance(sizes: list[int], parts: int) -> list[int]:
    """Bounds ``[0, b1, ..., len(sizes)]`` cutting ``sizes`` into ``parts`` consecutive,
    non-empty pieces whose largest sum is as small as it can be (the linear partition
    problem, by dynamic programming; ties cut later, so earlier stages, which hold more
    micro-batches under 1F1B, get the lighter pieces)."""
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"{n} layers cannot be cut into {parts} pipeline stages (one layer at least each)")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    INF = float("inf")
    best = [[INF] * (n + 1) for _ in range(parts + 1)]  # best[k][j]: first j layers in k pieces
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def record(trace, a: Action, start: float, v: int = 1) -> None:
    """``trace(name, category, track, start, end)`` the action ``a`` that ran from ``start``
    until now: a pass on the compute track (``F3``, or ``F3 chunk 1``), a message on the
    communication track (the timeline's diagram of a schedule)."""
    end = time.perf_counter()
    kind = type(a).__name__
    if isinstance(a, COMPUTE):
        trace(f"{a.code}{a.mb}" + (f" chunk {a.chunk}" if v > 1 else ""), kind.lower(), "compute", start, end)
    else:
        trace(f"{kind} {a.mb}", "communication", "communication", start, end)


def neighbour(p: int, v: int, rank: int, chunk: int, step: int) -> tuple[int, int]:
    """(rank, chunk) of the stage ``step`` (+1 next, -1 previous) places from ``(rank, chunk)``."""
    stage = chunk * p + rank + step
    if not 0 <= stage < p * v:
        raise ValueError(f"stage {stage} is outside the pipeline")
    return stage % p, stage // p


# ----------------------------------------------------------------------------- simulator
@dataclass
class Simulation:
    """What :func:`simulate` found: the step's length and, per rank, busy and idle time,
    peak micro-batches held (chunks count 1/v each) and the timed actions."""

    makespan: float
    busy: list[float]
    held: list[float]
    spans: list[list[tuple[float, float, Action]]] = field(repr=False)

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    def bubble_fraction(self, rank: int = 0) -> float:
        """Idle share of the step on ``rank``: ``idle / makespan``."""
        return self.idle[rank] / self.makespan

    def bubble_ratio(self, rank: int = 0) -> float:
        """Idle time over work on ``rank``: ``idle / busy`` (Megatron's bubble fraction)."""
        return self.idle[rank] / self.busy[rank]


def costs_of(F: float = 1.0, B: float = 1.0, W: float = 1.0, v: int = 1) -> dict:
    """Time of each action for one chunk (a stage's costs divided by ``v``)."""
    return {Forward: F / v, Backward: (B + W) / v, BackwardInput: B / v, BackwardWeight: W / v}


def simulate(ranks: list[list[Action]], p: int, v: int = 1, cost: dict | None = None,
             latency: float = 0) -> Simulation:
    """Run every rank's list in time: a compute action starts when its rank is free and
    the message it consumes has arrived (``latency`` after its send); sends and posting
    receives take no time. Raises ``ValueError`` if a list breaks a dependency (a backward
    before its forward), a send meets a receive meant for another message (MPI matches
    messages between two ranks with one tag in order), or the ranks wait on each other."""
    cost = cost or costs_of(v=v)
    sim = _Sim(ranks, p, v, cost, latency)
    while sim.advance():
        pass
    stuck = [r for r in range(p) if sim.pc[r] < len(ranks[r])]
    if stuck:
        raise ValueError("the ranks wait on each other: " + ", ".join(
            f"rank {r} at {ranks[r][sim.pc[r]]}" for r in stuck))
    for r in range(p):
        if sim.alive[r]:
            raise ValueError(f"rank {r} ends the step still holding {sorted(sim.alive[r])}")
    return Simulation(max(sim.clock), [sum(e - s for s, e, _ in sp) for sp in sim.spans],
                      [h / v for h in sim.peak], sim.spans)


class _Sim:
    """The state of :func:`simulate`: per rank a program counter and a clock; per channel
    (source, destination, tag) the messages sent and the receives posted, in order."""

    def __init__(self, ranks, p, v, cost, latency):
        self.ranks, self.p, self.v, self.cost, self.latency = ranks, p, v, cost, latency
        self.pc, self.clock = [0] * p, [0] * p  # exact with Fraction costs
        self.spans = [[] for _ in range(p)]
        self.sent: dict[tuple, list] = {}  # channel -> [(payload, arrival time)]
        self.posted: dict[tuple, int] = {}  # channel -> receives posted so far
        self.inbox = [{} for _ in range(p)]  # rank -> {(kind, mb, chunk): channel index}
        self.done = [set() for _ in range(p)]  # rank -> {(code, mb, chunk)}
        self.alive = [set() for _ in range(p)]  # micro-batch chunks whose activations are kept
        self.peak = [0] * p

    def advance(self) -> bool:
        moved = False
        for r in range(self.p):
            while self.pc[r] < len(self.ranks[r]) and self._try(r, self.ranks[r][self.pc[r]]):
                self.pc[r] += 1
                moved = True
        return moved

    def _try(self, r: int, a: Action) -> bool:
        key = (a.mb, a.chunk)
        if isinstance(a, (RecvActivation, RecvGrad)):
            step = -1 if isinstance(a, RecvActivation) else 1
            src = neighbour(self.p, self.v, r, a.chunk, step)[0]
            channel = (src, r, "activation" if step == -1 else "gradient")
            index = self.posted.get(channel, 0)
            self.posted[channel] = index + 1
            self.inbox[r][(type(a), *key)] = (channel, index)
            return True
        if isinstance(a, (SendActivation, SendGrad)):
            forward = isinstance(a, SendActivation)
            needed = (Forward,) if forward else (Backward, BackwardInput)
            if not any((k, *key) in self.done[r] for k in needed):
                raise ValueError(f"rank {r} sends {a} before computing it")
            dst, chunk = neighbour(self.p, self.v, r, a.chunk, 1 if forward else -1)
            channel = (r, dst, "activation" if forward else "gradient")
            self.sent.setdefault(channel, []).append(((a.mb, chunk), self.clock[r] + self.latency))
            return True
        return self._compute(r, a, key)

    def _compute(self, r: int, a: Action, key: tuple) -> bool:
        start = self.clock[r]
        stage, last = a.chunk * self.p + r, self.p * self.v - 1
        if isinstance(a, Forward):
            if stage > 0 and (arrival := self._arrival(r, RecvActivation, key)) is None:
                return False
            start = max(start, arrival) if stage > 0 else start
            self.alive[r].add(key)
            self.peak[r] = max(self.peak[r], len(self.alive[r]))
        elif isinstance(a, (Backward, BackwardInput)):
            if (Forward, *key) not in self.done[r]:
                raise ValueError(f"rank {r} runs {a} before its forward")
            if stage < last and (arrival := self._arrival(r, RecvGrad, key)) is None:
                return False
            start = max(start, arrival) if stage < last else start
        elif (BackwardInput, *key) not in self.done[r]:
            raise ValueError(f"rank {r} runs {a} before its input gradient")
        end = start + self.cost[type(a)]
        self.spans[r].append((start, end, a))
        self.clock[r] = end
        self.done[r].add((type(a), *key))
        if isinstance(a, FREES):
            self.alive[r].discard(key)
        return True

    def _arrival(self, r: int, kind, key: tuple):
        """When the message this compute consumes arrives; None while it is not sent yet."""
        if (kind, *key) not in self.inbox[r]:
            raise ValueError(f"rank {r} needs micro-batch {key[0]} chunk {key[1]} without "
                             f"having posted its receive")
        channel, index = self.inbox[r][(kind, *key)]
        sent = self.sent.get(channel, [])
        if index >= len(sent):
            return None
        payload, arrival = sent[index]
        if payload != key:
            raise ValueError(f"rank {channel[0]}'s {channel[2]} message {index} carries "
                             f"micro-batch {payload[0]} chunk {payload[1]}, but rank {r} receives it "
                             f"as micro-batch {key[0]} chunk {key[1]}")
        return arrival
