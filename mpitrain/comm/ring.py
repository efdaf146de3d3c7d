"""mpitrain's ring allreduce (Patarasuk & Yuan 2009; Baidu's and Horovod's allreduce),
written with point-to-point messages so that it can be read, counted and compared; its
two-rank form, the exchange; and MPI's sums of 16-bit numbers as float32 copies.
:mod:`mpitrain.comm.allreduce` picks one of them, MPI's own or the node-aware one by name.

Read :func:`ring_allreduce` first: the textbook ring, blocking, step by step, with why it
is bandwidth-optimal and what each rank sends (:func:`mpitrain.cost.ring_elements`).
:class:`Ring` computes the same sums, in the same order, bit for bit, but as a request:
``iallreduce`` (:func:`mpitrain.comm.allreduce.iallreduce`) starts it without waiting and
``test()`` posts each next step, so it moves while backward computes. What the fast
version adds:

**Partial sums.** For chunks up to ``IN_PLACE_CHUNK_BYTES`` they travel in two work arrays,
not in ``buf``: at reduce-scatter step ``s`` the chunk received goes into work array
``s % 2``, this rank's addend is added to it there, and step ``s + 1`` sends it on from
there; only the finished chunk ``r`` is copied into ``buf``. Each element of ``buf`` is
then written once, by that copy or by the allgather's receive. The reason is the cache:
MPICH moves large intra-node messages in one copy (CMA), the receiving process reading
the sender's pages, which leaves those cache lines shared between the two cores; the
next ``np.add`` into such a line must first invalidate the other core's copy. Adding
in place into ``buf``, which the neighbour read in the previous allreduce, was several
times slower than adding into the work array and copying the result (``memcpy``), and
medium buffers gained the most (``mpitrain/bench/README.md``). Larger chunks no longer
sit in the neighbour's cache, and there the copy costs more than it saves, so they are
received into one work array and added in place.

**Two ranks.** With ``P = 2`` the ring's two steps (each rank sends half, adds what it
gets; then sends its finished half back) move the same ``n`` elements per rank as one
*exchange*: each rank sends its whole buffer and adds the one it receives
(:class:`Exchange`). The sum is the same bits on both (``a + b == b + a`` in IEEE
arithmetic), and it takes one round instead of two. Across a network that is what
counts: beside compute, each round waits for a progress call on both ranks, and during
backward those come in bursts between layers. Across two emulated nodes, overlapped
with a GPT's backward, the exchange hid more of the communication than the two-step
ring and MPICH's ``Iallreduce`` (``mpitrain bench ddp --network``). On one node the
additions count instead, and the ring does half of them per rank: there the ring was
the faster for large buffers (both: ``mpitrain/bench/README.md``). So
``iallreduce(..., "ring")`` (:mod:`mpitrain.comm.allreduce`) on two ranks exchanges when
they are on different nodes and runs the ring when they share one.

**Half precision on the wire.** With ``wire="bf16"`` or ``"fp16"`` the ring and the exchange
send 16-bit numbers and add them to the buffer's own (float32) numbers: every partial
sum is rounded to the wire's format once per hop, the additions are done in float32
(which MPI's reductions cannot do: MPI has no bfloat16, and its float16 is an
extension), and the finished chunks are rounded once more, on their owner too, so
every rank ends with the same bits. Half the bytes of float32 on the wire; the sum is
within about ``(P - 1) x 2^-8`` (bf16) or ``2^-11`` (fp16) of the float32 one, relative.

Concurrent rings must not see each other's messages: every ring uses ``Tag.RING``, and a
caller with several rings in flight gives each its own duplicated communicator.
"""

from __future__ import annotations

import weakref

import numpy as np

from mpitrain.comm.communicator import Tag
from mpitrain.comm.requests import Request
from mpitrain.dtypes import FORMATS, dtype_of, is_half

WIRES = FORMATS  # the numbers a ring sends (see "Half precision on the wire")
wire_dtype = dtype_of  # a wire format's dtype; None for fp32 (the buffer's own numbers)

