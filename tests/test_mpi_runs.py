"""MPI tier: what a multi-rank run leaves behind: checkpoints that resume at another
rank count and across ddp and ZeRO-1, the merged timeline, and the bytes it said it would send.

A run on all ranks saves at step 8 and goes on to step 16; the same checkpoint resumed
in one process (and a one-process checkpoint resumed on all ranks) must end within
float32 tolerance of it: only the order of the gradient sums differs."""

import re
import shutil

import pytest
from test_checkpoint import assert_close
from test_mpi_data import shared_data

from mpitrain import checkpoint, config, train


def cfg(data, run_dir, strategy, overrides=()):
    return config.from_dict({
        "model": {"name": "lenet", "channels": [2, 4], "hidden": 8}, "data": {"path": str(data), "shift": 1},
        "optim": {"name": "adamw", "lr": 3e-3, "grad_clip": 1.0},
        "train": {"global_batch_size": 64, "steps": 16, "log_interval": 4, "threads": 1},
        "parallel": {"sync": strategy},
        "run": {"dir": str(run_dir), "checkpoint_interval": 8, "keep": 5}}, overrides)


def quiet(*args):
    pass


def close(a, b):
    """float32: the gradient sums run in another order."""
    assert_close(b, a, rtol=1e-5, floor=1e-3)


# the pairs that also run on more ranks: each ZeRO stage's shards of P pieces, saved and resumed
BEYOND_TWO = {("zero3", "ddp"), ("ddp", "zero3"), ("zero2", "zero1"), ("zero1", "zero1")}


@pytest.mark.mpi(min_size=2)
@pytest.mark.same_under_any_mpi  # a checkpoint's layout and its resume: MPICH's tier checks it for both
@pytest.mark.parametrize("saved_by,resumed_by", [("ddp", "ddp"), ("zero1", "ddp"), ("ddp", "zero1"),
                                                 ("zero1", "zero1"), ("zero2", "ddp"), ("ddp", "zero2"),
                                                 ("zero2", "zero1"), ("zero3", "ddp"), ("ddp", "zero3")])
def test_a_checkpoint_resumes_on_another_number_of_ranks(saved_by, resumed_by):
    from mpitrain.comm import SingleComm, world

    comm = world()
    if comm.size > 2 and (saved_by, resumed_by) not in BEYOND_TWO:
        pytest.skip(f"on 2 ranks; beyond, {sorted(BEYOND_TWO)}")
    d = shared_data(comm, n=960, test=64)
    root = d.parent
    # P ranks all the way; the step-8 checkpoint, resumed by one process
    train.train(cfg(root / "d", root / "p", saved_by), log=quiet, comm=comm)
    mine = root / f"one-{comm.rank}"
    (mine / "checkpoints").mkdir(parents=True)
    shutil.copy(checkpoint.path_for(root / "p", 8), mine / "checkpoints")
    train.train(cfg(root / "d", mine, resumed_by), log=quiet, comm=SingleComm(), resume=True)
    close(checkpoint.path_for(root / "p", 16), checkpoint.path_for(mine, 16))
    comm.barrier()
    # and the other way: one process saves, P ranks resume
    if comm.rank == 0:
        train.train(cfg(root / "d", root / "s", saved_by), log=quiet, comm=SingleComm())
        (root / "q" / "checkpoints").mkdir(parents=True)
        shutil.copy(checkpoint.path_for(root / "s", 8), root / "q" / "checkpoints")
    comm.barrier()
    train.train(cfg(root / "d", root / "q", resumed_by), log=quiet, comm=comm, resume=True)
    close(checkpoint.path_for(root / "s", 16), checkpoint.path_for(root / "q", 16))


@pytest.mark.mpi(min_size=2)
def test_the_merged_timeline_shows_communication_overlapping_backward_on_each_rank():
    import json

    from test_data import text_set

    from mpitrain.comm import world

    comm = world()
    root = shared_data(comm, text_set).parent
    cfg = config.from_dict({
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"path": str(root / "d")}, "optim": {"name": "adamw"},
        "train": {"global_batch_size": 8, "steps": 6, "log_interval": 3, "eval_batches": 1, "sample_tokens": 0,
                  "threads": 1},
        "parallel": {"bucket_mb": 0.01}, "run": {"dir": str(root / "run"), "timeline": True}})
    train.train(cfg, log=quiet, comm=comm)
    if comm.rank != 0:
        return
    events = json.loads((root / "run" / "timeline.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(comm.size)}
    for rank in range(comm.size):
        mine = [e for e in spans if e["pid"] == rank]
        kinds = {e["cat"] for e in mine}
        assert {"forward", "backward", "communication", "optimizer", "io", "evaluate", "checkpoint"} <= kinds
        assert sum(e["name"] == "backward block 0" for e in mine) == 6
        buckets = [e for e in mine if e["cat"] == "communication" and "allreduce" in e["name"]]
        backward = [e for e in mine if e["cat"] == "backward"]
        # a bucket started during backward runs while a later layer's backward computes
        overlapping = [(c, b) for c in buckets for b in backward
                       if c["tid"] != b["tid"] and c["ts"] <= b["ts"] < c["ts"] + c["dur"]]
        assert overlapping, f"rank {rank}: no allreduce overlaps a backward event"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("parallel", [
    {"sync": "ddp"}, {"sync": "ddp", "allreduce": "ring", "wire": "bf16"}, {"sync": "zero1"},
    {"sync": "zero2", "accumulate": "sharded"}, {"sync": "zero2", "accumulate": "full"}, {"sync": "zero3"}],
    ids=["ddp", "ddp-ring-bf16", "zero1", "zero2-sharded", "zero2-full", "zero3"])
def test_the_bytes_a_run_states_at_its_start_are_the_bytes_it_sends(parallel):
    """The start-of-run line's bytes per rank per step (the formulas, with what the config
    passes them: wire, micro-batches, accumulation) against the time table's (counted)."""
    from mpitrain.comm import world

    comm = world()
    d = shared_data(comm, n=256, test=32)
    run_dir = d.parent / f"bytes-{'-'.join(parallel.values())}"
    c = cfg(d, run_dir, "ddp", ["model.hidden=32768", "train.steps=4", "train.micro_batches=2",  # ~2 MB of gradients
                                "run.checkpoint_interval=0"] + [f"parallel.{k}={v}" for k, v in parallel.items()])
    lines = []
    train.train(c, log=lines.append, comm=comm)
    text = "\n".join(map(str, lines))
    if comm.rank == 0:
        stated = float(re.search(r"([\d.]+) MB sent per rank per step", text).group(1))
        table = text[text.index("time per rank:"):].splitlines()[1:1 + comm.size]
        sent = [float(row.split("|")[-1]) for row in table]
        assert stated >= 0.5  # so that its two decimals tell a formula's terms apart
        assert all(abs(s - stated) <= 0.0051 for s in sent), (stated, sent)
