"""The plain paths (the reading text) against the fast ones beside them (``ops.fast_paths``):
the GPT's fused block halves and blocked GELU bit for bit, the tiled convolution to
rounding, the tiled max-pool bit for bit."""

import itertools
import math

import numpy as np
import pytest

from mpitrain import nn, ops, rng
from mpitrain.gradcheck import gradcheck
from mpitrain.ops import conv, elementwise
from mpitrain.ops._util import BLOCK_ELEMENTS
from mpitrain.ops.linalg import Linear as LinearOp
from mpitrain.ops.transformer import AttentionSublayer, MLPSublayer
from mpitrain.tensor import Tensor, default_dtype, observe_ops


def assert_close(actual, expected, rtol, err_msg=""):
    """Equal to ``rtol`` relative to the array's largest magnitude (sums that cancel
    to near zero differ by rounding of the terms, not of the result)."""
    atol = rtol * np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=err_msg)


# ------------------------------------------------------------------------ switch
def test_switch_defaults_on_and_restores():
    assert ops.fast_paths_enabled()
    with ops.fast_paths(False):
        assert not ops.fast_paths_enabled()
        with ops.fast_paths(True):
            assert ops.fast_paths_enabled()
        assert not ops.fast_paths_enabled()
    assert ops.fast_paths_enabled()
    with pytest.raises(RuntimeError), ops.fast_paths(False):
        raise RuntimeError
    assert ops.fast_paths_enabled()
    assert ops.set_fast_paths(False) is True
    assert ops.set_fast_paths(True) is False and ops.fast_paths_enabled()


def test_the_bitwise_check_catches_one_ulp():
    a = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    b = a.copy()
    b[37] = np.nextafter(b[37], np.float32(np.inf))
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(a, b)


# -------------------------------------------------------------------------- GELU
@pytest.mark.parametrize("n", [10, BLOCK_ELEMENTS, 200003])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_plain_equals_blocked_bit_for_bit(n, dtype):
    x = (np.random.default_rng(n).standard_normal(n) * 3).astype(dtype)
    y, d = elementwise.gelu_plain(x)
    yb, db = np.empty_like(x), np.empty_like(x)
    elementwise.gelu_blocks(x, yb, db)
    assert y.dtype == d.dtype == dtype
    np.testing.assert_array_equal(y, yb)
    np.testing.assert_array_equal(d, db)


def test_gelu_textbook_grouping_is_not_bitwise():
    """Why gelu_plain is grouped as it is: the formula as usually written rounds
    differently in some elements, which the bitwise test above would catch."""
    s, c = math.sqrt(2 / math.pi), 0.044715
    x = (np.random.default_rng(0).standard_normal(200003) * 3).astype(np.float32)
    textbook = 0.5 * x * (1 + np.tanh(s * (x + c * x**3)))
    np.testing.assert_allclose(textbook, elementwise.gelu_plain(x)[0], rtol=1e-6, atol=1e-6)
    assert not np.array_equal(textbook, elementwise.gelu_plain(x)[0])


def test_ops_gelu_takes_the_plain_path_when_switched_off(monkeypatch):
    calls = []

    def spy(x, derivative=True):
        calls.append(x.shape)
        return plain(x, derivative)

    plain = elementwise.gelu_plain
    monkeypatch.setattr(elementwise, "gelu_plain", spy)
    x = np.random.default_rng(1).standard_normal((3, 70000)).astype(np.float32)
    g = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)
    results = []
    for fast in (True, False):
        xt = Tensor(x, requires_grad=True)
        with ops.fast_paths(fast):
            y = ops.gelu(xt)
            y.backward(g)
        results.append((y.data, xt.grad))
    assert calls == [(3, 70000)]
    for fast, plain_result in zip(*results):
        np.testing.assert_array_equal(fast, plain_result)


def test_gelu_plain_gradcheck():
    x = Tensor(np.random.default_rng(3).standard_normal((4, 7)) * 2, requires_grad=True)
    with ops.fast_paths(False):
        errors = gradcheck(ops.gelu, [x])
    assert errors and max(errors.values()) < 1e-6, errors


# ---------------------------------------------------------------------------- GPT
FUSED = {AttentionSublayer, MLPSublayer}


def gpt(dtype, **overrides):
    cfg = dict(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16) | overrides
    with default_dtype(dtype):
        rng.manual_seed(0)
        return nn.GPT(nn.GPTConfig(**cfg))


