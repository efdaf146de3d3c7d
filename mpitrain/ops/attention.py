"""Multi-head scaled dot-product self-attention as one fused node (Vaswani et al. 2017).

The input is the output of the query/key/value projection, ``qkv`` of shape
``(B, T, 3*C)`` laid out as ``[q | k | v]`` with each third split into ``n_head`` heads of
``hs = C / n_head`` features. The heads are strided views of that array, never copies,
and each head's output is written straight into its columns of ``(B, T, C)``.

    S = q k^T / sqrt(hs)            (B, nh, T, T), future keys set to -inf if causal
    P = softmax(S)                  dropout on P in training, if asked
    y = P v                         (B, nh, T, hs)

The backward pass is written as one function: ``dv = P^T dy``, ``dP = dy v^T``,
``dS = P * (dP - rowsum(dP * P))`` (softmax Jacobian; masked entries have P = 0 and so
get no gradient), ``dq = dS k / sqrt(hs)``, ``dk = dS^T q / sqrt(hs)``, written straight
into the head views of one ``dqkv`` array.

``self_attention`` is the whole sublayer as one node: the query/key/value projection,
attention, and the output projection (see :class:`SelfAttention` for why).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from mpitrain import rng as _rng
from mpitrain.tensor import Function, Tensor, as_tensor


@functools.lru_cache(maxsize=16)
def _causal_bias_t(T: int, dtype: np.dtype) -> np.ndarray:
    """(T, T) additive mask in key-major order [key j, query i]: -inf where j > i."""
    bias = np.zeros((T, T), dtype=dtype)
    bias[np.tril_indices(T, k=-1)] = -np.inf
    bias.flags.writeable = False
    return bias


@functools.lru_cache(maxsize=16)
def _ones_row(T: int, dtype: np.dtype) -> np.ndarray:
    ones = np.ones((1, T), dtype=dtype)
    ones.flags.writeable = False
    return ones


def _heads(a: np.ndarray, n_head: int) -> np.ndarray:
    """(B, T, 3C) -> (3, B, nh, T, hs) strided view."""
    B, T, C3 = a.shape
    return a.reshape(B, T, 3, n_head, C3 // (3 * n_head)).transpose(2, 0, 3, 1, 4)


def _t(a: np.ndarray) -> np.ndarray:
    return a.transpose(0, 1, 3, 2)


def _attend(fn, qkv, n_head, causal, dropout_p, generator) -> np.ndarray:
    """Attention of ``qkv`` (B, T, 3C); returns (B, T, C) with the heads merged, and
    keeps on ``fn`` what :func:`_attend_backward` needs."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = _heads(qkv, n_head)  # each (B, nh, T, hs)
    scale = 1.0 / math.sqrt(C // n_head)
    att = k @ np.multiply(_t(q), scale, order="C")  # St, (B, nh, T_key, T_query)
    if causal:
        att += _causal_bias_t(T, att.dtype)
    att -= att.max(axis=-2, keepdims=True)
    np.exp(att, out=att)
    inv = _ones_row(T, att.dtype) @ att  # column sums, (B, nh, 1, T_query)
    att *= np.reciprocal(inv, out=inv)  # a multiply is cheaper than a divide
    fn.keep = None
    probs = att
    if dropout_p > 0:
        fn.keep = _rng.dropout_mask(generator, att.shape, dropout_p, att.dtype)
        probs = att * fn.keep
    y = np.empty((B, T, n_head, C // n_head), dtype=qkv.dtype)  # heads merged, (B, T, nh, hs)
    np.matmul(_t(probs), v, out=y.transpose(0, 2, 1, 3))  # P v, each head into its columns
    fn.qkv, fn.n_head, fn.scale, fn.att, fn.probs = qkv, n_head, scale, att, probs
    return y.reshape(B, T, C)


def _attend_backward(fn, gy, gqkv, dq_scratch=None) -> None:
    """Gradients of attention's input into ``gqkv`` (B, T, 3C) from ``gy`` (B, T, C).

    ``gqkv`` may be the saved ``qkv`` itself; each of q, k and v is then overwritten
    only after its last read, and dq, whose slot ``q`` is read by dk, waits in
    ``dq_scratch`` (the (B, T, C) buffer of ``gy``, which is dead by then)."""
    B, T, C3 = gqkv.shape
    nh = fn.n_head
    q, k, v = _heads(fn.qkv, nh)
    gq, gk, gv = _heads(gqkv, nh)
    gy = gy.reshape(B, T, nh, C3 // (3 * nh)).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
    gatt = v @ np.multiply(_t(gy), fn.scale, order="C")  # dP^T / sqrt(hs), (B, nh, T_key, T_query)
    np.matmul(fn.probs, gy, out=gv)  # dv = P^T dy; v was read for the last time above
    if fn.keep is not None:
        gatt *= fn.keep
    att = fn.att
    gatt -= np.einsum("bhji,bhji->bhi", gatt, att)[:, :, None, :]
    gatt *= att  # dS^T / sqrt(hs): the scale of both dq and dk
    if dq_scratch is None:
        np.matmul(_t(gatt), k, out=gq)  # dq = dS k
        np.matmul(gatt, q, out=gk)  # dk = dS^T q
        return
    dq = dq_scratch.reshape(B, T, nh, -1).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
    np.matmul(_t(gatt), k, out=dq)  # dq = dS k
    np.matmul(gatt, q, out=gk)  # dk = dS^T q, over k
    np.copyto(gq, dq)  # over q, which dk has read


class CausalSelfAttention(Function):
    """Scores are kept key-major, ``St[b, h, j, i] = k_j . q_i``: the softmax then reduces
    over axis -2, which NumPy vectorises across queries (a reduction over the last,
    short axis runs row by row and is several times slower), and its sums are one GEMM
    with a row of ones. The right operand of the two products that contract over the
    head features (``k q^T`` and ``v dy^T``) is copied transposed, with the
    ``1/sqrt(hs)`` folded into the copy: OpenBLAS's small GEMMs run slowly with a
    transposed right operand (the scores of one benchmark block: 195 us from the view,
    152 us with the scaled copy included, 95 us with both operands contiguous), and the
    scale then costs no pass over the (T, T) scores."""

    def forward(self, qkv, n_head, causal, dropout_p, generator):
        return _attend(self, qkv, n_head, causal, dropout_p, generator)

    def backward(self, g):
        gqkv = np.empty(self.qkv.shape, dtype=g.dtype)
        _attend_backward(self, g, gqkv)
        return gqkv


class SelfAttention(Function):
    """The attention sublayer as one node: ``qkv = x W_qkv + b_qkv``, attention as
    above, ``y W_proj + b_proj``.

    Fused for the reason :class:`~mpitrain.ops.linalg.GeluMLP` is: ``qkv`` (N, 3C) and
    the merged heads ``y`` (N, C) are then private to this node, and backward writes
    its large gradients over them once they are read for the last time, while they are
    still in cache, instead of into fresh memory: ``dL/dy`` over ``y`` (after
    ``dW_proj = y^T dy``), and ``dL/dqkv`` over ``qkv`` (see ``_attend_backward``).
    Only when the engine says this is the node's last backward (``last_backward``).
    """

    def forward(self, x, w_qkv, b_qkv, w_proj, b_proj, n_head, causal, dropout_p, generator):
        B, T, C = x.shape
        x2 = x.reshape(-1, C)  # (N, C)
        qkv = x2 @ w_qkv  # (N, 3C)
        if b_qkv is not None:
            qkv += b_qkv
        y2 = _attend(self, qkv.reshape(B, T, -1), n_head, causal, dropout_p, generator).reshape(-1, C)
        out = y2 @ w_proj  # (N, C_out)
        if b_proj is not None:
            out += b_proj
        self.x2, self.y2, self.w_qkv, self.w_proj = x2, y2, w_qkv, w_proj
        return out.reshape(B, T, -1)

    def backward(self, g):
        need_x, need_wqkv, need_bqkv, need_wproj, need_bproj = self.needs_input_grad[:5]
        g2 = g.reshape(-1, g.shape[-1])  # (N, C_out)
        y2 = self.y2
        gw_proj = y2.T @ g2 if need_wproj else None  # (C, C_out)
        gb_proj = g2.sum(axis=0) if need_bproj else None
        gx = gw_qkv = gb_qkv = None
        if need_x or need_wqkv or need_bqkv:
            last = self.last_backward
            gy = y2 if last else np.empty_like(y2)  # y was read for the last time above
            np.matmul(g2, self.w_proj.T, out=gy)  # dL/dy, (N, C)
            gqkv = self.qkv if last else np.empty_like(self.qkv)  # (B, T, 3C)
            _attend_backward(self, gy, gqkv, dq_scratch=gy if last else None)
            gqkv2 = gqkv.reshape(len(g2), -1)  # (N, 3C)
            if need_x:
                gx = (gqkv2 @ self.w_qkv.T).reshape(self.qkv.shape[:2] + (-1,))
            if need_wqkv:
                gw_qkv = self.x2.T @ gqkv2  # (C, 3C)
            if need_bqkv:
                gb_qkv = gqkv2.sum(axis=0)
        return gx, gw_qkv, gb_qkv, gw_proj, gb_proj


def causal_self_attention(qkv, n_head: int, causal: bool = True, dropout_p: float = 0.0,
                          generator=None) -> Tensor:
    """Attention of ``qkv`` (B, T, 3C) with ``n_head`` heads; returns (B, T, C)."""
    qkv = as_tensor(qkv)
    if qkv.ndim != 3 or qkv.shape[-1] % (3 * n_head):
        raise ValueError(f"qkv must be (B, T, 3C) with C divisible by n_head={n_head}, got {qkv.shape}")
    generator = generator if generator is not None else _rng.generator()
    return CausalSelfAttention.apply(qkv, n_head, causal, float(dropout_p), generator)


def self_attention(x, w_qkv, b_qkv, w_proj, b_proj, n_head: int, causal: bool = True,
                   dropout_p: float = 0.0, generator=None) -> Tensor:
    """The attention sublayer of ``x`` (B, T, C): the query/key/value projection,
    :func:`causal_self_attention`, and the output projection; biases may be None."""
    x = as_tensor(x)
    if x.ndim != 3 or w_qkv.shape[-1] % (3 * n_head):
        raise ValueError(f"x must be (B, T, C) and w_qkv (C, 3C') with C' divisible by "
                         f"n_head={n_head}, got {x.shape} and {w_qkv.shape}")
    generator = generator if generator is not None else _rng.generator()
    return SelfAttention.apply(x, w_qkv, b_qkv, w_proj, b_proj, n_head, causal, float(dropout_p),
                               generator)
