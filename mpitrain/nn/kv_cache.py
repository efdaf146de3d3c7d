"""Decoding with a key-value cache (Pope et al. 2022, "Efficiently Scaling Transformer
Inference"): each block's keys and values of the tokens so far are kept, so a new token
costs one pass of one token through the model, not a pass over the whole context.

**Prefill.** The prompts go through the model once, each block keeping its keys and
values in the cache (:class:`KVCache`). Prompts of different lengths are right-padded to
the longest: attention is causal, so a prompt's own positions never see its padding,
and its first new token comes from the logits at its last position. The cache is ragged:
each sequence has its own length, and its padding is overwritten as it grows.

**Decode.** One token a sequence at its own next position: its query against the cache's
keys up to that position (the rest masked), its key and value written there. Attention is
the only part that looks across positions; norms, products and the MLP run on the one token.

**Past the context.** A GPT with learned positions sees at most ``block_size`` tokens.
When a sequence would pass it, its window slides, as recomputation's does: the last
``block_size`` tokens again from position 0. A cache cannot slide (every key's position
changes), so from then on each token is a prefill of the window (:func:`next_logits`).

The model may be whole or sliced over tensor-parallel ranks (heads and MLP columns,
:mod:`mpitrain.parallel.tensor_parallel`): the layers' own ``forward`` runs, so a sliced
layer sums over its ranks as in training, and each rank caches its heads' keys and values.
``gather`` joins a vocabulary-sliced head's logits (identity when whole).

Cache bytes: ``2 x layers x batch x context x width x itemsize`` (``width``: ``n_embd``, or
a rank's ``n_embd / t`` of the heads; :func:`mpitrain.cost.kv_cache_bytes`).
"""

from __future__ import annotations

import math

import numpy as np

from mpitrain.tensor import Tensor, no_grad