# Chunks above this many bytes are summed in place in the buffer (see "Partial sums"
# above): their cache lines are no longer in the neighbour's cache, and the work-array
# copy cost more than it saved (mpitrain/bench/README.md).
IN_PLACE_CHUNK_BYTES = 1 << 20


_work_arrays: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _work(comm, n: int, dtype) -> np.ndarray:
    """(n,) scratch for a ring on ``comm``, kept between calls (a fresh array costs a
    page fault per 4 KiB on first touch). Rings on one communicator run one at a
    time; concurrent ones (DataParallel's buckets) each have their own ``Dup``."""
    buf = _work_arrays.get(comm)
    if buf is None or buf.size < n or buf.dtype != dtype:
        buf = _work_arrays[comm] = np.empty(n, dtype=dtype)
    return buf[:n]


def work_numbers(widest: int, itemsize: int, wire: bool) -> int:
    """Numbers of the scratch a :class:`Ring` whose widest chunk is ``widest`` keeps (:func:`_work`):
    two chunks in a 16-bit ``wire`` format; one when a chunk of ``itemsize`` numbers is over
    ``IN_PLACE_CHUNK_BYTES`` (sums in place), two below."""
    if wire:
        return 2 * widest
    return widest if widest * itemsize > IN_PLACE_CHUNK_BYTES else 2 * widest


def chunk_bounds(n: int, parts: int) -> np.ndarray:
    """(parts + 1,) start of each chunk and the end: chunk i is [b[i], b[i + 1])."""
    return np.arange(parts + 1, dtype=np.int64) * n // parts


def chunk_length(n: int, parts: int, i: int) -> int:
    """The length of chunk ``i`` of :func:`chunk_bounds` (without the array: a plan asks it
    of every rank of a thousand)."""
    return n * (i + 1) // parts - n * i // parts


def ring_allreduce(comm, buf: np.ndarray) -> None:
    """Sum the flat contiguous array ``buf`` over ``comm`` in place: the textbook ring,
    blocking, to read before :class:`Ring`.

    Rank ``r`` sends to ``r + 1`` and receives from ``r - 1``; ``buf`` is cut into ``P``
    chunks (:func:`chunk_bounds`). **Reduce-scatter**: at step ``s`` rank ``r`` sends chunk
    ``r - s - 1`` and adds the chunk ``r - s - 2`` it receives to its own copy; a chunk
    gathers one addend per hop, so after ``P - 1`` steps rank ``r`` holds the full sum of
    chunk ``r``. **Allgather**: at step ``s`` it sends chunk ``r - s`` (its finished one
    first, then the one just received) and stores the chunk ``r - s - 1`` it receives;
    after ``P - 1`` steps every rank holds every sum.

    Rank ``r`` sends every chunk but its own, then every chunk but ``r + 1``'s:
    ``2n - c_r - c_{r+1}`` elements, ``2(P - 1)/P x n`` when ``P`` divides ``n``: under
    ``2n`` however many ranks there are. No allreduce can send less per rank (Patarasuk
    & Yuan 2009: a rank's data must reach the ``(P - 1)/P`` of the sum that others
    finish, and the part it finishes must reach them), so the ring is bandwidth-optimal;
    what grows with ``P`` is the number of steps, ``2(P - 1)`` message latencies, so
    small buffers are latency-bound. (Tested bit for bit equal to :class:`Ring`.)"""
    P, r = comm.size, comm.rank
    bounds = chunk_bounds(buf.size, P)
    chunk = [buf[bounds[i] : bounds[i + 1]] for i in range(P)]  # views into buf
    incoming = np.empty(int(np.diff(bounds).max()), dtype=buf.dtype)  # (widest chunk,)
    right, left = (r + 1) % P, (r - 1) % P
    for s in range(P - 1):  # reduce-scatter
        send, recv = chunk[(r - s - 1) % P], chunk[(r - s - 2) % P]
        into = incoming[: recv.size]
        comm.waitall([comm.irecv(into, left, Tag.RING), comm.isend(send, right, Tag.RING)])
        np.add(recv, into, out=recv)  # one more rank's addend in this partial sum
    for s in range(P - 1):  # allgather: received straight into place, nothing to add
        send, recv = chunk[(r - s) % P], chunk[(r - s - 1) % P]
        comm.waitall([comm.irecv(recv, left, Tag.RING), comm.isend(send, right, Tag.RING)])


