"""The two halves of a pre-norm transformer block (GPT-2), each as one node:

    attention_sublayer(x) = x + dropout(attention(LN(x) W_qkv + b_qkv) W_proj + b_proj)
    mlp_sublayer(x)       = x + dropout(gelu(LN(x) W_fc + b_fc) W_proj + b_proj)

They are ``nn.Block``'s fast path, chosen by ``ops.fast_paths`` (the plain path is
nanoGPT's two lines, op by op). Each does the arithmetic of the ops it stands for with
their code (``norm.layer_norm_rows``, ``attention.attend``, the same GEMMs,
``elementwise.gelu_blocks``), in their order, dropout draws included, so its values and
gradients are theirs bit for bit (``branch + x`` equals ``x + branch`` in IEEE
arithmetic); the tests hold a whole GPT to that, in float32 and float64.

Why one node. A new array costs a read from memory of every cache line before it is
written, and the block's large intermediates, LN(x), qkv (N, 3C), the merged heads (N, C)
and the MLP's hidden activation (N, 4C), are written once and read in backward long after
they have left the cache. Private to one node, they are reused while still in cache.
Forward: GELU runs in place over the fc output, dropout and the residual add over the
output projection's result. Backward, on the node's last (``Function.last_backward``;
with ``retain_graph`` every gradient gets a new array): each large gradient is written
over the array it is computed from, or one just read for the last time (dL/dh over h,
dL/dy over the merged heads, dL/dqkv over qkv, dL/dLN(x) over LN(x), the layer norm's
work over its xhat), and the residual's gradient is added in place, not by the engine
into a new array. Measured faster than op by op, and than fusing attention and MLP only
(``mpitrain/bench/README.md``).
"""

from __future__ import annotations

import numpy as np

from mpitrain import rng as _rng
from mpitrain.ops.attention import attend, attend_backward
from mpitrain.ops.elementwise import gelu_blocks, gelu_erf
from mpitrain.ops.linalg import affine
from mpitrain.ops.norm import layer_norm_rows, layer_norm_rows_backward
from mpitrain.tensor import Function, Tensor, as_tensor


class _Sublayer(Function):
    """Both sublayers: ``x + dropout(mid(LN(x) W_in + b_in) W_proj + b_proj)``, where a
    subclass supplies the middle, ``_middle`` (attention or GELU), its own settings last
    among the inputs, and its backward ``_middle_backward``."""

    def forward(self, x, ln_weight, ln_bias, w_in, b_in, w_proj, b_proj, eps, dropout_p, generator, *config):
        self.x_shape = x.shape
        u2, self.xhat, self.rstd = layer_norm_rows(x.reshape(-1, x.shape[-1]), ln_weight, ln_bias, eps)  # LN(x), (N, C)
        m2 = self._middle(affine(u2, w_in, b_in), dropout_p, generator, *config)  # (N, M)
        self.ln_weight, self.u2, self.m2, self.w_in, self.w_proj = ln_weight, u2, m2, w_in, w_proj
        out2 = affine(m2, w_proj, b_proj)  # the branch, (N, C)
        self.branch_keep = None
        if dropout_p > 0:
            self.branch_keep = _rng.dropout_mask(generator, out2.shape, dropout_p, out2.dtype)
            out2 *= self.branch_keep
        out2 += x.reshape(out2.shape)  # the residual
        return out2.reshape(x.shape)

    def backward(self, g):
        need = self.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])  # (N, C)
        if self.branch_keep is not None:
            g2 = g2 * self.branch_keep  # dL/d(branch), through dropout
        m2 = self.m2
        gw_proj = m2.T @ g2 if need[5] else None  # (M, C)
        gb_proj = g2.sum(axis=0) if need[6] else None
        gx = gln_w = gln_b = gw_in = gb_in = None
        if any(need[:5]):
            gm = self._work(m2)  # the middle's output was read for the last time just above
            np.matmul(g2, self.w_proj.T, out=gm)  # dL/d(middle output), (N, M)
            ga = self._middle_backward(gm)  # dL/d(LN(x) W_in + b_in), (N, H)
            gw_in = self.u2.T @ ga if need[3] else None  # (C, H)
            gb_in = ga.sum(axis=0) if need[4] else None
            if any(need[:3]):
                gu = self._work(self.u2)  # LN(x) was read for the last time just above
                np.matmul(ga, self.w_in.T, out=gu)  # dL/dLN(x), (N, C)
                gx, gln_w, gln_b = layer_norm_rows_backward(gu, self.xhat, self.rstd, self.ln_weight, need[:3],
                                                            out=gu, xhat_is_free=self.last_backward)
                if gx is not None:
                    gx += g.reshape(gx.shape)  # x reaches the output through the residual too
                    gx = gx.reshape(self.x_shape)
        return gx, gln_w, gln_b, gw_in, gb_in, gw_proj, gb_proj

    def _work(self, a):
        """``a`` itself when backward may write over it, else a new array like it."""
        return a if self.last_backward else np.empty_like(a)

    def _middle(self, a2, dropout_p, generator, *config):  # pragma: no cover - interface
        raise NotImplementedError

    def _middle_backward(self, gm):  # pragma: no cover - interface
        raise NotImplementedError


