"""Pipeline parallelism: consecutive layers on consecutive ranks, micro-batches streamed through.

**What is cut.** The model's layer list (``model.named_layers()``; the GPT: embedding, blocks,
final norm + head) is cut into ``p`` consecutive *stages*, one per rank of ``pp_comm``
(``p * v`` *chunks* for the interleaved schedule: rank r holds chunks r, r + p, ...).
Every rank builds the whole model from the seed and keeps its slice, so its weights are
those of one process. The cut balances parameters (:func:`mpitrain.schedules.balance`);
the trainer prints each stage's layers and parameter count at start.

**Schedules are data** (:mod:`mpitrain.schedules`, with their simulator): for ``p``
stages and ``m`` micro-batches, each rank's ordered list of actions (``Forward``,
``Backward`` or zero bubble's two halves, ``BackwardInput`` and ``BackwardWeight``, and
the point-to-point ``RecvActivation``/``SendActivation``, ``RecvGrad``/``SendGrad``) for
GPipe, 1F1B, interleaved 1F1B and ZB-H1; their bubbles and the micro-batches each stage
holds are :func:`mpitrain.cost.bubble_fraction` and :func:`mpitrain.cost.micro_batches_held`.
:meth:`PipelineStage.run` carries a list out: the interpreter.

**Communicator and calls.** ``pp_comm`` (the grid's duplicate). Activations go forward and
their gradients backward with non-blocking ``Isend``/``Irecv`` of contiguous arrays
(no pickling, no shape on the wire: every stage knows the boundary shape
``(b/m, T, C)``, ``b = B/dp`` the lane's samples, from the config, and checks the
configuration with the other stages once, before the first send). A receive is posted
where the schedule lists it, into a buffer of its own (a buffer whose contents backward
still needs is never reused); its wait is in the action that consumes it. A send is
tested between layers until it completes (MPI moves a large message while its sender
is inside an MPI call). Tags: ``Tag.PP_ACTIVATION`` and ``Tag.PP_GRADIENT``; MPI keeps
messages between two ranks with one tag in order, and :func:`mpitrain.schedules.simulate` checks that every
send meets the receive meant for it. The boundary is in the autograd graph: a stage's
input comes out of :class:`Recv` (forward: the received activation; backward: the
gradient to send back) and its output goes into :class:`Send` (forward: the activation
sent; backward: the gradient received), each the other's dual.

**Bytes.** Per stage boundary and micro-batch: ``b/m * T * C * itemsize`` forward and
the same backward (the GPT's residual stream); per rank per step, ``m`` times that for
each neighbour, ``v`` times over when interleaved. Once per step, the tied embedding's
gradient (``V * C * itemsize``) is allreduced between the first and the last stage, and
with ``dp > 1`` each stage's replicas allreduce its gradients (``data_parallel.py``).

**Dropout** draws per-sample streams keyed by each layer's index in the whole layer list
(:mod:`mpitrain.rng`): a stage draws the masks one process draws for those layers,
whatever p, m or the schedule. Zero-bubble schedules run the plain transformer block
(``ops.fast_paths(False)``): the fused sublayer is one node, whose weight pass would
recompute its whole backward.

**Sum or mean.** The last stage's loss is each micro-batch's mean scaled by ``1/m``, so the
gradients summed over micro-batches are those of the mean over the step's samples: the
loss is normalised once, by the global count, never per micro-batch. A weight used by two
stages (the GPT's token embedding, tied to the output head) lives on both; after the
step's backward, its two gradients are summed with one allreduce over the ranks that hold
it, so both copies take the same step. Batch norm sees each micro-batch's own statistics.

**Launch.** ``mpiexec -n 4 mpitrain train jobs/tinyshakespeare_gpt.toml --set parallel.pp=2
--set train.micro_batches=6 --set parallel.schedule=1f1b`` (dp = 2 x pp = 2: each lane's 6
samples in 6 micro-batches).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from mpitrain import autograd, ops, rng
from mpitrain.comm import Tag
from mpitrain.comm.allreduce import allreduce
from mpitrain.nn import Module
from mpitrain.schedules import (FREES, Action, Backward, BackwardInput, BackwardWeight, Forward,
                                 RecvActivation, RecvGrad, SendActivation, SendGrad, balance, check, micro_batches,
                                 neighbour, record, schedule, with_comm)
from mpitrain.tensor import Function, Tensor, no_grad


# ----------------------------------------------------------------------------- the boundary
class Mailbox:
    """What one micro-batch of one chunk has in flight on this rank: the posted receive of
    its input activation and of its output gradient (each into a buffer of its own), the
    tensor its backward starts from, the input gradient to send back; ``sends``, the
    stage's list of sends not known complete, each with the array it sends."""

    __slots__ = ("act", "grad", "root", "out", "input_grad", "weights", "sends")

    def __init__(self, sends: list):
        self.act = self.grad = self.root = self.out = self.input_grad = self.weights = None
        self.sends = sends


