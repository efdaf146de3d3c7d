"""MPI tier: the parameter-server strategy.

Synchronous mode equals one process with the whole global batch (float64 <= 1e-10) for
the GPT and the CNN with 1 and 2 servers; a worker's bytes per step are the formula;
after a run no message is left unreceived; asynchronous modes train and record
staleness."""

import numpy as np
import pytest
from test_mpi_parallel import STEPS, build, loss_of, relative

from mpitrain import cost
from mpitrain.parallel.param_server import ParameterServer, partition


def world():
    from mpitrain.comm import world as w

    return w()


B = 12  # splits evenly over 1, 2, 3 or 4 workers


def batches(kind, dtype):
    """STEPS global batches of B, the same on every rank."""
    g = np.random.default_rng(7)
    if kind == "gpt":
        x = g.integers(0, 11, (STEPS, B, 8))
        return [(x[s], np.roll(x[s], -1, axis=1)) for s in range(STEPS)]
    return [(g.standard_normal((B, 8, 8, 1)).astype(dtype), g.integers(0, 5, B)) for _ in range(STEPS)]


def reference(kind, dtype, opt_name):
    """One process, the whole batch of B."""
    model, opt = build(kind, dtype, opt_name)
    for x, y in batches(kind, dtype):
        loss_of(kind, model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return [p.data.copy() for p in model.parameters()]


def run(kind, servers, staleness, comm, opt_name="adamw", dtype="float64"):
    """Train STEPS steps under the parameter servers; every rank returns the final model."""
    model, opt = build(kind, dtype, opt_name)
    ps = ParameterServer(model, opt, comm, servers=servers, staleness=staleness)
    W = comm.size - servers
    if ps.is_server:
        ps.serve()
    else:
        for t, (x, y) in enumerate(batches(kind, dtype)):
            b = len(x) // W
            lanes = slice(ps.worker * b, (ps.worker + 1) * b)
            ps.pull_wait()
            loss_of(kind, model, x[lanes], y[lanes]).backward()
            ps.push(t)
        ps.leave()
    sent, received = ps.comm.stats.bytes_sent, ps.comm.stats.bytes_received
    left = ps.unreceived()
    ps.gather_parameters()
    return model, ps, sent, received, left


def servers_for(size):
    return [s for s in (1, 2) if s < size]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind,opt_name", [("gpt", "adamw"), ("cnn", "sgd")])
def test_synchronous_parameter_servers_equal_one_process(kind, opt_name):
    comm = world()
    for servers in servers_for(comm.size):
        model, ps, sent, received, left = run(kind, servers, 0, comm, opt_name=opt_name)
        assert relative(model.parameters(), reference(kind, "float64", opt_name)) <= 1e-10, f"{servers} server(s)"
        assert not left
        if not ps.is_server:  # push and pull per step, the first pull, the goodbye
            n = sum(p.data.nbytes for p in model.parameters())
            push, pull = cost.parameter_server_bytes(n, servers)
            assert (push, pull) == (n + 16 * servers, n + 8 * servers)
            assert sent == STEPS * push + 16 * servers
            assert received == (STEPS + 1) * pull
        ps.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("staleness", [-1, 2])
def test_asynchronous_modes_train_and_record_staleness(staleness):
    comm = world()
    servers = 1
    model, ps, _, _, left = run("gpt", servers, staleness, comm)
    histogram = ps.staleness_histogram()
    W = comm.size - servers
    assert sum(histogram.values()) == STEPS * W  # every gradient applied once
    if staleness >= 0:
        assert max(histogram) <= (staleness + 1) * W  # bounded: never more than s + 1 rounds of W updates behind
    assert not left
    assert all(np.isfinite(p.data).all() for p in model.parameters())
    ps.close()


@pytest.mark.mpi(min_size=2)
def test_every_rank_ends_with_the_workers_mean_batch_norm_statistics():
    comm = world()
    model, opt = build("resnet", "float64", "sgd")
    ps = ParameterServer(model, opt, comm, servers=1)
    x = np.random.default_rng(comm.rank).standard_normal((4, 8, 8, 2))
    if ps.is_server:
        ps.serve()
    else:
        ps.pull_wait()
        loss_of("resnet", model, x, np.zeros(4, dtype=np.int64)).backward()
        ps.push(0)
        ps.leave()
    mine = {n: np.array(b, copy=True) for n, b in model.named_buffers()}
    everyone = comm.allgather(mine)
    ps.gather_buffers(model)
    for name, b in model.named_buffers():
        workers = [d[name] for d in everyone[1:]]
        expected = np.mean(workers, axis=0) if b.dtype.kind == "f" else workers[0]
        assert np.allclose(b, expected, rtol=1e-12, atol=0), name
    ps.close()


@pytest.mark.mpi(min_size=2)
def test_an_evaluation_between_synchronous_steps_sees_the_pulled_parameters():
    """The trainer syncs buffers before it evaluates: a worker first takes the pull in
    flight, whose receives write the parameters it would score."""
    comm = world()
    model, opt = build("cnn", "float64", "sgd")
    ps = ParameterServer(model, opt, comm, servers=1)
    if ps.is_server:
        ps.serve()
    else:
        x, y = batches("cnn", "float64")[0]
        assert ps.begin_step()
        loss_of("cnn", model, x[:2], y[:2]).backward()
        ps.step()
        assert list(ps.versions) == [0]  # the reply to the push is on its way
        ps.sync_buffers()
        assert list(ps.versions) == [1] and ps.begin_step()  # taken: the next step's wait is over at once
    ps.end()
    assert not ps.unreceived()
    ps.close()


def test_partition_balances_sizes():
    assert partition([10, 10, 10, 10], 2) == [0, 1, 0, 1]
    owner = partition([100, 1, 50, 49, 2], 2)
    loads = [sum(s for s, o in zip([100, 1, 50, 49, 2], owner) if o == k) for k in range(2)]
    assert loads == [101, 101]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("micro", [1, 2])
def test_the_trainer_with_synchronous_servers_equals_one_process(micro):
    """`mpitrain train --set parallel.sync=ps`: the same test loss as one process, also
    when each worker's part goes through in two micro-batches (pushed once per step)."""
    from test_mpi_data import shared_data

    from mpitrain import config, train
    from mpitrain.comm import SingleComm

    comm = world()
    d = shared_data(comm, n=960, test=200)
    raw = {"model": {"name": "lenet", "channels": [4, 8], "hidden": 16}, "data": {"path": str(d)},
           "optim": {"name": "adamw", "lr": 3e-3}, "train": {"global_batch_size": 48, "epochs": 2, "dtype": "float64",
                                                             "log_interval": 10}}
    alone = train.train(config.from_dict(raw), log=lambda *a: None, comm=SingleComm())
    raw["parallel"] = {"sync": "ps", "servers": 1}
    raw["train"]["micro_batches"] = micro
    ours = train.train(config.from_dict(raw), log=lambda *a: None, comm=comm)
    assert abs(ours.test_loss - alone.test_loss) <= 1e-10 * alone.test_loss
    assert ours.test_accuracy == alone.test_accuracy and ours.steps == alone.steps
    if comm.rank >= 1:  # the workers also scored the model after the first epoch, between steps
        assert [r["step"] for r in ours.history] == [r["step"] for r in alone.history] == [20, 40]
        assert ours.history[0]["test_accuracy"] == alone.history[0]["test_accuracy"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")  # lr 1e30: the divergence asked for
def test_a_straggler_sleeps_and_skipped_steps_keep_the_step_count(monkeypatch):
    """`parallel.slow_worker`: that worker (only) sleeps before each push. With
    `run.on_nan = "skip"` a step that is not pushed still counts: the checkpoint is at
    the run's last step."""
    from test_mpi_data import shared_data

    from mpitrain import checkpoint, config, train
    from mpitrain.parallel import param_server

    comm = world()
    d = shared_data(comm, n=480, test=60)
    slept = []
    monkeypatch.setattr(param_server.time, "sleep", slept.append)
    raw = {"model": {"name": "lenet", "channels": [2, 4], "hidden": 8}, "data": {"path": str(d)},
           "optim": {"name": "sgd", "lr": 1e30, "warmup_steps": 0}, "train": {"global_batch_size": 48, "steps": 8},
           "parallel": {"sync": "ps", "slow_worker": 0, "slow_factor": 3.0},
           "run": {"dir": str(d.parent / "run"), "on_nan": "skip"}}
    result = train.train(config.from_dict(raw), log=lambda *a: None, comm=comm)
    assert (len(slept) > 0) == (comm.rank == 1) and all(s > 0 for s in slept)
    assert result.steps == 8 and result.checkpoint == str(checkpoint.path_for(d.parent / "run", 8))
    if comm.rank == 1:  # worker 0: the loss went non-finite and the updates were skipped
        assert result.skipped > 0


@pytest.mark.mpi(min_size=2)
def test_the_servers_final_checkpoint_equals_one_process_checkpoint():
    """Each server writes its parameters' optimizer state into the trainer's format: the
    file equals (float64, 1e-10) the one a single process writes after the same steps;
    `mpitrain report` draws the run from worker 0's metrics."""
    from test_checkpoint import assert_close
    from test_mpi_data import shared_data

    from mpitrain import checkpoint, config, train
    from mpitrain.comm import SingleComm

    comm = world()
    d = shared_data(comm, n=480, test=60)
    root = d.parent
    raw = {"model": {"name": "lenet", "channels": [2, 4], "hidden": 8}, "data": {"path": str(root / "d")},
           "optim": {"name": "adam", "lr": 3e-3}, "train": {"global_batch_size": 48, "epochs": 1, "dtype": "float64"},
           "run": {"dir": str(root / "one")}}
    if comm.rank == 0:
        train.train(config.from_dict(raw), log=lambda *a: None, comm=SingleComm())
    raw["parallel"] = {"sync": "ps", "servers": min(2, comm.size - 1)}
    raw["run"] = {"dir": str(root / "ps")}
    result = train.train(config.from_dict(raw), log=lambda *a: None, comm=comm)
    assert result.checkpoint == str(checkpoint.path_for(root / "ps", 10))
    comm.barrier()  # worker 0 writes metrics.jsonl: done on every rank now
    if comm.rank == 0:
        from mpitrain.observe.report import report

        written = report([root / "ps"], log=lambda *a: None)
        assert {p.name for p in written} == {"loss.png", "time_per_rank.png", "throughput.png", "summary.txt"}
        assert_close(result.checkpoint, checkpoint.path_for(root / "one", 10), rtol=1e-10, floor=1e-12)


@pytest.mark.mpi(min_size=2)
def test_a_parameter_server_timeline_shows_pushes_and_updates():
    import json

    from test_mpi_data import shared_data

    from mpitrain import config, train

    comm = world()
    d = shared_data(comm, n=480, test=60)
    root = d.parent
    raw = {"model": {"name": "lenet", "channels": [2, 4], "hidden": 8}, "data": {"path": str(root / "d")},
           "train": {"global_batch_size": 48, "steps": 4}, "parallel": {"sync": "ps", "staleness": -1},
           "run": {"dir": str(root / "run"), "timeline": True}}
    train.train(config.from_dict(raw), log=lambda *a: None, comm=comm)
    if comm.rank != 0:
        return
    spans = [e for e in json.loads((root / "run" / "timeline.json").read_text())["traceEvents"] if e["ph"] == "X"]
    server = [e["name"] for e in spans if e["pid"] == 0]
    assert sum(name.startswith("apply worker") for name in server) == 4 * (comm.size - 1)
    assert "waiting for pushes" in server
    for rank in range(1, comm.size):
        names = [e["name"] for e in spans if e["pid"] == rank]
        # a worker runs the trainer's loop: its layers' forward and backward, the pull before and the push after
        assert names.count("push") >= 1 and names.count("pull") >= 1
        assert any(n.startswith("forward ") for n in names) and any(n.startswith("backward ") for n in names)
