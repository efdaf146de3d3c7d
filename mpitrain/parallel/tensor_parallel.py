"""Tensor parallelism (Megatron-LM): each transformer layer's matrices sliced over ``tp_comm``.

**What is sliced** (Shoeybi et al. 2019, "Megatron-LM"). In every block the first matrix
of each sublayer by columns (:class:`ColumnParallelLinear`: attention's packed ``W_qkv``
by heads, ``n_head / t`` per rank; the MLP's ``W_fc`` by hidden units), the second by
rows (:class:`RowParallelLinear`), so each rank computes its heads or hidden units end
to end and a sublayer needs one sum over ranks. The token embedding and the head tied to
it by vocabulary rows (:class:`VocabParallelEmbedding`, :class:`VocabParallelHead`), the
cross-entropy taken on the slices (:func:`vocab_parallel_cross_entropy`). Layer norms,
row-parallel biases and the position embedding are whole on every rank. Cuts may be
uneven (a vocabulary of 65 over 2 ranks: 33 and 32 rows).

**The two conjugate operators**, autograd nodes: ``f`` (:func:`copy_to`), the identity
forward and an allreduce backward, before a column-parallel layer (its input is whole,
its gradient a partial sum); ``g`` (:func:`reduce_from`), an allreduce forward and the
identity backward, after a row-parallel layer (its output is a partial sum). Sequence
parallelism (Korthikanti et al. 2022, ``parallel.sequence_parallel``) replaces them by an
allgather along the sequence (:func:`gather_sequence`, a reduce-scatter backward) and a
reduce-scatter (:func:`scatter_sequence`, an allgather backward), each the other's
adjoint: between them the layer norms, residual adds and dropout run on each rank's
slice of the sequence, and the whole weights' gradients, each rank's from its slice, are
summed over the ranks after backward (:func:`sum_replicated_grads`).

**Calls and bytes.** Blocking collectives on ``tp_comm`` inside forward and backward: per
block and micro-batch of ``b`` samples two allreduces of ``(b, T, C)`` forward (a ``g``
per sublayer) and two backward (an ``f`` each), ``8 (t-1)/t x b T C x itemsize`` bytes per
rank (:func:`mpitrain.cost.tensor_parallel_bytes`, sequence parallelism the same); the
embedding adds a ``g``, the head an ``f``, the cross-entropy three allreduces of ``b T``.

**Dropout** draws :mod:`mpitrain.rng`'s per-sample streams, the same on every rank of
``tp_comm``: after a ``g`` each rank draws one process's mask; in the sliced region
attention's dropout keeps its heads' part of the whole layer's mask (Megatron gives it a
stream per rank: as random, not equal to serial training); on a slice of the sequence,
dropout takes its rows of one process's mask (:func:`mpitrain.rng.rows`).

**Launch.** ``mpiexec -n 2 mpitrain train jobs/tinyshakespeare_gpt.toml --set parallel.tp=2``.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from mpitrain import ops, rng
from mpitrain.comm.allreduce import allreduce
from mpitrain.nn import Module
from mpitrain.nn.models import GPT, MLP, CausalSelfAttention, GPTEmbedding
from mpitrain.tensor import Function, Parameter, Tensor, as_tensor


def shard(n: int, t: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank``'s part of ``n`` things cut into ``t`` nearly equal
    consecutive parts (the first ``n mod t`` one larger)."""
    size, extra = divmod(n, t)
    lo = rank * size + min(rank, extra)
    return lo, lo + size + (rank < extra)


