"""A step as data: the order of one rank's forward and backward passes, and its interpreter.

A *schedule* is a plain list of actions for one rank and one global batch: ``Forward(i)``
runs micro-batch ``i`` through the model and keeps its loss, ``Backward(i)`` runs its
backward pass (the action types are :mod:`mpitrain.schedules`'). The list can
be printed, checked and simulated without running anything; :func:`run` carries it out
in a few lines (PyTorch's ``torch.distributed.pipelining`` schedules are instruction
lists of the same kind).

With the whole model on the rank the schedule is gradient accumulation
(:func:`one_stage`): ``F0 B0 F1 B1 ...``; with one micro-batch it is plain training.
A pipeline stage's schedules (GPipe, 1F1B, interleaved, ZB-H1) add the actions that
receive its input and send its output, and run in
:meth:`mpitrain.parallel.pipeline.PipelineStage.run`. Either is the role's
``schedule(micro, sync, context, before_backward) -> loss`` (:func:`whole_model`).

**Loss scale.** Each micro-batch's loss is the mean over its ``b/m`` samples; scaled by
``1/m``, the sum of the micro-batches' gradients is the gradient of the mean over all
``b`` samples, the gradient of one pass over the whole batch (micro-batches are equal in
size; batch norm sees each micro-batch's statistics, as in any gradient accumulation).
"""

from __future__ import annotations

import contextlib
from functools import partial

import numpy as np

from mpitrain import ops
from mpitrain.schedules import Backward, Forward
from mpitrain.tensor import Tensor


def one_stage(micro_batches: int) -> list:
    """The whole model on this rank: each micro-batch's forward, then its backward (its
    activations are freed before the next forward)."""
    return [a for mb in range(micro_batches) for a in (Forward(mb), Backward(mb))]


def split(x, y, micro_batches: int) -> list[tuple]:
    """(x, y) of this rank's part of a batch cut into equal consecutive micro-batches."""
    b = len(x) // micro_batches
    return [(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]) for i in range(micro_batches)]


def whole_model(model, text: bool, micro_batches: int, scaler=None):
    """The schedule of a rank that holds the whole model, as the role's ``schedule``;
    ``scaler``: a mixed-precision run's :class:`~mpitrain.precision.LossScaler`, whose
    scale multiplies the loss that backward starts from (None: 1)."""
    loss_of = partial(text_loss if text else image_loss, model)
    actions = one_stage(micro_batches)

    def schedule(micro, sync, context=None, before_backward=None) -> float:
        return run(actions, micro, loss_of, sync, before_backward, context, 1.0 if scaler is None else scaler.scale)
    return schedule


def image_loss(model, x, y):
    return ops.cross_entropy(model(Tensor(x)), y)


def text_loss(model, x, y):
    return model(x, y)[1]


def run(actions: list, micro: list[tuple], loss_of, sync, before_backward=None, context=None,
        loss_scale: float = 1.0) -> float:
    """Carry out ``actions`` on the micro-batches ``micro`` (``loss_of(x, y)`` gives a
    micro-batch's mean loss as a tensor); every backward but the step's last runs inside
    ``sync.no_sync()``; ``context(mb)`` wraps each forward (the dropout streams);
    backward starts from the loss times ``loss_scale`` (mixed precision's). Returns this
    rank's loss of the step: the mean over micro-batches, unscaled."""
    scale = 1.0 / len(micro)
    last = max(i for i, a in enumerate(actions) if isinstance(a, Backward))
    losses, total = {}, 0.0  # micro-batch -> its scaled loss, alive from its forward to its backward
    for i, action in enumerate(actions):
        match action:
            case Forward(mb):
                with context(mb) if context is not None else contextlib.nullcontext():
                    losses[mb] = loss_of(*micro[mb]) * scale
            case Backward(mb):
                loss = losses.pop(mb)
                total += loss.item()
                if before_backward is not None:
                    before_backward()
                with contextlib.nullcontext() if i == last else sync.no_sync():
                    if loss_scale == 1.0:
                        loss.backward()
                    else:  # every gradient loss_scale times larger (mpitrain.precision)
                        loss.backward(np.array(loss_scale, dtype=loss.dtype))
    return total
