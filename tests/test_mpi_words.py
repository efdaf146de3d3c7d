"""MPI tier: 16-bit numbers cross MPI as 16-bit words, on every MPI library.

MPI has no bfloat16, and float16 only as an extension: MPICH maps NumPy's float16 to
``MPIX_C_FLOAT16``, Open MPI 4 has no such type (mpi4py: ``cannot map 'e' to MPI
datatype``). So mpitrain never asks MPI to know them: every copy of 16-bit floats goes
as ``MPI_UINT16_T`` words, and no sum of them is MPI's (the ring adds them in float32, MPI
a float32 copy). Here every path that moves them runs on a stand-in of the world
communicator that refuses a 16-bit float buffer as Open MPI 4 does, so that a new path
that hands one to MPI fails under MPICH too.
"""

import numpy as np
import pytest

from mpitrain import nn, optim, rng
from mpitrain.comm.communicator import Comm, Tag
from mpitrain.comm.replicas import digest
from mpitrain.comm.allreduce import iallreduce
from mpitrain.comm.ring import Exchange, Ring
from mpitrain.dtypes import dtype_of, is_half
from mpitrain.precision import MixedPrecision

HALVES = ["bf16", "fp16"]


class NoHalfTypes:
    """An mpi4py communicator that refuses, as Open MPI 4 does, any buffer of 16-bit
    floats handed to it (a bare array, or the first item of a buffer specification);
    the communicators made from it (``Dup``, ``Split``, ``Split_type``) refuse too."""

    MADE = ("Dup", "Split", "Split_type")

    def __init__(self, mpi):
        self._mpi = mpi

    def __getattr__(self, name):
        attr = getattr(self._mpi, name)
        if not callable(attr) or not name[:1].isupper():
            return attr

        def call(*args, **kwargs):
            for a in (*args, *kwargs.values()):
                first = a[0] if isinstance(a, list | tuple) and a else a
                if isinstance(first, np.ndarray) and is_half(first.dtype):
                    raise KeyError(f"cannot map {first.dtype.char!r} to MPI datatype (in {name})")
            out = attr(*args, **kwargs)
            return NoHalfTypes(out) if name in self.MADE else out

        return call


def strict():
    """The world, as a communicator that refuses 16-bit float buffers."""
    from mpitrain.comm import world

    return Comm(NoHalfTypes(world().mpi.Dup()))


def numbers(n: int, precision: str, rank: int) -> np.ndarray:
    g = np.random.default_rng(100 + rank)
    return (g.standard_normal(n) * 4).astype(dtype_of(precision))


def test_the_stand_in_refuses_what_open_mpi_4_refuses():
    """Not an MPI test: the stand-in's check on a stand-in's stand-in."""

    class Fake:
        def Bcast(self, buf, root):
            return "sent"

    comm = NoHalfTypes(Fake())
    assert comm.Bcast(np.zeros(3, np.float32), 0) == "sent"
    assert comm.Bcast(np.zeros(3, np.uint16), 0) == "sent"
    for precision in HALVES:
        with pytest.raises(KeyError, match="cannot map"):
            comm.Bcast([np.zeros(3, dtype_of(precision)), 3], 0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision", HALVES)
def test_every_copy_of_half_numbers_goes_as_words_bit_for_bit(precision):
    comm = strict()
    P, r, n = comm.size, comm.rank, 1001
    mine = numbers(n, precision, r)
    every = [numbers(n, precision, k) for k in range(P)]
    # a broadcast
    buf = mine.copy()
    comm.bcast_array(buf, root=P - 1)
    assert buf.tobytes() == every[P - 1].tobytes()
    # an allgather of blocks, blocking and started
    counts = [n // P + (k < n % P) for k in range(P)]
    lo = sum(counts[:r])
    whole = np.concatenate([every[k][sum(counts[:k]) : sum(counts[: k + 1])] for k in range(P)])
    for start in (False, True):
        buf = np.zeros(n, mine.dtype)
        buf[lo : lo + counts[r]] = mine[lo : lo + counts[r]]
        comm.iallgather_array(buf, counts).wait() if start else comm.allgather_array(buf, counts)
        assert buf.tobytes() == whole.tobytes()
    # point to point around the ring: started, blocking, from anyone
    right, left = (r + 1) % P, (r - 1) % P
    got = np.zeros(n, mine.dtype)
    comm.waitall([comm.irecv(got, left, Tag.RING), comm.isend(mine, right, Tag.RING)])
    assert got.tobytes() == every[left].tobytes()
    for receive in (lambda b: comm.recv(b, left, Tag.RING), lambda b: comm.recv_any(b, Tag.RING)):
        got[:] = 0
        send = comm.isend(mine, right, Tag.RING)
        receive(got)
        send.wait()
        assert got.tobytes() == every[left].tobytes()
    comm.barrier()
    comm.mpi.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision", HALVES)
def test_no_sum_of_half_numbers_is_left_to_mpi(precision):
    comm = strict()
    buf = numbers(8, precision, comm.rank)
    for call in (lambda: comm.allreduce(buf), lambda: comm.iallreduce(buf),
                 lambda: comm.reduce_scatter(buf, buf[:4], [4] * comm.size),
                 lambda: comm.ireduce_scatter(buf, buf[:4], [4] * comm.size)):
        with pytest.raises(TypeError, match="MPI cannot sum"):
            call()
    # what mpitrain sums them with: the ring in float32, and MPI's float32 copy
    exact = sum(numbers(8, precision, k).astype(np.float64) for k in range(comm.size))
    for algorithm in ("mpi", "ring"):
        out = buf.copy()
        iallreduce(comm, out, algorithm).wait()
        assert out.dtype == buf.dtype
        np.testing.assert_allclose(out.astype(np.float64), exact, rtol=comm.size * 2.0**-7, atol=1e-2)
    comm.barrier()
    comm.mpi.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision", HALVES)
def test_the_rings_16_bit_wire_and_the_exchange_send_words(precision):
    comm = strict()
    x = np.random.default_rng(comm.rank).standard_normal(3001).astype(np.float32)
    ways = [lambda b: Ring(comm, b, wire=dtype_of(precision)), lambda b: Ring(comm, b.astype(dtype_of(precision)))]
    if comm.size == 2:
        ways.append(lambda b: Exchange(comm, b, dtype_of(precision)))
    for way in ways:
        buf = x.copy()
        request = way(buf)
        request.wait()
        out = request.buf
        assert len(set(comm.allgather(out.tobytes()))) == 1  # the same bits on every rank
    comm.barrier()
    comm.mpi.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
@pytest.mark.parametrize("precision", HALVES)
def test_mixed_precision_data_parallel_moves_its_buckets_as_words(algorithm, precision):
    """The half weights broadcast at the start, the half gradients' buckets: every MPI."""
    from mpitrain.parallel.data_parallel import DataParallel

    comm = strict()
    rng.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16))
    mixed = MixedPrecision(optim.AdamW(model.parameters(), lr=1e-3), precision)
    dp = DataParallel(model, comm, optimizer=mixed, bucket_cap_mb=2e-3, algorithm=algorithm)
    assert {f.dtype for f in dp.flats} == {dtype_of(precision)}
    r = np.random.default_rng(10 + comm.rank)
    for _ in range(2):
        x, y = r.integers(0, 13, (2, 8)), r.integers(0, 13, (2, 8))
        dp.zero_grad()
        model(x, y)[1].backward(np.float32(mixed.scaler.scale))
        dp.finish()
        mixed.step()
    assert len(set(comm.allgather(digest([p.data for p in model.parameters()])))) == 1
    dp.close()
    comm.mpi.Free()
