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
  each parameter's ``.grad`` is a view into one, buckets are filled in reverse parameter
  order (the order backward produces gradients) up to ``bucket_cap_mb`` each;
* during backward, each parameter's gradient-ready hook counts down its bucket; when a
  bucket is complete (and every bucket before it has started, so all ranks start them
  in the same order) a non-blocking allreduce of the whole bucket starts: MPI's
  ``Iallreduce``, mpitrain's ring (:mod:`mpitrain.comm.ring`) or the node-aware one
  (:mod:`mpitrain.comm.hierarchical`: inside each node over shared memory, across nodes
  once per node), each bucket on its own ``Dup`` of ``dp_comm`` so concurrent rings
  cannot mix;
* :meth:`DataParallel.finish` after backward starts any bucket still waiting (a
  parameter that took no part in this forward), waits for all, and divides by ``P``;
  then every rank applies the same optimizer step to the same averaged gradients
  (:meth:`DataParallel.step`, no communication).

**Sum or mean.** Each rank's loss is the mean over its ``B/P`` samples; the allreduce
sums, and the ``1/P`` is applied to the summed buckets in ``finish``, so the result is
the mean over all ``B`` samples: the gradient of one process with batch ``B``.

**Bytes per rank per step**: one allreduce of all gradients, ``N`` parameters of ``s``
bytes: ``2 (P-1)/P x N x s`` (exact for the ring, counted per rank by ``comm``; MPI's
collectives are counted by the same formula). The node-aware allreduce on ``n`` nodes of
``L`` ranks sends ``2 (L-1)/L x N x s`` inside the node and ``2 (n-1)/n x N x s / L``
over the network per rank (:meth:`DataParallel.link_bytes`).

**Overlap.** MPICH moves a non-blocking collective forward only while the process is
inside an MPI call, so a bucket started early in backward sits still while NumPy runs,
unless something calls into MPI. Three ways to progress it (``progress=``):

* ``"test"`` (default): every gradient-ready hook calls ``Test`` on the buckets in
  flight, which is between the backward of consecutive layers;
* ``"thread"``: a communication thread (Horovod's design) runs each bucket's blocking
  allreduce as soon as the hook hands it over; needs MPI thread level ``serialized``
  or ``multiple``;
* ``"none"``: started early, finished in ``finish``;
* ``"off"``: no overlap, every bucket starts in ``finish`` after backward: the
  baseline the others are measured against.

Measured here (2-core Xeon VM, MPICH 5.0 wheel, 2 ranks with one BLAS thread each,
buckets of 4 MB, thread level ``multiple``) with ``mpitrain bench ddp``:

* nanoGPT's small GPT (3.2 MB of gradients in one bucket): the allreduce alone takes
  0.8 ms, 2% of the step, and every mode exposes 0-1.6 ms of it.
* a wide GPT (7.1 M parameters, 28.5 MB in 9 buckets, 32 tokens per rank): the
  allreduce alone takes 10 ms, 9-10% of a step that does not overlap it. Exposed:
  ``off`` 5.6-11.8 ms, ``test`` 14-16 ms, ``none`` 10-15 ms, ``thread`` 13-24 ms, while
  the steps of two synchronised ranks on this VM spread by +-15% (p10-p90 84-114 ms
  for the step without communication), more than these differences.
* the probe without a model (the same buckets against matrix products with ``Test``
  between them) hides 13% of the allreduce; started without any ``Test`` 17%, so
  what is hidden is waiting a separate allreduce pays, not copying done during the
  products.

Why so little: on one node an allreduce is memory copies and additions, and with
both cores computing, nobody else can do them: the copying is paid whoever does it
and only the waiting can be hidden. (An earlier measurement, 93% hidden at thread level
``single``, compared with a blocking ``Allreduce`` that is 3-4x slower than
``Iallreduce`` + ``Wait`` at that level: 3.9 ms against 1.1 ms for 4 MiB, measured
here; against the faster call there is nothing left to hide.)

**Across a network** the link moves the bytes and overlap pays. Measured with
``mpitrain bench ddp --network 1gbit`` (2 emulated nodes of one core and one rank each,
:mod:`mpitrain.cluster`), nanoGPT's GPT at its batch per process (12 sequences per rank,
``gpt-ddp``): 3.2 MB of gradients, 28-30 ms on the link, 31-33% of a step that does not
overlap them. What the timeline of each bucket showed, and what was done:

