"""Per-process settings that decide speed: BLAS threads, the memory allocator, huge pages.

* BLAS threads: one process's GEMMs may use the cores it has divided by the ranks that
  share them. More threads than cores make OpenBLAS threads spin against each other,
  and small batched matmuls collapse. The convolution's cache tiles grow with the
  threads (``ops.conv.set_blas_threads``).
* Allocator: every training step allocates and frees the same activation-sized arrays,
  which glibc serves above its mmap threshold (128 KiB at start) with fresh ``mmap`` pages
  returned on free: a page fault per 4 KiB touched, every step. :func:`tune_allocator`
  raises the threshold and keeps freed memory, so they reuse the heap (im2col included).
* Huge pages: a step then walks the same heap, more 4 KiB pages than the core's
  second-level TLB maps (about 2,000), so most array passes pay page walks. Once the
  heap has its steady size, :func:`huge_page_heap` asks Linux to back it with 2 MiB
  transparent huge pages. NumPy already asks for huge pages for arrays of 4 MiB and
  more; this covers the many smaller ones. (What each of these gained:
  ``mpitrain/bench/README.md``.)

Also two facts about the process that others need: whether a pid still lives
(:func:`process_alive`) and the emulated cluster it runs on (:func:`emulated_cluster`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import os
from pathlib import Path

from threadpoolctl import threadpool_limits

from mpitrain.ops import conv

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
MADV_COLLAPSE = 25  # Linux >= 6.1
HUGE_PAGE = 2 << 20

_heap_done = 0  # end of the heap range already handed to huge_page_heap


def my_cores() -> list[int]:
    """The cores this process may run on (where the OS cannot say: all of them)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def available_cores() -> int:
    return len(my_cores())


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts): what a killed process left behind
    (a dataset build's directory, an emulated cluster's namespaces) may be cleared only once it is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


CLUSTER_ENV = "MPITRAIN_CLUSTER"  # what mpitrain cluster tells every rank (mpitrain/cluster.py)


def emulated_cluster() -> dict | None:
    """The emulated cluster this process is a rank of, as ``mpitrain cluster`` described
    it in ``$MPITRAIN_CLUSTER`` (nodes, ranks_per_node, rate, dilation); None outside one."""
    text = os.environ.get(CLUSTER_ENV)
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


# a launcher's process name (/proc/PID/comm) -> the command a user types to launch again
LAUNCHERS = {"mpiexec": "mpiexec", "mpiexec.hydra": "mpiexec", "mpirun": "mpirun", "orterun": "mpirun",
             "prterun": "mpirun", "srun": "srun", "slurmstepd": "srun"}


def launcher() -> str | None:
    """The launcher that started this process (``mpiexec``, ``mpirun`` or ``srun``): the
    first of its ancestors whose name is one (Hydra's and Open MPI's proxies, or SLURM's
    step daemon, sit between); None without one, or where ``/proc`` cannot say."""
    pid = os.getppid()
    for _ in range(12):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        if name in LAUNCHERS:
            return LAUNCHERS[name]
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's: after the name, which may hold spaces
        if pid <= 1:
            return None
    return None


def blas_threads(requested: int = 0, ranks_per_node: int = 1) -> int:
    """BLAS threads per process: ``requested`` if given, else this process's share of the cores (at least one)."""
    return requested if requested > 0 else max(1, available_cores() // max(1, ranks_per_node))


@contextlib.contextmanager
def limit_blas_threads(n: int):
    """Limit BLAS (OpenBLAS, MKL, BLIS) to ``n`` threads while open, and size the convolution's tiles for them."""
    with threadpool_limits(limits=n, user_api="blas"):
        previous = conv.set_blas_threads(n)
        try:
            yield
        finally:
            conv.set_blas_threads(previous)


def tune_allocator(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Make glibc keep and reuse freed activation memory; returns False, changing nothing, elsewhere (macOS, musl)."""
    mallopt = _libc_function("mallopt")
    return (mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold))
            and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold)))


@functools.cache
def _libc_function(name: str):
    """A function of the C library, or None (``find_library`` runs a subprocess: once)."""
    path = ctypes.util.find_library("c")
    try:
        return None if path is None else getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None


def _heap() -> tuple[int, int] | None:
    """(start, end) of this process's C heap (the ``brk`` area), or None. The kernel lists it as several
    ``[heap]`` mappings once parts of it carry other advice (NumPy's huge pages for arrays of 4 MiB and more)."""
    try:
        with open("/proc/self/maps") as maps:
            spans = [[int(a, 16) for a in line.split()[0].split("-")]
                     for line in maps if line.rstrip().endswith("[heap]")]
    except OSError:  # not Linux
        return None
    return (spans[0][0], spans[-1][1]) if spans else None


def huge_page_heap() -> int:
    """Back the C heap with huge pages now (``MADV_HUGEPAGE``, then ``MADV_COLLAPSE``, a
    one-off cost; the trainer and the benchmarks call it after a few steps); returns the
    bytes asked for, only what grew since the last call. 0, changing nothing, where there
    is no ``[heap]`` (not Linux), no ``madvise``, or the kernel refuses ``MADV_HUGEPAGE``
    (huge pages disabled); a kernel older than 6.1 has no ``MADV_COLLAPSE``, and
    ``khugepaged`` collapses the range later."""
    global _heap_done
    heap = _heap()
    madvise = _libc_function("madvise")
    if heap is None or madvise is None:
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lo = -(-max(heap[0], _heap_done) // HUGE_PAGE) * HUGE_PAGE  # whole huge pages inside the heap
    hi = heap[1] // HUGE_PAGE * HUGE_PAGE
    if hi <= lo or madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
        return 0
    madvise(lo, hi - lo, MADV_COLLAPSE)  # best effort: khugepaged does it later if this fails
    _heap_done = hi
    return hi - lo
