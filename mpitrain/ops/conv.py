"""2-D convolution and pooling on channels-last (NHWC) images: images are ``(B, H, W, C)``
and convolution weights ``(kh, kw, C_in, C_out)``.

The plain path (:class:`Conv2d`, the text to learn from) is im2col + one GEMM over the
whole batch, the output already in NHWC order. The fast path (:class:`TiledConv2d`,
chosen by ``ops.fast_paths``, the default) does the same products in another order and
layout. Channels-last suits im2col: one row of a window is ``kw * C_in`` contiguous
numbers, copied as one opaque element (:func:`_im2col`). Backward takes the column
gradient tap by tap (one batched GEMM), so that col2im moves long contiguous runs.

Tiles. Built for the whole batch at once, the column matrix of a 32x32x16 layer at
batch 64 is 38 MB: im2col writes it to memory and the GEMM, whose packing reads it
back, waits on memory. The fast path therefore walks the batch in tiles of whole images
whose columns fit a cache budget (``TILE_BYTES_PER_THREAD``): the GEMM reads columns
im2col has just written to cache, the column gradient is added back while in cache, and
backward rebuilds a tile's columns from the saved padded input (a copy from cache)
rather than keep 38 MB alive from forward to backward. No Python loop runs over single
pixels or positions. Tiles group the weight and bias gradients and the col2im sums
differently: the two paths agree to rounding, not bit for bit.

Winograd's F(2x2, 3x3), fewer multiplications but NumPy passes over strided 4x4 tiles,
lost to im2col, whose narrow backward GEMMs (``COLUMN_GRAD_BYTES``) set the floor. Each
part's cost: ``mpitrain/bench/README.md``.
"""

from __future__ import annotations

import functools

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from mpitrain.ops._util import blocks, fast_paths_enabled
from mpitrain.ops.linalg import affine
from mpitrain.tensor import Function, Tensor, as_tensor

# Column-matrix bytes per tile of images and per BLAS thread, so that with the tile's input
# and output each thread's share stays in its core's L2: the size measured fastest.
TILE_BYTES_PER_THREAD = 3 << 19
_blas_threads = 1
# Column-gradient bytes per sub-tile in backward: its nine N = C_in GEMMs run faster on
# one image (590 KB for the bench CNN's 32x32x16 layer) than on a whole tile of two.
COLUMN_GRAD_BYTES = 1 << 19
# Input bytes per tile of images for max-pooling (no BLAS): with the tile's output,
# masks and gradient it stays in L2 while every tap of the window is visited.
POOL_TILE_BYTES = 1 << 19


def set_blas_threads(n: int) -> int:
    """Size tiles for GEMMs on ``n`` BLAS threads (``runtime.limit_blas_threads`` calls this); returns the previous."""
    global _blas_threads
    previous, _blas_threads = _blas_threads, max(1, int(n))
    return previous


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


@functools.lru_cache(maxsize=64)
def _tap_regions(H, W, kh, kw, sh, sw, ph, pw, Ho, Wo) -> tuple:
    """Where each tap's piece lands in an (H, W) image, once per geometry: ``(cover,
    others)``, each entry ``(tap, input region, piece region, covers every pixel)``.
    ``cover`` is the tap that reads every pixel once (the centre tap of a stride-1 'same'
    convolution) or None; ``others`` are the remaining taps that read any pixel."""
    regions = []
    for i in range(kh):
        oh, nh, h0 = _clip(H, Ho, i, sh, ph)
        for j in range(kw):
            ow, nw, w0 = _clip(W, Wo, j, sw, pw)
            if nh and nw:
                dst = (slice(None), slice(h0, h0 + sh * (nh - 1) + 1, sh), slice(w0, w0 + sw * (nw - 1) + 1, sw))
                src = (slice(None), slice(oh, oh + nh), slice(ow, ow + nw))
                regions.append((i * kw + j, dst, src, nh == H and nw == W and sh == sw == 1))
    cover = next((r for r in regions if r[3]), None)
    return cover, tuple(r for r in regions if r is not cover)


