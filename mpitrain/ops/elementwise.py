"""Elementwise operations with NumPy broadcasting.

Binary operations accept a tensor and either another tensor or a constant (a Python
number or an array); gradients of broadcast operands are summed back to their shape.
"""

from __future__ import annotations

import math

import numpy as np

from mpitrain.ops._util import BLOCK_ELEMENTS, blocks, constant, fast_paths_enabled, unbroadcast
from mpitrain.tensor import Function, Tensor, as_tensor


def _pair(a, b):
    if isinstance(a, Tensor):
        return a, constant(b, a)
    b = as_tensor(b)
    return constant(a, b), b


class Add(Function):
    def forward(self, a, b):
        self.shapes = (np.shape(a), np.shape(b))
        return a + b

    def backward(self, g):
        return (unbroadcast(g, self.shapes[0]) if self.needs_input_grad[0] else None,
                unbroadcast(g, self.shapes[1]) if self.needs_input_grad[1] else None)


class Sub(Function):
    def forward(self, a, b):
        self.shapes = (np.shape(a), np.shape(b))
        return a - b

    def backward(self, g):
        return (unbroadcast(g, self.shapes[0]) if self.needs_input_grad[0] else None,
                unbroadcast(-g, self.shapes[1]) if self.needs_input_grad[1] else None)