class Posted:
    """A receive started into ``buf``: ``wait()`` returns the array once it is there."""

    def __init__(self, comm, shape, dtype, source: int, tag):
        self.buf = np.empty(shape, dtype=dtype)
        self.request = comm.irecv(self.buf, source, tag)

    def wait(self) -> np.ndarray:
        self.request.wait()
        return self.buf


class Recv(Function):
    """The stage's input. Forward: the activation the previous stage sent (waits for the
    posted receive). Backward, the dual: the gradient of that activation, which goes back
    to the previous stage (the schedule's ``SendGrad`` sends what this leaves in the box)."""

    def forward(self, anchor, box: Mailbox):
        self.box = box
        return box.act.wait()

    def backward(self, g):
        self.box.input_grad = np.ascontiguousarray(g)
        return None


class Send(Function):
    """The stage's output. Forward: send the activation to the next stage (non-blocking)
    and return a token to run backward from. Backward, the dual: the gradient of that
    activation, received from the next stage (waits for the posted receive)."""

    def forward(self, x, box: Mailbox, comm, dest: int):
        out = np.ascontiguousarray(x)
        box.sends.append((comm.isend(out, dest, Tag.PP_ACTIVATION), out))  # out stays alive until sent
        self.box = box
        return np.zeros((), dtype=x.dtype)

    def backward(self, g):
        return self.box.grad.wait()


