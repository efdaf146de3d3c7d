"""Per-process settings that decide speed: BLAS threads and the memory allocator.

* BLAS threads: one process's GEMMs may use the cores it has divided by the ranks that
  share them. More threads than cores make OpenBLAS threads spin against each other
  (measured here: batched matmuls fell from ~50 to 2-7 GFLOP/s). The convolution's
  cache tiles grow with the threads (``ops.conv.set_blas_threads``).
* Allocator: every training step allocates and frees the same activation-sized arrays.
  glibc serves arrays above its mmap threshold (128 KiB at start) with fresh ``mmap``
  pages and returns them on free, so each step pays a page fault per 4 KiB touched
  (measured: 11,000 faults, 45 MB, per GPT step; about 15% of the step). Raising the
  threshold to 256 MiB and keeping freed memory (trim threshold 1 GiB) makes them
  reuse heap memory instead (im2col columns of a CNN step, 38 MB, included).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os

from threadpoolctl import threadpool_limits

from mpitrain.ops import conv

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def blas_threads(requested: int = 0, ranks_per_node: int = 1) -> int:
    """BLAS threads per process: ``requested`` if given, else this process's share of
    the cores (at least one)."""
    if requested > 0:
        return requested
    return max(1, available_cores() // max(1, ranks_per_node))


@contextlib.contextmanager
def limit_blas_threads(n: int):
    """Limit BLAS (OpenBLAS, MKL, BLIS) in this process to ``n`` threads while the
    context is open, and size the convolution's tiles for them."""
    with threadpool_limits(limits=n, user_api="blas"):
        previous = conv.set_blas_threads(n)
        try:
            yield
        finally:
            conv.set_blas_threads(previous)


def tune_allocator(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Make glibc keep and reuse freed activation memory; returns False where the C
    library is not glibc (macOS, musl), where nothing is changed."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
