"""2-D convolution and pooling on channels-last (NHWC) images.

Layout: images are ``(B, H, W, C)`` and convolution weights ``(kh, kw, C_in, C_out)``.
Channels-last suits im2col: one row of a ``kh x kw`` window is ``kw * C_in`` contiguous
numbers, so a strided view exposes all windows and one copy (moving runs of
``kw * C_in``) builds the ``(B*Ho*Wo, kh*kw*C_in)`` column matrix; a single GEMM with
the weight viewed as ``(kh*kw*C_in, C_out)`` then produces the output already in NHWC
order. The backward pass reuses the saved columns for the weight gradient (one GEMM)
and computes the column gradient tap by tap (one batched GEMM) so that col2im, adding
each tap's block back onto the pixels it read, moves long contiguous runs. Python loops
run over the kh*kw kernel taps, never over batch or pixels.

Cost, measured on this project's 2-core AVX-512 machine for the benchmark layer
(batch 64, 32x32x16 -> 32 channels, 3x3, 0.6 GFLOP per GEMM; one BLAS thread):
im2col copy 8 ms; forward GEMM 10-12 ms; weight-gradient GEMM 10-13 ms; tap-major
column-gradient GEMM 14-15 ms (its N = C_in = 16 is narrow for BLAS; the single
(N, kh*kw*C_in) GEMM takes 10 ms but its col2im, adding runs of only C_in numbers,
takes 16); adding the taps back 6 ms. The GEMMs run at 40-60 GFLOP/s against 140 for
a large square matmul: with 16-32 channels they are thin, and OpenBLAS spends a third
of their time packing the 38 MB column matrix. Processing the batch in cache-sized
blocks saved a further 7 ms per layer in a trial but is a loop over the batch, so it
is not done.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

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
    xp = np.empty((B, H + 2 * ph, W + 2 * pw, C), dtype=x.dtype)
    xp[:, ph : ph + H, pw : pw + W] = x
    xp[:, :ph] = value  # only the border is filled: no pass over the interior
    xp[:, ph + H :] = value
    xp[:, ph : ph + H, :pw] = value
    xp[:, ph : ph + H, pw + W :] = value
    return xp


def _clip(n_in: int, n_out: int, offset: int, s: int, p: int) -> tuple[int, int, int]:
    """Outputs o whose tap at ``offset`` reads an input pixel, o*s + offset - p in
    [0, n_in): returns (first o, how many, first input index)."""
    first = max(0, -(-(p - offset) // s))
    last = min(n_out - 1, (n_in - 1 + p - offset) // s)
    return first, max(0, last - first + 1), first * s + offset - p


def _scatter_taps(pieces, shape, dtype, kh, kw, sh, sw, ph, pw, Ho, Wo) -> np.ndarray:
    """Add each tap's (B, Ho, Wo, C) piece onto the input pixels the tap read.

    ``pieces(tap)`` returns the piece of tap ``i * kw + j``. The sum is taken straight
    into an unpadded (B, H, W, C) array, each tap clipped to the pixels inside the
    image. A tap that covers every pixel once (the centre tap of a stride-1 'same'
    convolution) is written first by assignment, so the array needs no zeroing."""
    B, H, W, C = shape
    regions = []
    for i in range(kh):
        oh, nh, h0 = _clip(H, Ho, i, sh, ph)
        for j in range(kw):
            ow, nw, w0 = _clip(W, Wo, j, sw, pw)
            if nh and nw:
                dst = (slice(None), slice(h0, h0 + sh * (nh - 1) + 1, sh),
                       slice(w0, w0 + sw * (nw - 1) + 1, sw))
                src = (slice(None), slice(oh, oh + nh), slice(ow, ow + nw))
                regions.append((i * kw + j, dst, src, nh == H and nw == W and sh == sw == 1))
    cover = next((r for r in regions if r[3]), None)
    gx = np.empty(shape, dtype=dtype) if cover else np.zeros(shape, dtype=dtype)
    if cover:
        np.copyto(gx, pieces(cover[0])[cover[2]])
    for tap, dst, src, _ in regions:
        if cover is None or tap != cover[0]:
            gx[dst] += pieces(tap)[src]
    return gx


def _windows(a: np.ndarray, Ho: int, n: int, sh: int, step: int, kh: int, kw: int) -> np.ndarray:
    """Strided view (B, Ho, n, kh, kw*C) of ``a`` (B, Hp, Wp, C):
    ``[b, ho, m, i, q] = a[b, ho*sh + i, m*step + q // C, q % C]``.

    A window row of kw pixels is kw*C contiguous numbers in channels-last memory, so
    copies and adds through this view move runs of kw*C elements, not C."""
    B, C = a.shape[0], a.shape[3]
    sb, srow, spix, sc = a.strides  # a may be a column slice of a wider array
    return as_strided(a, shape=(B, Ho, n, kh, kw * C),
                      strides=(sb, sh * srow, step * spix, srow, sc),
                      writeable=a.flags.writeable)


def _im2col(xp: np.ndarray, kh, kw, sh, sw, Ho, Wo) -> np.ndarray:
    """(N, kh*kw*C) column matrix, one row per output pixel, one copy."""
    B, C = xp.shape[0], xp.shape[3]
    cols = np.empty((B, Ho, Wo, kh, kw * C), dtype=xp.dtype)
    np.copyto(cols, _windows(xp, Ho, Wo, sh, sw, kh, kw))
    return cols.reshape(B * Ho * Wo, kh * kw * C)


def _taps(xp: np.ndarray, kh: int, kw: int, sh: int, sw: int, Ho: int, Wo: int):
    """Yield, tap by tap in row-major order, the (B, Ho, Wo, C) view of the pixels it reads."""
    for i in range(kh):
        for j in range(kw):
            yield xp[:, i : i + sh * (Ho - 1) + 1 : sh, j : j + sw * (Wo - 1) + 1 : sw]


class Conv2d(Function):
    """Convolution, optionally fused with a ReLU on its output (``relu=True``): the
    rectification runs in place on the GEMM's result instead of on a new array."""

    def forward(self, x, w, b=None, stride=(1, 1), padding=(0, 0), relu=False):
        B, H, W, C = x.shape
        kh, kw, wc, F = w.shape
        if wc != C:
            raise ValueError(f"conv2d: input has {C} channels, weight expects {wc}")
        (sh, sw), (ph, pw) = stride, padding
        Ho, Wo = _out_size(H, kh, sh, ph), _out_size(W, kw, sw, pw)
        xp = _pad(np.ascontiguousarray(x), ph, pw)  # (B, H+2ph, W+2pw, C)
        cols = _im2col(xp, kh, kw, sh, sw, Ho, Wo)  # (N, K)
        w2 = w.reshape(kh * kw * C, F)  # (K, F)
        out = cols @ w2  # (N, F)
        if b is not None:
            out += b
        if relu:
            np.maximum(out, 0, out=out)
        out = out.reshape(B, Ho, Wo, F)
        self.geometry = (x.shape, kh, kw, sh, sw, ph, pw, Ho, Wo)
        self.cols = cols if self.needs_input_grad[1] else None
        self.w2 = w2
        self.out = out if relu else None
        return out

    def backward(self, g):
        (xshape, kh, kw, sh, sw, ph, pw, Ho, Wo) = self.geometry
        B, H, W, C = xshape
        F = g.shape[-1]
        if self.out is not None:
            g = g * (self.out > 0)  # through the ReLU
        g2 = g.reshape(-1, F)  # (N, F)
        gx = gw = gb = None
        if self.needs_input_grad[1]:
            gw = (self.cols.T @ g2).reshape(kh, kw, C, F)
        if len(self.needs_input_grad) > 2 and self.needs_input_grad[2]:
            gb = (np.ones((1, g2.shape[0]), dtype=g2.dtype) @ g2)[0]  # column sums as a GEMV
        if self.needs_input_grad[0]:
            # column gradient tap-major: one (N, C) block per tap, so adding a tap's block
            # onto its pixels moves runs of Wo*C numbers (stride 1), not C
            w_taps = self.w2.reshape(kh * kw, C, F).transpose(0, 2, 1)  # (taps, F, C) view
            dcols = np.matmul(g2, w_taps).reshape(kh * kw, B, Ho, Wo, C)  # (taps, B, Ho, Wo, C)
            gx = _scatter_taps(lambda tap: dcols[tap], xshape, g.dtype, kh, kw, sh, sw, ph, pw, Ho, Wo)
        return gx, gw, gb


class MaxPool2d(Function):
    """Max over each window; the gradient goes to the first maximum in row-major window
    order (as in PyTorch), so ties never double-count. Forward is kh*kw - 1 elementwise
    maxima of strided views; backward recomputes which tap won from the saved input."""

    def forward(self, x, kernel, stride, padding):
        B, H, W, C = x.shape
        (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
        Ho, Wo = _out_size(H, kh, sh, ph), _out_size(W, kw, sw, pw)
        xp = _pad(x, ph, pw, -np.inf)
        taps = _taps(xp, kh, kw, sh, sw, Ho, Wo)
        out = next(taps).copy()  # (B, Ho, Wo, C)
        for view in taps:
            np.maximum(out, view, out=out)
        self.xp, self.out = xp, out
        self.geometry = (x.shape, kh, kw, sh, sw, ph, pw, Ho, Wo)
        return out

    def backward(self, g):
        (xshape, kh, kw, sh, sw, ph, pw, Ho, Wo) = self.geometry
        _, H, W, _ = xshape
        free = np.ones(self.out.shape, dtype=bool)  # windows whose maximum is still unclaimed
        won = []  # per tap: where it holds its window's first maximum, (B, Ho, Wo, C) bool
        for view in _taps(self.xp, kh, kw, sh, sw, Ho, Wo):
            hit = view == self.out
            hit &= free
            free &= ~hit
            won.append(hit)
        tiles = (ph == pw == 0 and (sh, sw) == (kh, kw) and (H, W) == (Ho * kh, Wo * kw))
        if tiles:  # windows tile the image: every pixel is written exactly once
            gx = np.empty(xshape, dtype=g.dtype)
            for target, hit in zip(_taps(gx, kh, kw, sh, sw, Ho, Wo), won):
                np.multiply(g, hit, out=target)
            return gx
        return _scatter_taps(lambda tap: g * won[tap], xshape, g.dtype, kh, kw, sh, sw, ph, pw, Ho, Wo)


class AvgPool2d(Function):
    """Mean over each window; padding counts as zeros in the mean (PyTorch's default)."""

    def forward(self, x, kernel, stride, padding):
        B, H, W, C = x.shape
        (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
        Ho, Wo = _out_size(H, kh, sh, ph), _out_size(W, kw, sw, pw)
        xp = _pad(x, ph, pw)
        out = np.zeros((B, Ho, Wo, C), dtype=x.dtype)
        for view in _taps(xp, kh, kw, sh, sw, Ho, Wo):
            out += view
        out /= kh * kw
        self.geometry = (x.shape, kh, kw, sh, sw, ph, pw, Ho, Wo)
        return out

    def backward(self, g):
        (xshape, kh, kw, sh, sw, ph, pw, Ho, Wo) = self.geometry
        share = g / (kh * kw)
        return _scatter_taps(lambda tap: share, xshape, g.dtype, kh, kw, sh, sw, ph, pw, Ho, Wo)


def conv2d(x, weight, bias=None, stride=1, padding=0, relu: bool = False) -> Tensor:
    """NHWC convolution: ``x`` (B, H, W, C_in), ``weight`` (kh, kw, C_in, C_out);
    ``relu=True`` applies max(0, .) to the result in the same node."""
    x = as_tensor(x)
    if x.ndim != 4:
        raise ValueError(f"conv2d expects (B, H, W, C) input, got shape {x.shape}")
    args = (x, weight) if bias is None else (x, weight, bias)
    return Conv2d.apply(*args, stride=_pair(stride), padding=_pair(padding), relu=relu)


def max_pool2d(x, kernel_size, stride=None, padding=0) -> Tensor:
    x = as_tensor(x)
    kernel, padding = _pair(kernel_size), _pair(padding)
    if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
        raise ValueError(f"max_pool2d: padding {padding} must be at most half the kernel {kernel}")
    return MaxPool2d.apply(x, kernel, _pair(kernel_size if stride is None else stride), padding)


def avg_pool2d(x, kernel_size, stride=None, padding=0) -> Tensor:
    x = as_tensor(x)
    stride = kernel_size if stride is None else stride
    return AvgPool2d.apply(x, _pair(kernel_size), _pair(stride), _pair(padding))
