"""What the benches share: calls timed on one process or on every rank, and variants timed
round by round, each once per round, so that all see the same machine (their ratios are
taken side by side: ``mpitrain/bench/README.md``)."""

from __future__ import annotations

import time

import numpy as np


def seconds(fn, calls: int = 1) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls, on this process."""
    tick = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - tick) / calls


def slowest(comm, fn, calls: int = 1, ranks: int | None = None) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls from a barrier, the slowest rank's;
    with ``ranks``, only the first ``ranks`` ranks call it, the others sleeping meanwhile."""
    comm.barrier()
    mine = seconds(fn, calls) if ranks is None or comm.rank < ranks else 0.0
    if ranks is not None:
        comm.sleeping_barrier()
    return max(comm.allgather(mine))


def interleaved(variants: dict, rounds: int, timed) -> dict:
    """{name: [seconds, ...]}: ``timed(variant)`` (seconds, or a list of them) of every
    variant in each of ``rounds`` rounds."""
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, variant in variants.items():
            t = timed(variant)
            times[k] += t if isinstance(t, list) else [t]
    return times


def medians(times: dict) -> dict:
    return {k: float(np.median(v)) for k, v in times.items()}
