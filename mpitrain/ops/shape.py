"""Operations that move data without arithmetic: reshape, transpose, indexing, concat, split."""

from __future__ import annotations

import numpy as np

from mpitrain.tensor import Function, Tensor, as_tensor


class Reshape(Function):
    def forward(self, x, shape):
        self.shape = x.shape
        return x.reshape(shape)

    def backward(self, g):
        return g.reshape(self.shape)


class Transpose(Function):
    def forward(self, x, axes):
        self.axes = axes
        return np.transpose(x, axes)

    def backward(self, g):
        return np.transpose(g, None if self.axes is None else np.argsort(self.axes))


def _is_basic(index) -> bool:
    """True when ``x[index]`` is a view: each element of x appears at most once."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, np.integer, slice)) for i in items)


class GetItem(Function):
    def forward(self, x, index):
        self.shape, self.dtype, self.index = x.shape, x.dtype, index
        return x[index]

    def backward(self, g):
        gx = np.zeros(self.shape, dtype=self.dtype)
        if _is_basic(self.index):
            gx[self.index] = g
        else:
            np.add.at(gx, self.index, g)  # repeated indices accumulate
        return gx


class Concat(Function):
    def forward(self, *arrays, axis):
        self.axis = axis
        self.bounds = np.cumsum([a.shape[axis] for a in arrays])[:-1]
        return np.concatenate(arrays, axis=axis)

    def backward(self, g):
        return tuple(np.split(g, self.bounds, axis=self.axis))


class Split(Function):
    def forward(self, x, bounds, axis):
        self.shape, self.dtype, self.bounds, self.axis = x.shape, x.dtype, bounds, axis
        return tuple(np.split(x, bounds, axis=axis))

    def backward(self, *grads):
        gx = np.empty(self.shape, dtype=self.dtype)
        for part, g in zip(np.split(gx, self.bounds, axis=self.axis), grads):
            part[...] = 0 if g is None else g
        return gx


def reshape(x, shape) -> Tensor:
    return Reshape.apply(as_tensor(x), tuple(shape))


def transpose(x, axes=None) -> Tensor:
    """Permute axes (reverse them when ``axes`` is None); negative axes count from the end."""
    x = as_tensor(x)
    if axes is not None:
        axes = tuple(int(a) % x.ndim if -x.ndim <= a < x.ndim else a for a in axes)
        if sorted(axes) != list(range(x.ndim)):
            raise ValueError(f"axes {axes} are not a permutation of {x.ndim} axes")
    return Transpose.apply(x, axes)


def getitem(x, index) -> Tensor:
    if isinstance(index, Tensor):
        index = index.data
    elif isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    elif isinstance(index, list):
        index = np.asarray(index)
    return GetItem.apply(as_tensor(x), index)


def concat(tensors, axis: int = 0) -> Tensor:
    return Concat.apply(*[as_tensor(t) for t in tensors], axis=axis)


def split(x, sections, axis: int = 0) -> tuple:
    """Split into equal parts (``sections`` an int) or at sizes (a list of part lengths)."""
    x = as_tensor(x)
    n = x.shape[axis]
    if isinstance(sections, int):
        if n % sections:
            raise ValueError(f"axis of length {n} does not split into {sections} equal parts")
        sizes = [n // sections] * sections
    else:
        sizes = list(sections)
        if sum(sizes) != n:
            raise ValueError(f"split sizes {sizes} do not add up to {n}")
    bounds = list(np.cumsum(sizes)[:-1])
    return Split.apply(x, bounds, axis)