def run(model, inputs, fast: bool, upstream=None):
    """One forward and backward on one path with the dropout masks of seed 7: the
    output (the GPT's logits and loss), the input's gradient when it is a tensor and
    every parameter's gradient by name, and the set of op classes that ran."""
    model.zero_grad(set_to_none=True)
    seen = set()
    with ops.fast_paths(fast), observe_ops(lambda cls, args, kwargs: seen.add(cls)):
        rng.manual_seed(7)
        y = model(*inputs)
        results = {"logits": y[0].data} if isinstance(y, tuple) else {}
        y = y[1] if isinstance(y, tuple) else y
        y.backward(upstream)
    results |= {"output": y.data} | {n: p.grad.copy() for n, p in model.named_parameters()}
    if isinstance(inputs[0], Tensor):
        results["input"] = inputs[0].grad.copy()
        inputs[0].grad = None
    return results, seen


def assert_bitwise(fast: dict, plain: dict):
    assert fast.keys() == plain.keys()
    for name, value in plain.items():
        np.testing.assert_array_equal(fast[name], value, err_msg=name)


CASES = [dict(dropout=d, bias=b) for d, b in itertools.product((0.0, 0.2), (False, True))]


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"dropout{c['dropout']}-bias{c['bias']}")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpt_fused_equals_plain_bit_for_bit(dtype, case, training, checkpoint):
    """Loss and every gradient, the whole model on each path. Bit for bit in float64
    too: the two do the same arithmetic, whatever the precision."""
    model = gpt(dtype, checkpoint_activations=checkpoint, **case).train(training)
    r = np.random.default_rng(1)
    ids, targets = r.integers(0, 13, (3, 8)), r.integers(0, 13, (3, 8))
    (fast, fast_ops), (plain, plain_ops) = (run(model, (ids, targets), f) for f in (True, False))
    assert FUSED <= fast_ops and not FUSED & plain_ops and LinearOp in plain_ops
    assert_bitwise(fast, plain)


