"""The ways of spreading training over ranks, one module each, and the seam they share.

Each module stands alone (it imports no other module of this package): :mod:`~.local`,
:mod:`~.data_parallel`, :mod:`~.zero` (stages 1 and 2), :mod:`~.zero3`, :mod:`~.param_server`
over the data-parallel ranks; :mod:`~.pipeline` and :mod:`~.tensor_parallel` cut the model
itself. The trainer (:mod:`mpitrain.train.build`) stacks them on one ``dp x pp x tp`` grid.

What the training loop calls on the data-parallel strategy, whichever it is, is a
:class:`GradSync`: how the gradients of a step become an update. Each step:

1. ``begin_step()`` before the first forward (a parameter-server worker waits for its
   pull; False ends its loop: the servers have had their updates);
2. the schedule's backward passes, all but the step's last inside ``no_sync()`` (data
   parallelism then only accumulates);
3. ``finish()`` after the last backward: the exchange completes;
4. once the ranks agree that the loss is finite, ``step(lr, grad_clip)``; ``zero_grad()``
   in any case.

Around the steps: ``sync_buffers()`` (batch-norm statistics) before an evaluation or a
checkpoint; ``whole_model()`` around what needs every parameter whole (ZeRO-3 gathers
them there; ``masters=True``: in mixed precision the float32 masters, for checkpoints); ``state_pieces(offsets)`` for checkpoints; after the loop (or serving),
however it ended, ``leave()``, then ``end()``, ``check_replicas()`` and ``summary()`` on
every rank. ``waits`` names the calls that wait for other ranks (the stall watchdog and
the timeline show them).

A strategy counts nothing: its communicators count bytes and seconds
(:mod:`mpitrain.comm.requests`), its memory is read from the arrays it keeps
(:func:`mpitrain.observe.memory.model_state`), every formula is :mod:`mpitrain.cost`'s.
The defaults below are one whole replica's; :mod:`~.local` is this class alone.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from mpitrain import flat, optim
from mpitrain.comm import replicas


def trained(optimizer) -> list:
    """The model's parameters that ``optimizer`` trains, in its order: a mixed-precision
    optimizer's 16-bit working copies (its groups hold their float32 masters)."""
    if hasattr(optimizer, "masters"):
        return list(optimizer.params)
    return [p for group in optimizer.param_groups for p in group["params"]]