class Ring(Request):
    """A ring reduce-scatter and/or allgather over ``comm`` on the flat array ``buf``,
    advanced one step at a time by :meth:`test` and :meth:`wait`.

    ``phases`` picks the halves: ``("reduce_scatter", "allgather")`` is an allreduce;
    ``("reduce_scatter",)`` leaves the sum of chunk ``rank`` in place (ZeRO's gradient
    shard); ``("allgather",)`` spreads every rank's chunk ``rank``."""

    def __init__(self, comm, buf: np.ndarray, phases=("reduce_scatter", "allgather"), wire=None):
        super().__init__(comm.stats, "ring " + " + ".join(phases), buf.nbytes)
        if buf.ndim != 1 or not buf.flags.c_contiguous:
            raise ValueError("the ring works on a flat contiguous array")
        self.comm, self.buf = comm, buf
        self.wire = None if wire is None or np.dtype(wire) == buf.dtype else np.dtype(wire)
        self.rounds_own = self.wire is not None and "allgather" in phases
        P, r = comm.size, comm.rank
        self.bounds = chunk_bounds(buf.size, P)
        self.right, self.left = (r + 1) % P, (r - 1) % P
        self.steps = []  # (chunk sent, chunk received, add it?)
        if "reduce_scatter" in phases:
            self.steps += [((r - s - 1) % P, (r - s - 2) % P, True) for s in range(P - 1)]
        if "allgather" in phases:
            self.steps += [((r - s) % P, (r - s - 1) % P, False) for s in range(P - 1)]
        widest = int(np.diff(self.bounds).max()) if P > 1 else 0
        # partial sums in two work arrays (step s fills partials[s % 2]) for chunks that a
        # core's cache holds; in place in buf, with one array to receive into, above that
        self.in_place = widest * buf.itemsize > IN_PLACE_CHUNK_BYTES or self.wire is not None
        # with a wire format: sums in buf; what arrives and what leaves in the wire's format
        dtype = buf.dtype if self.wire is None else self.wire
        work = _work(comm, work_numbers(widest, buf.itemsize, self.wire is not None), dtype)
        self.partials = (work[:widest], work[widest:])  # the second: empty in place, or the outgoing
        self.step, self.requests = 0, []
        if self.steps:
            self._post()
        else:
            self.done = True

    def _chunk(self, i: int) -> np.ndarray:
        return self.buf[self.bounds[i] : self.bounds[i + 1]]

    def _partial(self, step: int, chunk: int) -> np.ndarray:
        """The work array that reduce-scatter step ``step`` receives ``chunk`` into."""
        return self.partials[0 if self.in_place else step % 2][: self.bounds[chunk + 1] - self.bounds[chunk]]

    def _post(self) -> None:
        send, recv, add = self.steps[self.step]
        if add:  # reduce-scatter: pass on the partial sum made at the step before
            first = self.step == 0 or self.in_place
            source = self._chunk(send) if first else self._partial(self.step - 1, send)
            into = self._partial(self.step, recv)
        else:
            source, into = self._chunk(send), self._chunk(recv)
        if self.wire is not None:  # sent as 16-bit words: MPI knows no bfloat16
            out = self.partials[1][: source.size]
            np.copyto(out, source, casting="same_kind")  # rounded to the wire's format
            source, into = out.view(np.uint16), self.partials[0][: into.size].view(np.uint16)
        self.requests = [self.comm.irecv(into, self.left, Tag.RING),
                         self.comm.isend(source, self.right, Tag.RING)]

    def _finish_step(self) -> None:
        _, recv, add = self.steps[self.step]
        chunk = self._chunk(recv)
        if add:
            partial = self._partial(self.step, recv)
            finished = self.step + 1 == len(self.steps) or not self.steps[self.step + 1][2]
            if self.in_place:
                np.add(chunk, partial, out=chunk)
            else:
                np.add(partial, chunk, out=partial)
                if finished:
                    np.copyto(chunk, partial)  # the finished sum of chunk `rank`
            if finished and self.rounds_own:  # as the other ranks will receive it
                np.copyto(chunk, chunk.astype(self.wire))
        elif self.wire is not None:
            np.copyto(chunk, self.partials[0][: chunk.size])
        self.step += 1
        if self.step < len(self.steps):
            self._post()

    def _progress(self) -> bool:
        while self.step < len(self.steps) and all(r.test() for r in self.requests):
            self._finish_step()
        return self.step == len(self.steps)

    def _block(self) -> None:
        while self.step < len(self.steps):
            self.comm.waitall(self.requests)
            self._finish_step()