class Mul(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return a * b

    def backward(self, g):
        return (unbroadcast(g * self.b, np.shape(self.a)) if self.needs_input_grad[0] else None,
                unbroadcast(g * self.a, np.shape(self.b)) if self.needs_input_grad[1] else None)


class Div(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return a / b

    def backward(self, g):
        a, b = self.a, self.b
        ga = g / b
        gb = unbroadcast(-ga * a / b, np.shape(b)) if self.needs_input_grad[1] else None  # d(a/b)/db = -a/b^2
        return (unbroadcast(ga, np.shape(a)) if self.needs_input_grad[0] else None, gb)


class Neg(Function):
    def forward(self, a):
        return -a

    def backward(self, g):
        return -g


class Pow(Function):
    def forward(self, a, b):
        self.a, self.b, self.out = a, b, np.power(a, b)
        return self.out

    def backward(self, g):
        a, b, out = self.a, self.b, self.out
        ga = unbroadcast(g * b * np.power(a, b - 1), np.shape(a)) if self.needs_input_grad[0] else None
        if not self.needs_input_grad[1]:
            return ga, None
        log_a = np.log(np.asarray(a, dtype=out.dtype))  # a Python float would make float64
        return ga, unbroadcast(g * out * log_a, np.shape(b))


class Exp(Function):
    def forward(self, a):
        self.out = np.exp(a)
        return self.out

    def backward(self, g):
        return g * self.out


class Log(Function):
    def forward(self, a):
        self.a = a
        return np.log(a)

    def backward(self, g):
        return g / self.a


class Tanh(Function):
    def forward(self, a):
        self.out = np.tanh(a)
        return self.out

    def backward(self, g):
        d = self.out * self.out
        np.subtract(1, d, out=d)
        d *= g
        return d


class Sigmoid(Function):
    def forward(self, a):
        self.out = out = np.tanh(0.5 * a)  # 1/(1+exp(-a)) written through tanh: no overflow for large |a|
        out *= 0.5
        out += 0.5
        return out

    def backward(self, g):
        d = 1 - self.out
        d *= self.out
        d *= g
        return d


class ReLU(Function):
    def forward(self, a):
        self.out = np.maximum(a, 0)
        return self.out

    def backward(self, g):
        return g * (self.out > 0)


_GELU_S = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def gelu_plain(x: np.ndarray, derivative: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """GELU of ``x`` and its derivative (None unless ``derivative``), the textbook formula
    over the whole array (the plain path; see :class:`GELU`)::

        gelu(x)  = x * h,  h = 0.5 * (1 + tanh(s * (x + c x^3))),  s = sqrt(2/pi), c = 0.044715
        gelu'(x) = h + x * 2h(1 - h) * s * (1 + 3c x^2)           (1 - tanh^2 = 4h(1 - h))

    The grouping is the textbook formula rearranged so that :func:`gelu_blocks`'s in-place
    passes do the same floating-point operations in the same order: equal bit for bit."""
    x2 = x * x  # x^2
    h = 0.5 * np.tanh(x * (x2 * (_GELU_C * _GELU_S) + _GELU_S)) + 0.5  # 0.5 (1 + tanh(s (x + c x^3)))
    d = (1 - h) * h * ((x2 * (6 * _GELU_C * _GELU_S) + 2 * _GELU_S) * x) + h if derivative else None
    return x * h, d


def gelu_blocks(x: np.ndarray, out: np.ndarray, d: np.ndarray | None = None) -> None:
    """GELU of the flat array ``x`` into ``out`` (which may be ``x`` itself: each block
    is written last), and its derivative into ``d`` unless None; the fast path of
    :func:`gelu_plain`, equal to it bit for bit; see :class:`GELU`."""
    h = np.empty(min(x.size, BLOCK_ELEMENTS), dtype=x.dtype)  # one block's work arrays
    u = np.empty_like(h)
    for b in blocks(x.size):
        xb, hb, ub = x[b], h[: b.stop - b.start], u[: b.stop - b.start]
        np.square(xb, out=ub)
        np.multiply(ub, _GELU_C * _GELU_S, out=hb)
        hb += _GELU_S
        hb *= xb  # s (x + c x^3)
        np.tanh(hb, out=hb)
        hb *= 0.5
        hb += 0.5  # h
        if d is not None:
            db = d[b]
            ub *= 6 * _GELU_C * _GELU_S
            ub += 2 * _GELU_S
            ub *= xb  # 2 s x (1 + 3 c x^2)
            np.subtract(1, hb, out=db)
            db *= hb
            db *= ub
            db += hb
        np.multiply(xb, hb, out=out[b])


GELU_FORMS = ("tanh", "erf")
_SQRT_PI = math.sqrt(math.pi)
# erf's series terms and erfc's continued-fraction levels: against math.erf, 40 terms reach
# 1.3e-15 relative on [0, 2.5] and 30 levels 1.1e-16 absolute on [2.5, 6]; more change nothing
SERIES_TERMS, FRACTION_LEVELS = 40, 30

# the series' coefficients a_n = 2^n / (1 3 5 ... (2n+1)), a_0 = 1
_SERIES = np.cumprod([1.0] + [2 / (2 * n + 1) for n in range(1, SERIES_TERMS)])
# |x| < 1: Taylor's series, erf(x) = 2/sqrt(pi) x sum_n (-1)^n x^(2n) / (n! (2n+1)); 17
# terms leave less than 1e-16 (the next is below 1 / (17! 35))
_TAYLOR = np.array([(-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(17)])


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise, returned in ``x``'s dtype (NumPy has none),
    computed in float64: within 2e-15 of ``math.erf`` (tested). For ``|x| < 1`` Taylor's
    series; for ``1 <= |x| < 2.5`` the series of positive terms ``erf(x) = 2/sqrt(pi)
    exp(-x^2) x sum_n a_n x^(2n)`` (``_SERIES``; Abramowitz & Stegun 7.1.6), which has no
    cancellation. Both by Horner's rule, so no partial result is tiny (term by term, small
    x's terms fell into slow subnormals). For ``2.5 <= |x| < 6``, ``1 - erfc(x)`` with
    ``erfc(x) = exp(-x^2) / sqrt(pi) / (x + (1/2) / (x + 1 / (x + (3/2) / (x + ...))))``
    evaluated from its last level up (A&S 7.1.14); beyond, ``erfc < 2e-17``: +-1."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    out = np.ones_like(a)  # |x| >= 6 (and inf)
    near = a < 1
    out[near] = _horner(_TAYLOR, a[near]) * (2 / _SQRT_PI)
    small = ~near & (a < 2.5)
    xs = a[small]
    out[small] = np.exp(-xs * xs) * _horner(_SERIES, xs) * (2 / _SQRT_PI)
    mid = (a >= 2.5) & (a < 6)
    xm = a[mid]
    f = xm.copy()
    for k in range(FRACTION_LEVELS, 0, -1):
        f = xm + (k / 2) / f
    out[mid] = 1 - np.exp(-xm * xm) / (f * _SQRT_PI)
    out[np.isnan(a)] = np.nan
    return np.copysign(out, x).astype(np.result_type(x, np.float32), copy=False)


def _horner(coefficients: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``x sum_n c_n x^(2n)`` by Horner's rule in ``x^2``."""
    x2 = x * x
    p = np.full_like(x, coefficients[-1])
    for c in coefficients[-2::-1]:
        p *= x2
        p += c
    return p * x


def gelu_erf(x: np.ndarray, derivative: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """GELU, exact form (what nanoGPT and PyTorch's ``nn.GELU()`` use today): ``x Phi(x)``
    with ``Phi(x) = (1 + erf(x / sqrt 2)) / 2``; its derivative ``Phi(x) + x phi(x)``,
    ``phi(x) = exp(-x^2/2) / sqrt(2 pi)`` (None unless ``derivative``); the MLP op calls it too."""
    cdf = erf(x * (1 / math.sqrt(2))) * 0.5 + 0.5
    d = x * np.exp(x * x * -0.5) * (1 / math.sqrt(2 * math.pi)) + cdf if derivative else None
    return x * cdf, d


class GELU(Function):
    """GELU, tanh form (Hendrycks & Gimpel 2016; GPT-2's; :func:`gelu_plain` has the
    formula). Forward also computes the derivative when a gradient will be needed and keeps
    only it, not x and h: backward is one product (faster than recomputing it, nine passes:
    ``mpitrain/bench/README.md``). Fast paths off (``ops.fast_paths``): :func:`gelu_plain`,
    whole-array expressions; on: :func:`gelu_blocks`, the same arithmetic as in-place passes
    over blocks that stay in cache (``_util.blocks``), the derivative's seven in the same
    block as the value's eight. ``form="erf"``: the exact form (:func:`gelu_erf`), on both paths."""

    def forward(self, x, form="tanh"):
        need = self.needs_input_grad[0]
        if form == "erf" or not fast_paths_enabled():  # the exact form, or the plain path's whole-array tanh form
            y, self.d = (gelu_erf if form == "erf" else gelu_plain)(x, need)
            return y
        xf = np.ascontiguousarray(x).reshape(-1)  # (n,)
        y = np.empty_like(xf)
        self.d = np.empty_like(xf) if need else None  # dy/dx, (n,)
        gelu_blocks(xf, y, self.d)
        return y.reshape(x.shape)

    def backward(self, g):
        return np.multiply(self.d.reshape(g.shape), g)


def add(a, b) -> Tensor:
    return Add.apply(*_pair(a, b))


def sub(a, b) -> Tensor:
    return Sub.apply(*_pair(a, b))


def mul(a, b) -> Tensor:
    return Mul.apply(*_pair(a, b))


def div(a, b) -> Tensor:
    return Div.apply(*_pair(a, b))


def neg(a) -> Tensor:
    return Neg.apply(as_tensor(a))


def pow(a, b) -> Tensor:  # noqa: A001 - mirrors the operator name
    return Pow.apply(*_pair(a, b))


def exp(a) -> Tensor:
    return Exp.apply(as_tensor(a))


def log(a) -> Tensor:
    return Log.apply(as_tensor(a))


def tanh(a) -> Tensor:
    return Tanh.apply(as_tensor(a))


def sigmoid(a) -> Tensor:
    return Sigmoid.apply(as_tensor(a))


def relu(a) -> Tensor:
    return ReLU.apply(as_tensor(a))


def gelu(a, form: str = "tanh") -> Tensor:
    """GELU of ``a``: ``form`` "tanh" (GPT-2's approximation) or "erf" (exact)."""
    if form not in GELU_FORMS:
        raise ValueError(f"GELU form must be one of {GELU_FORMS}, got {form!r}")
    return GELU.apply(as_tensor(a), form)