# ----------------------------------------------------------------------------- the stage
class PipelineStage(Module):
    """This rank's chunks of ``model``'s layer list (``model.named_layers()``), cut over the
    ranks of ``pp_comm``, and the interpreter of its schedule.

    ``example`` is one input sample with its batch axis (``(1, T)`` token ids, ``(1, H, W,
    C)`` images): one forward of it through the whole model, before anything is dropped,
    gives every boundary's shape per sample, so no shape goes over the wire. ``loss(out, y,
    label_smoothing=e)`` is the mean loss of a micro-batch from the last layer's output (in
    training, with ``label_smoothing`` e > 0; else ``loss(out, y)``). ``sizes``: the whole model's
    parameter counts per layer, which the cut balances (given for a model sliced over
    tensor-parallel ranks, so that every slice cuts alike). Parameters keep the whole
    model's names (``state_dict`` is a part of the whole model's), a tied weight too."""

    def __init__(self, model: Module, pp_comm, example, loss, *, schedule_name: str = "1f1b",
                 micro_batches: int = 1, chunks: int = 1, sizes: list | None = None, label_smoothing: float = 0.0):
        super().__init__()
        p, rank, named = pp_comm.size, pp_comm.rank, model.named_layers()
        layers = [m for _, m in named]
        self.sizes = sizes or [sum(q.size for q in layer.parameters()) for layer in layers]
        example = np.asarray(example)
        _agree(pp_comm, {"schedule": schedule_name, "micro-batches": micro_batches, "chunks": chunks,
                         "layers": self.sizes, "input": (example.shape, str(example.dtype))})
        check(schedule_name, p, micro_batches, chunks)  # from here on every stage raises alike, or none
        self.comm, self.p, self.rank, self.v, self.m = pp_comm, p, rank, chunks, micro_batches
        self.loss, self.last = loss, p * chunks - 1
        self.scaler = None  # mixed precision's LossScaler: its scale multiplies the loss backward starts from
        self.smoothed = {"label_smoothing": label_smoothing} if label_smoothing else {}  # training's loss only
        self.outputs = _boundaries(model, layers, example)  # per layer: (shape per sample, dtype)
        self.bounds = balance(self.sizes, p * chunks)
        self.names = [n for n, _ in named]
        self._canonical = {id(q): n for n, q in model.named_parameters()}
        path = {id(mod): n for n, mod in model.named_modules()}
        self.chunks = []  # chunk -> [(index in the layer list, layer)]
        for c in range(chunks):
            lo, hi = self.bounds[c * p + rank], self.bounds[c * p + rank + 1]
            self.chunks.append([(i, layers[i]) for i in range(lo, hi)])
            for i in range(lo, hi):
                self._modules[path[id(layers[i])]] = layers[i]
        self.owner = {id(q): min(holders) for q, holders in _holders(layers, self.bounds, p)}
        stray = [n for n, q in model.named_parameters() if id(q) not in self.owner]
        if stray:
            raise ValueError(f"{type(model).__name__}: parameters {stray} belong to no layer of named_layers(): "
                             "it cannot be cut into pipeline stages")
        self.ties = _tie_groups(layers, self.bounds, p, pp_comm)  # [(params, comm)] held by several ranks
        self.actions = schedule(schedule_name, p, micro_batches, rank, chunks)
        self.last_use = {(a.mb, a.chunk): i for i, a in enumerate(self.actions)}  # each box's last action
        # the backwards that run outside no_sync: each chunk's last that makes weight gradients, so that a
        # data-parallel sync counts every parameter (a parameter belongs to one chunk) once per step
        self.synced = {max(i for i, a in enumerate(self.actions) if isinstance(a, FREES) and a.chunk == c)
                       for c in range(chunks)}
        self.split = any(isinstance(a, BackwardInput) for a in self.actions)  # backward in two passes
        self.anchor = Tensor(np.zeros(()), requires_grad=True)  # makes Recv a node of the graph
        self.trace = None  # set to record the actions: trace(name, category, track, start, end)
        self.in_flight: list = []  # [(request, array)]: sends not seen complete, tested between layers (_progress)
        for q in self.parameters():
            if q.requires_grad:  # (a frozen one gets no gradient)
                q.register_post_accumulate_grad_hook(lambda q: self._progress())

    def named_parameters(self, prefix: str = ""):
        """This stage's parameters under their names in the whole model (a tied weight
        under the name its first user gives it)."""
        for _, q in super().named_parameters(prefix):
            yield self._canonical[id(q)], q

    def named_layers(self) -> list:
        return [(self.names[i], layer) for chunk in self.chunks for i, layer in chunk]

    def speaks_for(self, q) -> bool:
        """Whether this rank counts parameter ``q`` for the whole model (a tied weight: on
        its first stage only)."""
        return self.owner[id(q)] == self.rank

    # ------------------------------------------------------------- running
    def run(self, x, y, lanes, sync, streams=None, before_backward=None) -> float | None:
        """Carry out this rank's schedule on this lane's batch ``(x, y)`` (its samples, the same on every
        stage; only the first reads ``x``) cut into its micro-batches; every backward runs inside
        ``sync.no_sync()`` but each chunk's last one that makes weight gradients
        (``synced``); ``streams(samples)`` wraps each forward (the dropout streams of those
        of the step's samples, ``lanes``). Returns the step's loss on the last stage, None
        elsewhere."""
        micro = micro_batches((x, y, lanes), self.m)
        boxes: dict[tuple, Mailbox] = {}
        total = 0.0
        for i, a in enumerate(self.actions):
            box = boxes.setdefault((a.mb, a.chunk), Mailbox(self.in_flight))
            start = time.perf_counter()
            match a:
                case RecvActivation() | RecvGrad():
                    self._post(a, box, len(micro[a.mb][0]))
                case Forward():
                    start = self._arrived(a, box.act, start)
                    total += self._forward(a, box, micro, streams)
                case SendActivation():
                    box.root, box.out = Send.apply(box.out, box, self.comm, self._peer(a, 1)), None
                case Backward() | BackwardInput() | BackwardWeight():
                    start = self._arrived(a, None if isinstance(a, BackwardWeight) else box.grad, start)
                    with contextlib.nullcontext() if i in self.synced else sync.no_sync():
                        self._backward(a, box, before_backward)
                case SendGrad():
                    self.in_flight.append((self.comm.isend(box.input_grad, self._peer(a, -1), Tag.PP_GRADIENT),
                                           box.input_grad))
                    box.input_grad = None
            if i == self.last_use[(a.mb, a.chunk)]:
                del boxes[(a.mb, a.chunk)]  # its buffers go as soon as the graph lets them
            if self.trace is not None:
                record(self.trace, a, start, self.v)
        self.comm.waitall([req for req, _ in self.in_flight])
        self.in_flight.clear()
        return total if self.last % self.p == self.rank else None

    def _progress(self) -> None:
        """Test the sends in flight and let go of the arrays of those complete. MPI moves
        a large message only while its sender is inside an MPI call (a rendezvous: the
        receiver asks, the sender answers), so a stage that sends and goes on computing
        would make its neighbour wait for its next MPI call; testing between layers
        (forward) and from the gradient hooks (backward) answers within a layer."""
        if self.in_flight:
            self.in_flight[:] = [(r, x) for r, x in self.in_flight if not r.test()]

    def _post(self, a: Action, box: Mailbox, b: int) -> None:
        """Start the receive ``a`` into a new buffer of the boundary's shape for ``b`` samples."""
        stage = a.chunk * self.p + self.rank
        if isinstance(a, RecvActivation):
            shape, dtype = self.outputs[self.bounds[stage] - 1]
            box.act = Posted(self.comm, (b, *shape), dtype, self._peer(a, -1), Tag.PP_ACTIVATION)
        else:
            shape, dtype = self.outputs[self.bounds[stage + 1] - 1]
            box.grad = Posted(self.comm, (b, *shape), dtype, self._peer(a, 1), Tag.PP_GRADIENT)

    def _peer(self, a: Action, step: int) -> int:
        return neighbour(self.p, self.v, self.rank, a.chunk, step)[0]

    def _arrived(self, a: Action, posted, start: float) -> float:
        """Wait for what a compute action consumes from a neighbour (``posted``; None:
        nothing), drawn on the timeline as idle; when the computing starts."""
        if posted is None:
            return start
        posted.wait()
        end = time.perf_counter()
        if self.trace is not None and end > start:
            what = "activation" if isinstance(a, Forward) else "gradient"
            self.trace(f"idle (waiting for {what} {a.mb})", "bubble", "compute", start, end)
        return end

    def _forward(self, a: Action, box: Mailbox, micro, streams) -> float:
        stage = a.chunk * self.p + self.rank
        x, y, lanes = micro[a.mb]
        if stage > 0:
            x = Recv.apply(self.anchor, box)
        with streams(lanes) if streams is not None else contextlib.nullcontext():
            out = self.forward_chunk(a.chunk, x)
        if stage < self.last:
            box.out = out
            return 0.0
        scale = 1.0 if self.scaler is None else self.scaler.scale  # a power of two: exact both ways
        box.root = self.loss(out, y, **self.smoothed) * (scale / len(micro))
        return box.root.item() / scale

    def _backward(self, a: Action, box: Mailbox, before_backward) -> None:
        """The pass ``a`` (its output's gradient has arrived); ``before_backward()`` marks
        where a backward's computing starts (the timeline)."""
        if before_backward is not None and not isinstance(a, BackwardWeight):
            before_backward()
        if isinstance(a, Backward):
            autograd.backward([box.root])
        elif isinstance(a, BackwardInput):
            box.weights = autograd.backward_split([box.root])
        else:
            box.weights.run()
            box.weights = None
        if not isinstance(a, BackwardWeight):
            box.root = None

    def forward_chunk(self, c: int, x):
        """Chunk ``c``'s layers, each with its own dropout stream (:func:`mpitrain.rng.layer`).
        Zero-bubble schedules run the plain path (``ops.fast_paths(False)``): a fused
        sublayer is one node, whose weight pass would recompute its whole backward."""
        with ops.fast_paths(False) if self.split else contextlib.nullcontext():
            for i, layer in self.chunks[c]:
                with rng.layer(i):
                    x = layer(x)
                self._progress()
        return x

    def forward_only(self, x) -> object:
        """One forward of ``x`` through the pipeline, without recording a graph
        (evaluation): the last stage's output on the rank that holds it, None elsewhere."""
        actions = with_comm([Forward(0, c) for c in range(self.v)], self.p, self.v, self.rank)
        box, out = Mailbox([]), None
        with no_grad():
            for a in actions:
                match a:
                    case RecvActivation():
                        self._post(a, box, len(x))
                    case Forward():
                        first = a.chunk * self.p + self.rank == 0
                        out = self.forward_chunk(a.chunk, x if first else Tensor(box.act.wait()))
                    case SendActivation():
                        Send.apply(out, box, self.comm, self._peer(a, 1))
                        box.act = None
        self.comm.waitall([req for req, _ in box.sends])
        return out if self.rank == self.last % self.p else None

    def loss_only(self, x, y):
        """The mean loss of ``(x, y)`` through the pipeline (evaluation): on the rank of the
        last stage; None elsewhere."""
        out = self.forward_only(x)
        if out is None:
            return None
        with no_grad():
            return self.loss(out, y)

    # ------------------------------------------------------------- after backward
    def sum_tied_grads(self, grads: dict | None = None) -> None:
        """Sum the gradient of each weight held by several stages over those stages (the
        GPT's token embedding: the input's and the output head's uses). ``grads``:
        ``id(parameter) -> the gradient to sum`` (None: each ``.grad``); a stage whose
        replicas shard the gradients (ZeRO) holds the same piece of a tied weight on
        every stage that holds it, so the pieces add up alike."""
        for params, comm in self.ties:
            for q in params:
                g = q.grad if grads is None else grads.get(id(q))
                if g is not None:  # half-precision gradients: added in float32 (ring.Float32Sum)
                    allreduce(comm, g.reshape(-1))


