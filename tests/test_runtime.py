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
