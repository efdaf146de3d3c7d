"""Per-rank shard reader: rank-count-independent global batches, read ahead by a thread.

Every rank must see its slice of the same global batches whether the job has 1, 2 or 4
ranks (so runs are comparable and resumable at any size), yet read only its own part of
the data, in large sequential reads. The answer is **lanes**: position ``g`` of every
global batch (``0 <= g < B``) is a lane that owns a contiguous region of the split; rank
``r`` of ``P`` serves positions ``[r*B/P, (r+1)*B/P)`` and so reads only its lanes'
regions, ``N/P`` contiguous samples per epoch. Which samples fill which batch is fixed
by ``(seed, epoch)`` alone (:class:`EpochPlan`):

1. rotate the split by a random offset ``o`` (so the ``N mod B`` samples left out by
   ``drop_last`` differ from epoch to epoch);
2. lane ``g`` takes the next ``L = N // B`` positions (``L + 1`` for ``g < N mod B``);
3. each lane region is cut into blocks of ``K`` positions; the epoch walks the blocks in
   a random order ``pi`` (the same for every lane, so all lanes stay in step), and within
   a block every lane takes its samples in its own random order.

A *round* is one block: ``K`` steps for which each rank reads ``B/P`` blocks of ``K``
contiguous samples (a few large ``preadv`` calls) and gathers them into ``K`` batches with
one ``take``. A background thread reads up to ``prefetch`` rounds ahead into a queue,
across epoch boundaries; ``K`` makes a round about ``buffer_mb`` of samples over all ranks.
The shuffle mixes within a lane's block (the builders shuffle class-sorted sources once).
Gathered over ranks, an epoch visits every sample exactly once (with ``drop_last``, all but
``N mod B``), and a step's rank slices, concatenated, are the global batch of a one-rank run.

Text is read the same way with *windows* of ``T + 1`` tokens as samples, giving
``(input, target)`` pairs of length ``T``; why each ``sampling``: ``datasets/README.md``,
"Reading: lanes". Window ``k`` of an epoch starts, with ``"stride"``, at ``t0 + k*T``
(``t0`` random in ``[0, T)`` per epoch), and with ``"random"`` at a uniformly random token,
a hash of (seed, epoch, ``k``) (:func:`mpitrain.data.samples.random_starts`) that any
rank computes by itself; an epoch is still ``n`` windows, which may overlap, read in
stretches across small gaps (:meth:`mpitrain.data.samples.Windows.read`).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from mpitrain.data.samples import READER, SAMPLING, Images, Windows
from mpitrain.data.shards import DataError, Split

@dataclass
class IOStats:
    """What one rank read and waited for in one epoch."""

    bytes_read: int = 0
    read_seconds: float = 0.0  # inside preadv / HDF5 reads
    gather_seconds: float = 0.0  # assembling batches from the blocks read
    samples: int = 0  # samples delivered to the training loop
    stall_seconds: float = 0.0  # the training loop waiting for a batch
    batches: int = 0

    @property
    def read_mb_per_s(self) -> float:
        return self.bytes_read / self.read_seconds / 1e6 if self.read_seconds else float("inf")


@dataclass
class Batch:
    """This rank's slice of one global batch."""

    epoch: int
    step: int  # within the epoch
    x: np.ndarray  # images (b, H, W, C) uint8 | text inputs (b, T) int64
    y: np.ndarray  # labels (b,) int64 | text targets (b, T) int64
    index: np.ndarray  # (b,) sample (window) index in the split
    lanes: np.ndarray  # (b,) position of each sample in the global batch


