"""The trainer's seam in the unit tier: a step as data, micro-batches, and the gradient
syncs that the loop calls (each strategy has every method of the protocol)."""

import contextlib
import json

import numpy as np
import pytest
from test_checkpoint import arrays
from test_train import JOBS

from mpitrain import checkpoint, config, nn, ops, optim, schedules
from mpitrain.comm import SingleComm
from mpitrain.parallel.data_parallel import DataParallel
from mpitrain.parallel.local import LocalSync
from mpitrain.parallel.param_server import ParameterServer
from mpitrain.parallel.pipeline import PipelineStage
from mpitrain.parallel.zero import Zero1, Zero2
from mpitrain.parallel.zero3 import Zero3
from mpitrain.tensor import Tensor
from mpitrain.train import GradSync, schedule, train
from mpitrain.train.parts import PartSync
from mpitrain.train.schedule import Backward, Forward


class Recorder:
    """A sync that records which backward passes ran inside ``no_sync``."""

    def __init__(self):
        self.inside, self.events = False, []

    @contextlib.contextmanager
    def no_sync(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


class Loss:
    """A stand-in for a loss tensor: records its backward."""

    def __init__(self, value, sync, mb):
        self.value, self.sync, self.mb = value, sync, mb

    def __mul__(self, scale):
        return Loss(self.value * scale, self.sync, self.mb)

    def item(self):
        return self.value

    def backward(self):
        self.sync.events.append((self.mb, self.sync.inside))


def test_one_stage_is_each_micro_batch_forward_then_backward():
    actions = schedule.one_stage(3)
    assert [str(a) for a in actions] == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert actions[1] == Backward(0) and actions[2] == Forward(1)
    for mb in range(3):  # every forward before its backward, each once
        assert actions.index(Forward(mb)) < actions.index(Backward(mb))
    assert schedule.one_stage(1) == [Forward(0), Backward(0)]


def test_micro_batches_cut_a_batch_into_equal_consecutive_parts():
    x, y, lanes = np.arange(12).reshape(6, 2), np.arange(6), np.arange(10, 16)
    parts = schedules.micro_batches((x, y, lanes), 3)
    assert [p[1].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [p[2].tolist() for p in parts] == [[10, 11], [12, 13], [14, 15]]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)


class Recorded(schedule.WholeModel):
    """The whole-model schedule with each micro-batch's loss a :class:`Loss` stand-in."""

    def __init__(self, sync, m):
        super().__init__(model=None, micro_batches=m)
        self.sync = sync

    def loss_only(self, x, y, label_smoothing=0.0):
        return Loss(float(x[0]), self.sync, int(x[0]))


def test_the_whole_model_schedule_trains_on_smoothed_labels_and_scores_one_hot_ones():
    model = nn.Linear(3, 4)
    x, y = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32), np.array([0, 1, 3, 3, 2])
    whole = schedule.WholeModel(model, label_smoothing=0.2)
    logits = model(Tensor(x))
    assert whole.loss_only(x, y).item() == ops.cross_entropy(logits, y).item()
    smoothed = ops.cross_entropy(logits, y, label_smoothing=0.2).item()
    assert whole.run(x, y, np.arange(5), LocalSync(model, optim.SGD(model.parameters(), lr=0.1))) == smoothed


def test_the_interpreter_holds_back_every_backward_but_the_last_and_averages_the_loss():
    sync = Recorder()
    x = np.array([2.0, 4.0, 6.0, 8.0])
    loss = Recorded(sync, 4).run(x, np.zeros(4), np.arange(4), sync)
    assert loss == pytest.approx(5.0)  # the mean of the micro-batches' losses
    assert sync.events == [(2, True), (4, True), (6, True), (8, False)]
    # an order where the last action is not a backward: the last backward still reduces
    sync = Recorder()
    crossed = Recorded(sync, 2)
    crossed.actions = [Forward(0), Forward(1), Backward(1), Backward(0)]
    crossed.run(x[:2], np.zeros(2), np.arange(2), sync)
    assert sync.events == [(4, True), (2, False)]