def _agree(pp_comm, plan: dict) -> None:
    """Raise ``ValueError`` on every stage unless all stages have the same ``plan``
    (schedule, micro-batches, chunks, the layers' sizes, the input's shape): a mismatch
    would otherwise hang a receive or read garbage; one small allgather, before anything
    else a stage computes from them (so that what raises next raises on every stage)."""
    plans = pp_comm.allgather(plan)
    for r, theirs in enumerate(plans):
        differ = [k for k in plan if theirs[k] != plans[0][k]]
        if differ:
            k = differ[0]
            raise ValueError(f"pipeline stages disagree: rank {r} of pp_comm has {k} {theirs[k]}, rank 0 has "
                             f"{plans[0][k]}; every stage must be built from the same config")


def _boundaries(model: Module, layers: list, example) -> list[tuple]:
    """Each layer's output (shape without the batch axis, dtype), from one forward of
    ``example`` in evaluation mode."""
    was = model.training
    model.eval()
    shapes = []
    with no_grad():
        x = example
        for layer in layers:
            x = layer(x)
            shapes.append((tuple(x.shape[1:]), x.dtype))
    model.train(was)
    return shapes


def _holders(layers: list, bounds: list[int], p: int) -> list[tuple]:
    """``[(parameter, the ranks whose chunks use it)]``."""
    holders: dict[int, tuple] = {}
    for s in range(len(bounds) - 1):
        for layer in layers[bounds[s]:bounds[s + 1]]:
            for q in layer.parameters():
                holders.setdefault(id(q), (q, set()))[1].add(s % p)
    return list(holders.values())


def _tie_groups(layers: list, bounds: list[int], p: int, pp_comm) -> list[tuple]:
    """``[(parameters, communicator)]`` for the parameters several ranks hold, one
    communicator per set of ranks, split from ``pp_comm`` (collective)."""
    groups: dict[tuple, list] = {}
    for q, ranks in _holders(layers, bounds, p):
        if len(ranks) > 1:
            groups.setdefault(tuple(sorted(ranks)), []).append(q)
    ties = []
    for ranks, params in sorted(groups.items()):
        part = pp_comm.split(0 if pp_comm.rank in ranks else 1, pp_comm.rank)
        if pp_comm.rank in ranks:
            ties.append((params, part))
        else:
            part.free()
    return ties
