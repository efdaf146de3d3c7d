"""Tensor-parallel layers on a one-rank communicator (unit tier): float64 gradient checks
of each sliced layer and operator, the vocabulary-parallel loss against the plain one,
and a GPT sliced over one rank against the plain GPT."""

import numpy as np
import pytest

from mpitrain import nn, ops, rng
from mpitrain.comm import SingleComm
from mpitrain.gradcheck import gradcheck
from mpitrain.parallel import tensor_parallel as tp
from mpitrain.tensor import Tensor, default_dtype
from mpitrain.train.parts import grad_norm, slices

TOL = 1e-6


def x64(*shape, seed=0, grad=True):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=grad)


def test_shard_cuts_evenly_with_the_first_ranks_one_larger():
    assert [tp.shard(65, 2, r) for r in range(2)] == [(0, 33), (33, 65)]
    assert [tp.shard(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [tp.shard(5, 3, r) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]


@pytest.mark.parametrize("op", [tp.copy_to, tp.reduce_from, tp.scatter_sequence, tp.gather_sequence,
                                tp.gather_features])
def test_each_operator_has_its_gradient(op):
    x = x64(2, 4, 3)
    assert max(gradcheck(lambda a: op(a, SingleComm()) * 1.0, [x]).values()) < TOL


def test_column_and_row_parallel_linears_have_their_gradients():
    with default_dtype(np.float64):
        first, second = nn.Linear(5, 8), nn.Linear(8, 5)
    cols = np.arange(8)
    col = tp.ColumnParallelLinear.from_linear(first, SingleComm(), cols)
    row = tp.RowParallelLinear.from_linear(second, SingleComm(), cols)
    x = x64(3, 5)
    errors = gradcheck(lambda a: row(ops.gelu(col(a))), [x], params=[*col.parameters(), *row.parameters()])
    assert max(errors.values()) < TOL
    np.testing.assert_allclose(row(ops.gelu(col(x))).data, second(ops.gelu(first(x))).data, rtol=1e-13)


def test_parallel_attention_has_its_gradient():
    with default_dtype(np.float64):
        attn = nn.models.CausalSelfAttention(nn.GPTConfig(vocab_size=5, n_head=2, n_embd=8, bias=True))
    sliced = tp.ParallelSelfAttention(attn, SingleComm())
    x = x64(2, 4, 8)
    assert max(gradcheck(sliced, [x], params=list(sliced.parameters())).values()) < TOL
    np.testing.assert_allclose(sliced(x).data, attn(x).data, rtol=1e-12)


@pytest.mark.parametrize("lo", [0, 3])
@pytest.mark.parametrize("e", [0.0, 0.1])
def test_the_vocabulary_parallel_loss_is_the_cross_entropy_and_has_its_gradient(lo, e):
    """On one rank holding columns lo.. of a vocabulary: its loss and gradient are the
    plain cross-entropy's (targets all in its columns when lo = 0), smoothed by e alike."""
    logits = x64(2, 3, 7)
    targets = np.random.default_rng(1).integers(lo, lo + 7, (2, 3))
    assert max(gradcheck(lambda z: tp.vocab_parallel_cross_entropy(z, targets, lo, SingleComm(), 7, e),
                         [logits]).values()) < TOL
    ours = tp.vocab_parallel_cross_entropy(logits, targets, lo, SingleComm(), 7, e)
    plain = ops.cross_entropy(logits, targets - lo, label_smoothing=e)
    assert ours.item() == pytest.approx(plain.item(), rel=1e-14)


def test_vocabulary_parallel_embedding_has_its_gradient():
    w = x64(5, 4)
    emb = tp.VocabParallelEmbedding(nn.Parameter(w.data), 0, SingleComm())
    ids = np.array([[0, 4, 2], [3, 3, 1]])
    assert max(gradcheck(emb, [ids], params=[emb.weight]).values()) < TOL


@pytest.mark.parametrize("vocab", [13, 16])
def test_a_gpt_sliced_over_one_rank_is_the_gpt(vocab):
    """Loss and every gradient of the swapped model equal the plain model's (its plain
    path: the swap makes the blocks decline the fused one), dropout on."""
    def build():
        rng.manual_seed(4)
        with default_dtype(np.float64):
            return nn.GPT(nn.GPTConfig(vocab_size=vocab, block_size=6, n_layer=2, n_head=2, n_embd=8,
                                       dropout=0.2, bias=True))

    sliced, plain = tp.slice_gpt(build(), SingleComm()), build()
    x = np.random.default_rng(2).integers(0, vocab, (3, 6))
    y = np.roll(x, -1, axis=1)
    losses = []
    for model in (sliced, plain):
        with ops.fast_paths(False), rng.sample_streams(0, 5, np.arange(3)):
            loss = model(x, y)[1]
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-13)
    for (n, a), (m, b) in zip(sliced.named_parameters(), plain.named_parameters()):
        assert n == m
        np.testing.assert_allclose(a.grad, b.grad, rtol=1e-10, atol=1e-14, err_msg=n)
    assert grad_norm(sliced.parameters(), lambda q: True, []) == pytest.approx(
        float(np.sqrt(sum(np.sum(q.grad ** 2) for q in plain.parameters()))), rel=1e-12)


def test_heads_that_do_not_split_are_refused():
    class Two(SingleComm):
        size, rank = 3, 0

    with default_dtype(np.float64):
        gpt = nn.GPT(nn.GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=2, n_embd=8))
    with pytest.raises(ValueError, match="2 attention heads do not split over 3"):
        tp.slice_gpt(gpt, Two())


def test_a_slice_is_restored_only_from_an_array_of_the_whole_shape(tmp_path):
    """The file's whole array must have the model's whole shape, not merely hold a slice
    of the right size (a vocabulary of 80 saved, one of 65 restored)."""
    from mpitrain import checkpoint, config, optim

    cfg = config.from_dict({"model": {"name": "gpt"}, "data": {"name": "shakespeare"}, "train": {"steps": 1}})

    def gpt(vocab):
        rng.manual_seed(0)
        with default_dtype(np.float64):
            return nn.GPT(nn.GPTConfig(vocab_size=vocab, block_size=4, n_layer=1, n_head=2, n_embd=8))

    def sgd(model):
        return optim.SGD(model.parameters(), 0.1)

    from mpitrain.parallel.local import LocalSync

    saved = gpt(80)
    opt = sgd(saved)
    checkpoint.save(tmp_path, 1, model=saved, optimizer=opt, sync=LocalSync(saved, opt), cfg=cfg, comm=SingleComm(),
                    keep=1)
    whole = gpt(65)
    layout = checkpoint.Layout.of(whole, sgd(whole)).with_parts(slices(whole.config, 1, 0))
    sliced = tp.slice_gpt(whole, SingleComm())
    opt = sgd(sliced)
    with pytest.raises(checkpoint.CheckpointError, match=r"embed.wte.weight has shape \(80, 8\) in the checkpoint, "
                                                           r"\(65, 8\) in this model"):
        checkpoint.restore(checkpoint.path_for(tmp_path, 1), model=sliced, optimizer=opt,
                           sync=LocalSync(sliced, opt), comm=SingleComm(), layout=layout)
