"""Softmax, log-softmax and the fused softmax cross-entropy loss."""

from __future__ import annotations

import numpy as np

from mpitrain.tensor import Function, Tensor, as_tensor


class Softmax(Function):
    def forward(self, x, axis):
        self.axis = axis
        self.out = e = x - x.max(axis=axis, keepdims=True)  # shift by the max: exp never overflows
        np.exp(e, out=e)
        e /= e.sum(axis=axis, keepdims=True)
        return e

    def backward(self, g):
        y = self.out
        gx = g * y
        gx -= y * gx.sum(axis=self.axis, keepdims=True)  # y * (g - sum(g * y))
        return gx


class LogSoftmax(Function):
    def forward(self, x, axis):
        self.axis = axis
        self.out = shifted = x - x.max(axis=axis, keepdims=True)
        shifted -= np.log(np.exp(shifted).sum(axis=axis, keepdims=True))
        return shifted

    def backward(self, g):
        return g - np.exp(self.out) * g.sum(axis=self.axis, keepdims=True)


class CrossEntropy(Function):
    """-log softmax(logits)[target] over the counted targets, in one node: their mean, or
    with ``reduction="sum"`` their sum; the mean's gradient is ``(softmax - onehot) / count``.
    Targets equal to ``ignore_index`` contribute neither loss nor gradient. With
    ``smoothing`` = e the target is ``(1 - e) onehot + e / V`` (Szegedy et al. 2016, as
    PyTorch's ``label_smoothing``): a row's loss ``logsumexp - (1 - e) z[target] - e mean(z)``,
    its gradient ``softmax - target``."""

    def forward(self, logits, targets, ignore_index, reduction, smoothing=0.0):
        V = logits.shape[-1]
        z = logits.reshape(-1, V)  # (N, V)
        t = targets.reshape(-1)  # (N,)
        if t.shape[0] != z.shape[0]:
            raise ValueError(f"cross_entropy: {z.shape[0]} rows of logits but {t.shape[0]} targets")
        keep = t != ignore_index  # (N,)
        safe_t = np.where(keep, t, 0)
        if np.any((safe_t < 0) | (safe_t >= V)):
            raise IndexError(f"cross_entropy: target outside [0, {V})")
        zmax = z.max(axis=1, keepdims=True)  # (N, 1)
        p = z - zmax
        np.exp(p, out=p)
        total = p.sum(axis=1, keepdims=True)  # (N, 1)
        p /= total  # softmax, kept for backward
        rows = np.arange(z.shape[0])
        lse = (np.log(total) + zmax)[:, 0]  # (N,)
        nll = lse - z[rows, safe_t]  # logsumexp - z[target], (N,)
        if smoothing:
            nll = (1 - smoothing) * nll + smoothing * (lse - z.mean(axis=1))
        nll = np.where(keep, nll, 0)  # an ignored row adds nothing, even where its loss is not finite
        self.p, self.rows, self.t, self.keep, self.shape = p, rows, safe_t, keep, logits.shape
        self.smoothing = smoothing
        self.scale = 1.0 if reduction == "sum" else 1.0 / max(int(keep.sum()), 1)  # the mean over counted targets
        return np.asarray(nll.sum() * self.scale, dtype=logits.dtype)

    def backward(self, g):
        p = self.p.copy()
        p[self.rows, self.t] -= 1 - self.smoothing
        if self.smoothing:
            p -= self.smoothing / p.shape[1]
        p *= (self.keep * (self.scale * g))[:, None].astype(p.dtype)
        return p.reshape(self.shape)


def softmax(x, axis: int = -1) -> Tensor:
    return Softmax.apply(as_tensor(x), axis)


def log_softmax(x, axis: int = -1) -> Tensor:
    return LogSoftmax.apply(as_tensor(x), axis)


def cross_entropy(logits, targets, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """Softmax cross-entropy of ``logits`` (..., V) against integer ``targets`` (...), their
    one-hot rows smoothed by ``label_smoothing`` in [0, 1] (:class:`CrossEntropy`)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], not {label_smoothing!r}")
    targets = targets.data if isinstance(targets, Tensor) else np.asarray(targets)
    return CrossEntropy.apply(as_tensor(logits), targets, ignore_index, reduction, float(label_smoothing))
