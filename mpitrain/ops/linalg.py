"""Matrix products: batched ``matmul`` and the fused affine map ``linear``.

Weights are stored ``(in_features, out_features)`` so that ``y = x @ W`` needs no
transpose in the forward pass; every product below is one BLAS GEMM (or one batch of
them), with leading dimensions of an activation folded into the GEMM's row count.
"""

from __future__ import annotations

import numpy as np

from mpitrain.ops._util import unbroadcast
from mpitrain.tensor import Function, Tensor, as_tensor


def affine(a: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """``a @ w + b`` for ``a`` (N, in), the bias (None: none) added in place."""
    y = a @ w  # (N, out)
    if b is not None:
        y += b
    return y


class MatMul(Function):
    """``a @ b`` for arrays of two or more dimensions, batch dimensions broadcasting."""

    def forward(self, a, b):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul needs operands of 2 or more dimensions, got {a.shape} and {b.shape}")
        self.a, self.b = a, b
        if b.ndim == 2:
            # (..., M, K) @ (K, N): one GEMM with all leading dims folded into M
            return (a.reshape(-1, a.shape[-1]) @ b).reshape(*a.shape[:-1], b.shape[1])
        return a @ b

    def backward(self, g):
        a, b, need = self.a, self.b, self.needs_input_grad
        if b.ndim == 2:
            g2 = g.reshape(-1, g.shape[-1])  # (M', N)
            return ((g2 @ b.T).reshape(a.shape) if need[0] else None,
                    a.reshape(-1, a.shape[-1]).T @ g2 if need[1] else None)  # (K, N)
        return (unbroadcast(g @ np.swapaxes(b, -1, -2), a.shape) if need[0] else None,
                unbroadcast(np.swapaxes(a, -1, -2) @ g, b.shape) if need[1] else None)


class Linear(Function):
    """``y = x @ W + b`` with ``x`` of shape ``(..., in)``, ``W`` ``(in, out)``, ``b`` ``(out,)``."""

    def forward(self, x, w, b=None):
        self.x_shape, self.x2, self.w = x.shape, x.reshape(-1, x.shape[-1]), w  # x2: (N, in)
        return affine(self.x2, w, b).reshape(*x.shape[:-1], w.shape[1])  # (N, out) -> (..., out)

    def backward(self, g):
        need = self.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])  # (N, out)
        gx = (g2 @ self.w.T).reshape(self.x_shape) if need[0] else None
        gw = self.x2.T @ g2 if need[1] else None  # (in, out)
        gb = g2.sum(axis=0) if len(need) > 2 and need[2] else None
        return gx, gw, gb


def matmul(a, b) -> Tensor:
    return MatMul.apply(as_tensor(a), as_tensor(b))


def linear(x, weight, bias=None) -> Tensor:
    return Linear.apply(as_tensor(x), weight, *(() if bias is None else (bias,)))
