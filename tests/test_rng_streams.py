"""Per-sample dropout streams (``rng.sample_streams``, ``rng.layer``): a sample's masks
depend on (seed, step, sample, layer) only, not on how the batch is cut into
micro-batches, replicas or pipeline stages; outside them nothing changes."""

import numpy as np
import pytest

from mpitrain import nn, ops, rng
from mpitrain.tensor import Tensor, default_dtype

SEED, STEP = 3, 17


def assert_close(actual, expected, rtol=1e-12, err_msg=""):
    """Equal to ``rtol`` relative to the array's largest magnitude."""
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max(), err_msg=err_msg)


@pytest.fixture
def masks(monkeypatch):
    """Every dropout mask drawn, in order."""
    drawn = []
    real = rng.dropout_mask

    def spy(*args):
        drawn.append(real(*args))
        return drawn[-1]

    monkeypatch.setattr(rng, "dropout_mask", spy)
    return drawn


def in_micro_batches(fn, n: int, parts: list, layer=None):
    """``fn(lo, hi)`` for each micro-batch ``[lo, hi)`` of ``range(n)`` cut at ``parts``,
    each inside its own ``sample_streams``; returns the list of results."""
    cuts = [0, *parts, n]
    out = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        with rng.sample_streams(SEED, STEP, range(lo, hi)), rng.layer(layer if layer is not None else 0):
            out.append(fn(lo, hi))
    return out


# ------------------------------------------------------------------ the ops
def test_dropout_op_masks_do_not_depend_on_the_micro_batches(masks):
    x = Tensor(np.ones((8, 5, 6)))

    def two_calls(lo, hi):
        return [ops.dropout(x[lo:hi], 0.3).data for _ in range(2)]

    (whole,) = in_micro_batches(two_calls, 8, [])
    halves = in_micro_batches(two_calls, 8, [4])
    uneven = in_micro_batches(two_calls, 8, [1, 6])
    for k in range(2):  # the k-th call of the layer continues each sample's stream
        np.testing.assert_array_equal(whole[k], np.concatenate([h[k] for h in halves]))
        np.testing.assert_array_equal(whole[k], np.concatenate([h[k] for h in uneven]))
    assert 0 < np.count_nonzero(whole[0]) < whole[0].size
    assert not np.array_equal(whole[0], whole[1])
    assert len(masks) == 2 + 4 + 6


def test_a_sample_gets_its_mask_in_any_position():
    x = Tensor(np.ones((8, 4, 3)))
    with rng.sample_streams(SEED, STEP, range(8)):
        whole = ops.dropout(x, 0.5).data
    with rng.sample_streams(SEED, STEP, [6, 1, 3]):
        some = ops.dropout(x[:3], 0.5).data
    np.testing.assert_array_equal(some, whole[[6, 1, 3]])


def test_streams_are_keyed_by_seed_step_and_layer():
    x = Tensor(np.ones((4, 64)))

    def mask(seed=SEED, step=STEP, layer=0):
        with rng.sample_streams(seed, step, range(4)), rng.layer(layer):
            return ops.dropout(x, 0.5).data

    reference = mask()
    np.testing.assert_array_equal(mask(), reference)
    for other in (mask(seed=SEED + 1), mask(step=STEP + 1), mask(layer=1)):
        assert not np.array_equal(other, reference)
    with rng.sample_streams(SEED, STEP, range(4)):  # no rng.layer: layer 0
        np.testing.assert_array_equal(ops.dropout(x, 0.5).data, reference)


def test_attention_op_masks_do_not_depend_on_the_micro_batches(masks):
    qkv = Tensor(np.random.default_rng(0).standard_normal((8, 5, 12)), requires_grad=True)

    def attend(lo, hi):
        return ops.causal_self_attention(qkv[lo:hi], 2, dropout_p=0.3).data

    (whole,) = in_micro_batches(attend, 8, [])
    halves = in_micro_batches(attend, 8, [4])
    assert len(masks) == 3 and masks[0].shape == (8, 2, 5, 5)
    np.testing.assert_array_equal(masks[0], np.concatenate(masks[1:]))
    assert_close(np.concatenate(halves), whole)


@pytest.mark.parametrize("fast", [True, False])
def test_block_masks_do_not_depend_on_the_micro_batches(masks, fast):
    """A GPT block, fused sublayers (fast paths) or op by op: the (B*T, C) branch masks
    of the fused ops are sample-major like the (B, T, C) ones of the plain path."""
    with default_dtype(np.float64):
        rng.manual_seed(0)
        block = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=8,
                                    dropout=0.3, bias=True)).blocks[0]
    x = Tensor(np.random.default_rng(1).standard_normal((8, 6, 8)))
    with ops.fast_paths(fast):
        (whole,) = in_micro_batches(lambda lo, hi: block(x[lo:hi]).data, 8, [], layer=1)
        n = len(masks)
        halves = in_micro_batches(lambda lo, hi: block(x[lo:hi]).data, 8, [4], layer=1)
    assert n == 3 and len(masks) == 9  # attention weights, attention branch, MLP branch
    for k in range(3):
        np.testing.assert_array_equal(masks[k], np.concatenate([masks[3 + k], masks[6 + k]]))
    assert_close(np.concatenate(halves), whole)
    if fast:
        assert masks[1].shape == (8 * 6, 8)  # rows: the fused op's layout


