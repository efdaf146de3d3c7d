"""The gradient sync of a rank that holds a part of the model: a pipeline stage, its slices
of every layer (tensor parallel), or both.

The part's replicas synchronise over ``dp_comm`` as any model's do (``inner``: ddp or
local); a part adds the whole model's view over the grid's other axes. After the
replicas' exchange the gradients parts share are summed: a weight two stages hold (the
GPT's embedding, tied to its head; :meth:`~mpitrain.parallel.pipeline.PipelineStage.sum_tied_grads`)
and, with sequence parallelism, each whole weight's over the slices
(:func:`~mpitrain.parallel.tensor_parallel.sum_replicated_grads`). Clipping takes the
whole model's norm: each rank's sum of squares over the parameters it speaks for (a tied
weight on its first stage, a weight every slice holds whole on slice 0), summed over
``pp_comm`` and ``tp_comm``. The digest is the whole model's, gathered from the parts;
checkpoints place a stage's optimizer state in the whole model's layout.
"""

from __future__ import annotations

import numpy as np

from mpitrain import optim, parallel
from mpitrain.comm import replicas
from mpitrain.parallel import GradSync
from mpitrain.parallel import tensor_parallel as tp


class PartSync(GradSync):
    """``inner`` (the replicas' sync of ``model``, this rank's part) with the whole model's
    sums, norm and digest. ``stage``: this rank's :class:`~mpitrain.parallel.pipeline.PipelineStage` (None: the whole
    layer list); ``tp_comm`` and ``everyone`` (every slice's :func:`slices`): the
    slices' communicator (None: not sliced); ``layout``: the whole model's
    :class:`~mpitrain.checkpoint.Layout`; ``order``: the part's parameters in its
    optimizer's order (default: ``inner``'s optimizer's, right when that is the part's
    own, not a shard's or the float32 masters')."""

    def __init__(self, inner, model, layout, stage=None, tp_comm=None, everyone=None, sequence: bool = False,
                 order=None):
        super().__init__(model, inner.optimizer, inner.comm)
        order = order or [q for g in inner.optimizer.param_groups for q in g["params"]]
        self.order = [id(q) for q in order]  # the part's parameters in its optimizer's order (checkpoints')
        self.inner, self.stage, self.tp_comm, self.everyone, self.sequence = inner, stage, tp_comm, everyone, sequence
        self.layout, self.index = layout, {name: i for i, (name, _) in enumerate(layout.params)}
        self.shapes = {name: shape for name, (shape, _) in layout.arrays.items()}  # the whole arrays'
        self.waits = {**inner.waits, **({"finish": "gradient exchange and tied weights"} if stage else {})}
        self.sliced = set() if tp_comm is None else tp.sliced_parameters(model)

    def begin_step(self) -> bool:
        return self.inner.begin_step()

    def no_sync(self):
        return self.inner.no_sync()

    def finish(self) -> None:
        """The order of a step's gradients after backward (the module docstring): the
        replicas' exchange over ``dp_comm``, then the sums the parts owe the whole
        model, on what each rank holds of them (whole, or its ZeRO shard's pieces)."""
        self.inner.finish()
        held = self.inner.held()
        if self.stage is not None:
            self.stage.sum_tied_grads(held)
        if self.sequence:
            tp.sum_replicated_grads(self.model, self.tp_comm, held)

    def step(self, lr: float | None = None, grad_clip: float = 0.0) -> None:
        """The replicas' update, clipped by the whole model's norm (:meth:`grad_norm`),
        which mixed precision also needs to clip as it unscales, in float32."""
        mixed = getattr(self.optimizer, "unscales", False)
        norm = self.grad_norm() if grad_clip > 0 or mixed else None
        self.inner.step(lr, grad_clip, norm=norm)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def sync_buffers(self) -> None:
        self.inner.sync_buffers()

    def whole_model(self, masters: bool = False):
        return self.inner.whole_model(masters)

    def speaks_for(self, q) -> bool:
        """Whether this rank counts ``q`` for the whole model."""
        stage = self.stage is None or self.stage.speaks_for(q)
        return stage and (self.tp_comm is None or id(q) in self.sliced or self.tp_comm.rank == 0)

    def grad_norm(self) -> float:
        """The whole model's gradient L2 norm (collective over the stages and slices, and
        over the replicas when each holds a shard of the gradients)."""
        comms = (self.inner.comm if self.inner.sharded else None, None if self.stage is None else self.stage.comm,
                 self.tp_comm)
        return grad_norm(self.model.parameters(), self.speaks_for, [c for c in comms if c], self.inner.held())

    def check_replicas(self) -> str:
        """Check the part's replicas; the SHA-256 of the whole model's parameters in its
        order, as one process computes it: the parts gathered (collective)."""
        self.inner.check_replicas()
        mine = dict(self.model.named_parameters())
        wholes = [(n, self._whole(n, mine[n].data)) for n in self.layout.arrays
                  if n in mine and (self.stage is None or self.stage.speaks_for(mine[n]))]
        if self.stage is None:
            return replicas.digest([a for _, a in wholes])
        return replicas.digest(self._gathered(wholes))

    def _whole(self, name: str, mine: np.ndarray) -> np.ndarray:
        if self.tp_comm is None:
            return mine
        return whole_array(name, mine, self.everyone, self.tp_comm, self.shapes)

    def _gathered(self, wholes: list) -> list:
        """Every stage's whole parameters (``wholes``: this stage's, by name), in the whole
        model's order: one allgather over ``pp_comm``."""
        comm = self.stage.comm
        sizes = {n: int(np.prod(shape)) for n, shape in self.shapes.items()}
        everyone = comm.allgather([n for n, _ in wholes])  # the names each stage speaks for
        counts = [sum(sizes[n] for n in theirs) for theirs in everyone]
        dtype = np.dtype(self.layout.arrays[self.layout.params[0][0]][1])  # every stage's, a stage may hold none
        flat = np.empty(sum(counts), dtype=dtype)  # (all parameters,) stage by stage
        at = sum(counts[: comm.rank])
        for _, a in wholes:
            flat[at : at + a.size] = a.reshape(-1)
            at += a.size
        comm.allgather_array(flat, counts)
        where, at = {}, 0
        for theirs in everyone:
            for n in theirs:
                where[n] = flat[at : at + sizes[n]]
                at += sizes[n]
        return [where[n] for n in self.layout.arrays if n in where]

    def state_pieces(self, offsets) -> tuple:
        """The part's optimizer state; a stage's placed in the whole model's flat layout
        (``offsets``: of the parts this rank holds, :func:`mpitrain.checkpoint.layout.part_offsets`)."""
        if self.stage is None:
            return self.inner.state_pieces(offsets)
        where = {id(q): self.index[n] for n, q in self.model.named_parameters() if n in self.index}  # what trains
        mine = [where[q] for q in self.order]  # the whole model's index of each
        local = np.concatenate([[0], np.cumsum([offsets[i + 1] - offsets[i] for i in mine], dtype=np.int64)])
        opt, pieces, writes = self.inner.state_pieces(local)
        return opt, [(mine[j], int(offsets[mine[j]] + lo - local[j]), int(offsets[mine[j]] + hi - local[j]))
                     for j, lo, hi in pieces], writes

    def end(self) -> int | None:
        return self.inner.end()

    def close(self) -> None:
        self.inner.close()
        for _, comm in () if self.stage is None else self.stage.ties:
            comm.free()


