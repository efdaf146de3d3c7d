"""The two halves of a pre-norm transformer block (GPT-2), each as one node:

    attention_sublayer(x) = x + dropout(attention(LN(x) W_qkv + b_qkv) W_proj + b_proj)
    mlp_sublayer(x)       = x + dropout(gelu(LN(x) W_fc + b_fc) W_proj + b_proj)

Each does the arithmetic of the ops it stands for (``layer_norm``, ``linear``,
``causal_self_attention`` or ``gelu``, ``linear``, ``dropout``, ``add``), in their
order and with their code (``norm.layer_norm_rows``, ``attention.attend``,
``elementwise.gelu_blocks``), so its values and gradients are theirs; the tests hold
it to them in float64, and ``nn.Block``'s submodules keep the op-by-op form.

Why one node. A new array costs, on this machine, a read from memory of every cache
line before it is written, and the block's large intermediates, LN(x), qkv (N, 3C),
the merged heads (N, C) and the MLP's hidden activation (N, 4C), are written once and
read in backward long after they have left the cache. Private to one node, they can be
reused while they are still in cache:

* forward: GELU runs in place over the fc output, and dropout and the residual add
  over the output projection's result;
* backward: each large gradient is written over the array it is computed from, or over
  one just read for the last time: dL/dh over h, dL/dy over the merged heads, dL/dqkv
  over qkv (``attention.attend_backward``), dL/dLN(x) over LN(x), the layer norm's work
  over its xhat; the residual's gradient is added in place, not by the engine into a
  new array.

Only when the engine says this is the node's last backward (``Function.last_backward``);
with ``retain_graph`` every gradient gets a new array instead. Measured on the GPT
bench step, 12 rounds of three separate processes side by side (medians): 59.4 ms op
by op; 56.4 with attention and MLP fused but layer norm and residual left out (faster
in 12 of 12); 54.9 as here (faster than that in 11 of 12).
"""

from __future__ import annotations

import numpy as np

from mpitrain import rng as _rng
from mpitrain.ops.attention import attend, attend_backward
from mpitrain.ops.elementwise import gelu_blocks
from mpitrain.ops.norm import layer_norm_rows, layer_norm_rows_backward
from mpitrain.tensor import Function, Tensor, as_tensor


def _affine(a, w, b):
    y = a @ w
    if b is not None:
        y += b
    return y


class _Sublayer(Function):
    """The parts both sublayers share: the layer norm in front of the branch, dropout
    and the residual add behind it. Inputs 0-2 are ``x``, the norm's weight and bias."""

    def _norm(self, x, weight, bias, eps):
        self.x_shape = x.shape
        u2, self.xhat, self.rstd = layer_norm_rows(x.reshape(-1, x.shape[-1]), weight, bias, eps)
        self.ln_weight = weight
        return u2  # LN(x), (N, C)

    def _residual(self, out2, x, dropout_p, generator):
        """``x + dropout(out2)``, written over the branch output ``out2`` (N, C)."""
        self.branch_keep = None
        if dropout_p > 0:
            self.branch_keep = _rng.dropout_mask(generator, out2.shape, dropout_p, out2.dtype)
            out2 *= self.branch_keep
        out2 += x.reshape(out2.shape)
        return out2.reshape(self.x_shape)

    def _branch_grad(self, g):
        """dL/d(branch output), (N, C): the upstream gradient through dropout."""
        g2 = g.reshape(-1, g.shape[-1])
        return g2 if self.branch_keep is None else g2 * self.branch_keep

    def _work(self, a):
        """``a`` itself when backward may write over it, else a new array like it."""
        return a if self.last_backward else np.empty_like(a)

    def _norm_backward(self, gu2, g):
        """(dx, dweight, dbias) from dL/dLN(x) ``gu2`` (N, C, this node's own array, which
        becomes dx) and the upstream ``g``, which reaches x also through the residual."""
        gx, gw, gb = layer_norm_rows_backward(gu2, self.xhat, self.rstd, self.ln_weight,
                                              self.needs_input_grad[:3], out=gu2,
                                              xhat_is_free=self.last_backward)
        if gx is not None:
            gx += g.reshape(gx.shape)
            gx = gx.reshape(self.x_shape)
        return gx, gw, gb


class AttentionSublayer(_Sublayer):
    def forward(self, x, ln_weight, ln_bias, w_qkv, b_qkv, w_proj, b_proj, n_head, eps, dropout_p,
                generator):
        B, T, _ = x.shape
        u2 = self._norm(x, ln_weight, ln_bias, eps)  # (N, C)
        qkv = _affine(u2, w_qkv, b_qkv).reshape(B, T, -1)  # (B, T, 3C)
        y2 = attend(self, qkv, n_head, True, dropout_p, generator).reshape(B * T, -1)  # heads merged, (N, C)
        self.u2, self.y2, self.w_qkv, self.w_proj = u2, y2, w_qkv, w_proj
        return self._residual(_affine(y2, w_proj, b_proj), x, dropout_p, generator)

    def backward(self, g):
        need = self.needs_input_grad
        g2 = self._branch_grad(g)  # (N, C)
        y2 = self.y2
        gw_proj = y2.T @ g2 if need[5] else None
        gb_proj = g2.sum(axis=0) if need[6] else None
        gx = gln_w = gln_b = gw_qkv = gb_qkv = None
        if any(need[:5]):
            gy = self._work(y2)  # y was read for the last time just above
            np.matmul(g2, self.w_proj.T, out=gy)  # dL/dy, (N, C)
            gqkv = self._work(self.qkv)  # (B, T, 3C)
            attend_backward(self, gy, gqkv, dq_scratch=gy if self.last_backward else None)
            gqkv2 = gqkv.reshape(len(g2), -1)  # (N, 3C)
            gw_qkv = self.u2.T @ gqkv2 if need[3] else None
            gb_qkv = gqkv2.sum(axis=0) if need[4] else None
            if any(need[:3]):
                gu = self._work(self.u2)  # LN(x) was read for the last time just above
                np.matmul(gqkv2, self.w_qkv.T, out=gu)  # dL/dLN(x), (N, C)
                gx, gln_w, gln_b = self._norm_backward(gu, g)
        return gx, gln_w, gln_b, gw_qkv, gb_qkv, gw_proj, gb_proj


