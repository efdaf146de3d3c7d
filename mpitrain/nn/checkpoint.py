"""Activation checkpointing: keep a block's input, drop its activations, recompute them
during backward (Chen, Xu, Zhang & Guestrin 2016, "Training deep nets with sublinear
memory cost"). One extra forward per block buys memory proportional to blocks, not layers.

The block runs as one graph node whose inputs are the block's input *and* its
parameters. The recomputation builds a private graph and takes gradients from it with
:func:`mpitrain.autograd.grad`, which leaves ``.grad`` alone; the outer backward then
accumulates them like any other node's. So a parameter used both inside and outside
the block (a tied embedding) gets its post-accumulate hook only when all uses are in.

Replay is exact: the random streams (the process-wide generator, and the per-sample
streams with their layer) are rewound to where the forward pass began (backward may run
outside those contexts), and buffers the forward pass updated (batch-norm running
statistics) are put back after it, so they are updated once per step, not twice.
"""

from __future__ import annotations

import numpy as np

from mpitrain import rng
from mpitrain.autograd import grad
from mpitrain.nn.module import Module
from mpitrain.tensor import Function, Tensor, as_tensor, enable_grad, is_grad_enabled, no_grad


class _Checkpoint(Function):
    def forward(self, x, *param_arrays, module):
        self.module, self.x = module, x
        self.rng_state = rng.snapshot()
        with no_grad():
            return module.forward(Tensor(x)).data

    def backward(self, g):
        x, out = replay(self.module, self.x, self.needs_input_grad[0], self.rng_state)
        return tuple(grad([out], [x] + self.module.parameters(), [g]))


def replay(module: Module, x: np.ndarray, x_needs_grad: bool, rng_state) -> tuple[Tensor, Tensor]:
    """Run ``module.forward`` on ``x`` again, recording a private graph, with the random
    streams rewound to ``rng_state`` (:func:`mpitrain.rng.snapshot` of when the first pass
    began) and the buffers it updated put back after; returns (input tensor, output).
    ZeRO-3 (``mpitrain/parallel/zero3.py``) replays its layers this way too."""
    resume_state = rng.snapshot()
    updated = [np.array(b, copy=True) for _, b in module.named_buffers()]
    rng.restore(rng_state)
    try:
        with enable_grad():
            xt = Tensor(x, requires_grad=x_needs_grad)
            out = module.forward(xt)
    finally:
        rng.restore(resume_state)
    for (_, buffer), value in zip(module.named_buffers(), updated):
        np.copyto(buffer, value)
    return xt, out


def checkpoint(module: Module, x):
    """``module(x)`` without storing its activations (recomputed in backward); ``x`` is one
    tensor and the module returns one; outside gradient recording, a plain call. It runs the
    module's ``forward``, not its call, so that :func:`checkpointed` can route calls here."""
    if not is_grad_enabled():
        return module.forward(x)
    return _Checkpoint.apply(as_tensor(x), *module.parameters(), module=module)


def checkpointed(module: Module) -> Module:
    """Make every call of ``module`` a :func:`checkpoint` (``Module.call_through``), wherever it runs (the whole
    model, a pipeline stage, sliced over tensor-parallel ranks): the GPT's blocks with ``checkpoint_activations``."""
    module.call_through(checkpoint)
    return module