def shared_kind(model, stage=None, sequence: bool = False):
    """:func:`mpitrain.parallel.kinds` of this part's parameters: ``stage``'s ties,
    and under ``sequence`` parallelism the weights every slice holds whole. ZeRO shards
    runs of one kind on their own (:func:`mpitrain.parallel.zero.segments`), so every
    rank that sums a weight holds the same piece of it."""
    tied = {id(q) for params, _ in (() if stage is None else stage.ties) for q in params}
    sliced = tp.sliced_parameters(model) if sequence else set()
    replicated = {id(q) for q in model.parameters() if id(q) not in sliced} if sequence else set()
    return parallel.kinds(tied, replicated)


def grad_norm(params, speaks_for, comms, held: dict | None = None) -> float:
    """The whole model's gradient L2 norm from this rank's part of it: the squares of the
    gradients of the ``params`` it ``speaks_for``, summed over ``comms`` (the replicas'
    when sharded, the stages', the slices': collective); ``held``: ``id -> the gradient
    this rank holds`` (None: each ``.grad``; under ZeRO its shard's pieces)."""
    held = {id(q): q.grad for q in params} if held is None else held
    mine = np.array([optim.sum_of_squares(held[id(q)] for q in params if held.get(id(q)) is not None
                                          and speaks_for(q))])
    for comm in comms:
        comm.allreduce(mine)
    return float(np.sqrt(mine[0]))


def whole_array(name: str, mine: np.ndarray, everyone: list, tp_comm, shapes: dict) -> np.ndarray:
    """The whole parameter ``name`` of a GPT sliced over ``tp_comm``, from this rank's part
    ``mine`` (collective for a sliced one; ``everyone``: every rank's
    :func:`slices`; ``shapes``: whole shapes by name)."""
    if name not in everyone[0]:
        return mine
    whole = np.empty(shapes[name], dtype=mine.dtype)
    counts = [whole[p[name]].size for p in everyone]
    flat = np.empty(sum(counts), dtype=mine.dtype)  # every rank's slice, end to end
    at = sum(counts[: tp_comm.rank])
    flat[at : at + mine.size] = mine.reshape(-1)
    tp_comm.allgather_array(flat, counts)
    for r, p in enumerate(everyone):
        start = sum(counts[:r])
        whole[p[name]] = flat[start : start + counts[r]].reshape(whole[p[name]].shape)
    return whole


def slices(cfg, t: int, r: int) -> dict:
    """Rank ``r``'s part of each parameter of a GPT of config ``cfg`` sliced over ``t``
    ranks, by name (:func:`~mpitrain.parallel.tensor_parallel.gpt_slices`)."""
    return tp.gpt_slices(cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_layer, cfg.bias, t, r)