class AttentionSublayer(_Sublayer):
    """The middle is causal multi-head attention of ``qkv = a2`` (N, 3C)."""

    def _middle(self, a2, dropout_p, generator, n_head):
        B, T, _ = self.x_shape
        return attend(self, a2.reshape(B, T, -1), n_head, True, dropout_p, generator).reshape(B * T, -1)

    def _middle_backward(self, gy):
        gqkv = self._work(self.qkv)  # (B, T, 3C)
        attend_backward(self, gy, gqkv, dq_scratch=gy if self.last_backward else None)
        return gqkv.reshape(len(gy), -1)


class MLPSublayer(_Sublayer):
    """The middle is GELU, in place over the first product's output."""

    def _middle(self, h, dropout_p, generator, form="tanh"):
        need = any(self.needs_input_grad[:5])
        if form == "erf":  # the exact GELU, the same function as ops.gelu's
            h[...], self.d = gelu_erf(h, need)  # GELU(h) into h; GELU' (N, H) or None
            return h
        self.d = np.empty_like(h) if need else None  # GELU', (N, H)
        gelu_blocks(h.reshape(-1), h.reshape(-1), None if self.d is None else self.d.reshape(-1))
        return h

    def _middle_backward(self, gh):
        gh *= self.d  # gh is this node's own array
        return gh


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
    the attention weights and on the branch, masks drawn in that order from ``generator``
    (:func:`mpitrain.rng.dropout_mask`; the (B*T, C) branch mask is sample-major)."""
    x = _check(x, w_qkv, w_proj, "attention_sublayer")
    if w_qkv.shape[1] % (3 * n_head) or w_proj.shape[0] != w_qkv.shape[1] // 3:
        raise ValueError(f"attention_sublayer: w_qkv {w_qkv.shape} must be (C, 3C') with C' divisible "
                         f"by n_head={n_head}, and w_proj (C', C), got {w_proj.shape}")
    return AttentionSublayer.apply(x, ln_weight, ln_bias, w_qkv, b_qkv, w_proj, b_proj, float(eps),
                                   float(dropout_p), generator, n_head)


def mlp_sublayer(x, ln_weight, ln_bias, w_fc, b_fc, w_proj, b_proj, eps: float = 1e-5,
                 dropout_p: float = 0.0, generator=None, gelu: str = "tanh") -> Tensor:
    """``x + dropout(gelu(layer_norm(x) @ w_fc + b_fc) @ w_proj + b_proj)`` for ``x``
    (B, T, C), as one node; biases may be None; ``gelu`` is the GELU's form."""
    x = _check(x, w_fc, w_proj, "mlp_sublayer")
    if w_proj.shape[0] != w_fc.shape[1]:
        raise ValueError(f"mlp_sublayer: w_fc {w_fc.shape} and w_proj {w_proj.shape} do not chain")
    return MLPSublayer.apply(x, ln_weight, ln_bias, w_fc, b_fc, w_proj, b_proj, float(eps),
                             float(dropout_p), generator, gelu)
