"""The probes :mod:`mpitrain.plan.calibrate` launches on 2 ranks (``python -m
mpitrain.plan.probes pingpong|turns`` under ``mpiexec -n 2``): a ping-pong and how much of
a nonblocking collective compute hides (:func:`pingpong`, :func:`overlap`), and what a
blocking call costs between 2 ranks that take turns on one core (:func:`turns`). Rank 0
prints one JSON line of what it measured, which :func:`probed` reads back."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def probed(done, what: str) -> dict:
    """The JSON line rank 0 of a probe printed (``done``: its finished process: these
    probes', or another program's that prints the same way, as :mod:`mpitrain.plan.objects`'s);
    HardwareError naming ``what`` and the last line it wrote if it failed."""
    from mpitrain.plan.hardware import HardwareError

    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[-1]
        raise HardwareError(f"{what} failed: {tail}")
    return json.loads(lines[-1])


def pingpong(max_bytes: int = 16 << 20, repeats: int = 5) -> list | None:
    """On 2 ranks: rank 0 gets [(bytes, one-way seconds), ...] for messages of 8 B doubling
    to ``max_bytes``, each the median of ``repeats`` rounds of round trips (about 1 MiB each
    way a round), rank 1 None. Blocking Send/Recv on a duplicate of the world: a message
    space of its own, where the default tag meets no other."""
    from mpitrain.comm import world

    mpi = world().mpi.Dup()
    if mpi.Get_size() != 2:
        raise SystemExit(f"the ping-pong runs on 2 ranks, not {mpi.Get_size()}")
    peer, rows, size = 1 - mpi.Get_rank(), [], 8  # rank 0 (peer 1) sends first
    while size <= max_bytes:
        buf, trips, times = np.zeros(size, np.uint8), max(1, min(1000, (1 << 20) // size)), []
        for r in range(repeats + 1):  # round 0 warms up: connections, caches
            mpi.Barrier()
            tick = time.perf_counter()
            for _ in range(trips):
                for step in (mpi.Send, mpi.Recv) if peer else (mpi.Recv, mpi.Send):
                    step(buf, peer)
            times += [(time.perf_counter() - tick) / trips / 2] if r else []
        rows.append((size, float(np.median(times))))
        size *= 2
    mpi.Free()
    return rows if peer else None


def overlap(sizes=(1 << 18, 1 << 20, 1 << 22), repeats: int = 9) -> dict | None:
    """On 2 ranks: {collective: the share of a nonblocking call that compute beside it
    hides, however long the compute} for ``Iallreduce``, ``Iallgather`` and
    ``Ireduce_scatter_block``, the median over calls of ``sizes`` bytes a rank (rank 0;
    rank 1 None): the call alone takes ``c``, GEMMs of about ``2 c`` alone ``w``, both
    (start, compute, wait) ``t``; what stays exposed, ``t - w``, is the part of ``c`` that
    compute cannot hide. Without a thread of its own MPI moves bytes only inside calls,
    over TCP or shared memory the rank's own core copies them, and a reduction waits for a
    call to add (what it measured: ``mpitrain/bench/README.md``, "The emulation's limits")."""
    from threadpoolctl import threadpool_limits

    from mpitrain.comm import world

    mpi = world().mpi.Dup()
    rng = np.random.default_rng(0)
    a, b = rng.random((768, 128), np.float32), rng.random((128, 512), np.float32)

    def calls(nbytes: int) -> dict:
        mine, every = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4 * 2, np.float32)
        return {"allreduce": lambda: mpi.Iallreduce(mine, every[: len(mine)]),
                "allgather": lambda: mpi.Iallgather(mine, every),
                "reduce_scatter": lambda: mpi.Ireduce_scatter_block(every, mine)}

    def timed(fn) -> float:
        times = []
        for r in range(repeats + 1):  # round 0 warms up
            mpi.Barrier()
            tick = time.perf_counter()
            fn()
            times += [time.perf_counter() - tick] if r else []
        return max(mpi.allgather(float(np.median(times))))  # the slower rank's

    def compute(k: int) -> None:
        for _ in range(k):
            a @ b  # each product dropped at once, as in a layer: no new pages

    def beside(start, k: int) -> None:
        request = start()
        compute(k)
        request.Wait()

    shares: dict = {}
    with threadpool_limits(limits=1, user_api="blas"):
        gemm = timed(lambda: a @ b)
        for nbytes in sizes:
            for kind, start in calls(nbytes).items():
                c = timed(lambda: start().Wait())  # noqa: B023 (called at once)
                k = max(1, round(2 * c / gemm))
                w, t = timed(lambda: compute(k)), timed(lambda: beside(start, k))  # noqa: B023
                shares.setdefault(kind, []).append(min(1.0, max(0.0, 1 - (t - w) / c)))
    rank = mpi.Get_rank()
    mpi.Free()
    return {kind: round(float(np.median(v)), 2) for kind, v in shares.items()} if rank == 0 else None


def turns(sizes=(1 << 12, 1 << 16, 1 << 18), rounds: int = 40, repeats: int = 7) -> float | None:
    """On 2 ranks pinned to one core (:func:`measure_turns` launches them so): the seconds a
    blocking allreduce adds, beyond its own time, when each rank computes before it, as a
    layer does (rank 0; rank 1 None). Both ranks computing ``k`` GEMMs take ``w`` (the core's
    time shared), the calls alone ``c``, rounds of both ``t``; the rest, ``(t - w - c)``
    per call, is the turn each waits for: its partner's compute, or the scheduler handing
    the core over. The median over ``sizes`` bytes."""
    from threadpoolctl import threadpool_limits

    from mpitrain.comm import world

    mpi = world().mpi.Dup()
    rng = np.random.default_rng(0)
    a, b = rng.random((256, 256), np.float32), rng.random((256, 256), np.float32)

    def timed(fn) -> float:
        times = []
        for r in range(repeats + 1):  # round 0 warms up
            mpi.Barrier()
            tick = time.perf_counter()
            for _ in range(rounds):
                fn()
            times += [(time.perf_counter() - tick) / rounds] if r else []
        return max(mpi.allgather(float(np.median(times))))

    added = []
    with threadpool_limits(limits=1, user_api="blas"):
        for nbytes in sizes:
            mine, every = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
            w = timed(lambda: a @ b)
            c = timed(lambda: mpi.Allreduce(mine, every))  # noqa: B023 (called at once)
            t = timed(lambda: (a @ b, mpi.Allreduce(mine, every)))  # noqa: B023
            added.append(max(0.0, t - w - c))
    rank = mpi.Get_rank()
    mpi.Free()
    return float(np.median(added)) if rank == 0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpitrain.plan.probes", description=__doc__.split("\n\n")[0])
    p.add_argument("probe", choices=("pingpong", "turns"),
                   help="pingpong: the ping-pong and the overlap probe; turns: 2 ranks on one core")
    p.add_argument("--max-bytes", type=int, default=16 << 20, help="the ping-pong's largest message (default 16 MiB)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of each size, whose median counts (default 5)")
    args = p.parse_args(argv)
    if args.probe == "turns":
        found = {"turns": turns()}
    else:
        found = {"pingpong": pingpong(args.max_bytes, args.repeats), "overlap": overlap()}
    if found.get("turns", found.get("pingpong")) is not None:  # rank 0
        print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
