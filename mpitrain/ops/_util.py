"""Helpers shared by the op modules, and the switch between plain and fast paths."""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from mpitrain.tensor import Tensor

_fast_paths = True


def set_fast_paths(enabled: bool) -> bool:
    """Select the fast paths (True, the default) or the plain ones for the whole process;
    returns the previous setting. The switch selects:

    * ``nn.Block``: each half of a transformer block as one fused op (``ops.transformer``),
      or nanoGPT's two lines through its ``Linear`` and ``LayerNorm`` modules;
    * ``ops.gelu``: GELU in cache-sized blocks of in-place passes (``gelu_blocks``), or
      the textbook expression over the whole array (``gelu_plain``);
    * ``ops.conv2d``: im2col + GEMM over cache-sized tiles of images with an opaque-row
      copy (``TiledConv2d``), or over the whole batch at once (``Conv2d``);
    * ``ops.max_pool2d``: the batch in cache-sized tiles, or whole.

    Both do the same arithmetic in the same order, equal bit for bit, except the
    convolutions, equal to rounding (1e-12 relative in float64): tiles change the GEMMs'
    shapes and the weight gradient's order of summation. The tests hold them to that."""
    global _fast_paths
    previous, _fast_paths = _fast_paths, bool(enabled)
    return previous


def fast_paths_enabled() -> bool:
    """True when the fast paths are selected (see :func:`set_fast_paths`)."""
    return _fast_paths


@contextlib.contextmanager
def fast_paths(enabled: bool):
    """``with fast_paths(False): ...`` runs the plain paths inside the block (:func:`set_fast_paths`)."""
    previous = set_fast_paths(enabled)
    try:
        yield
    finally:
        set_fast_paths(previous)


# Elements per block of a multi-pass elementwise op: 64K float32 numbers (256 KiB) and
# their few temporaries stay in L2, so each pass after the first reads cache, not memory.
BLOCK_ELEMENTS = 1 << 16


def blocks(n: int, size: int = BLOCK_ELEMENTS) -> list[slice]:
    """Consecutive slices covering ``range(n)``, ``size`` long (the last may be shorter)."""
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


@functools.lru_cache(maxsize=64)
def cached_full(shape: tuple, value: float, dtype: np.dtype) -> np.ndarray:
    """A read-only array of ``value``, made once per shape: a product with ones (1/n) is a sum (mean) as a GEMM."""
    a = np.full(shape, value, dtype=dtype)
    a.flags.writeable = False
    return a


def unbroadcast(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum ``grad`` over the axes that broadcasting expanded, giving an array of ``shape``."""
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(extra + i for i, n in enumerate(shape) if n == 1 and grad.shape[extra + i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad.reshape(shape)


def constant(x, like: Tensor):
    """A non-tensor operand of an elementwise op, as an array of ``like``'s dtype when
    numeric, so that float32 stays float32: NumPy scalars and arrays (``np.float64(2)``,
    ``np.arange(3)``) would otherwise promote the result to float64. Python numbers
    already adopt the tensor's dtype under NumPy's promotion rules and pass through."""
    if isinstance(x, Tensor) or type(x) in (int, float, bool):
        return x
    x = np.asarray(x)
    return x.astype(like.dtype, copy=False) if x.dtype.kind in "biuf" else x


def normalize_axes(axis, ndim: int) -> tuple:
    """Axes as sorted non-negative ints; ``None`` means all. Out-of-range axes raise."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    for a in axes:
        if not -ndim <= a < ndim:
            raise np.exceptions.AxisError(a, ndim)
    normalized = tuple(sorted(int(a) % ndim for a in axes))
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"repeated axis in {axis}")
    return normalized


def expand_reduced(grad: np.ndarray, axes: tuple, keepdims: bool) -> np.ndarray:
    """Re-insert the reduced axes of a reduction's gradient as length-1 axes."""
    return grad if keepdims else np.expand_dims(grad, axes)