* **Bucket size: about 2 ms of the link.** The default 4 MB is one bucket for this
  model, complete only when backward ends: nothing hidden. Buckets of 0.125, 0.25, 0.5,
  1 MB hid 66-71%, 67-70%, 55-61% and 51-54% (``ring``): a bucket must be small enough
  that the first starts early and the last leaves little to send after backward, and
  large enough that its per-message costs stay small. 0.25 MB is 2 ms at 1 Gbit/s; the
  same rule gives 2.5 MB at 10 Gbit/s and 25 MB (PyTorch DDP's default) at 100 Gbit/s.
  :func:`mpitrain.cluster.link_bucket_mb` computes it (``bench ddp --network`` and
  ``jobs/scaling_cluster.sh`` use it); set ``parallel.bucket_mb`` to it.
* **One round per allreduce.** A rank progresses MPI only from the gradient hooks,
  which come in bursts between layers (4-5 ms apart here), and each round of an
  allreduce waits for the next burst on both ranks: MPICH's ``Iallreduce`` of two ranks
  (reduce-scatter, then allgather) took 10 ms for a 0.26 MB bucket that needs 2 ms on
  the link. mpitrain's ``ring`` on two ranks on different nodes is one exchange
  (:class:`mpitrain.comm.ring.Exchange`): 65-70% hidden against MPI's 53-57%.
* **Progress.** ``test`` and ``none`` do alike with the exchange (each bucket's start
  pushes its bytes into the kernel, which sends them at line rate without the rank);
  ``thread`` hides next to nothing (-32% to +7%), its blocking allreduce spinning on the
  node's only core. A thread that polls with ``Test`` and sleeps between (Horovod's
  cycle) was slower than ``test`` too: on one core it contends for the GIL and wakes.
* **What is left** is CPU: the emulated link's TCP stack and MPI's copies cost 6-7 ms of
  the rank's core per step (measured without compute: ``user`` + ``sys`` of a step's
  buckets), which the backward pays when communication overlaps it (32 ms alone, 39-41
  ms beside it). At nanoGPT's small setting on 2 ranks (``gpt``, 6 sequences per rank)
  backward takes 17 ms against 28 ms on the link, so at most about half can hide:
  measured 43-51%.

**Mixed precision** (:class:`mpitrain.precision.MixedPrecision` as the optimizer): the
parameters and their gradients, so the buckets too, are half-precision arrays; the ring
sends them as they are, adding in float32 at each hop, and MPI's allreduce sums a float32
copy of each (MPI cannot add bfloat16); the average's ``1/P`` is one more float32
product, rounded (exact when ``P`` is a power of two). The construction broadcasts the
float32 masters with the parameters.

**Half the bytes.** With ``wire="bf16"`` or ``"fp16"`` (and the ring) the buckets stay
float32 but travel as 16-bit numbers, added in float32 at each hop and rounded alike on
every rank (:mod:`mpitrain.comm.ring`, "Half precision on the wire"): half the bytes per
step. Measured with ``bench ddp --network 1gbit --allreduce ring --wire bf16`` against
fp32 (2 nodes, one sitting): the communication alone 15.5-15.6 ms against 28.6-28.7; the
exposed part (``test``) of nanoGPT's small GPT (``gpt``, 6 sequences per rank) 6.6
against 17.8 ms, 63% less; of ``gpt-ddp`` (12 per rank, where fp32 already hides
61-62%) 7.1-7.9 against 10.9-11.2 ms, 28-37% less; with nothing overlapped (``off``)
45-48% less for both. The tiny shakespeare run reaches 1.8993 with bf16 on the wire
against 1.8991 (2 ranks, 2,000 steps). MPI's allreduce cannot add 16-bit numbers in
float32 (MPI has no bfloat16), so ``algorithm="mpi"`` refuses a 16-bit wire.

Defaults: ``progress="test"`` (what the probe favours, within the noise of the step),
MPI thread level ``multiple`` (see :func:`mpitrain.comm.thread_level`), buckets of 4 MB
(for shared memory, where smaller buckets only add per-message costs).

**Batch norm.** Each rank normalises with the statistics of its own ``B/P`` samples, as
PyTorch DDP does by default: the gradients then equal those of one process that splits
its batch into ``P`` groups of ``B/P`` for batch norm (tested). Running statistics are
not part of the gradient; :meth:`DataParallel.sync_buffers` averages them over ranks
(the trainer does so before each evaluation), so replicas evaluate alike.

**Gradient accumulation.** Inside ``with dp.no_sync():`` backward only accumulates into
the buckets; the next backward outside it reduces the sum (the trainer's micro-batches:
``train.micro_batches``, every backward but the last of a step inside ``no_sync``).

**In the trainer** the class is one implementation of the gradient sync the loop calls
(``mpitrain/train/sync.py``): ``begin_step``, ``no_sync``, ``finish``, ``step``,
``zero_grad``, ``sync_buffers``, ``check_replicas``, ``state_pieces``, ``describe``.

