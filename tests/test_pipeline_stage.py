"""A pipeline stage on one rank (unit tier, no MPI): the whole model as one stage, run by
each schedule, trains exactly as plain gradient accumulation does; the cut; refusals."""

import numpy as np
import pytest

from mpitrain import nn, ops, optim, rng, schedules
from mpitrain.comm import SingleComm
from mpitrain.parallel import pipeline as pl
from mpitrain.parallel.local import LocalSync
from mpitrain.tensor import default_dtype

B, T, M = 8, 8, 4


def gpt(dtype):
    rng.manual_seed(1)
    with default_dtype(dtype):
        return nn.GPT(nn.GPTConfig(vocab_size=13, block_size=T, n_layer=2, n_head=2, n_embd=16, dropout=0.1))


def data(steps=3):
    x = np.random.default_rng(2).integers(0, 13, (steps, B, T))
    return [(x[s], np.roll(x[s], -1, axis=1)) for s in range(steps)]


def micro(x, y):
    b = B // M
    return [(x[k * b:(k + 1) * b], y[k * b:(k + 1) * b]) for k in range(M)]


def streams(step):
    return lambda samples: rng.sample_streams(0, step, samples)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_one_stage_trains_as_gradient_accumulation_bit_for_bit(name, dtype):
    stage = pl.PipelineStage(gpt(dtype), SingleComm(), np.zeros((1, T), dtype=np.int64), ops.cross_entropy,
                             schedule_name=name, micro_batches=M)
    sync = LocalSync(stage, optim.AdamW(stage.parameters(), 1e-2))
    plain = gpt(dtype)
    opt = optim.AdamW(plain.parameters(), 1e-2)
    for step, (x, y) in enumerate(data()):
        loss = stage.run(x, y, np.arange(B), sync, streams(step))
        sync.step(None, 1.0)
        sync.zero_grad()
        total = 0.0
        for k, (xm, ym) in enumerate(micro(x, y)):
            with streams(step)(np.arange(k * (B // M), (k + 1) * (B // M))):
                part = plain(xm, ym)[1] * (1.0 / M)
            total += part.item()
            part.backward()
        optim.update(opt, plain.parameters(), None, 1.0)
        opt.zero_grad()
        assert loss == total
    for (n, a), (m, b) in zip(stage.named_parameters(), plain.named_parameters()):
        assert n == m
        np.testing.assert_array_equal(a.data, b.data, err_msg=n)


def test_a_smoothed_stage_trains_on_smoothed_labels_scores_one_hot_ones_and_takes_two_argument_losses():
    (x, y), = data(1)
    with rng.sample_streams(0, 0, np.arange(B)):  # the dropout masks of step 0's samples
        logits = gpt(np.float64)(x)[0]
    one_hot, smoothed = (ops.cross_entropy(logits, y, label_smoothing=e).item() for e in (0.0, 0.2))
    for loss, want in ((ops.cross_entropy, smoothed), (lambda out, y: ops.cross_entropy(out, y), one_hot)):
        stage = pl.PipelineStage(gpt(np.float64), SingleComm(), np.zeros((1, T), dtype=np.int64), loss,
                                 label_smoothing=0.2 if loss is ops.cross_entropy else 0.0)
        with rng.sample_streams(0, 0, np.arange(B)):
            assert stage.loss_only(x, y).item() == one_hot  # evaluation: the one-hot targets
        assert stage.run(x, y, np.arange(B), LocalSync(stage, optim.SGD(stage.parameters(), 0.1)),
                         streams(0)) == pytest.approx(want, rel=1e-15)


def test_the_cut_balances_parameters_and_keeps_the_whole_models_names():
    model = gpt(np.float32)
    names = [n for n, _ in model.named_parameters()]
    sizes = [sum(q.size for q in layer.parameters()) for _, layer in model.named_layers()]
    assert schedules.balance(sizes, 2) == [0, 2, 4]  # embed + block 0 | block 1 + head
    assert schedules.balance([1] * 6, 4) == [0, 1, 2, 4, 6]  # ties: later stages take more (1F1B keeps fewer there)
    stage = pl.PipelineStage(model, SingleComm(), np.zeros((1, T), dtype=np.int64), ops.cross_entropy)
    assert [n for n, _ in stage.named_parameters()] == names
    assert stage.bounds == [0, len(sizes)] and stage.names[0] == "embed" and stage.names[-1] == "head"


def test_refusals():
    with pytest.raises(ValueError, match="4 layers cannot be cut into 5"):
        schedules.balance([1, 2, 3, 4], 5)
    with pytest.raises(ValueError, match="at least 2 pipeline stages"):
        schedules.check("interleaved", 1, 4, 2)
    model = gpt(np.float32)
    model.extra = nn.Linear(2, 2)  # a parameter outside the layer list
    with pytest.raises(ValueError, match="belong to no layer"):
        pl.PipelineStage(model, SingleComm(), np.zeros((1, T), dtype=np.int64), ops.cross_entropy)
