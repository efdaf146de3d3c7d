"""Helpers shared by the op modules."""

from __future__ import annotations

import numpy as np

from mpitrain.tensor import Tensor


def unbroadcast(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum ``grad`` over the axes that broadcasting expanded, giving an array of ``shape``."""
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        extra + i for i, n in enumerate(shape) if n == 1 and grad.shape[extra + i] != 1
    )
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad.reshape(shape)


def constant(x, like: Tensor):
    """A non-tensor operand: Python numbers stay (they adopt the tensor's dtype under
    NumPy's promotion rules); NumPy floats are cast so float32 stays float32."""
    if isinstance(x, (Tensor, int, float, bool)):
        return x
    x = np.asarray(x)
    if x.dtype.kind == "f" and x.dtype != like.dtype:
        x = x.astype(like.dtype)
    return x


def normalize_axes(axis, ndim: int) -> tuple:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    return tuple(sorted(a % ndim for a in axis))


def expand_reduced(grad: np.ndarray, axes: tuple, keepdims: bool) -> np.ndarray:
    """Re-insert the reduced axes of a reduction's gradient as length-1 axes."""
    return grad if keepdims else np.expand_dims(grad, axes)
