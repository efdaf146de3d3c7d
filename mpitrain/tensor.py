"""Tensors on NumPy arrays, and the graph of operations they record.

A :class:`Tensor` wraps an ``np.ndarray``. Every differentiable operation is a
:class:`Function` with a hand-written ``forward`` and ``backward``; each call on tensors
that require gradients records one node, and the nodes form a directed acyclic graph
from the leaves (parameters, inputs) to the result. :mod:`mpitrain.autograd` walks that
graph backward (``loss.backward()`` calls it).

A node keeps only what its ``backward`` saved and, per input needing a gradient, an edge: the
leaf itself, or an :class:`_Edge` (an intermediate's producer, output index and shape, not
its array). An intermediate no backward needs (a residual add's input, the pre-activation
once GELU has its derivative) is thus freed as the forward pass moves on, its memory
reused, still in cache, by the next op (measured faster: ``mpitrain/bench/README.md``).
Saved arrays are references, not copies: writing into a parameter (an optimizer step,
loading weights) between a forward pass and its backward changes the gradients.

Default dtype is float32; :func:`default_dtype` switches to float64 for gradient checks.
Every op reads a float16 or bfloat16 tensor (mixed precision's working weights) upcast to
float32, and its gradient is rounded into a ``.grad`` of its own dtype.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from mpitrain.dtypes import is_half, upcast

_state = threading.local()


def is_grad_enabled() -> bool:
    """True unless inside :func:`no_grad` (per thread)."""
    return getattr(_state, "grad_enabled", True)


@contextlib.contextmanager
def _grad_mode(enabled: bool):
    previous = is_grad_enabled()
    _state.grad_enabled = enabled
    try:
        yield
    finally:
        _state.grad_enabled = previous


def no_grad():
    """Run operations without recording the graph (evaluation, optimizer updates)."""
    return _grad_mode(False)


def enable_grad():
    """Record the graph even inside :func:`no_grad` (activation checkpointing uses it)."""
    return _grad_mode(True)


_default_dtype = np.dtype(np.float32)


def get_default_dtype() -> np.dtype:
    """The floating dtype of new parameters and of tensors made from Python numbers."""
    return _default_dtype


def set_default_dtype(dtype) -> None:
    global _default_dtype
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"default dtype must be float32 or float64, not {dtype}")
    _default_dtype = dtype


@contextlib.contextmanager
def default_dtype(dtype):
    """``with default_dtype(np.float64): ...`` builds float64 models (gradient checks)."""
    previous = _default_dtype
    set_default_dtype(dtype)
    try:
        yield
    finally:
        set_default_dtype(previous)


class Tensor:
    """An ``np.ndarray`` with an optional gradient and the node that produced it."""

    __slots__ = ("data", "grad", "requires_grad", "_ctx", "_index", "_hooks", "name", "__weakref__")
    __array_priority__ = 100  # ndarray <op> Tensor defers to Tensor's reflected operator

    def __init__(self, data, requires_grad: bool = False, dtype=None, name: str | None = None):
        if isinstance(data, Tensor):
            data = data.data
        if dtype is not None:
            data = np.asarray(data, dtype=dtype)
        elif isinstance(data, np.generic):  # NumPy scalar (a full reduction): keep its dtype
            data = np.asarray(data)
        elif not isinstance(data, np.ndarray):
            data = np.asarray(data)
            if data.dtype.kind == "f":  # Python floats become the default dtype, not float64
                data = data.astype(_default_dtype)
        if requires_grad and not (data.dtype.kind == "f" or is_half(data.dtype)):
            raise TypeError(f"only floating tensors can require gradients, got {data.dtype}")
        self.data, self.requires_grad, self.name = data, bool(requires_grad), name
        self.grad: np.ndarray | None = None
        self._ctx: Function | None = None  # the node that produced it; None for a leaf
        self._index, self._hooks = 0, None  # which of its node's outputs; post-accumulate hooks

    # ----------------------------------------------------------------- properties
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    is_leaf = property(lambda self: self._ctx is None)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}{grad})"

    def numpy(self) -> np.ndarray:
        return self.data

    def item(self) -> float:
        return self.data.item()

    def detach(self) -> "Tensor":
        """The same data, cut from the graph."""
        return Tensor(self.data)

    # ------------------------------------------------------------------- autograd
    def backward(self, grad=None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad``; ``grad`` is the upstream
        gradient d(loss)/d(self), which only a single-element tensor may omit (then 1)."""
        from mpitrain.autograd import backward  # the engine builds on this module

        backward([self], None if grad is None else [grad], retain_graph=retain_graph)

    def retain_grad(self) -> None:
        """Keep this intermediate tensor's gradient in ``.grad`` after backward."""
        if self._ctx is None and not self.requires_grad:
            raise RuntimeError("retain_grad() on a tensor that does not require grad")
        if self._ctx is not None:  # a leaf keeps its gradient anyway
            self._ctx.retained[self._index] = self

    def register_post_accumulate_grad_hook(self, hook) -> None:
        """Call ``hook(tensor)`` once this leaf's ``.grad`` is complete in a backward pass:
        every use of the leaf in the graph has delivered its contribution. Hooks fire in the
        order gradients become final, for a sequential model the reverse of the forward
        order. A leaf in the graph that got no gradient this pass (its only consumers
        returned none) still fires, ``.grad`` as it was: a bucket waiting on it completes."""
        if self._ctx is not None:
            raise RuntimeError("post-accumulate hooks are for leaf tensors (parameters)")
        if not self.requires_grad:
            raise RuntimeError("hook on a tensor that does not require grad")
        self._hooks = [*(self._hooks or ()), hook]

    def zero_grad(self) -> None:
        if self.grad is not None:
            self.grad.fill(0)

    # --------------------------------------------------- operators (see mpitrain.ops)
    def __add__(self, other):
        return _ops.add(self, other)

    def __radd__(self, other):
        return _ops.add(other, self)

    def __sub__(self, other):
        return _ops.sub(self, other)

    def __rsub__(self, other):
        return _ops.sub(other, self)

    def __mul__(self, other):
        return _ops.mul(self, other)

    def __rmul__(self, other):
        return _ops.mul(other, self)

    def __truediv__(self, other):
        return _ops.div(self, other)

    def __rtruediv__(self, other):
        return _ops.div(other, self)

    def __neg__(self):
        return _ops.neg(self)

    def __pow__(self, exponent):
        return _ops.pow(self, exponent)

    def __rpow__(self, base):
        return _ops.pow(base, self)

    def __matmul__(self, other):
        return _ops.matmul(self, other)

    def __rmatmul__(self, other):
        return _ops.matmul(other, self)

    def __getitem__(self, index):
        return _ops.getitem(self, index)

    def sum(self, axis=None, keepdims=False):
        return _ops.sum(self, axis, keepdims)

    def mean(self, axis=None, keepdims=False):
        return _ops.mean(self, axis, keepdims)

    def max(self, axis=None, keepdims=False):
        return _ops.max(self, axis, keepdims)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return _ops.reshape(self, shape)

    def transpose(self, *axes):
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return _ops.transpose(self, axes or None)

    T = property(lambda self: _ops.transpose(self, None))

    def exp(self):
        return _ops.exp(self)

    def log(self):
        return _ops.log(self)

    def tanh(self):
        return _ops.tanh(self)

    def sigmoid(self):
        return _ops.sigmoid(self)

    def relu(self):
        return _ops.relu(self)


