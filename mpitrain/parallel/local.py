"""One data-parallel rank: nothing to synchronise. The baseline every strategy is measured against.

**What is split**: nothing. The rank holds the whole model, computes on the whole global
batch (or its part of it, when the grid's other axes, pipeline stages or tensor
slices, share the model) and keeps its gradients, optimizer state and update to itself.

**Communicator**: none. **Calls**: none; **bytes per step**: 0. **Sum or mean**: the loss
is the mean over the batch, so its gradient is.

**In the trainer** this is the gradient sync (``mpitrain/train/sync.py``) of a run with
``dp = 1``: ``parallel.sync = "local"``, and also ``"ddp"`` on one rank, which has no one
to exchange with. Written out so that the loop's calls (``begin_step``, ``no_sync``,
``finish``, ``step``, ``zero_grad``, ...) are seen doing the least they can.

**Launch**: ``mpitrain train jobs/mnist5k_lenet.toml`` (one process, no MPI).
"""

from __future__ import annotations

import contextlib

from mpitrain import flat, optim
from mpitrain.comm.replicas import digest


class LocalSync:
    """The update is the optimizer's step on the gradients backward left."""

    on_comm = None  # no communication to show on a timeline
    bytes_sent = 0

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.params = model.parameters()

    def begin_step(self) -> bool:
        return True

    def no_sync(self):
        return contextlib.nullcontext()

    def finish(self) -> None:
        pass

    def step(self, lr: float | None = None, grad_clip: float = 0.0) -> None:
        optim.update(self.optimizer, self.params, lr, grad_clip)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def whole_model(self):
        """The model's parameters are whole in ``.data`` already: nothing to gather."""
        return contextlib.nullcontext()

    def memory(self) -> dict:
        """Bytes this rank keeps between steps: parameters, gradients, optimizer state
        and the optimizer's work array."""
        return {"param_bytes": sum(p.data.nbytes for p in self.params),
                "grad_bytes": sum(p.grad.nbytes for p in self.params if p.grad is not None),
                **self.optimizer.memory()}

    def sync_buffers(self) -> None:
        pass

    def check_replicas(self) -> str:
        """The one replica's digest."""
        return digest([p.data for p in self.params])

    def state_pieces(self, offsets) -> tuple:
        """For checkpoints: this rank holds and writes the whole optimizer state."""
        return self.optimizer, flat.pieces(offsets), True

    def comm_seconds(self) -> tuple[float, float]:
        return 0.0, 0.0

    def describe(self) -> tuple[str, dict[str, str]]:
        return "local: one data-parallel rank, no gradient exchange", {}

    def close(self) -> None:
        pass
