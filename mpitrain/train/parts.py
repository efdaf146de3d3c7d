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

from mpitrain import optim
from mpitrain.comm import replicas
from mpitrain.parallel import GradSync
from mpitrain.parallel import tensor_parallel as tp


class PartSync(GradSync):
    """``inner`` (the replicas' sync of ``model``, this rank's part) with the whole model's
    sums, norm and digest. ``stage``: this rank's :class:`~mpitrain.parallel.pipeline.PipelineStage` (None: the whole
    layer list); ``tp_comm`` and ``everyone`` (every slice's :func:`slices`): the
    slices' communicator (None: not sliced); ``layout``: the whole model's
    :class:`~mpitrain.checkpoint.Layout`."""

    def __init__(self, inner, model, layout, stage=None, tp_comm=None, everyone=None, sequence: bool = False):
        super().__init__(model, inner.optimizer, inner.comm)
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
        self.inner.finish()
        if self.stage is not None:
            self.stage.sum_tied_grads()
        if self.sequence:
            tp.sum_replicated_grads(self.model, self.tp_comm)

    def step(self, lr: float | None = None, grad_clip: float = 0.0) -> None:
        if grad_clip > 0:
            optim.scale_to([q.grad for q in self.model.parameters()], self.grad_norm(), grad_clip)
        self.inner.step(lr, 0.0)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def sync_buffers(self) -> None:
        self.inner.sync_buffers()

    def speaks_for(self, q) -> bool:
        """Whether this rank counts ``q`` for the whole model."""
        stage = self.stage is None or self.stage.speaks_for(q)
        return stage and (self.tp_comm is None or id(q) in self.sliced or self.tp_comm.rank == 0)

    def grad_norm(self) -> float:
        """The whole model's gradient L2 norm (collective over the stages and slices)."""
        return grad_norm(self.model.parameters(), self.speaks_for,
                         [c for c in (None if self.stage is None else self.stage.comm, self.tp_comm) if c is not None])

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
        """The part's optimizer state; a stage's placed in the whole model's flat layout."""
        opt, pieces, writes = self.inner.state_pieces(offsets)
        if self.stage is None:
            return opt, pieces, writes
        where = {id(q): self.index[n] for n, q in self.model.named_parameters()}
        pieces = [(where[id(q)], int(offsets[where[id(q)]]), int(offsets[where[id(q)] + 1]))
                  for g in opt.param_groups for q in g["params"]]
        return opt, pieces, writes

    def end(self) -> int | None:
        return self.inner.end()

    def close(self) -> None:
        self.inner.close()
        for _, comm in () if self.stage is None else self.stage.ties:
            comm.free()


def grad_norm(params, speaks_for, comms) -> float:
    """The whole model's gradient L2 norm from this rank's part of it: the squares of the
    gradients of the ``params`` it ``speaks_for``, summed over ``comms`` (the stages', the
    slices': collective)."""
    mine = np.array([optim.sum_of_squares(q.grad for q in params if q.grad is not None and speaks_for(q))])
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
    ranks (:func:`~mpitrain.parallel.tensor_parallel.slice_gpt`), by name: the index of
    its slice in the whole array (the rest are whole). Checkpoints and the digest put the
    whole parameters together by it."""
    C = cfg.n_embd
    cols, qkv = tp.heads(C, cfg.n_head, t, r)
    hidden = np.arange(*tp.shard(4 * C, t, r))
    out = {"embed.wte.weight": (slice(*tp.shard(cfg.vocab_size, t, r)),)}
    for i in range(cfg.n_layer):
        b = f"blocks.{i}"
        out.update({f"{b}.attn.c_attn.weight": (slice(None), qkv), f"{b}.attn.c_proj.weight": (cols,),
                    f"{b}.mlp.c_fc.weight": (slice(None), hidden), f"{b}.mlp.c_proj.weight": (hidden,)})
        if cfg.bias:
            out.update({f"{b}.attn.c_attn.bias": (qkv,), f"{b}.mlp.c_fc.bias": (hidden,)})
    return out