class Parameter(Tensor):
    """A leaf tensor that a :class:`~mpitrain.nn.Module` owns and an optimizer updates."""

    __slots__ = ()

    def __init__(self, data, name: str | None = None):
        data = np.array(data, dtype=data.dtype if isinstance(data, np.ndarray) else _default_dtype)
        super().__init__(data, requires_grad=True, name=name)

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"


_observers: list = []  # called with (function class, args, kwargs) before each op runs


@contextlib.contextmanager
def observe_ops(observer):
    """Call ``observer(cls, args, kwargs)`` for every op applied inside the block (FLOP
    counting, tracing); costs nothing when no observer is installed."""
    _observers.append(observer)
    try:
        yield observer
    finally:
        # by identity: observers may compare equal (two empty FLOP counters)
        del _observers[next(i for i, o in enumerate(_observers) if o is observer)]


def as_tensor(x) -> Tensor:
    return x if isinstance(x, Tensor) else Tensor(x)


class Function:
    """One recorded operation: subclass it and write ``forward`` and ``backward``.

    ``forward(*args, **kwargs)`` receives the positional inputs as arrays (tensors are
    unwrapped; other values, Python numbers or index arrays, pass through as constants)
    and returns an array, or a tuple of arrays for several outputs; it may keep on
    ``self`` whatever ``backward`` needs.

    ``backward(*grads)`` receives one gradient per output (``None`` for an output that got
    none) and returns one per positional input, of the input's shape (a tuple, or an array
    for one input), or ``None`` for constants and where ``self.needs_input_grad[i]`` is
    false. It must not write into the gradients it receives: one array may be shared by
    several consumers (``add`` hands the same gradient to both inputs).

    ``self.last_backward`` is true when the engine frees the node after this backward
    (no ``retain_graph``): ``backward`` may then write over arrays it saved in forward
    and has read for the last time, still in cache, instead of allocating cold memory
    (``ops.transformer`` does)."""

    last_backward = False

    @classmethod
    def apply(cls, *args, **kwargs):
        for observer in _observers:
            observer(cls, args, kwargs)
        fn = cls()
        arrays = [upcast(a.data) if isinstance(a, Tensor) else a for a in args]  # half computed in float32
        wanted = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        record = is_grad_enabled() and any(wanted)
        fn.needs_input_grad = wanted if record else (False,) * len(args)
        out = fn.forward(*arrays, **kwargs)
        several = isinstance(out, tuple)
        outs = out if several else (out,)
        tensors = tuple(Tensor(o, requires_grad=record) for o in outs)
        if record:
            fn.inputs = tuple((a if a._ctx is None else _Edge(a)) if needed else None
                              for a, needed in zip(args, wanted))
            fn.retained, fn.n_outputs = {}, len(outs)
            for i, t in enumerate(tensors):
                t._ctx, t._index = fn, i
        return tensors if several else tensors[0]

    def forward(self, *args, **kwargs):  # pragma: no cover - interface
        raise NotImplementedError

    def backward(self, *grads):  # pragma: no cover - interface
        raise NotImplementedError


class _Edge:
    """Where an intermediate input's gradient goes (producer, output index) and its shape."""

    __slots__ = ("_ctx", "_index", "shape")

    def __init__(self, t: Tensor):
        self._ctx, self._index, self.shape = t._ctx, t._index, t.shape


from mpitrain import ops as _ops  # noqa: E402  (ops build on Tensor; operators call them)
