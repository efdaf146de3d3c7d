"""FLOPs of a training step, counted analytically from the shapes each op sees.

Only products count (:func:`mpitrain.cost.matmul_flops`, backward by
:func:`~mpitrain.cost.backward_flops`): ``linear``, ``matmul``, ``conv2d`` (plain or
tiled), attention's two batched products, and those inside the fused transformer
sublayers (``ops.transformer``), counted as their ops one by one would be, so the plain
and fast paths (``ops.fast_paths``) count the same; elementwise work is ignored, as in
the usual model-FLOPs convention (Kaplan et al. 2020; Chowdhery et al. 2022). Counting
runs one real step under an op observer, so it covers any model built from these ops,
and recomputation (activation checkpointing) is counted as executed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpitrain.cost import attention_flops, backward_flops, conv2d_flops, matmul_flops
from mpitrain.ops.attention import CausalSelfAttention
from mpitrain.ops.conv import Conv2d, TiledConv2d
from mpitrain.ops.linalg import Linear, MatMul
from mpitrain.ops.transformer import AttentionSublayer, MLPSublayer
from mpitrain.tensor import Tensor, is_grad_enabled, observe_ops


def _needs_grad(*tensors) -> int:
    return sum(1 for t in tensors if isinstance(t, Tensor) and t.requires_grad) if is_grad_enabled() else 0


def _linear(args, kwargs):
    x, w = args[0], args[1]
    fwd = matmul_flops(math.prod(x.shape[:-1]), w.shape[0], w.shape[1])
    return fwd, backward_flops(fwd, _needs_grad(x, w))


def _matmul(args, kwargs):
    a, b = args
    batch = math.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    fwd = batch * matmul_flops(a.shape[-2], a.shape[-1], b.shape[-1])
    return fwd, backward_flops(fwd, _needs_grad(a, b))


def _conv2d(args, kwargs):
    x, w = args[0], args[1]
    (sh, sw), (ph, pw) = kwargs["stride"], kwargs["padding"]
    B, H, W, _ = x.shape
    kh, kw, cin, cout = w.shape
    fwd = conv2d_flops(B, (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1, kh, kw, cin, cout)
    return fwd, backward_flops(fwd, _needs_grad(x, w))


def _attention(args, kwargs):
    qkv = args[0]
    B, T, C3 = qkv.shape
    fwd = attention_flops(B, T, C3 // 3)
    return fwd, backward_flops(fwd, 2) if _needs_grad(qkv) else 0  # dv and dP; dq and dk


def _sublayer(args, attention: bool):
    """The products of LN(x) W_in, attention's two (if ``attention``) and h W_proj, each
    backward product counted when the op-by-op form's operand would need a gradient."""
    x, ln_w, ln_b, w_in, b_in, w_proj = args[:6]
    B, T, C = x.shape
    first, proj = matmul_flops(B * T, C, w_in.shape[1]), matmul_flops(B * T, w_proj.shape[0], w_proj.shape[1])
    middle = attention_flops(B, T, w_proj.shape[0]) if attention else 0
    normed = _needs_grad(x, ln_w, ln_b) > 0  # LN(x) needs a gradient
    hidden = normed or _needs_grad(w_in, b_in) > 0  # the first product's output needs one
    bwd = backward_flops(first, normed + _needs_grad(w_in)) + backward_flops(middle, 2 * hidden) \
        + backward_flops(proj, hidden + _needs_grad(w_proj))
    return first + middle + proj, bwd


RULES = {Linear: _linear, MatMul: _matmul, Conv2d: _conv2d, TiledConv2d: _conv2d,
         CausalSelfAttention: _attention,
         AttentionSublayer: lambda args, kwargs: _sublayer(args, attention=True),
         MLPSublayer: lambda args, kwargs: _sublayer(args, attention=False)}


@dataclass(eq=False)  # an observer: compared by identity
class FlopCount:
    forward: int = 0
    backward: int = 0

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def __call__(self, cls, args, kwargs) -> None:
        if (rule := RULES.get(cls)) is not None:
            fwd, bwd = rule(args, kwargs)
            self.forward += fwd
            self.backward += bwd


def count_flops(step) -> FlopCount:
    """Run ``step()`` (a forward and backward pass) once and count its FLOPs."""
    counter = FlopCount()
    with observe_ops(counter):
        step()
    return counter