@pytest.mark.parametrize("gelu", ["tanh", "erf"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_block_fused_equals_plain_bit_for_bit_over_several_gelu_blocks(dtype, gelu):
    """A block at the benchmark's width whose MLP activation spans several GELU blocks:
    output, input gradient and every parameter gradient; either form of GELU."""
    block = gpt(dtype, n_embd=128, n_head=4, block_size=64, dropout=0.1, bias=True, gelu=gelu).blocks[0]
    r = np.random.default_rng(2)
    x = Tensor(r.standard_normal((3, 64, 128)).astype(dtype), requires_grad=True)
    assert 3 * 64 * 4 * 128 > BLOCK_ELEMENTS
    g = r.standard_normal(x.shape).astype(dtype)
    (fast, fast_ops), (plain, plain_ops) = (run(block, (x,), f, g) for f in (True, False))
    assert FUSED <= fast_ops and not FUSED & plain_ops
    assert_bitwise(fast, plain)


class CountingLinear(nn.Linear):
    """A swapped-in layer (as tensor slicing would swap one), computing as Linear does."""

    calls = 0

    def forward(self, x):
        CountingLinear.calls += 1
        return super().forward(x)


def test_a_swapped_layer_makes_the_block_take_the_plain_path():
    model = gpt(np.float64)
    plain, _ = run(model, (np.zeros((2, 8), dtype=np.int64), np.ones((2, 8), dtype=np.int64)), False)
    old = model.blocks[1].mlp.c_fc
    swapped = CountingLinear(old.in_features, old.out_features, bias=old.bias is not None)
    swapped.weight = old.weight
    model.blocks[1].mlp.c_fc = swapped
    CountingLinear.calls = 0
    fast, seen = run(model, (np.zeros((2, 8), dtype=np.int64), np.ones((2, 8), dtype=np.int64)), True)
    assert CountingLinear.calls == 1 and FUSED <= seen  # block 0 still fused, block 1 plain
    assert not model.blocks[1]._fusable() and model.blocks[0]._fusable()
    assert_bitwise(fast, plain)


# ------------------------------------------------------------------- convolution
def conv_run(fast, x, w, b, stride, padding, relu, g):
    """Output and gradients of x, w (and b) of one convolution on one path; its node's
    class and tiles (None for the plain one), read before backward frees the node."""
    ts = [Tensor(a, requires_grad=True) for a in (x, w, b) if a is not None]
    with ops.fast_paths(fast):
        y = ops.conv2d(ts[0], ts[1], ts[2] if b is not None else None, stride, padding, relu=relu)
        node = type(y._ctx), getattr(y._ctx, "tiles", None)
        y.backward(g)
    return [y.data] + [t.grad for t in ts], node


CONV_GRID = list(itertools.product((1, 2), (0, 1, 2), (1, 3, 5), (False, True), (False, True)))


@pytest.mark.parametrize("tiling", ["image tiles", "one tile, sub-tiles of 2"])
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_plain_conv_equals_tiled(monkeypatch, dtype, rtol, tiling):
    """Values and all gradients over strides, paddings, kernels, ReLU and bias, on a
    non-square batch of 5 that the tiled path walks in several tiles of one image, or in
    one tile whose input gradient goes in sub-tiles of 2, 2 and 1 images."""
    for stride, padding, k, relu, bias in CONV_GRID:
        r = np.random.default_rng(k + 10 * padding)
        x, w = r.standard_normal((5, 9, 7, 3)).astype(dtype), r.standard_normal((k, k, 3, 4)).astype(dtype)
        b = r.standard_normal(4).astype(dtype) if bias else None
        Ho, Wo = (9 + 2 * padding - k) // stride + 1, (7 + 2 * padding - k) // stride + 1
        if tiling == "image tiles":
            monkeypatch.setattr(conv, "TILE_BYTES_PER_THREAD", 1)
        else:
            monkeypatch.setattr(conv, "TILE_BYTES_PER_THREAD", 1 << 30)
            monkeypatch.setattr(conv, "COLUMN_GRAD_BYTES", 2 * k * k * Ho * Wo * 3 * x.itemsize)
        g = r.standard_normal((5, Ho, Wo, 4)).astype(dtype)
        tiled, (op, tiles) = conv_run(True, x, w, b, stride, padding, relu, g)
        assert op is conv.TiledConv2d and len(tiles) == (5 if tiling == "image tiles" else 1)
        plain, (op, _) = conv_run(False, x, w, b, stride, padding, relu, g)
        assert op is conv.Conv2d
        for name, t, p in zip(("y", "dx", "dw", "db"), tiled, plain):
            assert_close(t, p, rtol, err_msg=f"{name}: stride {stride} padding {padding} k {k} relu {relu}")


@pytest.mark.parametrize("stride,padding,k,relu",
                         [(1, 1, 3, True), (2, 1, (3, 2), False), ((1, 2), (2, 0), 5, False)])
def test_plain_conv_gradcheck(stride, padding, k, relu):
    kh, kw = (k, k) if isinstance(k, int) else k
    r = np.random.default_rng(4)
    x, w, b = (Tensor(r.standard_normal(s), requires_grad=True) for s in ((2, 7, 6, 3), (kh, kw, 3, 4), (4,)))
    with ops.fast_paths(False):
        errors = gradcheck(lambda x, w, b: ops.conv2d(x, w, b, stride, padding, relu=relu), [x, w, b])
    assert errors and max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("k,s,p,relu", [(2, 2, 0, True), (2, 2, 0, False), (3, 2, 1, True), (2, 1, 1, False)])
def test_max_pool_whole_batch_equals_tiles_bit_for_bit(monkeypatch, k, s, p, relu):
    monkeypatch.setattr(conv, "POOL_TILE_BYTES", 1)
    r = np.random.default_rng(5)
    x = r.integers(-2, 3, (3, 6, 7, 2)).astype(np.float32)  # ties and values <= 0
    results = []
    for fast in (True, False):
        xt = Tensor(x, requires_grad=True)
        with ops.fast_paths(fast):
            y = ops.max_pool2d(xt, k, s, p, relu=relu)
            assert len(y._ctx.tiles) == (3 if fast else 1)
            y.backward(np.random.default_rng(6).standard_normal(y.shape).astype(np.float32))
        results.append((y.data, xt.grad))
    for tiled, whole in zip(*results):
        np.testing.assert_array_equal(tiled, whole)


class WithLoss(nn.Module):
    """A classifier and its cross-entropy on fixed labels, as one module."""

    def __init__(self, model, labels):
        super().__init__()
        self.model, self.labels = model, labels

    def forward(self, x):
        return ops.cross_entropy(self.model(x), self.labels)


@pytest.mark.parametrize("make", [
    lambda: nn.LeNet(in_channels=2, image_size=12, channels=(4, 6), hidden=16, dropout=0.2),
    lambda: nn.ConvNet(in_channels=3, image_size=12, channels=(4, 6)),
    lambda: nn.ResNet(in_channels=3, widths=(4, 6), blocks=1),
], ids=["lenet", "convnet", "resnet"])
def test_cnn_plain_equals_fast(monkeypatch, make):
    """Loss, input gradient and every parameter gradient in float64, with several tiles
    per convolution on the fast path."""
    monkeypatch.setattr(conv, "TILE_BYTES_PER_THREAD", 4000)
    with default_dtype(np.float64):
        rng.manual_seed(0)
        model = make()
    r = np.random.default_rng(8)
    x = Tensor(r.standard_normal((6, 12, 12, model.parameters()[0].shape[2])), requires_grad=True)
    loss = WithLoss(model, r.integers(0, 10, 6))
    (fast, fast_ops), (plain, plain_ops) = (run(loss, (x,), f) for f in (True, False))
    assert conv.TiledConv2d in fast_ops and conv.Conv2d in plain_ops and conv.Conv2d not in fast_ops
    assert fast.keys() == plain.keys()
    for name, value in plain.items():
        assert_close(fast[name], value, 1e-12, err_msg=name)