def _scatter_taps(pieces, gx, kh, kw, sh, sw, ph, pw, Ho, Wo) -> np.ndarray:
    """Set ``gx`` (B, H, W, C) to the sum of each tap's (B, Ho, Wo, C) piece, ``pieces(tap)``
    for tap ``i * kw + j``, added onto the input pixels the tap read; returns ``gx``. Each
    tap is clipped to the pixels inside the image, so no padded array is built. A tap that
    covers every pixel once is written first by assignment, so ``gx`` needs no zeroing."""
    _, H, W, _ = gx.shape
    cover, others = _tap_regions(H, W, kh, kw, sh, sw, ph, pw, Ho, Wo)
    if cover:
        np.copyto(gx, pieces(cover[0])[cover[2]])
    else:
        gx.fill(0)
    for tap, dst, src, _ in others:
        gx[dst] += pieces(tap)[src]
    return gx


def _im2col(xp: np.ndarray, kh, kw, sh, sw, Ho, Wo, work: np.ndarray) -> np.ndarray:
    """(n*Ho*Wo, kh*kw*C) column matrix of ``xp`` (n, Hp, Wp, C), one row per output
    pixel, in one copy into the front of ``work`` (flat, of xp's dtype, reused by every tile so
    that one tile's columns are alive at a time, not two while the next is built):
    ``cols[b, ho, wo, i, q] = xp[b, ho*sh + i, wo*sw + q // C, q % C]``.
    A window row (kw*C contiguous numbers) moves as one opaque element of kw*C*itemsize
    bytes, so NumPy's inner loop runs along output pixels rather than along the 48 (or,
    for RGB input, 9) numbers of one row: faster than copying the view number by number."""
    n, _, _, C = xp.shape
    xp = np.ascontiguousarray(xp)  # a buffer for the view below
    row = np.dtype((np.void, kw * C * xp.itemsize))
    sb, srow, spix, _ = xp.strides
    windows = np.ndarray((n, Ho, Wo, kh), dtype=row, buffer=xp, strides=(sb, sh * srow, sw * spix, srow))
    cols = work[: n * Ho * Wo * kh * kw * C].reshape(n, Ho, Wo, kh, kw * C)
    np.copyto(cols.view(row).reshape(n, Ho, Wo, kh), windows)
    return cols.reshape(n * Ho * Wo, kh * kw * C)


def _columns_work(tiles: list, Ho: int, Wo: int, K: int, dtype) -> np.ndarray:
    """One flat work array for the largest tile's column matrix (the first tile's)."""
    return np.empty((tiles[0].stop - tiles[0].start) * Ho * Wo * K if tiles else 0, dtype=dtype)


def _taps(xp: np.ndarray, kh: int, kw: int, sh: int, sw: int, Ho: int, Wo: int):
    """Yield, tap by tap in row-major order, the (B, Ho, Wo, C) view of the pixels it reads."""
    for i in range(kh):
        for j in range(kw):
            yield xp[:, i : i + sh * (Ho - 1) + 1 : sh, j : j + sw * (Wo - 1) + 1 : sw]