@pytest.mark.parametrize("cls", [LocalSync, DataParallel, Zero1, Zero2, Zero3, ParameterServer, PartSync])
def test_every_gradient_sync_is_one_and_names_its_waits(cls):
    assert issubclass(cls, GradSync)
    assert set(cls.waits) <= {"begin", "finish", "step"} and all(isinstance(v, str) for v in cls.waits.values())


def test_one_rank_syncs_name_the_calls_that_wait():
    model = nn.LeNet(1, 8, 5, channels=(2, 3), hidden=4)
    opt = optim.SGD(model.parameters(), lr=0.1)
    syncs = [LocalSync(model, opt), DataParallel(model, SingleComm(), optimizer=opt), Zero1(model, opt, SingleComm()),
             Zero2(model, opt, SingleComm())]
    assert [sync.waits for sync in syncs] == [
        {}, {"finish": "gradient exchange"}, {"finish": "gradient reduce-scatter", "step": "ZeRO-1 update"},
        {"finish": "gradient reduce-scatter", "step": "ZeRO-2 update"}]
    syncs[1].close()
    syncs[3].close()
    gpt = nn.GPT(nn.GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4))
    layout = checkpoint.Layout.of(gpt, optim.SGD(gpt.parameters(), lr=0.1))
    stage = PipelineStage(gpt, SingleComm(), np.zeros((1, 4), dtype=np.int64), ops.cross_entropy)
    piped = PartSync(LocalSync(stage, optim.SGD(stage.parameters(), lr=0.1)), stage, layout, stage=stage)
    assert piped.waits == {"finish": "gradient exchange and tied weights"}


def tiny_gpt(text_data, run_dir, *extra):
    return config.load(JOBS / "tinyshakespeare_gpt.toml", [
        f"data.path={text_data}", "model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=8",
        "train.steps=6", "train.global_batch_size=8", "train.log_interval=3", "train.eval_batches=1",
        "train.sample_tokens=0", "train.threads=1", "train.dtype=float64", "optim.grad_clip=1.0",
        f"run.dir={json.dumps(str(run_dir))}", *extra])


@pytest.mark.parametrize("sync", ["ddp", "zero1", "zero2", "zero3"])
def test_micro_batches_equal_one_pass_over_the_same_global_batch(text_data, tmp_path, sync):
    """One process: 4 micro-batches of 2 against 1 of 8, float64: model and optimizer
    state after 6 steps of AdamW with clipping within 1e-12."""
    runs = {}
    for m in (1, 4):
        runs[m] = tmp_path / f"m{m}"
        result = train(tiny_gpt(text_data, runs[m], f"parallel.sync={sync!r}", f"train.micro_batches={m}"),
                             log=lambda *a: None)
        assert result.steps == 6
    a, b = arrays(checkpoint.path_for(runs[4], 6)), arrays(checkpoint.path_for(runs[1], 6))
    for k in a:
        if a[k].dtype.kind == "f":
            assert np.abs(a[k] - b[k]).max() <= 1e-12 * max(1.0, np.abs(b[k]).max()), k
    assert not all(np.array_equal(a[k], b[k]) for k in a)  # the sums did run in another order


def test_the_header_names_the_grid_and_the_micro_batches(text_data, tmp_path):
    lines = []
    train(tiny_gpt(text_data, tmp_path / "r", "train.micro_batches=2", "train.steps=1"), log=lines.append)
    where, model, parallel = lines[0].splitlines()
    assert where == f"run directory: {tmp_path / 'r'} (checkpoints, metrics.jsonl)"
    assert "; 1 steps of 8 in 2 micro-batches per rank;" in model
    assert parallel.startswith("parallel: dp 1 x pp 1 x tp 1; local: one data-parallel rank")