def test_block_fused_equals_plain_under_sample_streams():
    whole = {}
    for fast in (True, False):
        with default_dtype(np.float64):
            rng.manual_seed(0)
            block = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=8,
                                        dropout=0.3, bias=True)).blocks[0]
        x = Tensor(np.random.default_rng(1).standard_normal((8, 6, 8)))
        with ops.fast_paths(fast), rng.sample_streams(SEED, STEP, range(8)), rng.layer(1):
            whole[fast] = block(x).data
    np.testing.assert_array_equal(whole[True], whole[False])


def test_the_leading_dimension_must_be_a_multiple_of_the_samples():
    with rng.sample_streams(SEED, STEP, range(3)), pytest.raises(ValueError, match="multiple"):
        ops.dropout(Tensor(np.ones((4, 2))), 0.5)


def test_a_generator_given_is_used_inside_sample_streams_too():
    x = Tensor(np.ones((4, 16)))
    with rng.sample_streams(SEED, STEP, range(4)):
        got = ops.dropout(x, 0.5, generator=np.random.default_rng(8)).data
    expected = rng.dropout_mask(np.random.default_rng(8), x.shape, 0.5, x.dtype)
    np.testing.assert_array_equal(got, expected)


# ------------------------------------------------------------------- the GPT
def gpt(**overrides):
    cfg = dict(vocab_size=13, block_size=8, n_layer=3, n_head=2, n_embd=16, dropout=0.2, bias=True) | overrides
    with default_dtype(np.float64):
        rng.manual_seed(0)
        return nn.GPT(nn.GPTConfig(**cfg))


def batch(n=8, T=8):
    r = np.random.default_rng(5)
    return r.integers(0, 13, (n, T)), r.integers(0, 13, (n, T))


def accumulate(model, ids, targets, m: int, streams: bool):
    """One step's gradients over ``m`` equal micro-batches (each loss scaled by 1/m), the
    logits of each sample and the step's loss."""
    model.zero_grad(set_to_none=True)
    rng.manual_seed(9)
    b = len(ids) // m
    logits, loss = [], 0.0
    for j in range(m):
        part = slice(j * b, (j + 1) * b)
        context = rng.sample_streams(SEED, STEP, range(j * b, (j + 1) * b)) if streams else rng.layer(0)
        with context:
            out, mean = model(ids[part], targets[part])
        (mean * (1.0 / m)).backward()
        logits.append(out.data)
        loss += mean.item() / m
    grads = {n: p.grad.copy() for n, p in model.named_parameters()}
    return grads, np.concatenate(logits), loss


def per_sample_losses(logits, targets):
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0].mean(axis=-1)  # (B,)


def test_gpt_gradients_do_not_depend_on_the_micro_batches():
    model = gpt()
    ids, targets = batch()
    g1, logits1, loss1 = accumulate(model, ids, targets, 1, streams=True)
    g4, logits4, loss4 = accumulate(model, ids, targets, 4, streams=True)
    assert g1.keys() == g4.keys()
    for name in g1:
        assert_close(g4[name], g1[name], err_msg=name)
    assert_close(logits4, logits1)
    assert_close(per_sample_losses(logits4, targets), per_sample_losses(logits1, targets))
    assert loss4 == pytest.approx(loss1, rel=1e-12)


def test_gpt_gradients_depend_on_the_micro_batches_without_sample_streams():
    """The test above can fail: with the process-wide stream the masks change."""
    model = gpt()
    ids, targets = batch()
    g1, logits1, _ = accumulate(model, ids, targets, 1, streams=False)
    g4, logits4, _ = accumulate(model, ids, targets, 4, streams=False)
    assert not np.allclose(logits4, logits1, rtol=1e-6, atol=0)
    differ = [n for n in g1 if not np.allclose(g4[n], g1[n], rtol=1e-6, atol=1e-6 * np.abs(g1[n]).max())]
    assert len(differ) > len(g1) // 2, differ


@pytest.mark.parametrize("cut", [0, 1, 2, 3])
def test_pipeline_stages_draw_the_masks_of_one_process(cut):
    """Layers 0..cut in one call and the rest in another (two stages, with another
    micro-batch's forward and some process-wide draws in between) give GPT.forward's
    logits bit for bit."""
    model = gpt()
    ids, _ = batch()
    with rng.sample_streams(SEED, STEP, range(8)):
        reference = model(ids)[0].data
    layers = model.layers()
    with rng.sample_streams(SEED, STEP, range(8)):
        x = ids
        for i in range(cut + 1):
            with rng.layer(i):
                x = layers[i](x)
    with rng.sample_streams(SEED, STEP + 1, range(8, 16)):  # something else runs meanwhile
        model(ids)
    rng.generator().random(100)
    with rng.sample_streams(SEED, STEP, range(8)):
        for i in range(cut + 1, len(layers)):
            with rng.layer(i):
                x = layers[i](x)
    np.testing.assert_array_equal(x.data, reference)


