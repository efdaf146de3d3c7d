"""The backward engine: reverse-mode automatic differentiation over the graph that
:class:`mpitrain.tensor.Function` records (``loss.backward()`` calls :func:`backward`).

:func:`reference_backward` is the whole idea in a page, to read first. :func:`backward`
walks the graph once in reverse topological order, so every node's backward runs once,
after all gradients of its outputs have been summed. That ordering gives the three
services later modules rely on:

* an explicit upstream gradient (``y.backward(dy)``): a pipeline stage receives ``dy``
  from the next rank instead of starting from a scalar loss;
* gradients of tensors that are not parameters: a leaf created with ``requires_grad=True``
  (a stage's received activation) gets ``.grad`` like a parameter,
  :meth:`~mpitrain.tensor.Tensor.retain_grad` keeps an intermediate's, :func:`grad` leaves
  ``.grad`` alone;
* post-accumulate hooks on leaves, fired once a leaf's ``.grad`` is final for the pass
  (the engine counts the edges into each leaf first): data parallelism starts a bucket's
  allreduce there, while backward continues on earlier layers.

:func:`backward_split` cuts the walk in two for zero-bubble pipeline schedules (Qi et
al. 2024): the parameters' gradients come later, bit for bit as from one ``backward``.

Gradients accumulate: ``.grad`` of a leaf is summed in place across backward passes
until ``zero_grad``, so a ``.grad`` that is a view into a flat buffer stays one. Every
gradient handed out (``.grad``, :func:`grad`'s results) is the tensor's own array.
"""

from __future__ import annotations

import collections

import numpy as np

from mpitrain.tensor import Function, Parameter, Tensor


def _owned(g: np.ndarray, dtype) -> np.ndarray:
    """A private copy of a gradient handed to the user (arrays in the graph may be shared,
    read-only broadcast views, or the caller's own), in C order even from a transposed
    view (a transpose's backward): optimizers and flat buffers see the parameter's layout."""
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
            raise RuntimeError("backward through a graph that was already freed; "
                               "pass retain_graph=True to the first backward")
        stack.append((node, True))
        for t, needed in zip(node.inputs, node.needs_input_grad):
            if needed and t._ctx is None:
                leaf_uses[id(t)] = leaf_uses.get(id(t), 0) + 1
            elif needed and id(t._ctx) not in visited:
                stack.append((t._ctx, False))
    order.reverse()
    return order, leaf_uses


_WHOLE, _INPUTS, _WEIGHTS = "whole", "inputs", "weights"  # the phases of a walk (_walk says which)


def _run(roots, grads, retain_graph: bool, capture: dict | None, phase: str = _WHOLE):
    """The backward engine shared by :func:`backward`, :func:`grad` and the first phase of
    :func:`backward_split`: hands the roots their gradients and walks the graph. Returns
    what the walk kept for a second phase and the leaf use counts it left."""
    if len(grads) != len(roots):
        raise ValueError(f"{len(roots)} tensors but {len(grads)} gradients")
    order, leaf_uses = _graph(roots)
    pending: dict[int, list] = {}  # id(node) -> gradients of its outputs
    deliver = _deliverer(pending, leaf_uses, capture)
    for t, g in zip(roots, grads):
        if not t.requires_grad:
            raise RuntimeError("backward from a tensor that does not require grad")
        g = np.asarray(g.data if isinstance(g, Tensor) else g, dtype=t.data.dtype)
        if t._ctx is None:
            leaf_uses[id(t)] = leaf_uses.get(id(t), 0) + 1
        deliver(t, g, "the upstream gradient")
    steps = ((node, pending.pop(id(node), None) or [None] * node.n_outputs) for node in order)
    return _walk(steps, deliver, phase, not retain_graph, capture), leaf_uses


def _deliverer(pending: dict, leaf_uses: dict, capture: dict | None):
    """``deliver(t, g, source)``, which hands the gradient ``g`` to ``t``: to ``pending``
    for an intermediate's producer; for a leaf, to ``capture`` (:func:`grad`) or into its
    ``.grad``, firing its hooks once its last edge (``leaf_uses``) has delivered."""

    def deliver(t: Tensor, g, source: str):
        if g is not None and g.shape != t.shape:
            raise RuntimeError(f"{source} gave a gradient of shape {g.shape} "
                               f"for a tensor of shape {t.shape}")
        if t._ctx is not None:
            slot = pending.setdefault(id(t._ctx), [None] * t._ctx.n_outputs)
            slot[t._index] = g if slot[t._index] is None else slot[t._index] + g  # out of place: g may be shared (add)
            return
        key = id(t)
        if capture is not None:
            if key in capture and g is not None:
                capture[key] = _owned(g, g.dtype) if capture[key] is None else capture[key] + g  # unrounded: see grad
        elif g is not None:
            if t.grad is None:
                t.grad = _owned(g, t.data.dtype)
            else:
                t.grad += g
        leaf_uses[key] -= 1
        if leaf_uses[key] == 0 and capture is None and t._hooks:
            for hook in t._hooks:
                hook(t)

    return deliver