class KVCache:
    """Keys and values of ``layers`` blocks for ``batch`` sequences of up to ``capacity``
    tokens, ``heads`` heads of ``head_size``: arrays ``(layers, batch, heads, capacity,
    head_size)``; ``lengths``, each sequence's tokens cached."""

    def __init__(self, layers: int, batch: int, heads: int, capacity: int, head_size: int, dtype):
        shape = (layers, batch, heads, capacity, head_size)
        self.k, self.v = np.zeros(shape, dtype=dtype), np.zeros(shape, dtype=dtype)
        self.lengths = np.zeros(batch, dtype=np.int64)
        self.capacity = capacity

    @classmethod
    def for_model(cls, model, batch: int, capacity: int) -> "KVCache":
        """A cache for ``model``'s blocks as this rank holds them (a slice's heads)."""
        attn = model.blocks[0].attn
        width = attn.c_attn.weight.shape[1] // 3  # the heads this rank computes, their q (or k, or v) columns
        return cls(len(model.blocks), batch, attn.n_head, capacity, width // attn.n_head,
                   model.embed.wpe.weight.dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _split(qkv: np.ndarray, heads: int) -> tuple:
    """(B, T, 3W) packed ``[q | k | v]`` -> q, k, v each (B, heads, T, W / heads), views."""
    B, T, W3 = qkv.shape
    return qkv.reshape(B, T, 3, heads, W3 // (3 * heads)).transpose(2, 0, 3, 1, 4)


def _block(block, x: Tensor, layer: int, step) -> Tensor:
    """One block on ``x`` (B, T, C): ``step(qkv, layer)`` attends (and fills the cache)."""
    attn = block.attn
    qkv = attn.c_attn(block.ln_1(x))  # (B, T, 3W): this rank's heads
    y = step(qkv.data, layer)  # (B, T, W)
    x = x + attn.c_proj(Tensor(y))  # a row-parallel layer sums over the ranks
    return x + block.mlp(block.ln_2(x))


def prefill(model, ids: np.ndarray, lengths: np.ndarray, cache: KVCache, gather=None) -> np.ndarray:
    """The logits (B, V) after each prompt, ``ids`` (B, T) right-padded, ``lengths`` (B,)
    its tokens; the prompts' keys and values go into ``cache`` (from position 0)."""
    from mpitrain import ops  # the training op: attention over the whole prompt, causal

    heads = model.blocks[0].attn.n_head

    def step(qkv, layer):
        _, k, v = _split(qkv, heads)
        T = qkv.shape[1]
        cache.k[layer, :, :, :T], cache.v[layer, :, :, :T] = k, v
        return ops.causal_self_attention(qkv, heads).data

    rows = np.arange(len(ids))
    with no_grad():
        x = model.embed(ids)  # (B, T, C)
        for i, block in enumerate(model.blocks):
            x = _block(block, x, i, step)
        last = Tensor(np.ascontiguousarray(x.data[rows, lengths - 1][:, None]))  # (B, 1, C)
        logits = model.head(last)
    cache.lengths[:] = lengths
    return _whole(logits, gather)


def decode(model, tokens: np.ndarray, cache: KVCache, gather=None) -> np.ndarray:
    """The logits (B, V) after one more token a sequence, ``tokens`` (B,), each at its
    sequence's next position, its key and value cached there."""
    heads = model.blocks[0].attn.n_head
    rows, pos = np.arange(len(tokens)), cache.lengths.copy()  # (B,) each sequence's new position
    span = int(pos.max()) + 1
    future = np.arange(span)[None, :] > pos[:, None]  # (B, span): keys past a sequence's position

    def step(qkv, layer):
        q, k, v = _split(qkv, heads)  # each (B, heads, 1, hs)
        keys, values = cache.k[layer], cache.v[layer]  # (B, heads, capacity, hs)
        keys[rows, :, pos], values[rows, :, pos] = k[:, :, 0], v[:, :, 0]
        scores = q @ keys[:, :, :span].transpose(0, 1, 3, 2)  # (B, heads, 1, span)
        scores *= 1.0 / math.sqrt(q.shape[-1])
        scores[np.broadcast_to(future[:, None, None, :], scores.shape)] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        y = scores @ values[:, :, :span]  # (B, heads, 1, hs)
        return np.ascontiguousarray(y.transpose(0, 2, 1, 3)).reshape(len(rows), 1, -1)  # (B, 1, W)

    with no_grad():
        embed = model.embed
        x = embed.wte(tokens[:, None]) + Tensor(embed.wpe.weight.data[pos][:, None, :])  # (B, 1, C)
        for i, block in enumerate(model.blocks):
            x = _block(block, x, i, step)
        logits = model.head(x)
    cache.lengths += 1
    return _whole(logits, gather)


def _whole(logits: Tensor, gather) -> np.ndarray:
    """(B, V): a sliced head's logits joined by ``gather``."""
    out = logits if gather is None else gather(logits)
    out = out.data if isinstance(out, Tensor) else out
    return out[:, -1, :]


def windows(sequences: list, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (B, T) right-padded with zeros, lengths (B,)) of each sequence's last ``size`` tokens."""
    tails = [np.asarray(s[-size:]) for s in sequences]
    lengths = np.array([len(t) for t in tails], dtype=np.int64)
    ids = np.zeros((len(tails), int(lengths.max())), dtype=np.int64)
    for row, t in zip(ids, tails):
        row[: len(t)] = t
    return ids, lengths


def next_logits(model, sequences: list, cache: KVCache, block_size: int, gather=None) -> np.ndarray:
    """The logits (B, V) after each of ``sequences`` (lists of ids, each one token longer
    than the cache holds): a decode step of the newest tokens; or, if one would pass
    ``block_size``, a prefill of every sequence's window (the last ``block_size`` tokens)."""
    if cache.lengths.max() + 1 > min(block_size, cache.capacity):
        return prefill(model, *windows(sequences, min(block_size, cache.capacity)), cache, gather)
    return decode(model, np.array([s[-1] for s in sequences], dtype=np.int64), cache, gather)
