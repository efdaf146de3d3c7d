"""MPI tier: a run knows its own checkpoints. Checkpoints of three other runs (another
seed, another model size, another optimizer) copied into a run's ``checkpoints/`` as its
newest files are named, never loaded and never pruned, and the resumed run ends where
the uninterrupted one ended, to the bit; ``--from`` starts a new run from one of them."""

import hashlib
import json
import shutil

import numpy as np
import pytest
from test_checkpoint import arrays, assert_identical
from test_mpi_data import shared_data
from test_mpi_runs import cfg, quiet

from mpitrain import checkpoint, train
from mpitrain.train import identity

pytestmark = pytest.mark.same_under_any_mpi  # mpitrain's logic above MPI: MPICH's tier checks it for both

OTHERS = {"seed": ["train.seed=7"], "size": ["model.hidden=16"], "optimizer": ["optim.name=sgd", "optim.lr=0.05"]}
DIFFERENCE = {"seed": "train.seed = 7 (this run: 1337)", "size": "model.hidden = 16 (this run: 8)",
              "optimizer": "optim.name = 'sgd' (this run: 'adamw')"}


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.mpi(min_size=2)
def test_checkpoints_of_other_runs_are_named_left_in_place_and_from_starts_a_new_run_from_one():
    from mpitrain.comm import world

    comm = world()
    if comm.size > 2:
        pytest.skip("whose checkpoint is whose does not depend on the ranks: on 2")
    d = shared_data(comm, n=960, test=64)
    root, every = d.parent, ["run.checkpoint_interval=4", "run.keep=1"]
    train.train(cfg(d, root / "whole", "ddp", ["run.checkpoint_interval=4", "run.keep=10"]), log=quiet, comm=comm)
    if comm.rank == 0:  # this run, stopped after step 8
        shutil.copytree(root / "whole", root / "mine", ignore=lambda _, names: [n for n in names if "-000000" in n
                                                                                and n > "step-00000008.h5"])
    placed = {}
    for k, (name, extra) in enumerate(OTHERS.items()):  # each ends at a step past this run's: its newest
        steps = 20 + 4 * k
        train.train(cfg(d, root / name, "ddp", every + extra + [f"train.steps={steps}"]), log=quiet, comm=comm)
        placed[name] = root / "mine" / "checkpoints" / f"step-{steps:08d}.h5"
        if comm.rank == 0:
            shutil.copy(checkpoint.path_for(root / name, steps), placed[name])
    comm.barrier()
    before = {name: sha(path) for name, path in placed.items()}
    said = []
    again = train.train(cfg(d, root / "mine", "ddp", every), log=quiet, warn=said.append, comm=comm, resume=True)
    assert again.start_step == 8
    if comm.rank == 0:
        for name, path in placed.items():
            line = next(w for w in said if w.startswith(f"resume: {path} is a checkpoint of another run "))
            assert DIFFERENCE[name] in line and line.endswith("left in place, not loaded"), line
    assert {name: sha(path) for name, path in placed.items()} == before  # not loaded, not pruned, not moved
    assert checkpoint.listed(root / "mine") == [checkpoint.path_for(root / "mine", 16), *placed.values()]
    assert_identical(checkpoint.path_for(root / "whole", 16), checkpoint.path_for(root / "mine", 16))

    # a new run from the weights of the SGD run's checkpoint, trained by Adam at a learning
    # rate too small to move them: its first checkpoint holds those weights
    origin = placed["optimizer"]
    fresh = train.train(cfg(d, root / "from", "ddp", ["optim.lr=1e-12", "train.steps=1"]), log=quiet, comm=comm,
                        origin=origin)
    assert fresh.start_step == 0
    came = identity.read(root / "from")["from"]
    assert came["step"] == 28 and came["run"] == identity.of(checkpoint.header(origin))["id"]
    assert came["file_sha256"] == checkpoint.header(origin)["file_sha256"]
    loaded, source = arrays(checkpoint.path_for(root / "from", 1)), arrays(origin)
    for name in (k for k in source if k.startswith("model/")):
        assert np.abs(loaded[name] - source[name]).max() <= 1e-9 * max(1.0, np.abs(source[name]).max()), name
    assert json.loads((root / "from" / "run.json").read_text())["run"]["id"] != came["run"]
