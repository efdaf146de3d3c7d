"""Embedding lookup and dropout."""

from __future__ import annotations

import numpy as np

from mpitrain import rng as _rng
from mpitrain.tensor import Function, Tensor, as_tensor


class Embedding(Function):
    """``weight[ids]``: rows of a (V, C) table for integer ids of any shape. Backward sums
    the gradients of repeated ids: the ids sorted once, one ``np.add.reduceat`` adds each
    run of equal ids (faster than ``np.add.at``; unlike a one-hot product, independent of V)."""

    def forward(self, weight, ids):
        self.ids, self.wshape = ids, weight.shape
        return weight[ids]  # (*ids.shape, C)

    def backward(self, g):
        V, C = self.wshape
        ids = self.ids.reshape(-1)
        if ids.size == 0:
            return np.zeros((V, C), dtype=g.dtype)
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
        sums = np.add.reduceat(g.reshape(-1, C)[order], starts, axis=0)  # (unique ids, C)
        gw = np.zeros((V, C), dtype=g.dtype)
        gw[sorted_ids[starts]] = sums
        return gw


class Dropout(Function):
    def forward(self, x, p, generator):
        self.mask = _rng.dropout_mask(generator, x.shape, p, x.dtype)
        return x * self.mask

    def backward(self, g):
        return g * self.mask


def embedding(ids, weight) -> Tensor:
    ids = ids.data if isinstance(ids, Tensor) else np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"embedding ids must be integers, got {ids.dtype}")
    V = weight.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= V):
        raise IndexError(f"embedding id outside [0, {V})")
    return Embedding.apply(weight, ids)


def dropout(x, p: float, training: bool = True, generator=None) -> Tensor:
    """Inverted dropout: zero each element with probability ``p`` and scale the rest by 1/(1-p), so
    evaluation needs no rescaling; masks from ``generator`` as :func:`mpitrain.rng.dropout_mask` draws them."""
    x = as_tensor(x)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    return Dropout.apply(x, float(p), generator)