**Launch**: ``mpiexec -n 2 mpitrain train jobs/mnist_lenet.toml --set parallel.sync=ddp``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from mpitrain import flat, optim
from mpitrain.comm import replicas
from mpitrain.comm.hierarchical import link_bytes
from mpitrain.comm.ring import ALGORITHMS, allreduce, iallreduce, wire_dtype

PROGRESS = ("test", "thread", "none", "off")


@dataclass
class Bucket:
    params: list  # in the order backward completes them (reverse registration order)
    flat: np.ndarray  # (n,) the gradients of ``params``, back to back
    comm: object  # a Dup of dp_comm for this bucket alone
    waiting: int = 0  # parameters of this pass not ready yet
    request: object = None
    started: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class StepStats:
    """Communication of the steps so far (seconds are wall time on this rank)."""

    exposed_seconds: float = 0.0  # finish() waiting: communication not hidden by backward
    total_seconds: float = 0.0  # per bucket, from start to seen complete, summed


class DataParallel:
    """Average gradients over ``dp_comm`` with bucketed allreduces started during backward.

    Use::

        dp = DataParallel(model, dp_comm, optimizer=opt)
        loss = loss_fn(model, x_local, y_local)
        loss.backward()      # buckets start as they complete
        dp.finish()          # wait, average: every rank now has the same .grad
        dp.step(lr, grad_clip); dp.zero_grad()   # or opt.step(); opt.zero_grad()
    """

    def __init__(self, model, dp_comm, optimizer=None, bucket_cap_mb: float = 4.0, algorithm: str = "mpi",
                 progress: str = "test", broadcast: bool = True, wire: str = "fp32"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"allreduce algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if progress not in PROGRESS:
            raise ValueError(f"progress must be one of {PROGRESS}, got {progress!r}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.model, self.comm, self.optimizer = model, dp_comm, optimizer
        self.algorithm, self.progress, self.bucket_cap_mb = algorithm, progress, bucket_cap_mb
        self.wire_name, self.wire = wire, wire_dtype(wire)  # the gradients' numbers on the wire (ring only)
        if self.wire is not None and algorithm != "ring":
            raise ValueError(f"gradients in {wire} on the wire need the ring (algorithm='ring'), not {algorithm!r}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if broadcast:  # and a mixed-precision optimizer's float32 masters (mpitrain.precision)
            replicas.broadcast(dp_comm, [p.data for p in self.params] + [b for _, b in model.named_buffers()]
                               + list(getattr(optimizer, "masters", [])))
        # backward produces gradients in reverse parameter order: buckets fill in that order
        self.buckets = [Bucket(group, flat.Flat(group, what="a DataParallel bucket").grad, dp_comm.dup())
                        for group in flat.buckets(reversed(self.params), int(bucket_cap_mb * 2**20))]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._views = {id(p): p.grad for p in self.params}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)
        self._sync = True
        self._next = 0  # the first bucket not started in this pass
        self.stats = StepStats()
        self.on_comm = None  # called (name, start, end, bytes) as each bucket's allreduce completes (a timeline)
        self._thread = self._queue = None
        if progress == "thread" and dp_comm.size > 1:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._communicate, name="dp-allreduce", daemon=True)
            self._thread.start()
        self._reset()

    # ------------------------------------------------------------- backward
    def _reset(self) -> None:
        for b in self.buckets:
            b.waiting, b.request = len(b.params), None
            b.done.clear()
        self._next = 0

    def _ready(self, p) -> None:
        """Gradient-ready hook: count down the bucket; start complete buckets in order."""
        if not self._sync:
            return
        if p.grad is not self._views[id(p)]:
            raise RuntimeError("a parameter's .grad was replaced; DataParallel keeps it as a view "
                               "into a bucket (zero it in place, never set it to None)")
        bucket = self._bucket_of[id(p)]
        if bucket.waiting == 0:
            raise RuntimeError("a second backward before finish(): call dp.finish() after each "
                               "backward, or accumulate inside dp.no_sync()")
        bucket.waiting -= 1
        if self.progress == "off":
            return
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self._start(self.buckets[self._next])
            self._next += 1
        if self.progress == "test":
            for b in self.buckets[: self._next]:
                if not b.done.is_set() and b.request.test():
                    self._completed(b)

    def _start(self, bucket: Bucket) -> None:
        bucket.started = time.perf_counter()
        if self.comm.size == 1:
            bucket.done.set()
        elif self._queue is not None:
            self._queue.put(bucket)
        else:
            bucket.request = iallreduce(bucket.comm, bucket.flat, self.algorithm, self.wire)

    def _completed(self, bucket: Bucket) -> None:
        end = time.perf_counter()
        self.stats.total_seconds += end - bucket.started
        if self.on_comm is not None:
            self.on_comm(f"allreduce bucket {self.buckets.index(bucket)}", bucket.started, end, bucket.flat.nbytes)
        bucket.done.set()

    def _communicate(self) -> None:
        """The communication thread: blocking allreduces, one bucket at a time."""
        while True:
            bucket = self._queue.get()
            if bucket is None:
                return
            allreduce(bucket.comm, bucket.flat, self.algorithm, self.wire)
            self._completed(bucket)

    def finish(self) -> None:
        """After backward: start what is left, wait for every bucket, average."""
        if not self._sync:
            raise RuntimeError("finish() inside no_sync(): gradients are only accumulated there")
        tick = time.perf_counter()
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
            self._next += 1
        scale = 1.0 / self.comm.size
        for b in self.buckets:
            if not b.done.is_set():
                if b.request is not None:
                    b.request.wait()
                    self._completed(b)
                else:
                    b.done.wait()
            if self.comm.size > 1:  # a half bucket in float32 arithmetic: 1/P rounded to bf16 would be 2^-9 off
                np.multiply(b.flat, np.float32(scale) if b.flat.itemsize == 2 else scale, out=b.flat,
                            casting="same_kind")
        self.stats.exposed_seconds += time.perf_counter() - tick
        self._reset()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    # ------------------------------------------------ the update, and checks
    def begin_step(self) -> bool:
        """Nothing to wait for before a step's forward."""
        return True

    def step(self, lr: float | None = None, grad_clip: float = 0.0) -> None:
        """The optimizer step on the averaged gradients (the same on every replica, so
        no communication); ``grad_clip`` > 0 clips them to that global norm first."""
        if self.optimizer is None:
            raise RuntimeError("DataParallel.step needs the optimizer: DataParallel(model, dp_comm, optimizer=opt)")
        optim.update(self.optimizer, self.params, lr, grad_clip)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.flat.fill(0)

    def whole_model(self):
        """The model's parameters are whole in ``.data`` already: nothing to gather."""
        return contextlib.nullcontext()

    def memory(self) -> dict:
        """Bytes this rank keeps between steps (``mpitrain bench memory``): parameters,
        gradients, optimizer state and the optimizer's work array."""
        return {"param_bytes": sum(p.data.nbytes for p in self.params),
                "grad_bytes": sum(b.flat.nbytes for b in self.buckets), **self.optimizer.memory()}

    def sync_buffers(self) -> None:
        """Average floating buffers (batch-norm running statistics) over ranks."""
        replicas.average(self.comm, [b for _, b in self.model.named_buffers()])

    def check_replicas(self) -> str:
        """Raise unless every rank holds bit-identical parameters; returns the digest."""
        return replicas.check_same(self.comm, [p.data for p in self.params])

    def state_pieces(self, offsets):
        """For checkpoints: the optimizer, every parameter's ``(index, lo, hi)`` in the flat
        layout ``offsets``, and whether this rank writes them: the state is replicated,
        so rank 0 of ``dp_comm`` does."""
        return self.optimizer, flat.pieces(offsets), self.comm.rank == 0

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent in gradient allreduces."""
        return sum(self.link_bytes().values())

    def link_bytes(self) -> dict[str, int]:
        """The same by link class: ``intra-node`` and ``inter-node`` with the node-aware
        allreduce, ``comm`` (all of it) with the others."""
        total: dict[str, int] = {}
        for b in self.buckets:
            for link, n in link_bytes(b.comm).items():
                total[link] = total.get(link, 0) + n
        return total

    def comm_seconds(self) -> tuple[float, float]:
        """(exposed, total) communication seconds so far on this rank."""
        return self.stats.exposed_seconds, self.stats.total_seconds

    def bytes_per_step(self) -> float:
        """The formula: ``2 (P-1)/P x`` gradient bytes (in the wire's format; half-precision
        buckets, mixed precision's, as they are on the ring and in float32 through MPI)."""
        P = self.comm.size
        numbers = sum(b.flat.size for b in self.buckets)
        size = self.buckets[0].flat.itemsize if self.wire is None else self.wire.itemsize
        return 2 * (P - 1) / P * numbers * (4 if size == 2 and self.algorithm == "mpi" else size)

    def describe(self) -> tuple[str, dict[str, str]]:
        """One line for the start of a run, and the name of each call that waits for
        the other ranks (the trainer's stall watchdog shows it)."""
        what = (f"ddp over {self.comm.size} rank(s): {len(self.buckets)} bucket(s) of <= {self.bucket_cap_mb:g} MB, "
                f"{self.algorithm} allreduce{'' if self.wire is None else ' in ' + self.wire_name}, "
                f"progress '{self.progress}'; "
                f"{self.bytes_per_step() / 1e6:.2f} MB sent per rank per step")
        return what, {"finish": "gradient exchange"}

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for b in self.buckets:
            b.comm.free()
