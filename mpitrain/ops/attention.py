"""Multi-head scaled dot-product self-attention as one fused node (Vaswani et al. 2017).

The input is the output of the query/key/value projection, ``qkv`` of shape
``(B, T, 3*C)`` laid out as ``[q | k | v]`` with each third split into ``n_head`` heads of
``hs = C / n_head`` features. The heads are strided views of that array, never copies,
and each head's output is written straight into its columns of ``(B, T, C)``.

    S = q k^T / sqrt(hs)            (B, nh, T, T), future keys set to -inf if causal
    P = softmax(S)                  dropout on P in training, if asked
    y = P v                         (B, nh, T, hs)

Backward is one function (:func:`attend_backward`): ``dv = P^T dy``, ``dP = dy v^T``,
``dS = P * (dP - rowsum(dP * P))`` (softmax Jacobian; masked entries have P = 0 and so
get no gradient), ``dq = dS k / sqrt(hs)``, ``dk = dS^T q / sqrt(hs)``, written straight
into the head views of one ``dqkv`` array (``qkv`` itself in ``ops.transformer``).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from mpitrain import rng as _rng
from mpitrain.ops._util import cached_full
from mpitrain.tensor import Function, Tensor, as_tensor


@functools.lru_cache(maxsize=16)
def _causal_bias_t(T: int, dtype: np.dtype) -> np.ndarray:
    """(T, T) additive mask in key-major order [key j, query i]: -inf where j > i."""
    bias = np.zeros((T, T), dtype=dtype)
    bias[np.tril_indices(T, k=-1)] = -np.inf
    bias.flags.writeable = False
    return bias


def _heads(a: np.ndarray, n_head: int) -> np.ndarray:
    """(B, T, 3C) -> (3, B, nh, T, hs) strided view."""
    B, T, C3 = a.shape
    return a.reshape(B, T, 3, n_head, C3 // (3 * n_head)).transpose(2, 0, 3, 1, 4)


def _t(a: np.ndarray) -> np.ndarray:
    return a.transpose(0, 1, 3, 2)


def attend(fn, qkv, n_head, causal, dropout_p, generator, heads=None) -> np.ndarray:
    """Attention of ``qkv`` (B, T, 3C); returns (B, T, C) with the heads merged, and keeps
    on ``fn`` what :func:`attend_backward` needs; ``heads`` as :func:`causal_self_attention`'s."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = _heads(qkv, n_head)  # each (B, nh, T, hs)
    scale = 1.0 / math.sqrt(C // n_head)
    att = k @ np.multiply(_t(q), scale, order="C")  # St, (B, nh, T_key, T_query)
    if causal:
        att += _causal_bias_t(T, att.dtype)
    att -= att.max(axis=-2, keepdims=True)
    np.exp(att, out=att)
    inv = cached_full((1, T), 1.0, att.dtype) @ att  # column sums, (B, nh, 1, T_query)
    att *= np.reciprocal(inv, out=inv)  # a multiply is cheaper than a divide
    fn.keep = None
    if dropout_p > 0 and heads is None:
        fn.keep = _rng.dropout_mask(generator, att.shape, dropout_p, att.dtype)
    elif dropout_p > 0:  # the whole layer's mask, (B, total, T, T), then these heads'
        whole = _rng.dropout_mask(generator, (B, heads[1], T, T), dropout_p, att.dtype)
        fn.keep = np.ascontiguousarray(whole[:, heads[0] : heads[0] + n_head])
    probs = att if fn.keep is None else att * fn.keep
    y = np.empty((B, T, n_head, C // n_head), dtype=qkv.dtype)  # heads merged, (B, T, nh, hs)
    np.matmul(_t(probs), v, out=y.transpose(0, 2, 1, 3))  # P v, each head into its columns
    fn.qkv, fn.n_head, fn.scale, fn.att, fn.probs = qkv, n_head, scale, att, probs
    return y.reshape(B, T, C)


def attend_backward(fn, gy, gqkv, dq_scratch=None) -> None:
    """Gradients of attention's input into ``gqkv`` (B, T, 3C) from ``gy`` (B, T, C).
    ``gqkv`` may be the saved ``qkv`` itself: each of q, k and v is then overwritten only
    after its last read, and dq (dk reads slot ``q``) waits in ``dq_scratch``, gy's dead buffer."""
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
    dq = gq if dq_scratch is None else dq_scratch.reshape(B, T, nh, -1).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
    np.matmul(_t(gatt), k, out=dq)  # dq = dS k
    np.matmul(gatt, q, out=gk)  # dk = dS^T q (over k where gqkv is qkv)
    if dq is not gq:
        np.copyto(gq, dq)  # over q, which dk has read


class CausalSelfAttention(Function):
    """Scores are kept key-major, ``St[b, h, j, i] = k_j . q_i``: the softmax then reduces
    over axis -2, which NumPy vectorises across queries (over the last, short axis it runs
    row by row, several times slower), and its sums are one GEMM with a row of ones. The
    right operand of ``k q^T`` and ``v dy^T`` (contracting over the head features) is
    copied transposed with ``1/sqrt(hs)`` folded in: OpenBLAS's small GEMMs run slowly with
    a transposed right operand (copy included, measured faster: ``mpitrain/bench/README.md``),
    and the scale costs no pass over the (T, T) scores."""

    def forward(self, qkv, n_head, causal, dropout_p, generator, heads=None):
        return attend(self, qkv, n_head, causal, dropout_p, generator, heads)

    def backward(self, g):
        gqkv = np.empty(self.qkv.shape, dtype=g.dtype)
        attend_backward(self, g, gqkv)
        return gqkv


def causal_self_attention(qkv, n_head: int, causal: bool = True, dropout_p: float = 0.0,
                          generator=None, heads: tuple | None = None) -> Tensor:
    """Attention of ``qkv`` (B, T, 3C) with ``n_head`` heads, (B, T, C); dropout on its weights
    draws from ``generator`` (:func:`mpitrain.rng.dropout_mask`). ``heads = (first, total)``:
    heads ``first ..`` of a layer of ``total`` sliced over ranks, masked as in the whole layer."""
    qkv = as_tensor(qkv)
    if qkv.ndim != 3 or qkv.shape[-1] % (3 * n_head):
        raise ValueError(f"qkv must be (B, T, 3C) with C divisible by n_head={n_head}, got {qkv.shape}")
    return CausalSelfAttention.apply(qkv, n_head, causal, float(dropout_p), generator, heads)