def tile_images(image_bytes: int, threads: int | None = None) -> int:
    """Images per tile: as many whole images as fit the tile budget of ``threads`` BLAS
    threads (default: the threads set now) with ``image_bytes`` of columns each (one at least).
    The planner times a convolution's products at this many images' rows (``plan/shapes.py``)."""
    return max(1, TILE_BYTES_PER_THREAD * (threads or _blas_threads) // max(1, image_bytes))


def _tiles(batch: int, image_bytes: int) -> list[slice]:
    """Consecutive slices of whole images whose column matrix stays within the tile budget."""
    return blocks(batch, tile_images(image_bytes))


class Conv2d(Function):
    """The plain path: convolution as im2col + one GEMM over the whole batch, ``relu=True``
    fusing a ReLU on its output::

        cols = im2col(pad(x))       (B*Ho*Wo, kh*kw*C_in), one row per output pixel
        y    = cols @ w2 + b        (B*Ho*Wo, C_out), w2 = w viewed (kh*kw*C_in, C_out)
        dw2  = cols^T @ dy          db = dy summed over rows
        dx   = col2im(dy @ w2^T)    each tap's columns added onto the pixels it read
    """

    def forward(self, x, w, b=None, stride=(1, 1), padding=(0, 0), relu=False):
        B, H, W, C = x.shape
        kh, kw, _, F = w.shape
        (sh, sw), (ph, pw) = stride, padding
        Ho, Wo = _out_size(H, kh, sh, ph), _out_size(W, kw, sw, pw)
        xp = np.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0)))  # (B, H+2ph, W+2pw, C)
        windows = sliding_window_view(xp, (kh, kw), axis=(1, 2))[:, ::sh, ::sw]  # (B, Ho, Wo, C, kh, kw) view
        cols = windows.transpose(0, 1, 2, 4, 5, 3).reshape(B * Ho * Wo, kh * kw * C)  # a copy, (rows, K)
        w2 = w.reshape(kh * kw * C, F)  # (K, F)
        out = affine(cols, w2, b)  # (rows, F)
        if relu:
            np.maximum(out, 0, out=out)
        self.geometry = (x.shape, kh, kw, sh, sw, ph, pw, Ho, Wo)
        self.cols = cols if self.needs_input_grad[1] else None
        self.w2, self.out = w2, (out if relu else None)
        return out.reshape(B, Ho, Wo, F)

    def backward(self, g):
        (xshape, kh, kw, sh, sw, ph, pw, Ho, Wo) = self.geometry
        B, H, W, C = xshape
        need = self.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])  # (rows, F)
        if self.out is not None:
            g2 = g2 * (self.out > 0)  # through the ReLU
        gw = (self.cols.T @ g2).reshape(kh, kw, C, -1) if need[1] else None  # (kh, kw, C, F)
        gb = g2.sum(axis=0) if len(need) > 2 and need[2] else None  # (F,)
        gx = None
        if need[0]:
            dcols = (g2 @ self.w2.T).reshape(B, Ho, Wo, kh * kw, C)  # column gradient (rows, K), per tap
            gxp = np.zeros((B, H + 2 * ph, W + 2 * pw, C), dtype=dcols.dtype)  # padded input gradient
            for tap, view in enumerate(_taps(gxp, kh, kw, sh, sw, Ho, Wo)):
                view += dcols[:, :, :, tap]  # col2im: (B, Ho, Wo, C) onto the pixels the tap read
            gx = gxp[:, ph : ph + H, pw : pw + W]  # un-padded, (B, H, W, C)
        return gx, gw, gb


