"""Synchronous data parallelism: every rank holds the whole model, gradients are averaged.

**What is split.** The global batch of ``B`` samples: each of the ``P = dp_size`` ranks
of ``dp_comm`` computes forward and backward on its ``B/P`` samples (the shard reader
hands each rank its slice of the same global batches at any ``P``). Parameters,
gradients and optimizer state are replicated.

**The calls and when** (Li et al., "PyTorch Distributed", VLDB 2020; Sergeev & Del Balso,
"Horovod", 2018):

* at construction, ``Bcast`` of rank 0's parameters and buffers, so every replica
  starts equal whatever each rank initialised (:func:`mpitrain.comm.replicas.broadcast`);
* the gradients live in flat contiguous *bucket* buffers (:class:`mpitrain.flat.Flat`):
  each parameter's ``.grad`` is a view into one; buckets are filled in reverse parameter
  order (the order backward produces gradients) up to ``bucket_cap_mb`` each;
* during backward, each parameter's gradient-ready hook counts down its bucket; when a
  bucket is complete (and every bucket before it has started, so all ranks start them
  in the same order: :class:`mpitrain.flat.Buckets`) a non-blocking allreduce of the
  whole bucket starts: MPI's ``Iallreduce``, mpitrain's ring (:mod:`mpitrain.comm.ring`)
  or the node-aware one (:mod:`mpitrain.comm.hierarchical`), each bucket on its own
  ``Dup`` of ``dp_comm`` so concurrent rings cannot mix;
* :meth:`DataParallel.finish` after backward starts any bucket still waiting (a
  parameter that took no part in this forward), waits for all, and divides by ``P``;
  then every rank applies the same optimizer step to the same averaged gradients (no
  communication).

**Sum or mean.** Each rank's loss is the mean over its ``B/P`` samples; the allreduce
sums, and the ``1/P`` is applied to the summed buckets in ``finish``, so the result is
the mean over all ``B`` samples: the gradient of one process with batch ``B``.

**Bytes per rank per step**: one allreduce of all gradients, ``N`` parameters of ``s``
bytes: ``2 (P-1)/P x N x s`` (:func:`mpitrain.cost.collective_bytes`; exact for the ring;
the node-aware allreduce's split between shared memory and the network is
:func:`mpitrain.cost.node_aware_bytes`).

**Overlap.** MPICH moves a non-blocking collective forward only inside an MPI call, so a
bucket started early in backward sits still while NumPy runs unless something calls
into MPI. The default, ``progress="test"``, calls ``Test`` on the buckets in flight from
every gradient-ready hook, between the backward of consecutive layers. Beside it:
``"none"`` leaves them to ``finish``; ``"thread"`` hands each complete bucket to a
communication thread (:class:`mpitrain.comm.CommThread`, Horovod's design; MPI thread
level ``serialized`` or ``multiple``); ``"off"`` starts every bucket in ``finish``, the
baseline. On one node an allreduce is copies and additions the computing cores must do
anyway, so little can hide; across a network overlap pays, most with buckets of about
2 ms of the link (:func:`mpitrain.cluster.link_bucket_mb`) and, on two ranks, the ring's
one-round exchange (:class:`mpitrain.comm.ring.Exchange`); measured:
``mpitrain/bench/README.md``.

**Mixed precision** (:class:`mpitrain.precision.MixedPrecision` as the optimizer): the
parameters and their gradients, so the buckets too, are half-precision arrays; the ring
sends them as they are, adding in float32 at each hop, and MPI's allreduce sums a float32
copy of each (MPI cannot add bfloat16); the ``1/P`` is one more float32 product, rounded
(exact when ``P`` is a power of two). The construction broadcasts the float32 masters
with the parameters. With ``wire="bf16"`` or ``"fp16"`` (the ring only) float32 buckets
travel as 16-bit numbers, added in float32 at each hop and rounded alike on every rank
(:mod:`mpitrain.comm.ring`): half the bytes.

**Batch norm.** Each rank normalises with the statistics of its own ``B/P`` samples, as
PyTorch DDP does by default: the gradients then equal those of one process that splits
its batch into ``P`` groups of ``B/P`` for batch norm (tested). Running statistics are
not part of the gradient; ``sync_buffers`` averages them over ranks (the trainer does so
before each evaluation), so replicas evaluate alike.

**Gradient accumulation.** Inside ``with dp.no_sync():`` backward only accumulates into
the buckets; the next backward outside it reduces the sum (the trainer's micro-batches).

**Launch**: ``mpiexec -n 2 mpitrain train jobs/mnist_lenet.toml --set parallel.sync=ddp``.
"""

