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
construction, rank 0's parameters and buffers are broadcast.

**Bytes per rank per step**: reduce-scatter ``(P-1)/P x N x s`` plus allgather
``(P-1)/P x N x s``: ``2 (P-1)/P x N x s``, the same as data parallelism's allreduce,
which is the two halves done back to back. **Optimizer state per rank**: ``1/P`` of
data parallelism's (:meth:`Zero1.state_bytes`).

**Launch**: ``mpiexec -n 2 mpitrain train jobs/tinyshakespeare_gpt.toml --set parallel.strategy=zero1``.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from mpitrain.allreduce import ALGORITHMS, Ring, chunk_bounds


class Zero1:
    """Wrap ``optimizer`` (built on ``model``'s parameters) so that each rank of
    ``dp_comm`` keeps and updates one shard. Use::

        zero = Zero1(model, opt, dp_comm)
        loss.backward()
        zero.step(lr, grad_clip)   # reduce-scatter, update my shard, allgather
        zero.zero_grad()
    """

    def __init__(self, model, optimizer, dp_comm, algorithm: str = "mpi"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"allreduce algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.comm, self.algorithm, self.model = dp_comm, algorithm, model
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeRO-1 keeps parameters in one flat array of one dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        n = sum(p.size for p in self.params)
        self.flat_params = np.empty(n, dtype=dtype)  # (N,) every parameter, end to end
        self.flat_grads = np.zeros(n, dtype=dtype)  # (N,)
        self.offsets = np.cumsum([0] + [p.size for p in self.params])  # (len(params) + 1,)
        for p, lo, hi in zip(self.params, self.offsets[:-1], self.offsets[1:]):
            self.flat_params[lo:hi] = p.data.reshape(-1)
            p.data = self.flat_params[lo:hi].reshape(p.shape)
            p.grad = self.flat_grads[lo:hi].reshape(p.shape)
        for p in self.params:
            dp_comm.bcast_array(p.data)
        for _, b in model.named_buffers():
            dp_comm.bcast_array(b)
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

    def zero_grad(self) -> None:
        self.flat_grads.fill(0)

    def state_pieces(self, offsets):
        """For checkpoints: the optimizer of my shard and its pieces (parameter index,
        lo, hi) in flat coordinates (``offsets`` is this flat layout's own)."""
        return self.optimizer, self.pieces

    def sync_buffers(self) -> None:
        """Average floating buffers (batch-norm running statistics) over ranks; each
        rank's batch norm sees only its own samples."""
        for _, b in self.model.named_buffers():
            if b.dtype.kind == "f" and self.comm.size > 1:
                self.comm.allreduce(b)
                b /= self.comm.size

    def check_replicas(self) -> str:
        """Raise unless every rank holds bit-identical parameters; returns the digest."""
        digests = self.comm.allgather(hashlib.sha256(self.flat_params.tobytes()).hexdigest())
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise RuntimeError(f"replicas diverged: the parameters of rank(s) {differ} differ from rank 0's")
        return digests[0]

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