class EpochPlan:
    """Which sample fills which batch position: a function of (N, B, seed, epoch) only."""

    def __init__(self, n: int, global_batch: int, seed: int, epoch: int, block: int, shuffle: bool):
        self.n, self.B = n, global_batch
        self.L, self.R = divmod(n, global_batch)
        self.K = max(1, min(block, self.L)) if self.L else 1
        self.blocks = -(-self.L // self.K)  # ceil
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        rng = np.random.default_rng((seed, READER, epoch))
        self.offset = int(rng.integers(n)) if shuffle else 0
        self.order = rng.permutation(self.blocks) if shuffle else np.arange(self.blocks)
        self.token_offset_draw = float(rng.random()) if shuffle else 0.0  # text: see Windows

    def starts(self, lanes: np.ndarray, first: int) -> np.ndarray:
        """Split index of the sample at lane position ``first`` for each lane. Lane ``g``
        holds positions ``[g*L, (g+1)*L)`` of the rotated split, and the ``R`` samples
        after ``B*L`` are the extra positions of lanes ``0..R-1``; so the lanes of one
        rank are contiguous, and whole lanes are read in one piece."""
        if first >= self.L:
            return (self.B * self.L + lanes + self.offset) % self.n
        return (lanes * self.L + first + self.offset) % self.n

    def rounds(self, drop_last: bool):
        """(round id, first position in the lane, length) of every round of the epoch."""
        for j, blk in enumerate(self.order):
            first = int(blk) * self.K
            yield j, first, min(self.K, self.L - first)
        if not drop_last and self.R:
            yield self.blocks, self.L, 1  # the extra position of lanes g < R

    def permutations(self, round_id: int, length: int) -> np.ndarray:
        """(B, length): the order in which each lane takes its samples of the round."""
        if not self.shuffle or length == 1:
            return np.broadcast_to(np.arange(length), (self.B, length))
        keys = np.random.default_rng((self.seed, READER, self.epoch, round_id)).random((self.B, length))
        return np.argsort(keys, axis=1)


def _runs(starts: np.ndarray, length: int, n: int):
    """(i, j) ranges of consecutive lanes whose blocks follow each other in the split."""
    follows = (starts[1:] - starts[:-1]) % n == length  # (b - 1,)
    cuts = np.flatnonzero(~follows) + 1
    return list(itertools.pairwise([0, *cuts.tolist(), len(starts)]))


class ShardReader:
    """This rank's batches of a split, read ahead by a background thread. ``global_batch``
    must be divisible by ``size``; every rank yields the same number of batches per epoch
    (:attr:`steps_per_epoch`). ``window`` (the context length) makes a text split's
    samples (input, target) windows."""

    def __init__(self, split: Split, *, rank: int, size: int, global_batch: int, seed: int,
                 shuffle: bool = True, drop_last: bool = True, window: int | None = None,
                 sampling: str = "stride", buffer_mb: float = 32, prefetch: int = 2):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in [0, {size})")
        if sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")
        if global_batch % size:
            raise ValueError(f"global batch {global_batch} is not divisible by {size} ranks")
        self.split, self.rank, self.size = split, rank, size
        self.B, self.b = global_batch, global_batch // size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        if split.y_dtype is None:
            if window is None:
                raise ValueError(f"split {split.name!r} is text: give the window (context length)")
            self.items = Windows(split, window, sampling)
        elif sampling != "stride":
            raise ValueError(f"sampling {sampling!r} places text windows; split {split.name!r} holds images")
        else:
            self.items = Images(split)
        self.n = self.items.n
        if self.n < global_batch and drop_last:
            raise DataError(f"{split.shards[0].path.parent}: split {split.name!r} has {self.n} samples, "
                            f"fewer than one global batch of {global_batch}")
        self.item_bytes = int(np.prod(self.items.sample_shape, dtype=np.int64)) * self.items.dtype.itemsize
        # what storage delivers per sample: x and label; a window adds T new tokens, a random one all T + 1
        self.sample_bytes = (split.sample_bytes if window is None else
                             (window + (sampling == "random")) * split.x_dtype.itemsize)
        # steps per round, from the global batch so that the plan is the same at any rank count
        self.block = max(1, int(buffer_mb * 2**20) // max(1, self.B * self.item_bytes))
        self.prefetch = max(1, prefetch)
        self.lanes = np.arange(rank * self.b, (rank + 1) * self.b)
        self.stats: dict[int, IOStats] = {}
        self._lock = threading.Lock()
        self._spare: list[dict] = []  # read buffers kept between iterations (see _produce)
        self.on_read = None  # called (start, end, bytes) after each round's read, from the reader thread
        self._open = threading.Event()  # clear: no new round is begun (hold)
        self._open.set()
        self._reading = threading.Lock()  # held by the thread while it reads and gathers a round
        self._full = threading.Event()  # set: the thread waits to queue a round (or has ended); see settle

    @property
    def steps_per_epoch(self) -> int:
        L, R = divmod(self.n, self.B)
        return L + (0 if self.drop_last or not R else 1)

    def epoch_stats(self) -> list[IOStats]:
        """Each epoch's statistics so far, taken under the lock (the reader thread adds
        the next epoch's entry while the training loop reads them)."""
        with self._lock:
            return list(self.stats.values())

    def plan(self, epoch: int) -> EpochPlan:
        return EpochPlan(self.n, self.B, self.seed, epoch, self.block, self.shuffle)

    def _stats(self, epoch: int) -> IOStats:
        with self._lock:
            return self.stats.setdefault(epoch, IOStats())

    def hold(self) -> None:
        """Until :meth:`release`, the thread begins no round unless the training loop runs
        out of batches; returns once the round being read, if any, is done. A heap's peak
        measured meanwhile (:class:`mpitrain.observe.memory.HeapTrace`) is the step's own:
        a round's gather allocates its batches and index arrays on the thread's schedule."""
        self._open.clear()
        with self._reading:
            pass

    def release(self) -> None:
        self._open.set()

    def settle(self, timeout: float = 60.0) -> bool:
        """Wait until the thread holds all it may: ``prefetch`` rounds queued and the next
        one gathered, waiting its turn (or the thread has ended). That is the reader's
        steady state whenever storage keeps up, and what :func:`mpitrain.cost.reader_bytes`
        counts; a heap measured before it would catch the queue half filled. False if
        ``timeout`` seconds passed first."""
        return self._full.wait(timeout)

    # ------------------------------------------------------------- producer
    def _round(self, plan: EpochPlan, round_id: int, first: int, length: int, buffers: dict):
        """Read this rank's blocks of one round and gather them into ``length`` batches. The
        blocks go into buffers reused from round to round (fresh ones would cost a page
        fault per 4 KiB); the batches are new arrays, since the training loop may keep them."""
        lanes = self.lanes
        if first >= plan.L:  # the extra step: only lanes g < R have a sample
            lanes = lanes[lanes < plan.R]
        b = len(lanes)
        shape = self.items.sample_shape
        if b == 0:  # this rank has no sample in the epoch's last, partial batch
            return (np.empty((length, 0, *shape), dtype=self.items.dtype),
                    np.empty((length, 0), dtype=self.items.label_dtype), np.zeros((length, 0), dtype=np.int64), lanes)
        if buffers.get("length") != length:
            buffers.update(length=length, block=np.empty((self.b, length, *shape), dtype=self.items.dtype),
                           labels=np.empty((self.b, length), dtype=self.items.label_dtype))
        block, labels = buffers["block"][:b], buffers["labels"][:b]  # (b, k, ...), (b, k)
        starts = plan.starts(lanes, first)  # (b,)
        tick = time.perf_counter()
        nbytes = 0
        for i, j in _runs(starts, length, plan.n):  # lanes i..j-1 are one contiguous stretch
            rows = block[i:j].reshape((j - i) * length, *shape)  # (m*k, ...) view
            labs = labels[i:j].reshape(-1)
            start, count = int(starts[i]), (j - i) * length
            head = min(count, plan.n - start)  # rows before the split wraps around
            nbytes += self.items.read(start, start + head, rows[:head], labs[:head], plan)
            if head < count:
                nbytes += self.items.read(0, count - head, rows[head:], labs[head:], plan)
        read_s = time.perf_counter() - tick
        if self.on_read is not None:
            self.on_read(tick, tick + read_s, nbytes)
        perm = plan.permutations(round_id, length)[lanes]  # (b, k)
        take = np.arange(b)[None, :] * length + perm.T  # (k, b) flat index into the blocks
        # kept as stored (a token in one byte, not eight) until the step's batch is handed out
        x = block.reshape(b * length, *shape).take(take, axis=0)  # (k, b, ...)
        y = labels.reshape(-1).take(take)  # (k, b)
        index = (starts[None, :] + perm.T) % plan.n  # (k, b)
        stats = self._stats(plan.epoch)
        with self._lock:
            stats.bytes_read += nbytes
            stats.read_seconds += read_s
            stats.gather_seconds += time.perf_counter() - tick - read_s
        return x, y, index, lanes

    def _produce(self, first_epoch: int, first_step: int, epochs: int | None, out: queue.Queue,
                 stop: threading.Event):
        def put(item) -> bool:
            """Queue ``item`` unless the consumer has stopped; never blocks for good."""
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    self._full.clear()
                    return True
                except queue.Full:
                    self._full.set()
            return False

        with self._lock:  # reuse the buffers of an earlier iteration: fresh pages cost a fault each
            buffers = self._spare.pop() if self._spare else {}
        try:
            for epoch in itertools.count(first_epoch) if epochs is None else range(first_epoch, first_epoch + epochs):
                plan = self.plan(epoch)
                skip = first_step if epoch == first_epoch else 0
                step = 0
                for round_id, first, length in plan.rounds(self.drop_last):
                    if stop.is_set():  # the consumer is done: read no more
                        return
                    if step + length > skip:  # rounds before a resumed position are not read
                        while not self._open.wait(0.1):  # held (see hold)
                            if stop.is_set():
                                return
                        with self._reading:
                            batches = self._round(plan, round_id, first, length, buffers)
                        if not put((epoch, step, max(0, skip - step), batches)):
                            return
                    step += length
            put(None)
        except BaseException as e:  # handed to the training loop, which re-raises it
            put(e)
        finally:
            self._full.set()
            with self._lock:
                self._spare.append(buffers)

    # ------------------------------------------------------------- consumer
    def batches(self, first_epoch: int = 0, epochs: int | None = None, first_step: int = 0):
        """Yield :class:`Batch` for ``epochs`` epochs (or forever) from step ``first_step``
        of ``first_epoch`` (a resumed run: the rounds before it are not read)."""
        if not 0 <= first_step < self.steps_per_epoch:
            raise ValueError(f"first_step {first_step} is not in [0, {self.steps_per_epoch})")
        out: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        self._full.clear()
        thread = threading.Thread(target=self._produce, args=(first_epoch, first_step, epochs, out, stop),
                                  name=f"shard-reader-{self.split.name}", daemon=True)
        thread.start()
        try:
            while True:
                tick = time.perf_counter()
                if out.empty():  # a held thread must read what the loop waits for
                    self._open.set()
                item = out.get()
                waited = time.perf_counter() - tick
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                epoch, step, skip, (x, y, index, lanes) = item
                stats = self._stats(epoch)
                with self._lock:
                    stats.stall_seconds += waited
                    stats.samples += (len(x) - skip) * len(lanes)
                    stats.batches += len(x) - skip
                for k in range(skip, len(x)):
                    yield Batch(epoch, step + k, *self.items.pair(x[k], y[k]), index[k], lanes)
        finally:
            stop.set()
            with contextlib.suppress(queue.Empty):  # a thread waiting to queue a round goes on at once, sees
                out.get_nowait()  # the stop and ends (not at its put's next timeout)
            thread.join()

    def epoch(self, epoch: int):
        """The batches of one epoch."""
        return self.batches(epoch, 1)
