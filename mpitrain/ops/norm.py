"""Normalisations: batch norm (Ioffe & Szegedy 2015) and layer norm (Ba et al. 2016).

Both normalise ``xhat = (x - mean) / sqrt(var + eps)`` and apply a per-feature scale and
shift; they differ in which axes the statistics run over. The backward pass is the
closed form, with ``dxhat = g * weight`` and ``m`` elements per statistic:

    dx = (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) / sqrt(var + eps)
"""

from __future__ import annotations

import numpy as np

from mpitrain.ops._util import cached_full
from mpitrain.tensor import Function, Tensor, as_tensor


def _dot_per_channel(a2: np.ndarray, b2: np.ndarray) -> np.ndarray:
    """The sum over the rows of a2 * b2, per column: (m, C) x2 -> (C,)."""
    return np.einsum("nc,nc->c", a2, b2)


def _column_sums(a2: np.ndarray) -> np.ndarray:
    """(m, C) -> (C,): the sum of each column, as a GEMV with ones."""
    return (cached_full((1, a2.shape[0]), 1.0, a2.dtype) @ a2)[0]


class BatchNorm(Function):
    """Normalise over every axis but the last (channels-last), e.g. (B, H, W, C) or (B, C).
    Training mode uses the batch statistics and updates ``running_mean`` and
    ``running_var`` in place (``running = (1 - momentum) * running + momentum * batch``,
    with the unbiased batch variance, as PyTorch does); eval mode uses the running ones.
    Every pass runs on the input viewed as (m, C), whose column sums are GEMVs with a
    vector of ones, as in :class:`LayerNorm`: several times faster than NumPy's reduction
    over the leading axes."""

    def forward(self, x, weight, bias, running_mean, running_var, training, momentum, eps):
        x2 = x.reshape(-1, x.shape[-1])  # (m, C)
        if training:
            m = x2.shape[0]
            if m < 2:
                raise ValueError(f"batch_norm in training mode needs more than one value per "
                                 f"channel, got input of shape {x.shape}")
            mean = _column_sums(x2) / m  # (C,)
            xc = x2 - mean  # (m, C)
            var = _dot_per_channel(xc, xc) / m  # biased variance, (C,)
            if running_mean is not None:
                running_mean *= 1 - momentum
                running_mean += momentum * mean
                running_var *= 1 - momentum
                running_var += momentum * var * (m / max(m - 1, 1))
        else:
            mean, var = running_mean, running_var
            xc = x2 - mean
        rstd = 1.0 / np.sqrt(var + eps)  # (C,)
        xhat = xc
        xhat *= rstd
        self.training, self.xhat, self.rstd, self.weight = training, xhat, rstd, weight
        y = np.multiply(xhat, weight)  # (m, C)
        y += bias
        return y.reshape(x.shape)

    def backward(self, g):
        xhat, rstd = self.xhat, self.rstd  # (m, C), (C,)
        g2 = g.reshape(xhat.shape)  # (m, C)
        gw = _dot_per_channel(g2, xhat) if self.needs_input_grad[1] else None
        gb = _column_sums(g2) if self.needs_input_grad[2] else None
        gx = None
        if self.needs_input_grad[0]:
            scale = self.weight * rstd  # (C,)
            if self.training:
                m = xhat.shape[0]
                sum_g = gb if gb is not None else _column_sums(g2)
                sum_gxhat = gw if gw is not None else _dot_per_channel(g2, xhat)
                gx = xhat * (sum_gxhat / m)
                np.subtract(g2, gx, out=gx)
                gx -= sum_g / m
                gx *= scale
            else:
                gx = g2 * scale  # statistics are constants in eval mode
            gx = gx.reshape(g.shape)
        return gx, gw, gb


def layer_norm_rows(x2, weight, bias, eps):
    """Layer norm of the rows of ``x2`` (N, C): returns ``(y, xhat, rstd)``, the output
    (a new array), the normalised input and 1/sqrt(var + eps) (N,), for backward."""
    C = x2.shape[1]
    xhat = x2 - x2 @ cached_full((C, 1), 1.0 / C, x2.dtype)  # x - mean, (N, C)
    var = np.einsum("nc,nc->n", xhat, xhat)  # C * variance, (N,)
    var /= C
    var += eps
    rstd = 1.0 / np.sqrt(var, out=var)  # (N,)
    xhat *= rstd[:, None]
    y = xhat * weight
    if bias is not None:
        y += bias
    return y, xhat, rstd


def layer_norm_rows_backward(g2, xhat, rstd, weight, need, out=None, xhat_is_free=False):
    """``(gx, gw, gb)`` of :func:`layer_norm_rows` from the output gradient ``g2`` (N, C),
    each None unless ``need`` (three flags) asks for it. ``gx`` is computed in ``out`` (it
    may be ``g2``) or a new array; with ``xhat_is_free``, ``xhat`` serves as work space."""
    N, C = xhat.shape
    gw = np.einsum("nc,nc->c", g2, xhat) if need[1] else None
    gb = (cached_full((N, 1), 1.0, g2.dtype).T @ g2)[0] if need[2] else None
    gx = None
    if need[0]:
        gx = np.multiply(g2, weight, out=out)  # dxhat, (N, C)
        mean_d = gx @ cached_full((C, 1), 1.0 / C, gx.dtype)  # (N, 1)
        mean_dx = np.einsum("nc,nc->n", gx, xhat)  # (N,)
        mean_dx /= C
        gx -= np.multiply(xhat, mean_dx[:, None], out=xhat if xhat_is_free else None)
        gx -= mean_d
        gx *= rstd[:, None]
    return gx, gw, gb


class LayerNorm(Function):
    """Normalise over the last axis; ``weight`` and ``bias`` (optional) have its length.
    Row sums are GEMVs with a vector of ones (BLAS is several times faster than NumPy's
    reduction over a short last axis) and row dot products are ``einsum``."""

    def forward(self, x, weight, bias, eps):
        y, self.xhat, self.rstd = layer_norm_rows(x.reshape(-1, x.shape[-1]), weight, bias, eps)
        self.weight = weight
        return y.reshape(x.shape)

    def backward(self, g):
        g2 = g.reshape(self.xhat.shape)  # (N, C)
        gx, gw, gb = layer_norm_rows_backward(g2, self.xhat, self.rstd, self.weight, self.needs_input_grad,
                                              xhat_is_free=self.last_backward)
        return (None if gx is None else gx.reshape(g.shape)), gw, gb


def batch_norm(x, weight, bias, running_mean=None, running_var=None, training=True, momentum=0.1, eps=1e-5) -> Tensor:
    if not training and running_mean is None:
        raise ValueError("batch_norm in eval mode needs running statistics")
    return BatchNorm.apply(as_tensor(x), weight, bias, running_mean, running_var, training, momentum, eps)


def layer_norm(x, weight, bias=None, eps=1e-5) -> Tensor:
    return LayerNorm.apply(as_tensor(x), weight, bias, eps)