class MLPSublayer(_Sublayer):
    def forward(self, x, ln_weight, ln_bias, w_fc, b_fc, w_proj, b_proj, eps, dropout_p, generator):
        u2 = self._norm(x, ln_weight, ln_bias, eps)  # (N, C)
        h = _affine(u2, w_fc, b_fc)  # (N, H)
        self.d = np.empty_like(h) if any(self.needs_input_grad[:5]) else None  # GELU', (N, H)
        gelu_blocks(h.reshape(-1), h.reshape(-1), None if self.d is None else self.d.reshape(-1))
        self.u2, self.h, self.w_fc, self.w_proj = u2, h, w_fc, w_proj
        return self._residual(_affine(h, w_proj, b_proj), x, dropout_p, generator)

    def backward(self, g):
        need = self.needs_input_grad
        g2 = self._branch_grad(g)  # (N, C)
        h = self.h
        gw_proj = h.T @ g2 if need[5] else None  # (H, C)
        gb_proj = g2.sum(axis=0) if need[6] else None
        gx = gln_w = gln_b = gw_fc = gb_fc = None
        if self.d is not None:
            gh = self._work(h)  # h was read for the last time just above
            np.matmul(g2, self.w_proj.T, out=gh)  # dL/dh, (N, H)
            gh *= self.d  # through GELU
            gw_fc = self.u2.T @ gh if need[3] else None
            gb_fc = gh.sum(axis=0) if need[4] else None
            if any(need[:3]):
                gu = self._work(self.u2)  # LN(x) was read for the last time just above
                np.matmul(gh, self.w_fc.T, out=gu)  # dL/dLN(x), (N, C)
                gx, gln_w, gln_b = self._norm_backward(gu, g)
        return gx, gln_w, gln_b, gw_fc, gb_fc, gw_proj, gb_proj


def _check(x, w_in, w_proj, what: str) -> Tensor:
    x = as_tensor(x)
    if x.ndim != 3 or w_in.shape[0] != x.shape[-1] or w_proj.shape[-1] != x.shape[-1]:
        raise ValueError(f"{what}: x must be (B, T, C) with weights (C, ...) and (..., C), got x "
                         f"{x.shape}, weights {w_in.shape} and {w_proj.shape}")
    return x


def attention_sublayer(x, ln_weight, ln_bias, w_qkv, b_qkv, w_proj, b_proj, n_head: int,
                       eps: float = 1e-5, dropout_p: float = 0.0, generator=None) -> Tensor:
    """``x + dropout(causal_self_attention(layer_norm(x) @ w_qkv + b_qkv) @ w_proj + b_proj)``
    for ``x`` (B, T, C), as one node; biases may be None. Dropout, as in GPT-2, acts on
    the attention weights and on the branch, with masks drawn from ``generator`` in that
    order (the global generator by default)."""
    x = _check(x, w_qkv, w_proj, "attention_sublayer")
    if w_qkv.shape[1] % (3 * n_head) or w_proj.shape[0] != w_qkv.shape[1] // 3:
        raise ValueError(f"attention_sublayer: w_qkv {w_qkv.shape} must be (C, 3C') with C' divisible "
                         f"by n_head={n_head}, and w_proj (C', C), got {w_proj.shape}")
    generator = generator if generator is not None else _rng.generator()
    return AttentionSublayer.apply(x, ln_weight, ln_bias, w_qkv, b_qkv, w_proj, b_proj, n_head,
                                   float(eps), float(dropout_p), generator)


def mlp_sublayer(x, ln_weight, ln_bias, w_fc, b_fc, w_proj, b_proj, eps: float = 1e-5,
                 dropout_p: float = 0.0, generator=None) -> Tensor:
    """``x + dropout(gelu(layer_norm(x) @ w_fc + b_fc) @ w_proj + b_proj)`` for ``x``
    (B, T, C), as one node; biases may be None."""
    x = _check(x, w_fc, w_proj, "mlp_sublayer")
    if w_proj.shape[0] != w_fc.shape[1]:
        raise ValueError(f"mlp_sublayer: w_fc {w_fc.shape} and w_proj {w_proj.shape} do not chain")
    generator = generator if generator is not None else _rng.generator()
    return MLPSublayer.apply(x, ln_weight, ln_bias, w_fc, b_fc, w_proj, b_proj, float(eps),
                             float(dropout_p), generator)
