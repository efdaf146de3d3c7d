"""Reductions over axes: sum, mean, max."""

from __future__ import annotations

import numpy as np

from mpitrain.ops._util import expand_reduced, normalize_axes
from mpitrain.tensor import Function, Tensor, as_tensor


class Sum(Function):
    def forward(self, x, axes, keepdims):
        self.shape, self.axes, self.keepdims = x.shape, axes, keepdims
        return np.sum(x, axis=axes, keepdims=keepdims)

    def backward(self, g):
        return np.broadcast_to(expand_reduced(g, self.axes, self.keepdims), self.shape)


class Mean(Function):
    def forward(self, x, axes, keepdims):
        self.shape, self.axes, self.keepdims = x.shape, axes, keepdims
        self.count = int(np.prod([x.shape[a] for a in axes]))
        return np.mean(x, axis=axes, keepdims=keepdims)

    def backward(self, g):
        return np.broadcast_to(expand_reduced(g, self.axes, self.keepdims) / self.count, self.shape)


class Max(Function):
    """Maximum over axes; tied maxima share the gradient equally, whichever one calls the maximum."""

    def forward(self, x, axes, keepdims):
        self.axes, self.keepdims = axes, keepdims
        out = np.max(x, axis=axes, keepdims=True)
        self.mask = mask = (x == out).astype(x.dtype)
        mask /= mask.sum(axis=axes, keepdims=True)
        return out if keepdims else np.squeeze(out, axis=axes)

    def backward(self, g):
        return self.mask * expand_reduced(g, self.axes, self.keepdims)


def sum(x, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    x = as_tensor(x)
    return Sum.apply(x, normalize_axes(axis, x.ndim), keepdims)


def mean(x, axis=None, keepdims: bool = False) -> Tensor:
    x = as_tensor(x)
    return Mean.apply(x, normalize_axes(axis, x.ndim), keepdims)


def max(x, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    x = as_tensor(x)
    return Max.apply(x, normalize_axes(axis, x.ndim), keepdims)