from __future__ import annotations

import contextlib

import numpy as np

from mpitrain import flat
from mpitrain.comm import CommThread, replicas
from mpitrain.comm.allreduce import ALGORITHMS, allreduce, iallreduce
from mpitrain.comm.ring import wire_dtype
from mpitrain.parallel import GradSync

PROGRESS = ("test", "none", "thread", "off")


class DataParallel(GradSync):
    """Average gradients over ``dp_comm`` with bucketed allreduces started during backward.

    Use::

        dp = DataParallel(model, dp_comm, optimizer=opt)
        loss = loss_fn(model, x_local, y_local)
        loss.backward()      # buckets start as they complete
        dp.finish()          # wait, average: every rank now has the same .grad
        dp.step(lr, grad_clip); dp.zero_grad()   # or opt.step(); opt.zero_grad()
    """

    waits = {"finish": "gradient exchange"}

    def __init__(self, model, dp_comm, optimizer=None, bucket_cap_mb: float = 4.0, algorithm: str = "mpi",
                 progress: str = "test", broadcast: bool = True, wire: str = "fp32"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"allreduce algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if progress not in PROGRESS:
            raise ValueError(f"progress must be one of {PROGRESS}, got {progress!r}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        super().__init__(model, optimizer, dp_comm)
        self.algorithm, self.wire = algorithm, wire_dtype(wire)  # the gradients' numbers on the wire (ring only)
        if self.wire is not None and algorithm != "ring":
            raise ValueError(f"gradients in {wire} on the wire need the ring (algorithm='ring'), not {algorithm!r}")
        if broadcast:  # and a mixed-precision optimizer's float32 masters (mpitrain.precision)
            replicas.broadcast(dp_comm, [p.data for p in self.params] + [b for _, b in model.named_buffers()]
                               + list(getattr(optimizer, "masters", [])))
        self.buckets = flat.Buckets(self.params, int(bucket_cap_mb * 2**20), self._start,
                                    progress=self._test if progress == "test" else None, early=progress != "off")
        self.flats = [flat.Flat(group, what="a DataParallel bucket").grad for group in self.buckets.groups]  # (n_i,)
        self._views = [p.grad for p in self.params]
        self.comms = [dp_comm.dup() for _ in self.flats]  # concurrent allreduces must not see each other's messages
        self.requests: list = [None] * len(self.flats)
        self.thread = CommThread(dp_comm.stats, "dp-allreduce") if progress == "thread" and dp_comm.size > 1 else None

    # ------------------------------------------------------------- backward
    def _start(self, i: int) -> None:
        """Bucket ``i`` is complete: start summing it over the ranks."""
        if self.comm.size == 1:
            return
        if self.thread is None:
            self.requests[i] = iallreduce(self.comms[i], self.flats[i], self.algorithm, self.wire)
        else:  # progress="thread": the communication thread runs the blocking allreduce
            self.requests[i] = self.thread.submit(
                lambda: allreduce(self.comms[i], self.flats[i], self.algorithm, self.wire))

    def _test(self) -> None:
        """``progress="test"``: let MPI move the allreduces in flight (from every hook)."""
        for request in self.requests:
            if request is not None:
                request.test()

    def finish(self) -> None:
        """After backward: start what is left, wait for every bucket, average."""
        if not self.buckets.counting:
            raise RuntimeError("finish() inside no_sync(): gradients are only accumulated there")
        if any(p.grad is not view for p, view in zip(self.params, self._views)):
            raise RuntimeError("a parameter's .grad was replaced; DataParallel keeps it as a view into a bucket "
                               "(zero it in place, never set it to None)")
        self.buckets.flush()
        for i, bucket in enumerate(self.flats):
            if self.requests[i] is not None:
                self.requests[i].wait()
                self.requests[i] = None
            if self.comm.size > 1:  # a half bucket in float32 arithmetic: 1/P rounded to bf16 would be 2^-9 off
                np.multiply(bucket, np.float32(1 / self.comm.size) if bucket.itemsize == 2 else 1 / self.comm.size,
                            out=bucket, casting="same_kind")

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally."""
        self.buckets.counting = False
        try:
            yield
        finally:
            self.buckets.counting = True

    def zero_grad(self) -> None:
        for bucket in self.flats:
            bucket.fill(0)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.close()
            self.thread = None
        for comm in self.comms:
            comm.free()