class TiledConv2d(Function):
    """The fast path: :class:`Conv2d` in tiles of whole images (the module docstring says
    why); ``relu=True`` rectifies in place on the GEMM's result, not on a new array."""

    def forward(self, x, w, b=None, stride=(1, 1), padding=(0, 0), relu=False):
        B, H, W, C = x.shape
        kh, kw, _, F = w.shape
        (sh, sw), (ph, pw) = stride, padding
        Ho, Wo = _out_size(H, kh, sh, ph), _out_size(W, kw, sw, pw)
        xp = _pad(np.ascontiguousarray(x), ph, pw)  # (B, H+2ph, W+2pw, C)
        w2 = w.reshape(kh * kw * C, F)  # (K, F)
        out = np.empty((B, Ho, Wo, F), dtype=np.result_type(x, w))
        tiles = _tiles(B, Ho * Wo * kh * kw * C * xp.itemsize)
        # the bias repeated along an output row: adding it to (rows, Wo*F) runs NumPy's
        # inner loop over Wo*F numbers instead of F, faster for narrow F (bench/README.md)
        b_row = None if b is None else np.tile(b, Wo)  # (Wo*F,)
        work = _columns_work(tiles, Ho, Wo, kh * kw * C, xp.dtype)
        for tile in tiles:
            cols = _im2col(xp[tile], kh, kw, sh, sw, Ho, Wo, work)  # (n*Ho*Wo, K)
            o = out[tile].reshape(-1, F)  # (n*Ho*Wo, F) view into out
            np.matmul(cols, w2, out=o)
            if b_row is not None:
                rows = o.reshape(-1, Wo * F)  # (n*Ho, Wo*F) view
                rows += b_row
            if relu:
                np.maximum(o, 0, out=o)
        self.geometry = (x.shape, kh, kw, sh, sw, ph, pw, Ho, Wo)
        self.xp = xp if self.needs_input_grad[1] else None
        self.tiles, self.w2, self.out = tiles, w2, (out if relu else None)
        return out

    def backward(self, g):
        (xshape, kh, kw, sh, sw, ph, pw, Ho, Wo) = self.geometry
        C, F = xshape[3], g.shape[-1]
        need_x, need_w = self.needs_input_grad[0], self.needs_input_grad[1]
        need_b = len(self.needs_input_grad) > 2 and self.needs_input_grad[2]
        gx = np.empty(xshape, dtype=g.dtype) if need_x else None
        gw = np.zeros_like(self.w2) if need_w else None  # (K, F)
        gb = np.zeros(F, dtype=g.dtype) if need_b else None
        rows = (self.tiles[0].stop - self.tiles[0].start) * Ho * Wo if self.tiles else 0  # of a tile
        ones = np.ones(rows, dtype=g.dtype) if need_b else None  # (rows,)
        through_relu = None if self.out is None else np.empty(rows * F, g.dtype)  # (rows*F,)
        if need_x:
            # column gradient tap-major, so adding a tap's block onto its pixels moves runs of
            # Wo*C numbers (stride 1), not C; in sub-tiles of COLUMN_GRAD_BYTES, one work array
            w_taps = np.ascontiguousarray(self.w2.reshape(kh * kw, C, F).transpose(0, 2, 1))  # (taps, F, C)
            per_image = kh * kw * Ho * Wo * C * g.itemsize
            sub = max(1, min(rows // (Ho * Wo), COLUMN_GRAD_BYTES // per_image))  # images
            dcols = np.empty((kh * kw, sub * Ho * Wo, C), g.dtype)  # (taps, sub*Ho*Wo, C)
        work = _columns_work(self.tiles, Ho, Wo, kh * kw * C, self.xp.dtype) if need_w else None
        for tile in self.tiles:
            g2 = g[tile].reshape(-1, F)  # (n*Ho*Wo, F)
            if through_relu is not None:  # one work array reused by every tile
                g2 = np.multiply(g2, self.out[tile].reshape(-1, F) > 0,
                                 out=through_relu[: g2.size].reshape(g2.shape))
            if need_w:
                gw += _im2col(self.xp[tile], kh, kw, sh, sw, Ho, Wo, work).T @ g2
            if need_b:
                gb += ones[: g2.shape[0]] @ g2  # column sums as a GEMV
            if need_x:
                gxt = gx[tile]
                for s in blocks(tile.stop - tile.start, sub):
                    part = np.matmul(g2[s.start * Ho * Wo : s.stop * Ho * Wo], w_taps,
                                     out=dcols[:, : (s.stop - s.start) * Ho * Wo])
                    pieces = part.reshape(kh * kw, -1, Ho, Wo, C).__getitem__  # tap -> (n, Ho, Wo, C)
                    _scatter_taps(pieces, gxt[s], kh, kw, sh, sw, ph, pw, Ho, Wo)
        return gx, (None if gw is None else gw.reshape(kh, kw, C, F)), gb


class MaxPool2d(Function):
    """Max over each window; the gradient goes to the first maximum in row-major window
    order (as in PyTorch), so ties never double-count. Forward is kh*kw - 1 elementwise
    maxima of strided views; backward recomputes which tap won from the saved input. Both
    walk the batch in tiles of ``POOL_TILE_BYTES`` (one tile with the fast paths off).

    ``relu=True`` also takes the maximum with 0: ReLU and max-pooling commute (both are
    monotone), so ``conv -> pool(relu=True)`` equals ``conv(relu=True) -> pool`` in value
    and gradient, rectifying a quarter of the values and saving no mask of the conv's output."""

    def forward(self, x, kernel, stride, padding, relu):
        B, H, W, C = x.shape
        (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
        Ho, Wo = _out_size(H, kh, sh, ph), _out_size(W, kw, sw, pw)
        xp = _pad(x, ph, pw, -np.inf)
        out = np.empty((B, Ho, Wo, C), dtype=x.dtype)
        tile = max(1, POOL_TILE_BYTES // (xp[:1].nbytes or 1)) if fast_paths_enabled() else B
        self.tiles = blocks(B, tile)
        for t in self.tiles:
            o = out[t]  # (b, Ho, Wo, C)
            taps = _taps(xp[t], kh, kw, sh, sw, Ho, Wo)
            first = next(taps)
            if relu:
                np.maximum(first, 0, out=o)
            else:
                np.copyto(o, first)
            for view in taps:
                np.maximum(o, view, out=o)
        self.xp, self.out, self.relu = xp, out, relu
        self.geometry = (x.shape, kh, kw, sh, sw, ph, pw, Ho, Wo)
        return out

    def backward(self, g):
        (xshape, kh, kw, sh, sw, ph, pw, Ho, Wo) = self.geometry
        _, H, W, _ = xshape
        gx = np.empty(xshape, dtype=g.dtype)
        exact = (ph == pw == 0 and (sh, sw) == (kh, kw) and (H, W) == (Ho * kh, Wo * kw))
        for t in self.tiles:
            winners = self._first_maxima(t, kh, kw, sh, sw, Ho, Wo)
            gt = g[t]  # (b, Ho, Wo, C)
            if exact:  # windows tile the image: every pixel is written exactly once
                for target, hit in zip(_taps(gx[t], kh, kw, sh, sw, Ho, Wo), winners):
                    np.multiply(gt, hit, out=target)
            else:
                won = list(winners)
                _scatter_taps(lambda tap, gt=gt, won=won: gt * won[tap], gx[t], kh, kw, sh, sw, ph, pw, Ho, Wo)
        return gx

    def _first_maxima(self, t: slice, kh, kw, sh, sw, Ho, Wo):
        """Yield, tap by tap in row-major order, where the tap holds its window's first
        maximum in the images ``t``: a (b, Ho, Wo, C) bool array per tap."""
        # windows whose maximum is still unclaimed (None: all); a rectified 0 has none
        out = self.out[t]
        free = out > 0 if self.relu else None
        taps = list(_taps(self.xp[t], kh, kw, sh, sw, Ho, Wo))
        for k, view in enumerate(taps):
            hit = view == out
            if free is not None:
                hit &= free
            if k + 1 < len(taps):
                free = ~hit if free is None else np.logical_xor(free, hit, out=free)  # hit <= free
            yield hit


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
        return _scatter_taps(lambda tap: share, np.empty(xshape, dtype=g.dtype), kh, kw, sh, sw, ph, pw, Ho, Wo)


def conv2d(x, weight, bias=None, stride=1, padding=0, relu: bool = False) -> Tensor:
    """NHWC convolution: ``x`` (B, H, W, C_in), ``weight`` (kh, kw, C_in, C_out); ``relu=True`` rectifies the
    result in the same node. In tiles (``TiledConv2d``) with the fast paths on, else whole (``Conv2d``)."""
    x = as_tensor(x)
    if x.ndim != 4:
        raise ValueError(f"conv2d expects (B, H, W, C) input, got shape {x.shape}")
    if weight.shape[2] != x.shape[3]:
        raise ValueError(f"conv2d: input has {x.shape[3]} channels, weight expects {weight.shape[2]}")
    args = (x, weight) if bias is None else (x, weight, bias)
    op = TiledConv2d if fast_paths_enabled() else Conv2d
    return op.apply(*args, stride=_pair(stride), padding=_pair(padding), relu=relu)


def max_pool2d(x, kernel_size, stride=None, padding=0, relu: bool = False) -> Tensor:
    """Max-pooling of ``x`` (B, H, W, C); ``relu=True`` rectifies the result in the same node (ReLU commutes)."""
    x = as_tensor(x)
    kernel, padding = _pair(kernel_size), _pair(padding)
    if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
        raise ValueError(f"max_pool2d: padding {padding} must be at most half the kernel {kernel}")
    return MaxPool2d.apply(x, kernel, _pair(kernel_size if stride is None else stride), padding, relu)


def avg_pool2d(x, kernel_size, stride=None, padding=0) -> Tensor:
    stride = kernel_size if stride is None else stride
    return AvgPool2d.apply(as_tensor(x), _pair(kernel_size), _pair(stride), _pair(padding))
