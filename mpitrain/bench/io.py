"""``mpitrain bench io``: the shard reader against a plain sequential read of the same files.

For each storage state and layout (uncompressed, and a gzip copy written beside the shard
set, removed at the end) it prints a one-rank row and, under ``mpiexec -n 2``, a two-rank
row with the per-rank table the trainer prints (:func:`~mpitrain.observe.io.io_table`):

* **raw**: the shard files read front to back in 4 MiB pieces (with two ranks, each
  reads half the bytes at once; MB/s is the total over the slowest rank's time), twice:
  *reused*, every piece into the same 4 MiB buffer (what ``dd`` or ``cat`` measure: the
  buffer stays in the CPU cache), and *kept*, each piece into its own place in a buffer
  of the rank's share, as a reader must, which keeps the bytes: the baseline of the
  reader's ratio (``of kept``);
* **reader**: the training split read through :class:`~mpitrain.data.ShardReader`
  (global batch ``--batch``, shuffled as in training). *read MB/s* is what its I/O
  accounting reports (sample bytes over seconds inside reads, decompression included);
  *delivered MB/s* is sample bytes handed to a consumer over wall time, which adds the
  gather into batches and the hand-over between threads.

Storage states: *page cache* (files read once before timing) and *device* (each file
evicted from the page cache with ``posix_fadvise(DONTNEED)`` before each timing).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import numpy as np

from mpitrain.comm import world
from mpitrain.data import DatasetWriter, ShardReader, open_dataset
from mpitrain.data.reader import IOStats
from mpitrain.observe.io import io_row, io_table
from mpitrain.runtime import tune_allocator

RAW_BUFFER = 4 << 20
PAGE_CACHE_BYTES = 256 << 20


def _evict(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_read(files, rank: int, size: int, keep: bool, passes: int = 1) -> tuple[int, float]:
    """Read this rank's share (a contiguous 1/size of the concatenated bytes) ``passes``
    times as *raw* above, into a buffer touched beforehand so that page faults are not timed."""
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    lo, hi = total * rank // size, total * (rank + 1) // size
    buf = np.ones(hi - lo if keep else RAW_BUFFER, dtype=np.uint8)  # (bytes,)
    done = 0
    tick = time.perf_counter()
    for _ in range(passes):
        offset, at = 0, 0
        for f, n in zip(files, sizes):
            a, b = max(lo, offset) - offset, min(hi, offset + n) - offset
            if a < b:
                fd = os.open(f, os.O_RDONLY)
                try:
                    while a < b:
                        got = os.preadv(fd, [buf[at : at + min(b - a, RAW_BUFFER)]], a)
                        if not got:
                            break
                        a += got
                        done += got
                        at = at + got if keep else 0
                finally:
                    os.close(fd)
            offset += n
    return done, time.perf_counter() - tick


def _compressed_copy(path: Path, out: Path) -> None:
    data = open_dataset(path)
    split = data.split("train")
    keep = {k: data.manifest[k] for k in ("classes", "mean", "std", "vocab", "val_fraction") if k in data.manifest}
    x, y = split.read_all("x"), split.read_all("y") if split.y_dtype is not None else None  # read, then write
    data.close()
    with DatasetWriter(out, data.name, data.kind, compression="gzip", source=data.manifest.get("source"),
                       **keep) as w:
        w.write_split("train", x, y)


def run(path, batch: int = 256, window: int = 64, repeats: int = 5, buffer_mb: float = 64, log=print) -> list[dict]:
    comm = world()
    tune_allocator()
    path = Path(path)
    tmp = Path(comm.bcast(tempfile.mkdtemp(prefix=".bench-io-", dir=path.parent) if comm.rank == 0 else None))
    results = []
    try:
        comm.agree(lambda: _compressed_copy(path, tmp / "gzip") if comm.rank == 0 else None)
        for state in ("page cache", "device"):
            for layout, where in (("uncompressed", path), ("gzip", tmp / "gzip")):
                data = comm.agree(open_dataset, where)
                shards = data.split("train").shards
                files = [str(s.path) for s in shards]
                for size in (1, 2)[: comm.size]:  # the two-rank rows where there are two ranks
                    row = _measure(comm, data, files, size, state, batch, window, repeats, buffer_mb)
                    if comm.rank == 0:
                        row.update(state=state, layout=layout, ranks=size, file_mb=sum(s.bytes for s in shards) / 1e6)
                        results.append(row)
                        log(f"{state:>10} | {layout:>12} | {size} rank{'s' if size > 1 else ' '} | "
                            f"raw reused {row['raw_reused']:6.0f} kept {row['raw']:6.0f} MB/s | "
                            f"reader read {row['read']:6.0f} MB/s ({row['read'] / row['raw']:4.2f} of kept) | "
                            f"delivered {row['delivered']:6.0f} MB/s")
                        if size > 1:
                            log(io_table("    per rank", row["rows"], row["sample_bytes"]))
                data.close()
        if comm.size == 1:
            log("(one process: run under 'mpiexec -n 2' for the two-rank rows)")
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return results


def _measure(comm, data, files, size, state, batch, window, repeats, buffer_mb) -> dict:
    """Best of ``repeats`` for raw and reader; ranks >= size take part in the
    collectives with nothing to report. From the page cache a measurement covers
    enough epochs to deliver ``PAGE_CACHE_BYTES`` (one small split takes milliseconds)."""
    active = comm.rank < size
    split = data.split("train")
    passes = 1 if state == "device" else max(1, -(-PAGE_CACHE_BYTES // (split.count * split.sample_bytes)))
    reader = ShardReader(split, rank=comm.rank, size=size, global_batch=batch, seed=0, buffer_mb=buffer_mb,
                         window=window if split.y_dtype is None else None) if active else None
    if state == "page cache" and comm.rank == 0:
        _raw_read(files, 0, 1, keep=False)  # warm up: every file in memory
    best = {"raw_reused": 0.0, "raw": 0.0, "read": 0.0, "delivered": 0.0, "rows": None}
    for repeat in range(repeats):
        for key, keep in (("raw_reused", False), ("raw", True)):
            if state == "device" and comm.rank == 0:
                _evict(files)
            comm.barrier()
            mine = _raw_read(files, comm.rank, size, keep, passes) if active else None
            parts = [p for p in comm.allgather(mine) if p]
            best[key] = max(best[key], _rate(parts))

        if state == "device" and comm.rank == 0:
            _evict(files)
        comm.barrier()
        mine = None
        if active:
            first = repeat * passes
            tick = time.perf_counter()
            for _ in reader.batches(first, passes):
                pass
            seconds = time.perf_counter() - tick
            stats = _total([reader.stats[e] for e in range(first, first + passes)])
            mine = (stats.samples * reader.item_bytes, seconds, stats.bytes_read, stats.read_seconds,
                    io_row(comm.rank, stats, seconds - stats.stall_seconds))
        parts = [p for p in comm.allgather(mine) if p]
        delivered = _rate([(p[0], p[1]) for p in parts])
        best["read"] = max(best["read"], _rate([(p[2], p[3]) for p in parts]))
        if delivered > best["delivered"]:
            best["delivered"], best["rows"] = delivered, [p[4] for p in parts]
    best["sample_bytes"] = comm.bcast(reader.sample_bytes if comm.rank == 0 else None)
    return best


def _total(epochs: list[IOStats]) -> IOStats:
    return IOStats(**{f.name: sum(getattr(s, f.name) for s in epochs) for f in fields(IOStats)})


def _rate(parts) -> float:
    """MB/s of ranks reading at once: all their bytes over the slowest rank's seconds."""
    return sum(n for n, _ in parts) / max(t for _, t in parts) / 1e6