def heads(C: int, n_head: int, t: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s ``n_head / t`` heads: their columns of q (or k, or v), and their
    columns of the packed q, k and v weight (``c_attn``'s, q, k and v alike)."""
    if n_head % t:
        raise ValueError(f"{n_head} attention heads do not split over {t} tensor-parallel ranks")
    width = C // n_head * (n_head // t)
    cols = np.arange(rank * width, (rank + 1) * width)
    return cols, np.concatenate([cols, C + cols, 2 * C + cols])


def gpt_slices(C: int, n_head: int, V: int, n_layer: int, bias: bool, t: int, rank: int) -> dict:
    """Rank ``rank``'s part of each parameter of a GPT (width ``C``, ``n_head`` heads,
    vocabulary ``V``, ``n_layer`` blocks) sliced over ``t`` ranks, as :func:`slice_gpt`
    cuts it, by name: the index of its slice in the whole array (the rest are whole): the
    embedding's rows of its vocabulary, each block's q, k and v columns and projection rows
    of its heads, and its hidden units' columns and rows of the MLP. Checkpoints and the
    digest put the whole parameters together by it; the planner's shapes are cut by it."""
    cols, qkv = heads(C, n_head, t, rank)
    hidden = np.arange(*shard(4 * C, t, rank))
    out = {"embed.wte.weight": (slice(*shard(V, t, rank)),)}
    for i in range(n_layer):
        b = f"blocks.{i}"
        out.update({f"{b}.attn.c_attn.weight": (slice(None), qkv), f"{b}.attn.c_proj.weight": (cols,),
                    f"{b}.mlp.c_fc.weight": (slice(None), hidden), f"{b}.mlp.c_proj.weight": (hidden,)})
        if bias:
            out.update({f"{b}.attn.c_attn.bias": (qkv,), f"{b}.mlp.c_fc.bias": (hidden,)})
    return out


def sliced_shape(shape: tuple, index: tuple) -> tuple:
    """The shape of ``whole[index]`` for a whole array of ``shape`` and an index of
    :func:`gpt_slices` (slices and arrays of positions, leading axes)."""
    def length(k, n):
        return len(range(*k.indices(n))) if isinstance(k, slice) else len(k)
    return tuple(length(k, n) for k, n in zip(index, shape)) + tuple(shape[len(index):])


# ----------------------------------------------------------------------------- operators
class Copy(Function):
    """``f``: forward the identity; backward the sum over ranks (each rank's gradient is its slice's part)."""

    def forward(self, x, comm):
        self.comm = comm
        return x.view()

    def backward(self, g):
        out = np.array(g, copy=True)
        self.comm.allreduce(out)
        return out


class Reduce(Function):
    """``g``: forward the sum over ranks of the partial results; backward the identity."""

    def forward(self, x, comm):
        out = np.array(x, copy=True)
        comm.allreduce(out)
        return out

    def backward(self, g):
        return g


def _gather_along(x: np.ndarray, comm, axis: int, widths: list[int]) -> np.ndarray:
    """Every rank's ``x`` end to end along ``axis``, in rank order (an allgather; rank
    ``r``'s is ``widths[r]`` wide there)."""
    mine = np.ascontiguousarray(np.moveaxis(x, axis, 0))  # (w_r, ...): the ranks' parts contiguous
    whole = np.empty((sum(widths), *mine.shape[1:]), dtype=x.dtype)  # (sum w_r, ...)
    lo = sum(widths[: comm.rank])
    whole[lo : lo + len(mine)] = mine
    comm.allgather_array(whole.reshape(-1), [w * math.prod(mine.shape[1:]) for w in widths])
    return np.ascontiguousarray(np.moveaxis(whole, 0, axis))


class ScatterSequence(Function):
    """Sequence parallelism's ``g``: forward a reduce-scatter, each rank keeping the sum of
    its slice of the sequence, (B, T, C) -> (B, T/t, C); backward an allgather."""

    def forward(self, x, comm):
        self.comm, self.T = comm, x.shape[1]
        t = comm.size
        if self.T % t:
            raise ValueError(f"sequence parallelism: the sequence of {self.T} does not split over {t} ranks")
        whole = np.ascontiguousarray(np.moveaxis(x, 1, 0))  # (T, B, C): each rank's slice contiguous
        mine = np.empty((self.T // t, *whole.shape[1:]), dtype=x.dtype)  # (T/t, B, C)
        comm.reduce_scatter(whole.reshape(-1), mine.reshape(-1), [mine.size] * t)
        return np.ascontiguousarray(np.moveaxis(mine, 0, 1))

    def backward(self, g):
        return _gather_along(g, self.comm, 1, [self.T // self.comm.size] * self.comm.size)


class GatherSequence(Function):
    """Sequence parallelism's ``f``: forward an allgather of the ranks' sequence slices,
    (B, T/t, C) -> (B, T, C); backward a reduce-scatter."""

    def forward(self, x, comm):
        self.comm = comm
        return _gather_along(x, comm, 1, [x.shape[1]] * comm.size)

    def backward(self, g):
        return ScatterSequence().forward(g, self.comm)


class GatherFeatures(Function):
    """Forward: every rank's slice of the last axis (widths may differ), end to end in
    rank order; backward: this rank's slice of the gradient."""

    def forward(self, x, comm):
        self.comm, self.widths = comm, comm.allgather(x.shape[-1])
        return _gather_along(x, comm, -1, self.widths)

    def backward(self, g):
        lo = sum(self.widths[: self.comm.rank])
        return np.ascontiguousarray(g[..., lo : lo + self.widths[self.comm.rank]])


def _applied(node):
    """``node`` as a function of ``(x, comm)``: ``x`` a tensor (or array), recorded in the graph."""
    return lambda x, comm: node.apply(as_tensor(x), comm)


copy_to, reduce_from = _applied(Copy), _applied(Reduce)  # f and g
scatter_sequence, gather_sequence = _applied(ScatterSequence), _applied(GatherSequence)  # and with the sequence sliced
gather_features = _applied(GatherFeatures)


# ----------------------------------------------------------------------------- layers
class ColumnParallelLinear(Module):
    """``y[:, cols] = f(x) @ W[:, cols] + b[cols]``: this rank's output features ``cols``.
    With ``sequence``, ``x`` is this rank's slice of the sequence and ``f`` the allgather
    of the slices (sequence parallelism). With ``gather``, the ranks' outputs are put
    end to end (:func:`gather_features`): the whole ``y`` when the ranks hold consecutive
    columns."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None, comm, sequence: bool = False, gather: bool = False):
        super().__init__()
        self.weight = Parameter(np.ascontiguousarray(weight))  # (in, out / t)
        self.bias = None if bias is None else Parameter(np.ascontiguousarray(bias))
        self.comm, self.sequence, self.gather = comm, sequence, gather

    @classmethod
    def from_linear(cls, linear, comm, cols: np.ndarray, sequence: bool = False) -> "ColumnParallelLinear":
        """This rank's columns ``cols`` of a whole ``Linear``, copied."""
        bias = None if linear.bias is None else linear.bias.data[cols]
        return cls(linear.weight.data[:, cols], bias, comm, sequence)

    def forward(self, x):
        whole = gather_sequence(x, self.comm) if self.sequence else copy_to(x, self.comm)  # (B, T, in)
        y = ops.linear(whole, self.weight, self.bias)  # (B, T, out / t)
        return gather_features(y, self.comm) if self.gather else y


class RowParallelLinear(Module):
    """``y = g(x[:, rows] @ W[rows, :]) + b``: this rank's input features ``rows`` (the
    output of a column-parallel layer); the bias, whole on every rank, is added once,
    after the sum. With ``sequence``, ``g`` is the reduce-scatter: ``y`` is this rank's
    slice of the sequence."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None, comm, sequence: bool = False):
        super().__init__()
        self.weight = Parameter(np.ascontiguousarray(weight))  # (in / t, out)
        self.bias = None if bias is None else Parameter(np.array(bias, copy=True))
        self.comm, self.sequence = comm, sequence

    @classmethod
    def from_linear(cls, linear, comm, rows: np.ndarray, sequence: bool = False) -> "RowParallelLinear":
        bias = None if linear.bias is None else linear.bias.data
        return cls(linear.weight.data[rows], bias, comm, sequence)

    def forward(self, x):
        part = ops.matmul(x, self.weight)  # (B, T, out), this rank's share of the sum
        y = scatter_sequence(part, self.comm) if self.sequence else reduce_from(part, self.comm)
        return y if self.bias is None else y + self.bias


class ParallelSelfAttention(CausalSelfAttention):
    """This rank's heads of a :class:`CausalSelfAttention`: ``c_attn`` column-parallel
    (their q, k and v columns of the packed weight), ``c_proj`` row-parallel (their rows);
    the attention dropout mask is theirs of the whole layer's (``heads``)."""

    def __init__(self, whole: CausalSelfAttention, comm, sequence: bool = False):
        Module.__init__(self)  # the whole layer's weights are sliced, not drawn again
        C, nh, local = whole.c_attn.weight.shape[0], whole.n_head, whole.n_head // comm.size
        cols, qkv = heads(C, nh, comm.size, comm.rank)
        self.n_head, self.heads, self.dropout = local, (comm.rank * local, nh), whole.dropout
        self.c_attn = ColumnParallelLinear.from_linear(whole.c_attn, comm, qkv, sequence)
        self.c_proj = RowParallelLinear.from_linear(whole.c_proj, comm, cols, sequence)
        self.resid_dropout, self.comm, self.sequence = whole.resid_dropout, comm, sequence

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T, 3C / t)
        p = self.dropout if self.training else 0.0
        y = ops.causal_self_attention(qkv, self.n_head, dropout_p=p, heads=self.heads)  # (B, T, C / t)
        with _sequence_rows(y.shape[1], self.comm) if self.sequence else contextlib.nullcontext():
            return self.resid_dropout(self.c_proj(y))  # (B, T / t, C) with sequence parallelism


class ParallelMLP(MLP):
    """An MLP's hidden units sliced: ``c_fc`` column-parallel, ``c_proj`` row-parallel."""

    def __init__(self, whole: MLP, comm, sequence: bool = False):
        Module.__init__(self)
        hidden = np.arange(*shard(whole.c_fc.weight.shape[1], comm.size, comm.rank))
        self.c_fc = ColumnParallelLinear.from_linear(whole.c_fc, comm, hidden, sequence)
        self.c_proj = RowParallelLinear.from_linear(whole.c_proj, comm, hidden, sequence)
        self.dropout, self.comm, self.sequence, self.gelu = whole.dropout, comm, sequence, whole.gelu

    def forward(self, x):
        h = ops.gelu(self.c_fc(x), self.gelu)  # (B, T, 4C / t)
        with _sequence_rows(h.shape[1], self.comm) if self.sequence else contextlib.nullcontext():
            return self.dropout(self.c_proj(h))


def _sequence_rows(T: int, comm):
    """Dropout on this rank's slice of a sequence of ``T``: its rows of one process's masks."""
    n = T // comm.size  # T divides: the layers' reduce-scatter refused it otherwise
    return rng.rows(comm.rank * n, (comm.rank + 1) * n, T)


class VocabParallelEmbedding(Module):
    """Rows ``lo .. hi`` of the token embedding: each rank looks up the ids it holds (the
    others give zeros), and ``g`` sums the ranks' parts into every id's vector (with
    ``sequence``, the reduce-scatter: this rank's slice of the sequence)."""

    def __init__(self, weight: Parameter, lo: int, comm, sequence: bool = False):
        super().__init__()
        self.weight, self.lo, self.comm, self.sequence = weight, lo, comm, sequence  # (V / t, C)

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else np.asarray(ids)  # (B, T) ids (ZeRO-3 hands a Tensor)
        mine = (ids >= self.lo) & (ids < self.lo + self.weight.shape[0])  # (B, T)
        rows = ops.embedding(np.where(mine, ids - self.lo, 0), self.weight)  # (B, T, C)
        part = rows * mine[..., None].astype(self.weight.dtype)
        return scatter_sequence(part, self.comm) if self.sequence else reduce_from(part, self.comm)


class SequenceParallelEmbedding(GPTEmbedding):
    """The GPT's embedding on this rank's slice of the sequence: the token rows summed
    over ranks and scattered, its rows of the position embedding added, its rows of one
    process's dropout mask."""

    def __init__(self, whole: GPTEmbedding, wte: VocabParallelEmbedding):
        Module.__init__(self)
        self.block_size, self.wte, self.wpe, self.drop = whole.block_size, wte, whole.wpe, whole.drop

    def forward(self, ids):
        T, comm = np.shape(ids)[-1], self.wte.comm
        if T > self.block_size or T % comm.size:  # before any collective: every rank raises alike
            raise ValueError(f"sequence of length {T}: more than block_size {self.block_size}, or not a multiple "
                             f"of the {comm.size} tensor-parallel ranks")
        x = self.wte(ids)  # (B, T / t, C)
        n = x.shape[1]
        with _sequence_rows(T, comm):
            return self.drop(x + self.wpe.weight[comm.rank * n : (comm.rank + 1) * n])


class VocabParallelHead(Module):
    """The final layer norm and this rank's slice of the logits, ``f(ln_f(x)) @ wte_r^T``
    (the embedding's rows, tied; ``vocab``: all ranks' rows); the loss is taken on the slices."""

    def __init__(self, ln_f, wte: Parameter, lo: int, comm, sequence: bool, vocab: int):
        super().__init__()
        self.ln_f, self.wte, self.lo, self.comm, self.sequence, self.vocab = ln_f, wte, lo, comm, sequence, vocab

    def forward(self, x):
        h = self.ln_f(x)  # (B, T / t, C) with sequence parallelism
        whole = gather_sequence(h, self.comm) if self.sequence else copy_to(h, self.comm)  # (B, T, C)
        return ops.linear(whole, ops.transpose(self.wte))  # (B, T, V / t)

    def loss(self, logits, targets, label_smoothing: float = 0.0):
        return vocab_parallel_cross_entropy(logits, targets, self.lo, self.comm, self.vocab, label_smoothing)


class VocabParallelCrossEntropy(Function):
    """The mean cross-entropy of logits sliced by vocabulary over ranks (rank r holds columns
    ``lo ..`` of ``vocab``): three allreduces of one number per token forward (the maximum, the
    target's logit, the sum of exponentials), none backward (each rank's gradient is ``softmax -
    target`` on its own columns). Smoothed (``smoothing`` = e, as :func:`mpitrain.ops.cross_entropy`)
    the target's logit is ``(1 - e) z[t] + e mean(z)``, each rank's part summed by the same allreduce."""

    def forward(self, logits, targets, lo, comm, vocab, smoothing):
        Vr = logits.shape[-1]
        z = logits.reshape(-1, Vr)  # (N, V / t)
        t = np.asarray(targets).reshape(-1)  # (N,)
        zmax = z.max(axis=1)  # (N,)
        comm.allreduce(zmax, op="max")
        e = z - zmax[:, None]
        mine, rows = (t >= lo) & (t < lo + Vr), np.arange(len(t))
        target = np.where(mine, e[rows, np.where(mine, t - lo, 0)], 0.0)  # (N,) the target's shifted logit
        if smoothing:
            target = (1 - smoothing) * target + smoothing / vocab * e.sum(axis=1)
        comm.allreduce(target)
        np.exp(e, out=e)
        total = e.sum(axis=1)  # (N,)
        comm.allreduce(total)
        e /= total[:, None]  # this rank's columns of the softmax, kept for backward
        self.p, self.rows, self.t, self.mine, self.shape = e, rows, np.where(mine, t - lo, 0), mine, logits.shape
        self.smoothing, self.vocab = smoothing, vocab
        return np.asarray((np.log(total) - target).mean(), dtype=logits.dtype)

    def backward(self, g):
        p = self.p.copy()
        p[self.rows[self.mine], self.t[self.mine]] -= 1 - self.smoothing
        if self.smoothing:
            p -= self.smoothing / self.vocab
        p *= g / len(self.rows)
        return p.reshape(self.shape)


def vocab_parallel_cross_entropy(logits, targets, lo: int, comm, vocab: int, label_smoothing: float = 0.0) -> Tensor:
    targets = targets.data if isinstance(targets, Tensor) else np.asarray(targets)
    return VocabParallelCrossEntropy.apply(as_tensor(logits), targets, lo, comm, vocab, float(label_smoothing))


# ----------------------------------------------------------------------------- the swap
def slice_block(block, tp_comm, sequence: bool = False):
    """A transformer block's attention by heads and its MLP by hidden units, in place;
    with ``sequence``, the block takes and gives this rank's slice of the sequence (its
    layer norms, residual adds and dropout on the slice)."""
    block.attn = ParallelSelfAttention(block.attn, tp_comm, sequence)
    block.mlp = ParallelMLP(block.mlp, tp_comm, sequence)
    return block


def slice_gpt(model: GPT, tp_comm, sequence: bool = False) -> GPT:
    """Replace ``model``'s layers by sliced ones over ``tp_comm``, in place: every rank
    keeps its slice of the weights the seed gave the whole model (call it before anything
    wraps the model)."""
    t, r, cfg = tp_comm.size, tp_comm.rank, model.config
    heads(cfg.n_embd, cfg.n_head, t, r)  # refused before anything is sliced unless the heads split
    if sequence and cfg.block_size % t:
        raise ValueError(f"sequence parallelism: block_size {cfg.block_size} does not split over {t} ranks")
    for block in model.blocks:
        slice_block(block, tp_comm, sequence)
    lo, hi = shard(cfg.vocab_size, t, r)
    wte = Parameter(np.array(model.embed.wte.weight.data[lo:hi], copy=True))  # (V / t, C), tied
    model.embed.wte = VocabParallelEmbedding(wte, lo, tp_comm, sequence)
    if sequence:
        model.embed = SequenceParallelEmbedding(model.embed, model.embed.wte)
    model.head = VocabParallelHead(model.head.ln_f, wte, lo, tp_comm, sequence, cfg.vocab_size)
    return model


def sum_replicated_grads(model: Module, tp_comm, held: dict | None = None) -> None:
    """With sequence parallelism each rank's gradient of a whole (replicated) weight (the
    layer norms, the row-parallel biases, the position embedding) comes from its slice of
    the sequence: the sum over ranks is the whole gradient, the same everywhere.
    ``held``: ``id(parameter) -> the gradient to sum`` (None: each ``.grad``; with ZeRO
    the same piece of each on every slice)."""
    sliced = sliced_parameters(model)
    held = {id(q): q.grad for q in model.parameters()} if held is None else held
    grads = [held[id(q)] for q in model.parameters() if id(q) not in sliced and held.get(id(q)) is not None]
    if not grads:
        return
    flat = np.concatenate([g.reshape(-1) for g in grads])  # one allreduce for them all, not one each
    allreduce(tp_comm, flat)  # half-precision gradients: added in float32 (ring.Float32Sum)
    for g, summed in zip(grads, np.split(flat, np.cumsum([g.size for g in grads])[:-1])):
        g.reshape(-1)[...] = summed  # in place: a .grad may be a view into a bucket


# ----------------------------------------------------------------------------- the whole
def sliced_parameters(model: Module) -> set[int]:
    """``id`` of every parameter that is a slice (the rest are whole on every rank). The
    head's tied rows count on their own: a pipeline's last stage holds them without the
    embedding."""
    out = set()
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
            out.update(id(q) for q in m.parameters())
        elif isinstance(m, RowParallelLinear):
            out.add(id(m.weight))
        elif isinstance(m, VocabParallelHead):
            out.add(id(m.wte))
    return out
