"""FLOPs of a training step, counted analytically from the shapes each op sees.

Only products count (a multiply-add is 2 FLOPs): ``linear``, ``matmul``, ``conv2d``,
attention's two batched products, and the products inside the fused GPT sublayers
(``self_attention``, ``gelu_mlp``), counted as their unfused ops would be; elementwise work is ignored, as in the usual
model-FLOPs convention (Kaplan et al. 2020; Chowdhery et al. 2022). The backward pass
of a product ``Y = A B`` costs one product of the same size per operand that needs a
gradient, so a layer whose input is data (the first convolution) costs 2x its forward
FLOPs rather than 3x. Counting runs one real step under an op observer, so it covers
any model built from these ops, and recomputation (activation checkpointing) is counted
as executed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpitrain.ops.attention import CausalSelfAttention, SelfAttention
from mpitrain.ops.conv import Conv2d
from mpitrain.ops.linalg import GeluMLP, Linear, MatMul
from mpitrain.tensor import Tensor, is_grad_enabled, observe_ops


def _needs_grad(*tensors) -> int:
    if not is_grad_enabled():
        return 0
    return sum(1 for t in tensors if isinstance(t, Tensor) and t.requires_grad)


def _linear(args, kwargs):
    x, w = args[0], args[1]
    fwd = 2 * math.prod(x.shape[:-1]) * w.shape[0] * w.shape[1]
    return fwd, fwd * _needs_grad(x, w)


def _matmul(args, kwargs):
    a, b = args
    batch = math.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    fwd = 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
    return fwd, fwd * _needs_grad(a, b)


def _conv2d(args, kwargs):
    x, w = args[0], args[1]
    (sh, sw), (ph, pw) = kwargs["stride"], kwargs["padding"]
    B, H, W, _ = x.shape
    kh, kw, cin, cout = w.shape
    ho, wo = (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1
    fwd = 2 * B * ho * wo * kh * kw * cin * cout
    return fwd, fwd * _needs_grad(x, w)


def _attention(args, kwargs):
    qkv = args[0]
    B, T, C3 = qkv.shape
    fwd = 2 * 2 * B * T * T * (C3 // 3)  # q k^T and P v over all heads
    return fwd, 2 * fwd if _needs_grad(qkv) else 0  # dv, dP, dq, dk


def _self_attention(args, kwargs):
    x, w_qkv, b_qkv, w_proj = args[:4]
    N, C = math.prod(x.shape[:-1]), x.shape[-1]
    B, T = x.shape[:2]
    qkv, proj = 2 * N * C * w_qkv.shape[1], 2 * N * w_proj.shape[0] * w_proj.shape[1]
    att = 2 * 2 * B * T * T * (w_qkv.shape[1] // 3)
    upstream = _needs_grad(x, w_qkv, b_qkv) > 0  # whether attention's input needs a gradient
    bwd = qkv * _needs_grad(x, w_qkv) + (2 * att + proj) * upstream + proj * _needs_grad(w_proj)
    return qkv + att + proj, bwd


def _gelu_mlp(args, kwargs):
    x, w1, b1, w2 = args[:4]
    N = math.prod(x.shape[:-1])
    fc, proj = 2 * N * w1.shape[0] * w1.shape[1], 2 * N * w2.shape[0] * w2.shape[1]
    upstream = _needs_grad(x, w1, b1) > 0  # whether the hidden activation needs a gradient
    return fc + proj, fc * _needs_grad(x, w1) + proj * (upstream + _needs_grad(w2))


RULES = {Linear: _linear, MatMul: _matmul, Conv2d: _conv2d, CausalSelfAttention: _attention,
         SelfAttention: _self_attention, GeluMLP: _gelu_mlp}


@dataclass(eq=False)  # an observer: compared by identity
class FlopCount:
    forward: int = 0
    backward: int = 0

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def __call__(self, cls, args, kwargs) -> None:
        rule = RULES.get(cls)
        if rule is not None:
            fwd, bwd = rule(args, kwargs)
            self.forward += fwd
            self.backward += bwd


def count_flops(step) -> FlopCount:
    """Run ``step()`` (a forward and backward pass) once and count its FLOPs."""
    counter = FlopCount()
    with observe_ops(counter):
        step()
    return counter
