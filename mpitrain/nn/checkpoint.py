"""Activation checkpointing: keep a block's input, drop its activations, recompute them
during backward (Chen, Xu, Zhang & Guestrin 2016, "Training deep nets with sublinear
memory cost"). One extra forward per block buys memory proportional to the number of
blocks instead of the number of layers inside them.

The block runs as one graph node whose inputs are the block's input *and* its
parameters. The recomputation builds a private graph and takes gradients from it with
:func:`mpitrain.tensor.grad`, which leaves ``.grad`` alone; the outer backward then
accumulates them like any other node's. So a parameter used both inside and outside
the block (a tied embedding) gets its post-accumulate hook only when all uses are in.

Replay is exact: the random streams (dropout: the process-wide generator, and the
per-sample streams of ``rng.sample_streams`` with their layer) are rewound to where the
forward pass began (``rng.snapshot``; backward may run outside those contexts), and
buffers the forward pass updated (batch-norm running statistics) are put back after
the recomputation so they are updated once per step, not twice.
"""

from __future__ import annotations

import numpy as np

from mpitrain import rng
from mpitrain.nn.module import Module
from mpitrain.tensor import Function, Tensor, enable_grad, grad, is_grad_enabled, no_grad


class _Checkpoint(Function):
    def forward(self, x, *param_arrays, module):
        self.module, self.x = module, x
        self.rng_state = rng.snapshot()
        with no_grad():
            return module(Tensor(x)).data

    def backward(self, g):
        module = self.module
        params = module.parameters()
        resume_state = rng.snapshot()
        updated = [np.array(b, copy=True) for _, b in module.named_buffers()]
        rng.restore(self.rng_state)
        try:
            with enable_grad():
                x = Tensor(self.x, requires_grad=self.needs_input_grad[0])
                out = module(x)
        finally:
            rng.restore(resume_state)
        for (_, buffer), value in zip(module.named_buffers(), updated):
            np.copyto(buffer, value)
        grads = grad([out], [x] + params, [g])
        return tuple(grads)


def checkpoint(module: Module, x):
    """``module(x)`` without storing its activations (recomputed in backward).

    ``x`` is one tensor and the module returns one tensor. Outside gradient recording
    (evaluation) this is a plain call.
    """
    if not is_grad_enabled():
        return module(x)
    x = x if isinstance(x, Tensor) else Tensor(x)
    return _Checkpoint.apply(x, *module.parameters(), module=module)