class Exchange(Request):
    """The allreduce of two ranks in one round: send the whole buffer to the other rank,
    receive its buffer into scratch, add (see "Two ranks" above)."""

    def __init__(self, comm, buf: np.ndarray, wire=None):
        super().__init__(comm.stats, "exchange", buf.nbytes)
        if comm.size != 2:
            raise ValueError(f"an exchange is between 2 ranks, the communicator has {comm.size}")
        self.comm, self.buf = comm, buf
        self.wire = None if wire is None or np.dtype(wire) == buf.dtype else np.dtype(wire)
        if self.wire is None:
            self.mine, self.other = buf, _work(comm, buf.size, buf.dtype)  # (n,) the other rank's buffer
        else:  # both ranks add the two rounded buffers: the same bits on both
            work = _work(comm, 2 * buf.size, self.wire)
            self.mine, self.other = work[: buf.size], work[buf.size :]
            np.copyto(self.mine, buf, casting="same_kind")
        peer = 1 - comm.rank
        words = (lambda a: a) if self.wire is None else (lambda a: a.view(np.uint16))  # MPI knows no bfloat16
        self.requests = [comm.irecv(words(self.other), peer, Tag.RING), comm.isend(words(self.mine), peer, Tag.RING)]

    def _add(self) -> None:
        if self.wire is not None:
            np.copyto(self.buf, self.mine)
        np.add(self.buf, self.other, out=self.buf)  # buf is no longer being sent: both requests are done

    def _progress(self) -> bool:
        if all([r.test() for r in self.requests]):  # a list: test both, each progresses
            self._add()
            return True
        return False

    def _block(self) -> None:
        self.comm.waitall(self.requests)
        self._add()


class Float32Sum(Request):
    """MPI's sum of a half-precision array (mixed precision's gradients): MPI cannot add
    bfloat16 (it has no such type) nor, portably, float16, so a float32 copy is summed
    and rounded back: the ring's arithmetic, twice its bytes. An allreduce of ``buf`` in
    place; with ``recv`` and ``counts``, a reduce-scatter of ``buf`` into ``recv``."""

    def __init__(self, comm, buf: np.ndarray, recv: np.ndarray | None = None, counts=None):
        super().__init__(comm.stats)  # the float32 collective inside is the one that is busy
        self.wide = buf.astype(np.float32)
        if recv is None:
            self.out, self.sum = buf, self.wide
            self.request = comm.iallreduce(self.wide)
        else:
            self.out, self.sum = recv, np.empty(recv.size, dtype=np.float32)
            self.request = comm.ireduce_scatter(self.wide, self.sum, counts)

    def _progress(self) -> bool:
        if self.request.test():
            self._round()
            return True
        return False

    def _block(self) -> None:
        self.request.wait()
        self._round()

    def _round(self) -> None:
        with np.errstate(over="ignore"):  # a sum past fp16's range is inf: the loss scaler's to find
            np.copyto(self.out, self.sum, casting="same_kind")


def ireduce_scatter(comm, send: np.ndarray, recv: np.ndarray, counts) -> Request:
    """Start MPI's reduce-scatter of ``send`` into ``recv`` (block ``rank``, ``counts``
    elements each); 16-bit numbers as a float32 copy (:class:`Float32Sum`)."""
    return Float32Sum(comm, send, recv, counts) if is_half(send.dtype) else comm.ireduce_scatter(send, recv, counts)