def _walk(steps, deliver, phase: str, free: bool, capture: dict | None = None) -> collections.deque:
    """The engine loop: for each ``(node, out_grads)`` of ``steps`` in turn, call the
    node's backward and deliver the gradients it returns; ``free`` frees each node after.
    ``phase`` says which inputs a node is asked for: those it recorded (``_WHOLE``), its
    Parameter leaves (``_WEIGHTS``) or all others (``_INPUTS``). An ``_INPUTS`` walk keeps,
    unfreed, every node with a Parameter input needing a gradient, with its ``out_grads``,
    and returns them in the order it met them, for a ``_WEIGHTS`` walk."""
    kept = collections.deque()
    for node, out_grads in steps:
        if node.retained and phase != _WEIGHTS:  # complete once the node's turn comes
            _retain(node, out_grads, capture)
        needs = node.needs_input_grad if phase == _WHOLE else _restricted(node, phase == _WEIGHTS)
        keep = phase == _INPUTS and needs != node.needs_input_grad  # a Parameter input was masked off
        node.last_backward = free and not keep
        _call(node, out_grads, needs, deliver)
        if keep:
            kept.append((node, out_grads))
        elif free:
            node.__dict__.clear()  # frees saved activations; the node can't run again
    return kept


def _retain(node: Function, out_grads: list, capture: dict | None) -> None:
    """Store the gradients of the node's retained outputs (``retain_grad``, :func:`grad`)."""
    for i, t in node.retained.items():
        g = out_grads[i]
        if g is not None and capture is None:
            t.grad = _owned(g, t.dtype) if t.grad is None else t.grad + g
        elif g is not None and id(t) in capture:
            capture[id(t)] = _owned(g, t.dtype)


def _restricted(node: Function, weights: bool) -> tuple:
    """``node.needs_input_grad`` restricted to its Parameter inputs (``weights``) or to the others."""
    return tuple(needed and isinstance(t, Parameter) == weights
                 for t, needed in zip(node.inputs, node.needs_input_grad))


def _call(node: Function, out_grads: list, needs: tuple, deliver) -> None:
    """Run ``node.backward`` with ``needs`` as its ``needs_input_grad`` and deliver the
    gradients of the inputs ``needs`` flags. The node gets its recorded flags back after
    the call; it is not called at all when it is asked for nothing or received nothing."""
    recorded = node.needs_input_grad
    if not any(needs) or all(g is None for g in out_grads):
        in_grads = (None,) * len(needs)
    else:
        node.needs_input_grad = needs
        try:
            in_grads = node.backward(*out_grads)
        finally:
            node.needs_input_grad = recorded
    if not isinstance(in_grads, tuple):
        in_grads = (in_grads,)
    source = f"{type(node).__name__}.backward"
    for t, needed, g in zip(node.inputs, needs, in_grads):
        if needed:
            deliver(t, g, source)


def _upstream(tensors: list, grads) -> list:
    """The upstream gradients, 1 for each one-element tensor when ``grads`` is None."""
    if grads is not None:
        return list(grads)
    for t in tensors:
        if t.size != 1:
            raise RuntimeError(f"backward() without a gradient needs a one-element tensor, got shape {t.shape}")
    return [np.ones(t.shape, dtype=t.dtype) for t in tensors]


def backward(tensors, grads=None, retain_graph: bool = False) -> None:
    """Backpropagate from several tensors at once (``grads``: one upstream gradient each)."""
    tensors = list(tensors)
    _run(tensors, _upstream(tensors, grads), retain_graph, None)


def grad(outputs, inputs, grad_outputs=None, retain_graph: bool = False) -> list:
    """Gradients of ``outputs`` with respect to ``inputs``, leaving every ``.grad`` alone:
    leaves or intermediates (an intermediate's gradient is taken when its producing node
    runs); inputs that the outputs do not depend on get ``None``. A leaf's gradient is in
    the dtype it was computed in, float32 for a half-precision leaf: whoever adds it into
    a 16-bit sum rounds once there, as :func:`backward` does into ``.grad`` (rounding it
    here as well would round each micro-batch's gradient twice)."""
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    inputs = list(inputs)
    if grad_outputs is None:
        grad_outputs = [np.ones(o.shape, dtype=o.dtype) for o in outputs]
    capture = {id(t): None for t in inputs}
    saved = [(t, t._ctx.retained.get(t._index)) for t in inputs if t._ctx is not None]  # to restore after
    for t, _ in saved:
        t._ctx.retained[t._index] = t
    try:
        _run(outputs, list(grad_outputs), retain_graph, capture)
    finally:
        for t, previous in saved:
            if previous is None and hasattr(t._ctx, "retained"):
                t._ctx.retained.pop(t._index, None)
    return [capture[id(t)] for t in inputs]


