"""A step as data: the order of one rank's forward and backward passes, and its interpreter.

A *schedule* is a plain list of actions for one rank and one global batch
(:mod:`mpitrain.schedules`' types): ``Forward(i)`` runs micro-batch ``i`` and keeps its
loss, ``Backward(i)`` its backward pass; :meth:`WholeModel.run` carries it out in a few
lines (PyTorch's ``torch.distributed.pipelining`` schedules are such lists too). With the
whole model on the rank it is gradient accumulation (:func:`one_stage`: ``F0 B0 F1 B1
...``; one micro-batch: plain training); a pipeline stage's lists add the messages and
run in :meth:`mpitrain.parallel.pipeline.PipelineStage.run`. Either object is the role's
schedule, the one owner of the micro-batches (the loop hands it a lane's batch):
``run(x, y, lanes, sync, streams, before_backward) -> loss`` for a training step,
``forward_only(x)`` and ``loss_only(x, y)`` for evaluation (None where the model does
not end).

**Loss scale.** Each micro-batch's loss is the mean over its ``b/m`` samples; scaled by
``1/m``, the sum of the micro-batches' gradients is the gradient of the mean over all
``b`` samples, the gradient of one pass over the whole batch (micro-batches are equal in
size; batch norm sees each micro-batch's statistics, as in any gradient accumulation).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from mpitrain import ops
from mpitrain.schedules import Backward, Forward, micro_batches, record
from mpitrain.tensor import Tensor, no_grad


def one_stage(micro_batches: int) -> list:
    """The whole model on this rank: each micro-batch's forward, then its backward (its
    activations are freed before the next forward)."""
    return [a for mb in range(micro_batches) for a in (Forward(mb), Backward(mb))]


class WholeModel:
    """The schedule of a rank that holds the whole model (or its tensor-parallel slices):
    ``m`` micro-batches, each forward then backward. ``text``: the model takes targets
    and returns ``(logits, loss)`` (the GPT), else its output is scored by cross-entropy.
    ``scaler``: a mixed-precision run's :class:`~mpitrain.precision.LossScaler`, whose
    scale multiplies the loss that backward starts from (None: 1). ``label_smoothing``: the
    training loss's (:func:`mpitrain.ops.cross_entropy`); :meth:`loss_only`'s has none."""

    def __init__(self, model, micro_batches: int = 1, text: bool = False, scaler=None,
                 label_smoothing: float = 0.0):
        self.model, self.m, self.text, self.scaler = model, micro_batches, text, scaler
        self.smoothing = label_smoothing
        self.actions = one_stage(micro_batches)
        self.trace = None  # set to record the actions: trace(name, category, track, start, end)

    def loss_only(self, x, y, label_smoothing: float = 0.0):
        """The mean loss of ``(x, y)`` as a tensor (recorded unless under ``no_grad``)."""
        if self.text:
            return self.model(x, y, label_smoothing)[1]
        return ops.cross_entropy(self.model(Tensor(x)), y, label_smoothing=label_smoothing)

    def forward_only(self, x):
        """The model's output for ``x``, without recording a graph."""
        with no_grad():
            return self.model(x)

    def run(self, x, y, lanes, sync, streams=None, before_backward=None) -> float:
        """One training step on this lane's batch: carry out the actions on its
        micro-batches; every backward but the step's last runs inside ``sync.no_sync()``;
        ``streams(samples)`` wraps each forward (the dropout streams of those samples,
        their places ``lanes`` in the global batch); ``before_backward()`` marks where a
        backward starts (the timeline). Returns the mean loss, unscaled."""
        micro = micro_batches((x, y, lanes), self.m)
        last = len(self.actions) - 1
        losses, total = {}, 0.0  # micro-batch -> its scaled loss, alive from its forward to its backward
        for i, action in enumerate(self.actions):
            start = time.perf_counter()
            match action:
                case Forward(mb):
                    with streams(micro[mb][2]) if streams is not None else contextlib.nullcontext():
                        losses[mb] = self.loss_only(*micro[mb][:2], self.smoothing) * (1.0 / self.m)
                case Backward(mb):
                    loss = losses.pop(mb)
                    total += loss.item()
                    if before_backward is not None:
                        before_backward()
                    with contextlib.nullcontext() if i == last else sync.no_sync():
                        self._backward(loss)
            if self.trace is not None:
                record(self.trace, action, start)
        return total

    def _backward(self, loss) -> None:
        if self.scaler is None or self.scaler.scale == 1.0:
            loss.backward()
        else:  # every gradient scale times larger (mpitrain.precision)
            loss.backward(np.array(self.scaler.scale, dtype=loss.dtype))
