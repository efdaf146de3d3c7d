"""Tensors and reverse-mode automatic differentiation on NumPy arrays.

A :class:`Tensor` wraps an ``np.ndarray``. Every differentiable operation is a
:class:`Function` subclass with a hand-written ``forward`` (arrays in, array out) and
``backward`` (gradient of the output in, gradients of the inputs out). Calling an
operation on tensors that require gradients records one ``Function`` node per call;
the nodes form a directed acyclic graph from the leaves (parameters, inputs) to the
result.

:func:`backward` walks that graph once in reverse topological order, so every node's
backward runs exactly once, after all gradients of its outputs have been summed. That
ordering is what makes the three services later modules rely on possible:

* an explicit upstream gradient (``y.backward(dy)``): a pipeline stage receives
  ``dy`` from the next rank instead of starting from a scalar loss;
* gradients of tensors that are not parameters: a leaf created with
  ``requires_grad=True`` (a stage's received activation) gets ``.grad`` like a
  parameter, and :meth:`Tensor.retain_grad` keeps the gradient of an intermediate;
  :func:`grad` returns gradients without touching ``.grad`` at all;
* post-accumulate hooks on leaves: before the walk, the engine counts how many graph
  edges lead into each leaf; when the last of them has delivered its gradient, the
  leaf's ``.grad`` is final for this pass and its hooks fire. Data parallelism starts
  a bucket's allreduce from there, while backward continues on earlier layers.

Gradients accumulate: ``.grad`` of a leaf is summed in place across backward passes
until ``zero_grad``. In-place accumulation keeps ``.grad`` the same array, so a
``.grad`` that is a view into a flat buffer stays one. Every gradient handed out
(``.grad``, :func:`grad`'s results) is the tensor's own array, never shared.

A node keeps only what its ``backward`` saved and, for each input that needs a
gradient, an edge: the leaf tensor itself, or for an intermediate an :class:`_Edge`
naming its producer, output index and shape, not its array. An intermediate that no
backward needs (the input of a residual add, the pre-activation once GELU has its
derivative) is therefore freed as soon as the forward pass moves on; in the GPT that
is 3 MB per block less kept for backward, and the allocator hands the freed memory,
still in cache, to the next op (measured, ten pairs of processes: 72.1 -> 70.2 ms
median per GPT training step of ``mpitrain bench step``).

Saved arrays are references, not copies. Writing into a parameter (an optimizer step,
loading new weights) between a forward pass and its backward pass therefore changes
the gradients: update parameters only after backward.

Default dtype is float32; :func:`default_dtype` switches to float64 for gradient checks.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

_state = threading.local()


def is_grad_enabled() -> bool:
    """True unless inside :func:`no_grad` (per thread)."""
    return getattr(_state, "grad_enabled", True)


@contextlib.contextmanager
def no_grad():
    """Run operations without recording the graph (evaluation, optimizer updates)."""
    previous = is_grad_enabled()
    _state.grad_enabled = False
    try:
        yield
    finally:
        _state.grad_enabled = previous


@contextlib.contextmanager
def enable_grad():
    """Record the graph even inside :func:`no_grad` (activation checkpointing uses it)."""
    previous = is_grad_enabled()
    _state.grad_enabled = True
    try:
        yield
    finally:
        _state.grad_enabled = previous


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
        if requires_grad and data.dtype.kind != "f":
            raise TypeError(f"only floating tensors can require gradients, got {data.dtype}")
        self.data = data
        self.grad: np.ndarray | None = None
        self.requires_grad = bool(requires_grad)
        self._ctx: Function | None = None
        self._index = 0
        self._hooks: list | None = None
        self.name = name

    # ----------------------------------------------------------------- properties
    @property
    def shape(self) -> tuple:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def is_leaf(self) -> bool:
        return self._ctx is None

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
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad``.

        ``grad`` is the upstream gradient d(loss)/d(self); it may be omitted only for a
        single-element tensor (then it is 1).
        """
        backward([self], None if grad is None else [grad], retain_graph=retain_graph)

    def retain_grad(self) -> None:
        """Keep this intermediate tensor's gradient in ``.grad`` after backward."""
        if self._ctx is None:
            if not self.requires_grad:
                raise RuntimeError("retain_grad() on a tensor that does not require grad")
            return
        self._ctx.retained[self._index] = self

    def register_post_accumulate_grad_hook(self, hook) -> None:
        """Call ``hook(tensor)`` once this leaf's ``.grad`` is complete in a backward pass.

        Complete means every use of the leaf in the graph has delivered its
        contribution; hooks fire in the order gradients become final, which for a
        sequential model is the reverse of the forward order. A leaf that is in the
        graph but got no gradient this pass (its only consumers returned none) still
        fires, with ``.grad`` as it was: a bucket waiting on it always completes.
        """
        if self._ctx is not None:
            raise RuntimeError("post-accumulate hooks are for leaf tensors (parameters)")
        if not self.requires_grad:
            raise RuntimeError("hook on a tensor that does not require grad")
        if self._hooks is None:
            self._hooks = []
        self._hooks.append(hook)

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

    @property
    def T(self):
        return _ops.transpose(self, None)

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
    unwrapped; other values such as Python numbers or index arrays pass through as
    constants) and returns an array, or a tuple of arrays for several outputs. It may
    keep whatever ``backward`` needs on ``self``.

    ``backward(*grads)`` receives one gradient per output (``None`` for an output that
    got none) and returns one gradient per positional input (a tuple, or a single array
    for one input); entries for constants, or where ``self.needs_input_grad[i]`` is
    false, may be ``None``. Each returned gradient has the input's shape. ``backward``
    must not write into the gradients it receives: one array may be shared by several
    consumers (``add`` hands the same gradient to both inputs).

    ``self.last_backward`` is true when the engine frees the node after this backward
    (no ``retain_graph``): ``backward`` may then write over the arrays it saved in
    forward and has read for the last time, which are still in cache, instead of
    allocating cold memory (``ops.transformer`` does).
    """

    last_backward = False

    @classmethod
    def apply(cls, *args, **kwargs):
        for observer in _observers:
            observer(cls, args, kwargs)
        fn = cls()
        arrays = [a.data if isinstance(a, Tensor) else a for a in args]
        record = is_grad_enabled() and any(
            isinstance(a, Tensor) and a.requires_grad for a in args
        )
        if record:
            fn.needs_input_grad = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        else:
            fn.needs_input_grad = (False,) * len(args)
        out = fn.forward(*arrays, **kwargs)
        several = isinstance(out, tuple)
        outs = out if several else (out,)
        tensors = tuple(Tensor(o, requires_grad=record) for o in outs)
        if record:
            fn.inputs = tuple(
                (a if a._ctx is None else _Edge(a)) if needed else None
                for a, needed in zip(args, fn.needs_input_grad)
            )
            fn.retained = {}
            fn.n_outputs = len(outs)
            for i, t in enumerate(tensors):
                t._ctx = fn
                t._index = i
        return tensors if several else tensors[0]

    def forward(self, *args, **kwargs):  # pragma: no cover - interface
        raise NotImplementedError

    def backward(self, *grads):  # pragma: no cover - interface
        raise NotImplementedError


class _Edge:
    """The link from a node to an intermediate input: where its gradient goes (the
    producing node and output index) and the shape it must have, without the array."""

    __slots__ = ("_ctx", "_index", "shape")

    def __init__(self, t: Tensor):
        self._ctx, self._index, self.shape = t._ctx, t._index, t.shape


def _accumulate(current, g):
    # out of place: the same gradient array may be handed to several inputs (add)
    return g if current is None else current + g


def _owned(g: np.ndarray, dtype) -> np.ndarray:
    """A private copy of a gradient before it is handed to the user: arrays flowing
    through the graph may be shared, read-only broadcast views, or the caller's own.
    C order even when ``g`` is a transposed view (a transpose's backward), so
    optimizers and flat buffers see the parameter's own layout."""
    return np.array(g, dtype=dtype, copy=True, order="C")


def _graph(roots: list[Tensor]):
    """Nodes reachable from ``roots`` in reverse topological order, and leaf use counts."""
    order: list[Function] = []
    visited: set[int] = set()
    leaf_uses: dict[int, int] = {}
    stack = [(t._ctx, False) for t in roots if t._ctx is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        if not hasattr(node, "inputs"):
            raise RuntimeError(
                "backward through a graph that was already freed; "
                "pass retain_graph=True to the first backward"
            )
        stack.append((node, True))
        for t, needed in zip(node.inputs, node.needs_input_grad):
            if not needed:
                continue
            if t._ctx is None:
                leaf_uses[id(t)] = leaf_uses.get(id(t), 0) + 1
            elif id(t._ctx) not in visited:
                stack.append((t._ctx, False))
    order.reverse()
    return order, leaf_uses


def _run(roots, grads, retain_graph: bool, capture: dict | None):
    """The backward engine shared by :func:`backward` and :func:`grad`."""
    if len(grads) != len(roots):
        raise ValueError(f"{len(roots)} tensors but {len(grads)} gradients")
    order, leaf_uses = _graph(roots)
    pending: dict[int, list] = {}  # id(node) -> gradients of its outputs

    def deliver(t: Tensor, g, source: str):
        if g is not None and g.shape != t.shape:
            raise RuntimeError(f"{source} gave a gradient of shape {g.shape} "
                               f"for a tensor of shape {t.shape}")
        if t._ctx is not None:
            slot = pending.setdefault(id(t._ctx), [None] * t._ctx.n_outputs)
            slot[t._index] = _accumulate(slot[t._index], g)
            return
        key = id(t)
        if capture is not None:
            if key in capture and g is not None:
                current = capture[key]
                capture[key] = _owned(g, t.dtype) if current is None else current + g
        elif g is not None:
            if t.grad is None:
                t.grad = _owned(g, t.data.dtype)
            else:
                t.grad += g
        leaf_uses[key] -= 1
        if leaf_uses[key] == 0 and capture is None and t._hooks:
            for hook in t._hooks:
                hook(t)

    for t, g in zip(roots, grads):
        if isinstance(g, Tensor):
            g = g.data
        if not t.requires_grad:
            raise RuntimeError("backward from a tensor that does not require grad")
        g = np.asarray(g, dtype=t.data.dtype)
        if t._ctx is None:
            leaf_uses[id(t)] = leaf_uses.get(id(t), 0) + 1
        deliver(t, g, "the upstream gradient")

    for node in order:
        out_grads = pending.pop(id(node), None) or [None] * node.n_outputs
        for i, t in node.retained.items():
            g = out_grads[i]
            if g is None:
                continue
            if capture is not None:
                if id(t) in capture:
                    capture[id(t)] = _owned(g, t.dtype)
            else:
                t.grad = _owned(g, t.dtype) if t.grad is None else t.grad + g
        if all(g is None for g in out_grads):
            in_grads = (None,) * len(node.inputs)
        else:
            node.last_backward = not retain_graph
            in_grads = node.backward(*out_grads)
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
        source = f"{type(node).__name__}.backward"
        for t, needed, g in zip(node.inputs, node.needs_input_grad, in_grads):
            if needed:
                deliver(t, g, source)
        if not retain_graph:
            node.__dict__.clear()  # frees saved activations; the node can't run again


def backward(tensors, grads=None, retain_graph: bool = False) -> None:
    """Backpropagate from several tensors at once (``grads``: one upstream gradient each)."""
    tensors = list(tensors)
    if grads is None:
        grads = []
        for t in tensors:
            if t.size != 1:
                raise RuntimeError(
                    f"backward() without a gradient needs a one-element tensor, got shape {t.shape}"
                )
            grads.append(np.ones(t.shape, dtype=t.dtype))
    _run(tensors, list(grads), retain_graph, None)


def grad(outputs, inputs, grad_outputs=None, retain_graph: bool = False) -> list:
    """Gradients of ``outputs`` with respect to ``inputs``, leaving every ``.grad`` alone.

    ``inputs`` may be leaves or intermediates (an intermediate's gradient is taken when
    its producing node runs). Inputs that the outputs do not depend on get ``None``.
    """
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    inputs = list(inputs)
    if grad_outputs is None:
        grad_outputs = [np.ones(o.shape, dtype=o.dtype) for o in outputs]
    capture = {id(t): None for t in inputs}
    saved = []
    for t in inputs:
        if t._ctx is not None:
            saved.append((t, t._ctx.retained.get(t._index)))
            t._ctx.retained[t._index] = t
    try:
        _run(outputs, list(grad_outputs), retain_graph, capture)
    finally:
        for t, previous in saved:
            if hasattr(t._ctx, "retained"):
                if previous is None:
                    t._ctx.retained.pop(t._index, None)
    return [capture[id(t)] for t in inputs]


from mpitrain import ops as _ops  # noqa: E402  (ops build on Tensor; operators call them)
