"""MPI tier: run with `mpiexec -n N python -m pytest --with-mpi -m mpi` (N = 2 and 4)."""

import hashlib

import numpy as np
import pytest

from mpitrain import nn, rng


@pytest.mark.mpi(min_size=2)
def test_every_rank_builds_the_same_initial_model():
    """Parameters start identical on every rank: initialisation depends on the seed only."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    digests = []
    for build in (lambda: nn.GPT(nn.GPTConfig(vocab_size=65)), lambda: nn.ResNet(3, 32, 10)):
        rng.manual_seed(1234)
        model = build()
        h = hashlib.sha256()
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(np.ascontiguousarray(p.data).tobytes())
        digests.append(h.hexdigest())
    everyone = comm.allgather(digests)
    assert all(d == everyone[0] for d in everyone), everyone