def reference_backward(root: Tensor, grad=None) -> None:
    """Accumulate d(root)/d(leaf) into every leaf's ``.grad``: the whole idea of
    :func:`backward` in a page (micrograd's shape), to read first, and the oracle the
    engine is tested against (its gradients bit for bit, ``tests/test_tensor.py``).
    ``root`` is an op's output; ``grad`` is d(loss)/d(root), ones when omitted.

    1. Order the nodes so that each comes after every node that consumes its outputs: a
       depth-first walk from ``root``'s node appends a node once all its inputs' nodes
       are appended, and the reverse of that list is the order.
    2. Walk it: each node's ``backward`` gets the summed gradients of its outputs (it is
       skipped if none reached it) and returns one per input, added to the producing
       node's pending output gradient (an intermediate) or to ``.grad`` (a leaf).

    What the engine adds: hooks, freeing each node as it is passed, :func:`grad`'s
    capture, retained gradients, the split of :func:`backward_split`, a walk that
    needs no recursion. This walk frees nothing: the graph can be walked again."""
    order, seen = [], set()

    def visit(node):
        if id(node) not in seen:
            seen.add(id(node))
            # Last input first. Any topological order gives the gradients, but one summed
            # from three or more contributions rounds by their order, and this is the
            # engine's (its stack pops a node's inputs last first): bit for bit the same.
            for t, needed in reversed(list(zip(node.inputs, node.needs_input_grad))):
                if needed and t._ctx is not None:
                    visit(t._ctx)
            order.append(node)

    visit(root._ctx)
    pending = {id(root._ctx): [None] * root._ctx.n_outputs}  # id(node) -> its outputs' gradients
    pending[id(root._ctx)][root._index] = np.ones(root.shape, root.dtype) if grad is None else np.asarray(grad)
    for node in reversed(order):
        out_grads = pending.pop(id(node), [None] * node.n_outputs)
        if all(g is None for g in out_grads):
            continue
        in_grads = node.backward(*out_grads)
        in_grads = in_grads if isinstance(in_grads, tuple) else (in_grads,)
        for t, needed, g in zip(node.inputs, node.needs_input_grad, in_grads):
            if not needed or g is None:
                continue
            if t._ctx is not None:  # out of place: backward may hand one array to two inputs
                slot = pending.setdefault(id(t._ctx), [None] * t._ctx.n_outputs)
                slot[t._index] = g if slot[t._index] is None else slot[t._index] + g
            elif t.grad is None:
                t.grad = _owned(g, t.dtype)  # the leaf's own copy: g may be shared or read-only
            else:
                t.grad += g


def backward_split(tensors, grads=None) -> "WeightPass":
    """Phase one of a backward pass split in two: every gradient but the parameters' now,
    the parameters' when the returned :class:`WeightPass` is run.

    Why: a zero-bubble pipeline schedule (Qi et al., ICLR 2024) splits a stage's backward
    into B, the gradient of the stage's input, which the previous stage waits for, and
    W, the weight gradients, which nothing needs before the optimizer step. The stage
    sends B's result at once and runs W where it would otherwise wait.

    The walk is :func:`backward`'s (``tensors``, ``grads`` as there; a Parameter cannot
    be a root), in the same order, with every edge into a Parameter masked off: a node's
    backward sees ``needs_input_grad`` restricted to its other inputs, and is not called
    if none of them needs a gradient. On return the other leaves' ``.grad``, their hooks
    and every retained gradient are as after ``backward``; parameters' ``.grad`` and hooks untouched.

    Each node with a Parameter input needing a gradient is kept for phase two, with its
    saved arrays and output gradients (references: do not write into ``grads`` before
    ``run``), and sees ``last_backward`` false in phase one; the others are freed at
    once, and a WeightPass dropped unrun frees what it kept. ``WeightPass.run()`` calls
    the kept nodes again in the same order for their Parameter inputs only, with
    ``last_backward`` true, accumulating and firing hooks as ``backward`` does: each
    gradient receives its contributions in ``backward``'s order: its results bit for bit.

    Cost: a node's backward runs twice, and work its input and weight gradients share is
    done in both: nearly a second backward for a fused transformer sublayer (its ``W_in``
    and layer norm gradients lie behind its whole inner chain); for the plain block's
    ``Linear`` and ``LayerNorm`` nodes, the weight products and the norm's reductions
    alone. Activation checkpointing's node ignores the mask, recomputing its block each time."""
    tensors = list(tensors)
    if any(isinstance(t, Parameter) for t in tensors):
        raise ValueError("backward_split from a Parameter: its gradient is not an input gradient to split off")
    kept, leaf_uses = _run(tensors, _upstream(tensors, grads), False, None, _INPUTS)
    return WeightPass(kept, leaf_uses)


class WeightPass:
    """Phase two of :func:`backward_split`: ``run()`` it once for the parameters' gradients."""

    def __init__(self, kept: collections.deque, leaf_uses: dict):
        self._kept, self._leaf_uses = kept, leaf_uses

    def run(self) -> None:
        """Accumulate the kept nodes' parameter gradients into ``.grad`` and free them."""
        if self._kept is None:
            raise RuntimeError("WeightPass.run() called twice: the weight gradients were "
                               "delivered and the graph freed by the first call")
        kept, self._kept = self._kept, None
        deliver = _deliverer({}, self._leaf_uses, None)  # phase two delivers to parameters only
        # popped as the walk passes each node: its output gradients are freed with it
        _walk((kept.popleft() for _ in range(len(kept))), deliver, _WEIGHTS, free=True)