class GradSync:
    """The seam between the loop and a strategy, with the defaults most strategies share."""

    waits: dict[str, str] = {}  # a call -> what it waits for on other ranks ("finish": "gradient exchange")
    lockstep = True  # the loop's ranks take every step together (asynchronous parameter-server workers: not)
    pieces: list | None = None  # a sharded optimizer's (parameter index, lo, hi) in the checkpoints' flat layout
    sharded = False  # after finish() each rank holds a shard of the gradients (ZeRO), not all of them

    def __init__(self, model, optimizer, dp_comm):
        self.model, self.optimizer, self.comm = model, optimizer, dp_comm
        self.params = [p for p in model.parameters() if p.requires_grad]

    def begin_step(self) -> bool:
        return True

    def no_sync(self):
        return contextlib.nullcontext()

    def finish(self) -> None:
        """Nothing to exchange: the gradients backward left are the step's."""

    def held(self) -> dict:
        """After ``finish()``: ``id(parameter) -> the gradient this rank holds of it``,
        the replicas' mean; the whole ``.grad`` here, a piece of it where ``sharded``
        (views: what is done to them is done to the gradients the update reads)."""
        return {id(p): p.grad for p in self.params if p.grad is not None}

    def step(self, lr: float | None = None, grad_clip: float = 0.0, norm: float | None = None) -> None:
        """The optimizer's step; ``grad_clip`` > 0 clips to that global norm first.
        ``norm``: the whole gradient's norm when the caller summed it over more than this
        sync holds (a part of the model's sync: the whole model's); None: this sync's own."""
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}.step needs the optimizer it was built with")
        optim.update(self.optimizer, self.params, lr, grad_clip, norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def sync_buffers(self) -> None:
        """Average floating buffers (batch-norm running statistics) over the replicas,
        each of which normalised with its own samples."""
        replicas.average(self.comm, [b for _, b in self.model.named_buffers()])

    def whole_model(self, masters: bool = False):
        """Every parameter is whole in ``.data`` already: nothing to gather. ``masters``:
        a mixed-precision optimizer's float32 masters in ``.data`` instead of the 16-bit
        working copies (checkpoints save and load them;
        :meth:`mpitrain.precision.MixedPrecision.masters_in_model`)."""
        if masters and hasattr(self.optimizer, "masters_in_model"):
            return self.optimizer.masters_in_model()
        return contextlib.nullcontext()

    def check_replicas(self) -> str:
        """Raise unless every replica holds bit-identical parameters; their SHA-256."""
        return replicas.check_same(self.comm, [p.data for p in self.model.parameters()])

    def state_pieces(self, offsets) -> tuple | None:
        """For checkpoints: the optimizer, the pieces ``(parameter index, lo, hi)`` of the
        flat layout ``offsets`` it holds the state of, and whether this rank writes them:
        replicated state is written by rank 0 of ``dp_comm``, sharded state by every rank."""
        if self.pieces is None:
            return self.optimizer, flat.pieces(offsets), self.comm.rank == 0
        return self.optimizer, self.pieces, True

    def leave(self) -> None:
        """This rank's loop is over, normally or by an error."""

    def end(self) -> int | None:
        """After the loop, on every rank: one set of buffers. Returns the steps the run
        took when they are not the loop's (None)."""
        self.sync_buffers()
        return None

    def summary(self) -> tuple[list[str], dict]:
        """Lines for the end of the run and figures for its result (collective)."""
        return [], {}

    def close(self) -> None:
        """Release communicators and threads."""


def mean(shard: np.ndarray, P: int) -> None:
    """The sum of ``P`` ranks' gradients in ``shard``, divided by ``P`` in place; a 16-bit
    shard in float32 arithmetic (``1/P`` rounded to bfloat16 would be ``2^-9`` off)."""
    if P > 1:
        np.multiply(shard, np.float32(1 / P) if shard.itemsize == 2 else 1 / P, out=shard, casting="unsafe")


def sharded_update(comm, optimizer, shards: list, lr: float | None, grad_clip: float, norm: float | None) -> float:
    """A sharded strategy's update (ZeRO's): the learning rate, clipping to global norm
    ``grad_clip`` (``norm``: the whole gradient's if the caller has it; else summed here over ``comm`` from this rank's
    ``shards``: one allreduce of 8 bytes), then the update of my shard. Mixed precision
    clips as it unscales, in float32. Returns the norm (nan: no clipping)."""
    if lr is not None:
        optimizer.set_lr(lr)
    if norm is None and grad_clip > 0:
        squares = np.array([sum(np.dot(mine, mine) for mine in (a.astype(np.float64) for a in shards))])
        comm.allreduce(squares)
        norm = math.sqrt(squares[0])
    if getattr(optimizer, "unscales", False):
        optimizer.step(grad_clip, norm)
    else:
        if grad_clip > 0:
            optim.scale_to(shards, norm, grad_clip)
        optimizer.step()
    return float("nan") if norm is None else norm


def kinds(tied, replicated, key=id):
    """A parameter -> the whole model's sum it owes after the replicas' exchange, the
    label ZeRO keeps apart (:func:`mpitrain.parallel.zero.segments`, ZeRO-3's groups): its
    own for a weight several pipeline stages hold (``key(q)`` in ``tied``), ``"slices"`` for one every tensor slice holds
    whole under sequence parallelism (in ``replicated``), None for the rest. ``key``:
    ``id`` for the trainer's tensors, the name for the planner's."""
    def kind(q):
        k = key(q)
        return ("tied", k) if k in tied else "slices" if k in replicated else None

    return kind


def runs(params, kind) -> list[list]:
    """``params`` in their order, cut where ``kind`` (None: one run) changes."""
    out: list[list] = []
    for p in params:
        if not out or kind is not None and kind(p) != kind(out[-1][0]):
            out.append([])
        out[-1].append(p)
    return out
