"""Per-process settings: BLAS threads and the allocator."""

import platform

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from mpitrain import runtime


def test_blas_threads_share_the_cores():
    cores = runtime.available_cores()
    assert runtime.blas_threads() == cores
    assert runtime.blas_threads(ranks_per_node=cores * 4) == 1  # oversubscribed: one each
    assert runtime.blas_threads(requested=3, ranks_per_node=8) == 3


def test_limit_blas_threads_applies_and_restores():
    before = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    assert before, "threadpoolctl finds no BLAS library"
    with runtime.limit_blas_threads(1):
        assert all(p["num_threads"] == 1 for p in threadpool_info() if p["user_api"] == "blas")
        np.ones((64, 64)) @ np.ones((64, 64))
    assert [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"] == before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_tune_allocator_on_glibc():
    assert runtime.tune_allocator() is True


def _thp_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _thp_enabled(), reason="needs Linux with transparent huge pages not 'never'")
def test_huge_page_heap_keeps_the_data_and_asks_only_for_growth(monkeypatch):
    monkeypatch.setattr(runtime, "_heap_done", 0)
    runtime.tune_allocator()  # arrays of 1 MB come from the heap, and freed ones stay in it
    arrays = [np.full(1 << 18, i, dtype=np.float32) for i in range(48)]  # 48 MB of heap
    lo, hi = runtime._heap()
    assert hi - lo >= 48 << 20
    asked, again = runtime.huge_page_heap(), runtime.huge_page_heap()  # nothing allocated between the two calls:
    assert asked > 0 and asked % runtime.HUGE_PAGE == 0  # checking the values first grew the heap, and a growth
    assert again == 0  # of a few kB that crosses a huge page's boundary asks for one more (flaky in CI)
    assert all((a == i).all() for i, a in enumerate(arrays))  # collapsing moved pages, not values


def test_huge_page_heap_without_a_heap_changes_nothing(monkeypatch):
    monkeypatch.setattr(runtime, "_heap", lambda: None)
    assert runtime.huge_page_heap() == 0


def test_the_launcher_is_found_among_the_parent_processes():
    """runtime.launcher: a process started by mpiexec names it (for the stop line's resume
    command); one started by a shell, outside any launcher, names none."""
    import subprocess
    import sys
    from pathlib import Path

    from test_comm import MPIEXEC

    ask = [sys.executable, "-c", "from mpitrain.runtime import launcher; print(launcher())"]
    if runtime.launcher() is None:  # these tests themselves run outside a launcher
        shell = subprocess.run(["sh", "-c", '"$0" "$1" "$2"', *ask], capture_output=True, text=True, timeout=60)
        assert shell.stdout.strip() == "None", shell.stderr
    if MPIEXEC:
        out = subprocess.run([MPIEXEC, "-n", "1", *ask], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == runtime.LAUNCHERS[Path(MPIEXEC).name], out.stderr
