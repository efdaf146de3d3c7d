"""One data-parallel rank: nothing to synchronise. The baseline every strategy is measured against.

**What is split**: nothing. The rank holds the whole model, computes on the whole global
batch (or its part of it, when the grid's other axes, pipeline stages or tensor
slices, share the model) and keeps its gradients, optimizer state and update to itself.

**Communicator**: none. **Calls**: none; **bytes per step**: 0. **Sum or mean**: the loss
is the mean over the batch, so its gradient is.

**In the trainer** this is the gradient sync of a run with ``dp = 1``:
``parallel.sync = "local"``, and also ``"ddp"`` on one rank, which has no one to exchange
with. It is :class:`mpitrain.parallel.GradSync` itself: the loop's calls (``begin_step``,
``no_sync``, ``finish``, ``step``, ``zero_grad``, ...) doing the least they can.

**Launch**: ``mpitrain train jobs/mnist5k_lenet.toml`` (one process, no MPI).
"""

from __future__ import annotations

from mpitrain.comm import SingleComm
from mpitrain.parallel import GradSync


class LocalSync(GradSync):
    """The update is the optimizer's step on the gradients backward left."""

    def __init__(self, model, optimizer, dp_comm=None):
        super().__init__(model, optimizer, dp_comm or SingleComm())
