"""ZeRO stages 1 and 2: data parallelism with the optimizer state (stage 1) and also the
gradients (stage 2) sharded over the ranks.

**What is split.** As in data parallelism, the global batch (``B/P`` samples per rank of
``dp_comm``) with the whole model on every rank; in addition the *optimizer state*
(Adam's two moments: 8 bytes per float32 parameter, twice the weights) and the update
work, and with stage 2 the gradients (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020, stages P_os and P_os+g). Model
state per float32 parameter with Adam on ``P`` ranks: data parallelism 16 bytes
(weights 4, gradients 4, moments 8), stage 1 ``8 + 8/P``, stage 2 ``4 + 12/P``.

**Stage 1** (:class:`Zero1`). All ``N`` parameters are laid end to end in one flat array
cut into ``P`` contiguous shards, shard ``r`` being elements ``[N*r//P, N*(r+1)//P)``;
rank ``r`` keeps the optimizer state of shard ``r`` only and updates only those
parameters. The calls, in :meth:`Zero1.step` after backward:

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

All blocking, after backward (no overlap: stage 1's gain is memory, not time).
Gradients stay local until :meth:`Zero1.step`, so micro-batches only add into the
whole flat gradient (``no_sync`` is empty).

**Stage 2** (:class:`Zero2`). The parameters are cut into buckets as data parallelism
cuts its gradients (reverse order, up to ``bucket_cap_mb``), each bucket a contiguous
range of the flat layout cut into ``P`` chunks; rank ``r`` keeps chunk ``r`` of every
bucket: its gradient shard, its optimizer state and its part of the update. No whole
gradient is kept: backward's gradient of a parameter lives until its bucket is
complete, then the bucket's gradients are packed into one buffer, freed, and a
non-blocking ``Ireduce_scatter`` (or the ring's first half) of the buffer starts, during
backward, in the same bucket order on every rank; gradient hooks ``Test`` those in
flight. :meth:`Zero2.finish` waits for them and divides the shard by ``P``;
:meth:`Zero2.step` clips (as stage 1), updates the shard and allgathers the parameters
bucket by bucket. With micro-batches there are two known choices, both here
(``accumulate``): ``"sharded"`` (the default, DeepSpeed's) reduce-scatters every
micro-batch and adds into the shard, so the memory stays a shard at the cost of a
reduce-scatter per micro-batch; ``"full"`` lets the micro-batches add into whole
gradients and reduce-scatters their sum once, stage 1's bytes with data parallelism's
gradient memory until the last micro-batch.

**On a part of the model** (a pipeline stage, a tensor slice: Megatron-LM's distributed
optimizer). The replicas of one part shard its parameters as above, over their own
``dp_comm``. Some sums are then still owed to the whole model: a tied weight's gradient
over the stages that hold it, and under sequence parallelism the replicated weights'
over the slices. They come after the reduce-scatter, on the pieces each rank holds
(:class:`mpitrain.train.parts.PartSync`). For a piece to meet the same piece on the
other stage or slice, ``kind`` keeps those weights apart: the flat layout is cut into
runs of one kind (:func:`segments`), and each run into ``P`` chunks on its own, so a
tied weight's chunk ``r`` is the same numbers on every stage that holds it. Each run is
one reduce-scatter and one allgather: the bytes do not change, the number of calls does.

**Mixed precision.** The flat arrays hold the 16-bit working copies and gradients; each
rank keeps the float32 masters and Adam's moments of its shard only (ZeRO's
``2 + 2 + 12/P`` bytes per parameter for stage 1, ``2 + (2 + 12)/P`` for stage 2). The
16-bit gradients are reduce-scattered as float32 copies by MPI
(:func:`mpitrain.comm.ring.ireduce_scatter`) or added in float32 by the ring; the update
unscales and clips in float32 and rounds the new masters into the working copies that
the allgather shares. ``whole_model(masters=True)`` gathers the float32 masters whole for
a checkpoint.

**Bytes per rank per step**: reduce-scatter ``(P-1)/P x N x s`` (stage 2, ``"sharded"``:
once per micro-batch) plus allgather ``(P-1)/P x N x s``: ``2 (P-1)/P x N x s``, the same
as data parallelism's allreduce, which is the two halves done back to back
(:func:`mpitrain.cost.zero_bytes`). At construction rank 0's parameters and buffers are
broadcast (:func:`mpitrain.comm.replicas.broadcast`).

**Launch**: ``mpiexec -n 2 mpitrain train jobs/tinyshakespeare_gpt.toml --set parallel.sync=zero1``
(or ``zero2``; with ``--set parallel.accumulate=full`` for the other micro-batch choice).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from mpitrain.comm import replicas
from mpitrain.comm.allreduce import ALGORITHMS
from mpitrain.comm.ring import Ring, chunk_bounds, ireduce_scatter
from mpitrain.flat import Buckets, Flat, offsets
from mpitrain.parallel import GradSync, mean, runs, sharded_update, trained


class Zero1(GradSync):
    """Wrap ``optimizer`` (built on ``model``'s parameters) so that each rank of
    ``dp_comm`` keeps and updates one shard. Use::

        zero = Zero1(model, opt, dp_comm)
        loss.backward()
        zero.finish()              # reduce-scatter: my shard of the mean gradient
        zero.step(lr, grad_clip)   # update my shard, allgather
        zero.zero_grad()

    ``kind`` (a parameter -> a label; None: all alike) cuts the flat layout into
    segments of consecutive parameters of one kind, each cut into ``P`` shards on its
    own: a parameter that another part of the model holds too (a tied weight on two
    pipeline stages) then lies in the same piece of its shard on both (module docstring)."""

    waits = {"finish": "gradient reduce-scatter", "step": "ZeRO-1 update"}
    sharded = True

    def __init__(self, model, optimizer, dp_comm, algorithm: str = "mpi", kind=None):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"allreduce algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        super().__init__(model, optimizer, dp_comm)
        self.algorithm, self.exchanged = algorithm, False
        self.params = trained(optimizer)
        flat = Flat(self.params, data=True, what="ZeRO-1")
        self.flat_params, self.flat_grads, self.offsets = flat.data, flat.grad, flat.offsets  # (N,), (N,)
        replicas.broadcast(dp_comm, [self.flat_params] + [b for _, b in model.named_buffers()]
                           + list(getattr(optimizer, "masters", [])))  # mixed precision's float32 masters
        self.segments = segments(self.params, self.offsets, kind, dp_comm.size)  # [(lo, hi, chunk starts)]
        r = dp_comm.rank
        self.shards = [slice(int(b[r]), int(b[r + 1])) for _, _, b in self.segments]  # mine, in flat coordinates
        self.optimizer = self._shard_optimizer(optimizer)

    def _shard_optimizer(self, full):
        """The same optimizer over pieces: the part of each parameter inside my shard,
        as a tensor whose data and gradient are views of the flat arrays."""
        index = {id(p): i for i, p in enumerate(self.params)}
        self.pieces = []  # (parameter index, lo, hi) of each piece in flat coordinates, in shard order
        self.spans = []  # (lo, hi) of each piece in self.flat_params: the same here
        self.grads = {}  # id(parameter) -> my piece of its gradient (a view)

        def views(p):
            i = index[id(p)]
            for shard in self.shards:
                lo, hi = max(shard.start, self.offsets[i]), min(shard.stop, self.offsets[i + 1])
                if lo < hi:
                    self.pieces.append((i, int(lo), int(hi)))
                    self.spans.append((int(lo), int(hi)))
                    self.grads[id(p)] = self.flat_grads[lo:hi]
                    return self.flat_params[lo:hi], self.flat_grads[lo:hi], int(lo - self.offsets[i])  # views
            return None

        return full.over(views)

    def finish(self) -> None:
        """After the step's last backward: ``Reduce_scatter`` of each segment; my shard,
        divided by ``P``, is the mean over the global batch."""
        P = self.comm.size
        if P > 1:
            for (lo, hi, bounds), shard in zip(self.segments, self.shards):
                if self.algorithm == "ring":
                    Ring(self.comm, self.flat_grads[lo:hi], ("reduce_scatter",)).wait()
                else:
                    mine = np.empty(shard.stop - shard.start, dtype=self.flat_grads.dtype)  # for this call only
                    ireduce_scatter(self.comm, self.flat_grads[lo:hi], mine, np.diff(bounds)).wait()
                    self.flat_grads[shard] = mine
                mean(self.flat_grads[shard], P)
        self.exchanged = True

    def held(self) -> dict:
        return self.grads

    def step(self, lr: float | None = None, grad_clip: float = 0.0, norm: float | None = None) -> float:
        """Update my shard, share the parameters; returns the global gradient norm
        (computed only when clipping, else nan). ``norm``: the whole model's, when this is
        a part of it (:class:`~mpitrain.parallel.GradSync`)."""
        if not self.exchanged:
            self.finish()
        norm = sharded_update(self.comm, self.optimizer, [self.flat_grads[shard] for shard in self.shards], lr,
                              grad_clip, norm)
        if self.comm.size > 1:
            for lo, hi, bounds in self.segments:
                if self.algorithm == "ring":
                    Ring(self.comm, self.flat_params[lo:hi], ("allgather",)).wait()
                else:
                    self.comm.allgather_array(self.flat_params[lo:hi], np.diff(bounds))
        self.exchanged = False
        return norm

    def zero_grad(self) -> None:
        self.flat_grads.fill(0)
        self.exchanged = False

    def whole_model(self, masters: bool = False):
        return _masters_whole(self, self.segments) if masters else contextlib.nullcontext()


def segments(params, offsets, kind, P: int) -> list[tuple]:
    """The flat layout of ``params`` (at ``offsets``) in :func:`runs` of one ``kind``,
    each ``(lo, hi, bounds)``: its range and its ``P + 1`` chunk starts (chunk ``r`` is
    rank ``r``'s shard)."""
    out, first = [], 0
    for run in runs(params, kind):
        lo, hi = int(offsets[first]), int(offsets[first + len(run)])
        out.append((lo, hi, lo + chunk_bounds(hi - lo, P)))
        first += len(run)
    return out


# ----------------------------------------------------------------------------- ZeRO-2
ACCUMULATE = ("sharded", "full")  # ZeRO-2 with micro-batches: reduce-scatter each, or the sum once


@dataclass
class _Bucket:
    """Elements ``[lo, hi)`` of the flat layout, whose gradients are reduce-scattered
    together, cut into ``P`` chunks at ``bounds``; this rank keeps chunk ``rank`` at
    ``shard`` in its gradient shard."""

    lo: int
    hi: int
    bounds: np.ndarray  # (P + 1,) chunk starts in flat coordinates, and hi
    shard: slice  # where my chunk's gradient lies in Zero2.grad_shard
    comm: object  # a Dup of dp_comm for this bucket alone (concurrent rings must not mix)
    send: np.ndarray | None = None  # (hi - lo,) the packed gradients in flight, freed when done
    recv: np.ndarray | None = None  # MPI's reduce-scatter: my chunk's sum lands here
    request: object = None


class Zero2(GradSync):
    """ZeRO stage 2 over ``dp_comm``: gradients are reduce-scattered bucket by bucket
    during backward, and each rank keeps only its shard of them and of the optimizer
    state (Rajbhandari et al., SC 2020, stage P_os+g). Use like :class:`Zero1`::

        zero = Zero2(model, opt, dp_comm)
        loss.backward()            # complete buckets start their reduce-scatter
        zero.finish()              # wait for them, average my shard
        zero.step(lr, grad_clip)   # update my shard, allgather the parameters
        zero.zero_grad()

    ``accumulate`` decides what micro-batches (backward passes inside ``no_sync()``)
    do: ``"sharded"`` reduce-scatters every pass and adds into the shard (memory: one
    shard of gradient; bytes: one reduce-scatter per micro-batch), ``"full"`` lets the
    passes add into whole gradients and reduce-scatters their sum after the last
    (memory: the whole gradient until then; bytes: one reduce-scatter per step).
    ``kind``: a bucket holds parameters of one kind (:class:`Zero1`)."""

    waits = {"finish": "gradient reduce-scatter", "step": "ZeRO-2 update"}
    sharded = True

    def __init__(self, model, optimizer, dp_comm, algorithm: str = "mpi", bucket_cap_mb: float = 4.0,
                 accumulate: str = "sharded", kind=None):
        if algorithm not in ("mpi", "ring"):
            raise ValueError(f"ZeRO-2's reduce-scatter algorithm must be 'mpi' or 'ring', got {algorithm!r}")
        if accumulate not in ACCUMULATE:
            raise ValueError(f"accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        super().__init__(model, optimizer, dp_comm)  # self.params: the flat layout's order
        self.algorithm, self.accumulate, self.accumulating = algorithm, accumulate, False
        self._index = {id(p): i for i, p in enumerate(self.params)}
        opt_params = trained(optimizer)
        if {id(p) for p in opt_params} != {id(p) for p in self.params}:
            raise ValueError("ZeRO-2 needs an optimizer over exactly the model's trainable parameters")
        layout = Flat(self.params, data=True, grad=False, what="ZeRO-2")  # no whole gradient is ever kept
        self.flat_params, self.offsets = layout.data, layout.offsets  # (N,), (n_params + 1,)
        replicas.broadcast(dp_comm, [self.flat_params] + [b for _, b in model.named_buffers()]
                           + list(getattr(optimizer, "masters", [])))  # mixed precision's float32 masters
        for p in self.params:
            p.grad = None
        self.buckets = Buckets(self.params, int(bucket_cap_mb * 2**20), self._start, progress=self._test, kind=kind)
        self.ranges = self._ranges()
        self.grad_shard = np.zeros(sum(b.shard.stop - b.shard.start for b in self.ranges),
                                   dtype=self.flat_params.dtype)  # (about N/P,) my chunks, bucket by bucket
        self.optimizer = self._shard_optimizer(optimizer, opt_params)

    def _ranges(self) -> list:
        """Each bucket's contiguous range of the flat layout; my chunk of each, laid end to end."""
        P, r = self.comm.size, self.comm.rank
        out, at = [], 0
        for group in self.buckets.groups:
            first, last = self._index[id(group[-1])], self._index[id(group[0])]
            lo, hi = int(self.offsets[first]), int(self.offsets[last + 1])
            bounds = lo + chunk_bounds(hi - lo, P)
            mine = int(bounds[r + 1] - bounds[r])
            out.append(_Bucket(lo, hi, bounds, slice(at, at + mine), self.comm.dup()))
            at += mine
        return out

    def _shard_optimizer(self, full, opt_params):
        """The optimizer over my pieces: for each parameter, the part inside my chunk of
        its bucket (at most one range), its data a view of the flat parameters and its
        gradient a view of the shard. ``self.pieces`` says where each piece lies in the
        flat layout of the optimizer's own order (checkpoints' coordinates)."""
        opt_offsets = offsets(opt_params)
        opt_index = {id(p): i for i, p in enumerate(opt_params)}
        bucket_of = {id(p): b for b, group in zip(self.ranges, self.buckets.groups) for p in group}
        r = self.comm.rank
        self.pieces = []
        self.spans = []  # (lo, hi) of each piece in self.flat_params
        self.grads = {}  # id(parameter) -> my piece of its gradient (a view of the shard)

        def views(p):
            b, i = bucket_of[id(p)], self._index[id(p)]
            lo, hi = max(int(b.bounds[r]), int(self.offsets[i])), min(int(b.bounds[r + 1]), int(self.offsets[i + 1]))
            if lo >= hi:
                return None
            at = b.shard.start + lo - int(b.bounds[r])  # in the shard
            base = int(opt_offsets[opt_index[id(p)]]) - int(self.offsets[i])
            self.pieces.append((opt_index[id(p)], lo + base, hi + base))
            self.spans.append((lo, hi))
            self.grads[id(p)] = self.grad_shard[at : at + hi - lo]
            return self.flat_params[lo:hi], self.grads[id(p)], lo - int(self.offsets[i])

        return full.over(views)

    # ------------------------------------------------------------- backward
    def _start(self, i: int) -> None:
        """Bucket ``i`` is complete: pack its gradients (zeros for a parameter that had
        none), free them, start the reduce-scatter of the packed copy."""
        b = self.ranges[i]
        if b.request is not None:  # the previous micro-batch's, still in flight
            b.request.wait()
            self._completed(b)
        b.send = np.zeros(b.hi - b.lo, dtype=self.flat_params.dtype)  # (hi - lo,)
        for p in self.buckets.groups[i]:
            j = self._index[id(p)]
            if p.grad is not None:
                b.send[self.offsets[j] - b.lo : self.offsets[j + 1] - b.lo] = p.grad.reshape(-1)
                p.grad = None  # the whole gradient lives only until it is packed
        if self.algorithm == "ring":
            b.request = Ring(b.comm, b.send, ("reduce_scatter",))
        else:
            b.recv = np.empty(b.shard.stop - b.shard.start, dtype=b.send.dtype)
            b.request = ireduce_scatter(b.comm, b.send, b.recv, np.diff(b.bounds))

    def _test(self) -> None:
        """From every gradient-ready hook: progress the reduce-scatters in flight."""
        for b in self.ranges:
            if b.request is not None and b.request.test():
                self._completed(b)

    def _completed(self, b: _Bucket) -> None:
        """Add my chunk's sum into the shard; free the buffers."""
        r = self.comm.rank
        mine = b.recv if self.algorithm == "mpi" else b.send[b.bounds[r] - b.lo : b.bounds[r + 1] - b.lo]
        with np.errstate(over="ignore"):  # fp16's overflow is the loss scaler's to find
            self.grad_shard[b.shard] += mine
        b.send = b.recv = b.request = None

    def finish(self) -> None:
        """After the step's last backward: start what is left, wait for every bucket,
        average my shard over the ranks."""
        if self.accumulating:
            raise RuntimeError("finish() inside no_sync(): gradients are only accumulated there")
        self.buckets.flush()
        for b in self.ranges:
            if b.request is not None:
                b.request.wait()
                self._completed(b)
        mean(self.grad_shard, self.comm.size)

    def held(self) -> dict:
        return self.grads

    @contextlib.contextmanager
    def no_sync(self):
        """A micro-batch's backward: with ``accumulate="sharded"`` its buckets are
        reduce-scattered as usual (and the rest started when it ends); with ``"full"``
        it only adds into the parameters' gradients."""
        self.accumulating = True
        self.buckets.counting = self.accumulate == "sharded"
        try:
            yield
            if self.accumulate == "sharded":
                self.buckets.flush()
        finally:
            self.accumulating, self.buckets.counting = False, True

    # ---------------------------------------------------------------- update
    def step(self, lr: float | None = None, grad_clip: float = 0.0, norm: float | None = None) -> float:
        """Clip by the global norm (``norm``: as :class:`Zero1`), update my shard,
        allgather the parameters bucket by bucket; returns the global gradient norm
        (computed only when clipping, else nan)."""
        norm = sharded_update(self.comm, self.optimizer, [self.grad_shard], lr, grad_clip, norm)
        if self.comm.size > 1:
            for b in self.ranges:
                if self.algorithm == "ring":
                    Ring(b.comm, self.flat_params[b.lo : b.hi], ("allgather",)).wait()
                else:
                    b.comm.allgather_array(self.flat_params[b.lo : b.hi], np.diff(b.bounds))
        return norm

    def zero_grad(self) -> None:
        self.grad_shard.fill(0)
        for p in self.params:
            p.grad = None

    def whole_model(self, masters: bool = False):
        runs = [(b.lo, b.hi, b.bounds) for b in self.ranges]
        return _masters_whole(self, runs) if masters else contextlib.nullcontext()

    def close(self) -> None:
        for b in self.ranges:
            b.comm.free()


@contextlib.contextmanager
def _masters_whole(zero, runs):
    """``zero.whole_model(masters=True)``: in mixed precision the float32 masters, which the ranks
    hold in shards, gathered whole into every parameter's ``.data`` (a checkpoint saves
    or loads them there: one allgather of ``4N`` bytes); on the way out each rank keeps
    its shard of them and rounds every working copy from them. In float32 the flat
    parameters are whole already: nothing to do. ``runs`` are ``(lo, hi, chunk starts)`` of
    the flat layout, one allgather each."""
    if not hasattr(zero.optimizer, "masters"):
        yield
        return
    masters = zero.optimizer.masters  # mine (a rank may hold none: it still takes part in the allgather)
    whole = np.zeros(zero.flat_params.size, dtype=np.float32)  # (N,) every master, in the flat layout
    for (lo, hi), m in zip(zero.spans, masters):
        whole[lo:hi] = m
    for lo, hi, bounds in runs if zero.comm.size > 1 else ():
        zero.comm.allgather_array(whole[lo:hi], np.diff(bounds))
    halves = [p.data for p in zero.params]
    for p, lo, hi in zip(zero.params, zero.offsets[:-1], zero.offsets[1:]):
        p.data = whole[lo:hi].reshape(p.shape)
    try:
        yield
    finally:
        for p, half in zip(zero.params, halves):
            p.data = half
        for (lo, hi), m in zip(zero.spans, masters):
            m[...] = whole[lo:hi]
        np.copyto(zero.flat_params, whole, casting="same_kind")
