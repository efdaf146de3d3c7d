"""MPI tier: a trained run's checkpoint, saved by any layout, loads into one process's
whole model (and into the data-parallel ranks of the job) and scores what the run
printed at its last step (``mpitrain eval``, :mod:`mpitrain.train.trained`); the run's
report names the layout that ran."""

import pytest
from test_data import text_set
from test_mpi_data import shared_data

from mpitrain import config, train
from mpitrain.observe.report import report
from mpitrain.train import trained

pytestmark = pytest.mark.same_under_any_mpi  # mpitrain's logic above MPI: MPICH's tier checks it for both

LAYOUTS = {"ddp": [], "zero3": ["parallel.sync=zero3"], "pp2": ["parallel.pp=2", "train.micro_batches=2"],
           "tp2": ["parallel.tp=2"], "pp2tp2": ["parallel.pp=2", "parallel.tp=2", "train.micro_batches=2"]}
NAMED = {"ddp": "dp {P} x pp 1 x tp 1, ddp", "zero3": "dp {P} x pp 1 x tp 1, zero3",
         "pp2": "dp {half} x pp 2 x tp 1, ddp, 1f1b, 2 micro-batches", "tp2": "dp {half} x pp 1 x tp 2, ddp",
         "pp2tp2": "dp {quarter} x pp 2 x tp 2, ddp, 1f1b, 2 micro-batches"}  # as the report names each


def quiet(*args):
    pass


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_eval_of_any_layouts_checkpoint_reproduces_the_runs_final_validation_loss(layout):
    from mpitrain.comm import SingleComm, world

    comm = world()
    if layout == "pp2tp2" and comm.size % 4:
        pytest.skip("pp 2 x tp 2 needs a multiple of 4 ranks")
    if layout in ("ddp", "zero3") and comm.size > 2:
        pytest.skip("replicas alone: on 2 ranks (beyond them the same logic, more replicas)")
    d = shared_data(comm, make=text_set, n=3000)
    run_dir = d.parent / f"run-{layout}"
    cfg = config.from_dict({
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "dropout": 0.1},
        "data": {"path": str(d)}, "optim": {"name": "adamw", "lr": 3e-3},
        "train": {"global_batch_size": 8, "steps": 12, "eval_interval": 0, "eval_batches": 0, "sample_tokens": 0,
                  "threads": 1},
        "run": {"dir": str(run_dir)}}, LAYOUTS[layout])
    printed = train.train(cfg, log=quiet, comm=comm).val_loss
    run, step, _ = trained.load(run_dir, comm, quiet)  # the job's ranks, as data-parallel replicas
    spread = trained.evaluate(run, step, comm, quiet)
    run.close()
    assert step == 12 and spread["split"] == "val" and abs(spread["loss"] - printed) <= 1e-6, (spread, printed)
    if comm.rank == 0:  # one process
        run, _, _ = trained.load(run_dir, SingleComm(), quiet)
        alone = trained.evaluate(run, step, SingleComm(), quiet)
        run.close()
        assert abs(alone["loss"] - printed) <= 1e-6, (alone, printed)
        lines = []  # and the report names the layout that ran
        report([run_dir], log=lines.append)
        named = NAMED[layout].format(P=comm.size, half=comm.size // 2, quarter=comm.size // 4)
        assert f"{comm.size} rank(s), {named}, global batch 8" in lines[0], lines[0]
    comm.barrier()


@pytest.mark.mpi(min_size=2)
def test_sample_over_ranks_draws_what_one_process_draws(capsys):
    """``mpitrain sample RUN --tp 2`` (a model sliced by heads and MLP columns, each rank
    caching its heads) in ``P / 2`` data-parallel groups sharing ``P`` sequences (on an odd
    count of ranks ``--tp 1``): every sequence's text as one process draws it, with the
    figures of the request."""
    import json

    from mpitrain import cli
    from mpitrain.comm import SingleComm, world

    comm = world()
    tp = 2 if comm.size % 2 == 0 else 1
    d = shared_data(comm, make=text_set, n=3000)
    run_dir = d.parent / "run-sample"
    cfg = config.from_dict({
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16},
        "data": {"path": str(d)}, "optim": {"name": "adamw", "lr": 3e-3},
        "train": {"global_batch_size": 4 * comm.size, "steps": 6, "eval_interval": 0, "eval_batches": 0,
                  "sample_tokens": 0, "threads": 1},
        "run": {"dir": str(run_dir)}}, [])
    train.train(cfg, log=quiet, comm=comm)
    argv = ["sample", str(run_dir), "--prompt", "tobe", "--batch", str(comm.size), "--tokens", "40", "--seed", "1",
            "--tp", str(tp), "--json"]
    assert cli.main(argv) == 0
    if comm.rank == 0:
        got = json.loads(capsys.readouterr().out)
        assert (got["tp"], got["dp"], got["batch"]) == (tp, comm.size // tp, comm.size)
        per_group = comm.size // (comm.size // tp)  # sequences a group draws; each rank caches its heads of them
        assert got["kv_cache_bytes"] == 2 * 2 * per_group * 16 * (16 // tp) * 4
        run, _, _ = trained.load(run_dir, SingleComm(), quiet)
        prompts = trained.prompts_of(run, "tobe", None, comm.size)
        alone, _ = trained.serve(run, SingleComm(), prompts, 40, seed=1)
        run.close()
        assert got["texts"] == alone and len(set(alone)) > 1
    comm.barrier()
