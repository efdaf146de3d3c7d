"""2-D convolution and pooling on channels-last (NHWC) images.

Layout: images are ``(B, H, W, C)`` and convolution weights ``(kh, kw, C_in, C_out)``.
Channels-last makes im2col one copy: ``sliding_window_view`` exposes every
``kh x kw`` window as a strided view, one transposing copy turns it into the
``(B*Ho*Wo, kh*kw*C_in)`` column matrix, and a single GEMM with the weight viewed as
``(kh*kw*C_in, C_out)`` produces the output already in NHWC order. The backward pass
reuses the saved columns for the weight gradient (one GEMM) and scatters the column
gradient back to pixels with one strided add per kernel tap (col2im): the Python loop
runs over the kh*kw taps, never over batch or pixels.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from mpitrain.tensor import Function, Tensor, as_tensor


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _out_size(n: int, k: int, s: int, p: int) -> int:
    out = (n + 2 * p - k) // s + 1
    if out < 1:
        raise ValueError(f"window {k} with padding {p} does not fit an input of size {n}")
    return out


def _pad(x: np.ndarray, ph: int, pw: int, value: float = 0.0) -> np.ndarray:
    if ph == 0 and pw == 0:
        return x
    B, H, W, C = x.shape
    xp = np.full((B, H + 2 * ph, W + 2 * pw, C), value, dtype=x.dtype)
    xp[:, ph : ph + H, pw : pw + W] = x
    return xp


def _taps(xp: np.ndarray, kh: int, kw: int, sh: int, sw: int, Ho: int, Wo: int):
    """Yield (i, j, view) for each kernel tap: the (B, Ho, Wo, C) pixels it reads."""
    for i in range(kh):
        for j in range(kw):
            yield i, j, xp[:, i : i + sh * (Ho - 1) + 1 : sh, j : j + sw * (Wo - 1) + 1 : sw]


class Conv2d(Function):
    def forward(self, x, w, b=None, stride=(1, 1), padding=(0, 0)):
        B, H, W, C = x.shape
        kh, kw, wc, F = w.shape
        if wc != C:
            raise ValueError(f"conv2d: input has {C} channels, weight expects {wc}")
        (sh, sw), (ph, pw) = stride, padding
        Ho, Wo = _out_size(H, kh, sh, ph), _out_size(W, kw, sw, pw)
        xp = _pad(x, ph, pw)  # (B, H+2ph, W+2pw, C)
        win = sliding_window_view(xp, (kh, kw), axis=(1, 2))[:, ::sh, ::sw]  # (B, Ho, Wo, C, kh, kw)
        cols = np.empty((B, Ho, Wo, kh, kw, C), dtype=x.dtype)
        np.copyto(cols, win.transpose(0, 1, 2, 4, 5, 3))
        cols = cols.reshape(B * Ho * Wo, kh * kw * C)  # (N, K) im2col
        w2 = w.reshape(kh * kw * C, F)  # (K, F)
        out = cols @ w2  # (N, F)
        if b is not None:
            out += b
        self.geometry = (x.shape, xp.shape, kh, kw, sh, sw, ph, pw, Ho, Wo)
        self.cols = cols if self.needs_input_grad[1] else None
        self.w2 = w2
        return out.reshape(B, Ho, Wo, F)

    def backward(self, g):
        (xshape, xpshape, kh, kw, sh, sw, ph, pw, Ho, Wo) = self.geometry
        B, H, W, C = xshape
        F = g.shape[-1]
        g2 = g.reshape(-1, F)  # (N, F)
        gx = gw = gb = None
        if self.needs_input_grad[1]:
            gw = (self.cols.T @ g2).reshape(kh, kw, C, F)
        if len(self.needs_input_grad) > 2 and self.needs_input_grad[2]:
            gb = g2.sum(axis=0)
        if self.needs_input_grad[0]:
            dcols = (g2 @ self.w2.T).reshape(B, Ho, Wo, kh, kw, C)
            gxp = np.zeros(xpshape, dtype=g.dtype)
            for i, j, view in _taps(gxp, kh, kw, sh, sw, Ho, Wo):
                view += dcols[:, :, :, i, j, :]
            gx = gxp[:, ph : ph + H, pw : pw + W] if (ph or pw) else gxp
        return gx, gw, gb


class MaxPool2d(Function):
    """Max over each window; the gradient goes to the first maximum in row-major window
    order (as in PyTorch), so ties never double-count."""

    def forward(self, x, kernel, stride, padding):
        B, H, W, C = x.shape
        (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
        Ho, Wo = _out_size(H, kh, sh, ph), _out_size(W, kw, sw, pw)
        xp = _pad(x, ph, pw, -np.inf)
        taps = _taps(xp, kh, kw, sh, sw, Ho, Wo)
        out = next(taps)[2].copy()  # (B, Ho, Wo, C)
        arg = np.zeros(out.shape, dtype=np.int16)  # which tap holds the max
        for i, j, view in taps:
            better = view > out  # strictly greater: the first maximum wins
            np.copyto(out, view, where=better)
            np.putmask(arg, better, i * kw + j)
        self.arg = arg
        self.geometry = (x.shape, xp.shape, kh, kw, sh, sw, ph, pw, Ho, Wo)
        return out

    def backward(self, g):
        (xshape, xpshape, kh, kw, sh, sw, ph, pw, Ho, Wo) = self.geometry
        B, H, W, C = xshape
        gxp = np.zeros(xpshape, dtype=g.dtype)
        for i, j, view in _taps(gxp, kh, kw, sh, sw, Ho, Wo):
            view += g * (self.arg == i * kw + j)
        return gxp[:, ph : ph + H, pw : pw + W] if (ph or pw) else gxp


class AvgPool2d(Function):
    """Mean over each window; padding counts as zeros in the mean (PyTorch's default)."""

    def forward(self, x, kernel, stride, padding):
        B, H, W, C = x.shape
        (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
        Ho, Wo = _out_size(H, kh, sh, ph), _out_size(W, kw, sw, pw)
        xp = _pad(x, ph, pw)
        out = np.zeros((B, Ho, Wo, C), dtype=x.dtype)
        for _, _, view in _taps(xp, kh, kw, sh, sw, Ho, Wo):
            out += view
        out /= kh * kw
        self.geometry = (x.shape, xp.shape, kh, kw, sh, sw, ph, pw, Ho, Wo)
        return out

    def backward(self, g):
        (xshape, xpshape, kh, kw, sh, sw, ph, pw, Ho, Wo) = self.geometry
        B, H, W, C = xshape
        share = g / (kh * kw)
        gxp = np.zeros(xpshape, dtype=g.dtype)
        for _, _, view in _taps(gxp, kh, kw, sh, sw, Ho, Wo):
            view += share
        return gxp[:, ph : ph + H, pw : pw + W] if (ph or pw) else gxp


def conv2d(x, weight, bias=None, stride=1, padding=0) -> Tensor:
    """NHWC convolution: ``x`` (B, H, W, C_in), ``weight`` (kh, kw, C_in, C_out)."""
    x = as_tensor(x)
    if x.ndim != 4:
        raise ValueError(f"conv2d expects (B, H, W, C) input, got shape {x.shape}")
    args = (x, weight) if bias is None else (x, weight, bias)
    return Conv2d.apply(*args, stride=_pair(stride), padding=_pair(padding))


def max_pool2d(x, kernel_size, stride=None, padding=0) -> Tensor:
    x = as_tensor(x)
    stride = kernel_size if stride is None else stride
    return MaxPool2d.apply(x, _pair(kernel_size), _pair(stride), _pair(padding))


def avg_pool2d(x, kernel_size, stride=None, padding=0) -> Tensor:
    x = as_tensor(x)
    stride = kernel_size if stride is None else stride
    return AvgPool2d.apply(x, _pair(kernel_size), _pair(stride), _pair(padding))
