"""ZeRO stage 1: data parallelism with the optimizer state sharded over the ranks.

**What is split.** As in data parallelism, the global batch (``B/P`` samples per rank of
``dp_comm``) with the whole model on every rank; in addition the *optimizer state*
(Adam's two moments: 8 bytes per float32 parameter, twice the weights) and the update
work. All ``N`` parameters are laid end to end in one flat array and cut into ``P``
contiguous shards, shard ``r`` being elements ``[N*r//P, N*(r+1)//P)``; rank ``r`` keeps
the optimizer state of shard ``r`` only and updates only those parameters
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, stage P_os).

**The calls and when**, in :meth:`Zero1.step` after backward:

1. ``Reduce_scatter`` of the flat gradient (MPI's, or the first half of mpitrain's ring):
   rank ``r`` receives the sum of shard ``r``, then divides it by ``P`` (the mean over
   the global batch, as in data parallelism);
2. gradient clipping, if asked, from the global norm: one ``Allreduce`` of each rank's
   sum of squares (8 bytes);
3. the wrapped optimizer's update, on shard ``r`` only (every optimizer here is
   elementwise, so updating pieces equals updating the whole);
4. ``Allgatherv`` of the parameters (MPI's, or the second half of the ring): every rank
   sends its updated shard and receives the others, into the flat parameter array that
   every parameter's ``.data`` is a view of.

All blocking, after backward (no overlap: ZeRO's gain is memory, not time). At
construction, rank 0's parameters and buffers are broadcast
(:func:`mpitrain.comm.replicas.broadcast`), and the parameters and gradients are laid
end to end in two flat arrays (:class:`mpitrain.flat.Flat`) that every parameter's
``.data`` and ``.grad`` are views of.

**Gradient accumulation** needs nothing: gradients stay local until :meth:`Zero1.step`,
so ``no_sync`` is empty and every micro-batch's backward adds into the flat gradient.

**Bytes per rank per step**: reduce-scatter ``(P-1)/P x N x s`` plus allgather
``(P-1)/P x N x s``: ``2 (P-1)/P x N x s``, the same as data parallelism's allreduce,
which is the two halves done back to back. **Optimizer state per rank**: ``1/P`` of
data parallelism's (:meth:`Zero1.state_bytes`).

**In the trainer** the class is one implementation of the gradient sync the loop calls
(``mpitrain/train/sync.py``).

**Launch**: ``mpiexec -n 2 mpitrain train jobs/tinyshakespeare_gpt.toml --set parallel.sync=zero1``.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from mpitrain.comm import replicas
from mpitrain.comm.ring import ALGORITHMS, Ring, chunk_bounds
from mpitrain.flat import Flat


class Zero1:
    """Wrap ``optimizer`` (built on ``model``'s parameters) so that each rank of
    ``dp_comm`` keeps and updates one shard. Use::

        zero = Zero1(model, opt, dp_comm)
        loss.backward()
        zero.step(lr, grad_clip)   # reduce-scatter, update my shard, allgather
        zero.zero_grad()
    """

    on_comm = None  # every call blocks: nothing runs in the background for a timeline to show

    def __init__(self, model, optimizer, dp_comm, algorithm: str = "mpi"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"allreduce algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.comm, self.algorithm, self.model = dp_comm, algorithm, model
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        flat = Flat(self.params, data=True, what="ZeRO-1")
        self.flat_params, self.flat_grads, self.offsets = flat.data, flat.grad, flat.offsets  # (N,), (N,)
        n, dtype = flat.data.size, flat.data.dtype
        replicas.broadcast(dp_comm, [self.flat_params] + [b for _, b in model.named_buffers()])
        P, r = dp_comm.size, dp_comm.rank
        self.bounds = chunk_bounds(n, P)  # shard r is [bounds[r], bounds[r + 1])
        self.counts = np.diff(self.bounds)
        self.lo, self.hi = int(self.bounds[r]), int(self.bounds[r + 1])
        self.grad_shard = np.empty(self.hi - self.lo, dtype=dtype)  # MPI's reduce-scatter lands here
        self.optimizer = self._shard_optimizer(optimizer)

    def _shard_optimizer(self, full):
        """The same optimizer over pieces: the part of each parameter inside my shard,
        as a tensor whose data and gradient are views of the flat arrays."""
        index = {id(p): i for i, p in enumerate(self.params)}
        self.pieces = []  # (parameter index, lo, hi) of each piece in flat coordinates, in shard order

        def views(p):
            i = index[id(p)]
            lo, hi = max(self.lo, self.offsets[i]), min(self.hi, self.offsets[i + 1])
            if lo >= hi:
                return None
            self.pieces.append((i, int(lo), int(hi)))
            return self.flat_params[lo:hi], self.flat_grads[lo:hi]  # (hi - lo,) views

        return full.over(views)

    def step(self, lr: float | None = None, grad_clip: float = 0.0) -> float:
        """Average gradients, update my shard, share the parameters; returns the global
        gradient norm (computed only when clipping, else nan)."""
        P = self.comm.size
        if P > 1:
            if self.algorithm == "ring":
                Ring(self.comm, self.flat_grads, ("reduce_scatter",)).wait()
            else:
                self.comm.reduce_scatter(self.flat_grads, self.grad_shard, self.counts)
                self.flat_grads[self.lo : self.hi] = self.grad_shard
            self.flat_grads[self.lo : self.hi] *= 1.0 / P
        norm = float("nan")
        if grad_clip > 0:
            mine = self.flat_grads[self.lo : self.hi].astype(np.float64)
            squares = np.array([np.dot(mine, mine)])
            self.comm.allreduce(squares)
            norm = math.sqrt(squares[0])
            if math.isfinite(norm) and norm > grad_clip:
                self.flat_grads[self.lo : self.hi] *= grad_clip / (norm + 1e-6)
        if lr is not None:
            self.optimizer.set_lr(lr)
        self.optimizer.step()
        if P > 1:
            if self.algorithm == "ring":
                Ring(self.comm, self.flat_params, ("allgather",)).wait()
            else:
                self.comm.allgather_array(self.flat_params, self.counts)
        return norm

    def begin_step(self) -> bool:
        """Nothing to wait for before a step's forward."""
        return True

    def no_sync(self):
        """Gradients are exchanged only in :meth:`step`: nothing to hold back."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """Gradients are exchanged in :meth:`step`, after the ranks agree on the loss."""

    def zero_grad(self) -> None:
        self.flat_grads.fill(0)

    def state_pieces(self, offsets):
        """For checkpoints: the optimizer of my shard, its pieces (parameter index, lo,
        hi) in flat coordinates (``offsets`` is this flat layout's own), and True: every
        rank writes its shard."""
        return self.optimizer, self.pieces, True

    def sync_buffers(self) -> None:
        """Average floating buffers (batch-norm running statistics) over ranks; each
        rank's batch norm sees only its own samples."""
        replicas.average(self.comm, [b for _, b in self.model.named_buffers()])

    def check_replicas(self) -> str:
        """Raise unless every rank holds bit-identical parameters; returns the digest
        (of the parameters in the model's order, as every strategy's)."""
        return replicas.check_same(self.comm, [p.data for p in self.model.parameters()])

    def state_bytes(self) -> int:
        """Optimizer-state bytes held by this rank."""
        return sum(v.nbytes for s in self.optimizer.state.values() for v in s.values()
                   if isinstance(v, np.ndarray))

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent on ``dp_comm`` (broadcast, shards, norms)."""
        return self.comm.stats.bytes_sent

    def comm_seconds(self) -> tuple[float, float]:
        """(exposed, total) communication seconds so far: every call blocks, so both
        are the time inside them."""
        return self.comm.stats.seconds, self.comm.stats.seconds

    def bytes_per_step(self) -> float:
        P = self.comm.size
        return 2 * (P - 1) / P * self.flat_grads.nbytes

    def describe(self) -> tuple[str, dict[str, str]]:
        """One line for the start of a run, and the name of each call that waits for
        the other ranks (the trainer's stall watchdog shows it)."""
        what = (f"zero1 over {self.comm.size} rank(s): optimizer state sharded, {self.algorithm} reduce-scatter + "
                f"allgather of {self.flat_grads.nbytes / 1e6:.2f} MB; "
                f"{self.bytes_per_step() / 1e6:.2f} MB sent per rank per step")
        return what, {"step": "ZeRO-1 update"}

    def close(self) -> None:
        """Nothing to release."""