@pytest.mark.parametrize("schedule", ["inside", "outside", "interleaved"])
def test_checkpointing_replays_the_sample_streams(schedule):
    """Gradients with activation checkpointing equal those without, bit for bit, when
    backward runs inside the micro-batch's sample_streams, after it, or after another
    micro-batch's forward (F0 F1 B0 B1, as a pipeline schedule would)."""
    ids, targets = batch()
    grads = {}
    for ckpt in (False, True):
        model = gpt(checkpoint_activations=ckpt)
        model.zero_grad(set_to_none=True)
        losses = {}
        for j in range(2):
            part = slice(4 * j, 4 * j + 4)
            with rng.sample_streams(SEED, STEP, range(4 * j, 4 * j + 4)):
                losses[j] = model(ids[part], targets[part])[1]
                if schedule == "inside":
                    losses.pop(j).backward()
            if schedule == "outside":
                losses.pop(j).backward()
        for j in sorted(losses):
            losses[j].backward()
        grads[ckpt] = {n: p.grad.copy() for n, p in model.named_parameters()}
    for name in grads[False]:
        np.testing.assert_array_equal(grads[True][name], grads[False][name], err_msg=name)


def test_streams_start_only_when_a_mask_is_drawn(monkeypatch):
    started = []
    real = rng._Streams.start
    monkeypatch.setattr(rng._Streams, "start", lambda s: started.append(s.layer) or real(s))
    ids, targets = batch()
    with rng.sample_streams(SEED, STEP, range(8)):
        gpt(dropout=0.0)(ids, targets)
        gpt().eval()(ids, targets)
    assert started == []
    with rng.sample_streams(SEED, STEP, range(8)):
        gpt()(ids, targets)
    assert started == [0, 1, 2, 3]  # once per layer that draws: the embedding and each block, not the head


def test_snapshot_and_restore_resume_the_streams_mid_layer():
    x = Tensor(np.ones((4, 7)))  # odd per-sample length: a half word left over
    with rng.sample_streams(SEED, STEP, range(4)), rng.layer(2):
        first = ops.dropout(x, 0.5).data
        snap = rng.snapshot()
        expected = [ops.dropout(x, 0.5).data for _ in range(2)]
    rng.restore(snap)  # from outside the context, as a checkpointed block's backward
    again = [ops.dropout(x, 0.5).data for _ in range(2)]
    np.testing.assert_array_equal(again, expected)
    assert not np.array_equal(first, expected[0])
    rng.restore((rng.get_state(), None))  # no streams: the process-wide generator again
    state = rng.get_state()
    got = ops.dropout(x, 0.5).data
    rng.set_state(state)
    np.testing.assert_array_equal(got, rng.dropout_mask(rng.generator(), x.shape, 0.5, x.dtype))


def test_masks_drop_a_fraction_p():
    with rng.sample_streams(SEED, STEP, range(16)):
        m = ops.dropout(Tensor(np.ones((16, 10000), dtype=np.float32)), 0.3).data
    assert m.dtype == np.float32 and set(np.unique(m)) == {0.0, np.float32(1 / 0.7)}
    assert abs((m == 0).mean() - 0.3) < 0.01
    assert abs((m[0] == 0).mean() - 0.3) < 0.03 and not np.array_equal(m[0], m[1])


# ------------------------------------------------------ outside sample_streams
def test_outside_sample_streams_masks_come_from_the_process_wide_generator():
    shape, p = (4, 5, 6), 0.3
    rng.manual_seed(21)
    expected = (rng.generator().random(shape, dtype=np.float32) >= p).astype(np.float64) * (1 / (1 - p))
    rng.manual_seed(21)
    np.testing.assert_array_equal(rng.dropout_mask(None, shape, p, np.float64), expected)
    rng.manual_seed(21)
    with rng.layer(2):  # nothing outside sample_streams
        got = ops.dropout(Tensor(np.ones(shape)), p).data
    np.testing.assert_array_equal(got, expected)


def test_sample_streams_leave_the_process_wide_generator_alone():
    model = gpt()
    rng.manual_seed(4)
    before = rng.get_state()
    with rng.sample_streams(SEED, STEP, range(8)):
        model(*batch())
    assert rng.get_state() == before


def test_sample_streams_validate_their_arguments():
    with pytest.raises(ValueError):
        with rng.sample_streams(-1, 0, range(2)):
            pass
    with pytest.raises(TypeError):
        with rng.sample_streams(0, 0, [0.5, 1.0]):
            pass
    with pytest.raises(ValueError):
        with rng.sample_streams(0, 0, [-1, 2]):
            pass
