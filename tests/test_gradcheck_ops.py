"""Every op's backward pass against float64 central differences (max relative error < 1e-6)."""

import numpy as np
import pytest

from mpitrain import ops
from mpitrain.gradcheck import gradcheck
from mpitrain.ops import conv, elementwise, transformer
from mpitrain.ops._util import BLOCK_ELEMENTS
from mpitrain.tensor import Tensor

TOL = 1e-6


def t(*shape, seed=0, low=None, high=None, grad=True):
    r = np.random.default_rng(seed)
    data = r.standard_normal(shape) if low is None else r.uniform(low, high, shape)
    return Tensor(data.astype(np.float64), requires_grad=grad)


def away_from_zero(*shape, seed=0, margin=0.1):
    """Values with |x| >= margin: no kink of relu/max is within a finite-difference step."""
    r = np.random.default_rng(seed)
    x = r.standard_normal(shape)
    x = np.sign(x) * (np.abs(x) + margin)
    return Tensor(x, requires_grad=True)


def distinct(*shape, seed=0):
    """A random permutation of well-separated values: no ties anywhere (max, pooling)."""
    r = np.random.default_rng(seed)
    n = int(np.prod(shape))
    return Tensor((r.permutation(n) * 0.1 - n * 0.05).reshape(shape).astype(np.float64),
                  requires_grad=True)


def check(f, *inputs, **kw):
    errors = gradcheck(f, inputs, **kw)
    assert errors, "nothing was checked"
    assert max(errors.values()) < TOL, errors


# ------------------------------------------------------------------ elementwise
BROADCAST_PAIRS = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((2, 1, 4), (3, 1)), ((5,), (2, 5)), ((3, 4), ())]


@pytest.mark.parametrize("sa,sb", BROADCAST_PAIRS)
@pytest.mark.parametrize("op", [ops.add, ops.sub, ops.mul])
def test_binary_broadcasting(op, sa, sb):
    check(op, t(*sa, seed=1), t(*sb, seed=2))


@pytest.mark.parametrize("sa,sb", BROADCAST_PAIRS)
def test_div_broadcasting(sa, sb):
    check(ops.div, t(*sa, seed=1), t(*sb, seed=2, low=0.5, high=2.0))


def test_pow_tensor_exponent_and_constant():
    base = t(3, 4, low=0.5, high=2.0)
    check(ops.pow, base, t(4, seed=3))
    check(lambda x: x ** 3, t(3, 4))
    check(lambda x: x ** 0.5, base)
    check(lambda e: 2.0 ** e, t(3, seed=4))


def test_operators_with_constants_and_reflection():
    check(lambda x: 2.0 - x * 3 + 1 / (x * x + 1) - (-x), t(2, 3))
    check(lambda x: np.arange(3.0) * x + x / np.float64(2.0), t(2, 3))


@pytest.mark.parametrize("name", ["exp", "tanh", "sigmoid", "gelu", "neg"])
def test_unary(name):
    check(getattr(ops, name), t(4, 5))


def test_log():
    check(ops.log, t(4, 5, low=0.1, high=3.0))


def test_relu_away_from_kink():
    check(ops.relu, away_from_zero(4, 5))


def test_sigmoid_and_gelu_large_inputs():
    x = Tensor(np.linspace(-30, 30, 13), requires_grad=True)
    check(ops.sigmoid, x)
    check(ops.gelu, x)


def test_gelu_erf_form():
    """The exact GELU (nanoGPT's): its gradient against finite differences, large inputs
    included, and its values against the formula with math.erf."""
    import math

    check(lambda x: ops.gelu(x, "erf"), t(4, 5))
    check(lambda x: ops.gelu(x, "erf"), Tensor(np.linspace(-30, 30, 13), requires_grad=True))
    x = np.linspace(-9, 9, 1001)
    expected = np.array([v * (1 + math.erf(v / math.sqrt(2))) / 2 for v in x])
    np.testing.assert_allclose(ops.gelu(Tensor(x), "erf").data, expected, rtol=0, atol=4e-15)
    with pytest.raises(ValueError, match="GELU form must be one of"):
        ops.gelu(Tensor(x), "exact")


def test_erf_agrees_with_math_erf():
    """NumPy has no erf: ours is within 2e-15 of the C library's in float64, keeps the
    dtype, and takes infinities, NaN and signed zeros."""
    import math

    x = np.concatenate([np.linspace(-8, 8, 100001), [2.5, -2.5, 6.0, -6.0, 1e-300, -1e-300]])
    expected = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(elementwise.erf(x), expected, rtol=0, atol=2e-15)
    special = elementwise.erf(np.array([np.inf, -np.inf, np.nan, 0.0, -0.0]))
    assert special[:2].tolist() == [1.0, -1.0] and np.isnan(special[2]) and np.signbit(special[4])
    x32 = x.astype(np.float32)
    assert elementwise.erf(x32).dtype == np.float32
    np.testing.assert_allclose(elementwise.erf(x32), [math.erf(v) for v in x32.astype(np.float64)], atol=2e-6)


def test_gelu_over_several_blocks_matches_the_formula():
    # the op works in cache blocks and computes its derivative during forward
    x = np.random.default_rng(0).normal(0, 3, (2, BLOCK_ELEMENTS + 7))  # float64, three blocks
    u = np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)
    dudx = np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x**2)
    expected = 0.5 * x * (1 + np.tanh(u))
    expected_grad = 0.5 * (1 + np.tanh(u)) + 0.5 * x * (1 - np.tanh(u) ** 2) * dudx
    xt = Tensor(x, requires_grad=True)
    y = ops.gelu(xt)
    g = np.random.default_rng(1).standard_normal(x.shape)
    y.backward(g)
    np.testing.assert_allclose(y.data, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(xt.grad, expected_grad * g, rtol=1e-10, atol=1e-12)
    fn = elementwise.GELU()  # no gradient wanted: the same values, no derivative computed
    fn.needs_input_grad = (False,)
    np.testing.assert_array_equal(fn.forward(x), y.data)
    assert fn.d is None


# ------------------------------------------------------------------- reductions
@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, False), (1, True), ((0, 2), False), (-1, True)])
@pytest.mark.parametrize("op", [ops.sum, ops.mean, ops.max])
def test_reductions(op, axis, keepdims):
    check(lambda x: op(x, axis, keepdims), distinct(2, 3, 4))


def test_max_ties_share_gradient():
    x = Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]]), requires_grad=True)
    ops.max(x, axis=1).backward(np.ones(2))
    np.testing.assert_allclose(x.grad, [[0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])


# ------------------------------------------------------------------------ shape
def test_reshape_transpose():
    check(lambda x: ops.reshape(x, (4, 6)), t(2, 3, 4))
    check(lambda x: ops.transpose(x, (2, 0, 1)), t(2, 3, 4))
    check(lambda x: x.T, t(3, 5))


@pytest.mark.parametrize("index", [
    (slice(1, 3), Ellipsis),
    (0, slice(None, None, 2)),
    (Ellipsis, None, 1),
    np.array([2, 0, 2, 1]),  # repeated rows accumulate
    (np.array([0, 1, 1]), np.array([2, 0, 2])),
    np.array([[True, False, True, False], [False, True, True, True], [True, True, False, False]]),
])
def test_getitem(index):
    check(lambda x: x[index], t(3, 4))


def test_concat_and_split():
    check(lambda a, b, c: ops.concat([a, b, c], axis=1), t(2, 1, 3), t(2, 4, 3, seed=1), t(2, 2, 3, seed=2))
    check(lambda x: ops.split(x, 3, axis=-1), t(2, 6))
    check(lambda x: ops.split(x, [1, 4, 2], axis=0), t(7, 2))
    # only some parts used downstream: unused parts get zero gradient
    check(lambda x: ops.split(x, 2, axis=0)[1] * 2.0, t(4, 3))


# ------------------------------------------------------------------------ linalg
@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
                                   ((2, 1, 3, 4), (5, 4, 2)), ((3, 4), (2, 4, 5))])
def test_matmul_batched_broadcasting(sa, sb):
    check(ops.matmul, t(*sa, seed=1), t(*sb, seed=2))


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    args = (t(2, 3, 4), t(4, 5, seed=1)) + ((t(5, seed=2),) if bias else ())
    check(ops.linear, *args)


def test_linear_with_transposed_weight():
    check(lambda x, w: ops.linear(x, ops.transpose(w)), t(2, 3, 4), t(5, 4, seed=1))


# ------------------------------------------------------------------- conv, pool
@pytest.mark.parametrize("stride,padding,k", [(1, 0, 3), (1, 1, 3), (2, 1, 3), (2, 0, 2), ((1, 2), (2, 0), (3, 2)), (1, 2, 5)])
def test_conv2d(stride, padding, k):
    kh, kw = (k, k) if isinstance(k, int) else k
    check(lambda x, w, b: ops.conv2d(x, w, b, stride, padding),
          t(2, 7, 6, 3), t(kh, kw, 3, 4, seed=1), t(4, seed=2))


@pytest.mark.parametrize("stride,padding,relu", [(1, 1, True), (2, 1, False), (1, 0, False)])
def test_conv2d_in_tiles_of_one_image(monkeypatch, stride, padding, relu):
    """Forward and backward walk the batch one image at a time when a tile holds one."""
    monkeypatch.setattr(conv, "TILE_BYTES_PER_THREAD", 1)
    assert len(conv._tiles(3, 1000)) == 3
    check(lambda x, w, b: ops.conv2d(x, w, b, stride, padding, relu=relu),
          t(3, 6, 5, 2), t(3, 3, 2, 4, seed=1), t(4, seed=2))


def test_conv2d_fused_relu_and_strided_input():
    check(lambda x, w, b: ops.conv2d(x, w, b, 1, 1, relu=True), t(2, 5, 6, 3), t(3, 3, 3, 4, seed=1), t(4, seed=2))
    x = t(2, 3, 5, 6).data.transpose(0, 2, 3, 1)  # (2, 5, 6, 3), not contiguous
    w = t(3, 3, 3, 4, seed=1).data
    y = ops.conv2d(Tensor(x), Tensor(w), None, 1, 1).data
    np.testing.assert_allclose(y, ops.conv2d(Tensor(np.ascontiguousarray(x)), Tensor(w), None, 1, 1).data)
    fused = ops.conv2d(Tensor(x), Tensor(w), None, 1, 1, relu=True).data
    np.testing.assert_array_equal(fused, np.maximum(y, 0))


def test_conv2d_without_bias_or_input_grad():
    x = t(2, 5, 5, 2, grad=False)
    check(lambda w: ops.conv2d(x, w, None, 1, 1), t(3, 3, 2, 3, seed=1))


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 1, 0), (3, 2, 1), (2, 1, 1)])
def test_max_pool2d(k, s, p):
    check(lambda x: ops.max_pool2d(x, k, s, p), distinct(2, 6, 7, 3))


@pytest.mark.parametrize("k,s,p,relu", [(2, 2, 0, True), (2, 2, 0, False), (3, 2, 1, True), (2, 1, 1, False)])
def test_max_pool2d_in_tiles_of_one_image(monkeypatch, k, s, p, relu):
    """Forward and backward walk the batch one image at a time when a tile holds one,
    with the same values and gradients as the whole batch at once."""
    x = np.random.default_rng(4).integers(-2, 3, (3, 6, 6, 2)).astype(np.float64)  # ties
    results = []
    for tile_bytes in (1 << 30, 1):
        monkeypatch.setattr(conv, "POOL_TILE_BYTES", tile_bytes)
        xt = Tensor(x, requires_grad=True)
        y = ops.max_pool2d(xt, k, s, p, relu=relu)
        assert len(y._ctx.tiles) == (1 if tile_bytes > 1 else 3)
        y.backward(np.random.default_rng(5).standard_normal(y.shape))
        results.append((y.data, xt.grad))
    for whole, tiled in zip(*results):
        np.testing.assert_array_equal(whole, tiled)
    check(lambda x: ops.max_pool2d(x, k, s, p, relu=relu), distinct(3, 6, 7, 2))


def test_max_pool2d_ties_go_to_first():
    x = Tensor(np.zeros((1, 2, 2, 1)), requires_grad=True)
    ops.max_pool2d(x, 2).backward(np.ones((1, 1, 1, 1)))
    assert x.grad.reshape(-1).tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 2, 1)])
def test_max_pool2d_fused_relu(k, s, p):
    check(lambda x: ops.max_pool2d(x, k, s, p, relu=True), distinct(2, 6, 7, 3))


def test_max_pool2d_relu_equals_relu_then_pool():
    """Same values and gradients as rectifying first, including windows of ties and
    windows whose maximum is 0 or negative."""
    r = np.random.default_rng(3)
    x = r.integers(-2, 3, (3, 6, 6, 4)).astype(np.float64)  # many ties, many <= 0
    g = r.standard_normal((3, 3, 3, 4))
    fused, plain = Tensor(x, requires_grad=True), Tensor(x, requires_grad=True)
    y = ops.max_pool2d(fused, 2, relu=True)
    y.backward(g)
    ref = ops.max_pool2d(ops.relu(plain), 2)
    ref.backward(g)
    np.testing.assert_array_equal(y.data, ref.data)
    np.testing.assert_array_equal(fused.grad, plain.grad)


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 1, 1), (3, 2, 1)])
def test_avg_pool2d(k, s, p):
    check(lambda x: ops.avg_pool2d(x, k, s, p), t(2, 6, 5, 3))


# -------------------------------------------------------------------- norms
@pytest.mark.parametrize("shape", [(4, 3, 3, 5), (6, 5)])
def test_batch_norm_train(shape):
    rm, rv = np.zeros(shape[-1]), np.ones(shape[-1])
    check(lambda x, w, b: ops.batch_norm(x, w, b, rm.copy(), rv.copy(), training=True),
          t(*shape), t(shape[-1], seed=1), t(shape[-1], seed=2))


def test_batch_norm_eval():
    rm, rv = np.random.default_rng(3).standard_normal(5), np.linspace(0.5, 2, 5)
    check(lambda x, w, b: ops.batch_norm(x, w, b, rm, rv, training=False),
          t(4, 2, 2, 5), t(5, seed=1), t(5, seed=2))


def test_batch_norm_running_statistics():
    x = np.random.default_rng(0).standard_normal((8, 3, 3, 2)) * 2 + 1
    rm, rv = np.zeros(2), np.ones(2)
    ops.batch_norm(Tensor(x), Tensor(np.ones(2)), Tensor(np.zeros(2)), rm, rv, True, 0.1)
    flat = x.reshape(-1, 2)
    np.testing.assert_allclose(rm, 0.1 * flat.mean(0))
    np.testing.assert_allclose(rv, 0.9 + 0.1 * flat.var(0, ddof=1))


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(bias):
    args = (t(2, 3, 6), t(6, seed=1)) + ((t(6, seed=2),) if bias else (None,))
    check(ops.layer_norm, *args)


# ----------------------------------------------------------------- softmax, loss
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_and_log_softmax(axis):
    check(lambda x: ops.softmax(x, axis), t(3, 4, 5))
    check(lambda x: ops.log_softmax(x, axis), t(3, 4, 5))


def test_cross_entropy_with_ignore_index():
    targets = np.array([[1, 4, -100], [0, -100, 3]])
    check(lambda z: ops.cross_entropy(z, targets), t(2, 3, 5))
    check(lambda z: ops.cross_entropy(z, targets, reduction="sum"), t(2, 3, 5))
    check(lambda z: ops.cross_entropy(z, np.array([2, 0, 2]), ignore_index=2), t(3, 4))


def test_cross_entropy_value_and_extremes():
    z = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]])
    loss = ops.cross_entropy(Tensor(z), np.array([1, 2]))
    assert np.isclose(loss.item(), (1000.0 + np.log(3.0)) / 2)
    all_ignored = ops.cross_entropy(Tensor(z, requires_grad=True), np.array([-100, -100]))
    assert all_ignored.item() == 0.0


@pytest.mark.parametrize("e", [0.1, 1.0])
def test_cross_entropy_with_label_smoothing(e):
    targets = np.array([[1, 4, -100], [0, -100, 3]])
    check(lambda z: ops.cross_entropy(z, targets, label_smoothing=e), t(2, 3, 5))
    check(lambda z: ops.cross_entropy(z, targets, reduction="sum", label_smoothing=e), t(2, 3, 5))


def test_label_smoothing_is_the_cross_entropy_against_the_smoothed_target():
    z, y, e = t(6, 5).data, np.array([0, 4, 2, 2, -100, 1]), 0.2
    counted = y != -100
    q = np.full((6, 5), e / 5) + (1 - e) * np.eye(5)[np.where(counted, y, 0)]  # (N, V) the smoothed targets
    logp = z - z.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    want = -(q * logp).sum(1)[counted].mean()
    zt = Tensor(z, requires_grad=True)
    loss = ops.cross_entropy(zt, y, label_smoothing=e)
    loss.backward()
    assert abs(loss.item() - want) < 1e-14
    np.testing.assert_allclose(zt.grad, (np.exp(logp) - q) * counted[:, None] / counted.sum(), rtol=0, atol=1e-15)
    assert ops.cross_entropy(Tensor(z), y, label_smoothing=0.0).item() == ops.cross_entropy(Tensor(z), y).item()
    z[4, 0] = -np.inf  # in an ignored row: it adds nothing, smoothed or not (as PyTorch's masked rows)
    assert ops.cross_entropy(Tensor(z), y, label_smoothing=e).item() == pytest.approx(want, rel=1e-14)


@pytest.mark.parametrize("e", [-0.1, 1.5, float("nan")])
def test_label_smoothing_outside_0_1_is_refused(e):
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        ops.cross_entropy(Tensor(np.zeros((2, 3))), np.array([0, 1]), label_smoothing=e)


def test_cross_entropy_rejects_bad_targets():
    with pytest.raises(IndexError):
        ops.cross_entropy(Tensor(np.zeros((2, 3))), np.array([0, 3]))


# ------------------------------------------------------------ attention, embedding
@pytest.mark.parametrize("causal", [True, False])
def test_causal_self_attention(causal):
    check(lambda qkv: ops.causal_self_attention(qkv, n_head=2, causal=causal), t(2, 5, 12))


def test_attention_causal_mask_blocks_the_future():
    """Changing a later position must not change earlier outputs, nor get gradient from them."""
    x = t(1, 6, 18).data
    y1 = ops.causal_self_attention(Tensor(x), n_head=3).data
    x2 = x.copy()
    x2[:, 4:] += 1.0
    y2 = ops.causal_self_attention(Tensor(x2), n_head=3).data
    np.testing.assert_allclose(y1[:, :4], y2[:, :4], rtol=0, atol=1e-12)
    assert not np.allclose(y1[:, 4:], y2[:, 4:])
    xt = Tensor(x, requires_grad=True)
    out = ops.causal_self_attention(xt, n_head=3)
    g = np.zeros(out.shape)
    g[:, :2] = 1.0
    out.backward(g)
    assert np.all(xt.grad[:, 2:] == 0)


def test_attention_matches_unfused_ops():
    """The fused node equals attention composed from primitive ops."""
    B, T, C, nh = 2, 5, 12, 3
    x = t(B, T, 3 * C).data
    fused = ops.causal_self_attention(Tensor(x), nh).data
    q, k, v = (Tensor(a).reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3) for a in np.split(x, 3, axis=-1))
    s = ops.matmul(q, k.transpose(0, 1, 3, 2)) * (1 / np.sqrt(C // nh))
    s = s + np.triu(np.full((T, T), -np.inf), 1)
    y = ops.matmul(ops.softmax(s, -1), v).transpose(0, 2, 1, 3).reshape(B, T, C)
    np.testing.assert_allclose(fused, y.data, rtol=1e-12, atol=1e-12)


def test_attention_dropout_is_seeded():
    qkv = t(2, 4, 6)
    gen = lambda: np.random.default_rng(5)  # noqa: E731
    check(lambda x: ops.causal_self_attention(x, 1, dropout_p=0.3, generator=gen()), qkv)


def test_embedding_with_repeated_ids():
    ids = np.array([[1, 3, 1], [0, 1, 3]])
    check(lambda w: ops.embedding(ids, w), t(5, 4))


def test_dropout_seeded_and_scaled():
    gen = lambda: np.random.default_rng(7)  # noqa: E731
    check(lambda x: ops.dropout(x, 0.4, generator=gen()), t(6, 7))
    x = Tensor(np.ones((200, 200)))
    y = ops.dropout(x, 0.25, generator=np.random.default_rng(0)).data
    assert set(np.unique(y)) == {0.0, 1 / 0.75}
    assert abs((y == 0).mean() - 0.25) < 0.01
    assert ops.dropout(x, 0.25, training=False) is x


def test_gradcheck_refuses_a_cut_graph():
    x = t(3)
    with pytest.raises(ValueError, match="graph is cut"):
        gradcheck(lambda a: Tensor(a.data * 2), [x])


NONCONTIGUOUS = [
    ("conv2d", lambda x: ops.conv2d(x, Tensor(np.ones((3, 3, 3, 2))), None, 1, 1)),
    ("max_pool2d", lambda x: ops.max_pool2d(x, 2)),
    ("avg_pool2d", lambda x: ops.avg_pool2d(x, 2)),
    ("layer_norm", lambda x: ops.layer_norm(x, Tensor(np.ones(3)))),
    ("linear", lambda x: ops.linear(x, Tensor(np.ones((3, 2))))),
    ("softmax", lambda x: ops.softmax(x)),
]


@pytest.mark.parametrize("name,f", NONCONTIGUOUS)
def test_ops_on_non_contiguous_inputs(name, f):
    """A transposed (non-contiguous) view as input: the gradient must equal the
    gradient for the same values stored contiguously."""
    base = distinct(2, 3, 4, 4).data  # (B, C, H, W): channels-first storage
    view = Tensor(base.transpose(0, 2, 3, 1), requires_grad=True)  # (B, H, W, C) view
    contiguous = Tensor(np.ascontiguousarray(view.data), requires_grad=True)
    g = np.random.default_rng(1).standard_normal(f(contiguous).shape)
    f(view).backward(g)
    f(contiguous).backward(g)
    np.testing.assert_allclose(view.grad, contiguous.grad, rtol=1e-12, atol=1e-12)


def test_pooling_and_norm_reject_bad_shapes():
    with pytest.raises(ValueError, match="padding"):
        ops.max_pool2d(t(1, 4, 4, 1), 2, 2, 2)
    with pytest.raises(ValueError, match="more than one value per channel"):
        ops.batch_norm(t(1, 3), t(3), t(3), np.zeros(3), np.ones(3), training=True)


def test_embedding_of_no_ids():
    w = t(5, 3)
    ops.embedding(np.zeros((0,), dtype=np.int64), w).backward(np.zeros((0, 3)))
    assert np.all(w.grad == 0)


# ------------------------------------------------------------ transformer sublayers
def _sublayer_inputs(kind, bias):
    C, H = 6, (18 if kind == "attention" else 10)
    ln_b = t(C, seed=2) if bias else None
    return (t(2, 4, C), t(C, seed=1, low=0.5, high=1.5), ln_b, t(C, H, seed=3),
            t(H, seed=4) if bias else None, t(H // 3 if kind == "attention" else H, C, seed=5),
            t(C, seed=6) if bias else None)


def _sublayer(kind, dropout=0.0, seed=7):
    """The fused op, with a fresh generator of ``seed`` per call (the same dropout masks)."""
    def f(*inputs):
        gen = np.random.default_rng(seed)
        if kind == "attention":
            return ops.attention_sublayer(*inputs, n_head=3, dropout_p=dropout, generator=gen)
        return ops.mlp_sublayer(*inputs, dropout_p=dropout, generator=gen)
    return f


def _op_by_op(kind, dropout=0.0, seed=7):
    """The same computation from the separate ops, drawing masks in the same order."""
    def f(x, ln_w, ln_b, w_in, b_in, w_proj, b_proj):
        gen = np.random.default_rng(seed)
        u = ops.layer_norm(x, ln_w, ln_b)
        if kind == "attention":
            y = ops.causal_self_attention(ops.linear(u, w_in, b_in), 3, dropout_p=dropout, generator=gen)
        else:
            y = ops.gelu(ops.linear(u, w_in, b_in))
        return x + ops.dropout(ops.linear(y, w_proj, b_proj), dropout, generator=gen)
    return f


@pytest.mark.parametrize("kind", ["attention", "mlp"])
@pytest.mark.parametrize("bias,dropout", [(True, 0.0), (False, 0.0), (True, 0.3)])
def test_transformer_sublayer(kind, bias, dropout):
    check(_sublayer(kind, dropout), *_sublayer_inputs(kind, bias))


@pytest.mark.parametrize("kind", ["attention", "mlp"])
@pytest.mark.parametrize("bias,dropout", [(True, 0.0), (False, 0.3)])
def test_transformer_sublayer_equals_its_ops(kind, bias, dropout):
    """Values and gradients equal the op-by-op form's: after a plain backward (the node
    then writes over its saved arrays) and after one with retain_graph (it must not),
    which a second backward through the same graph then doubles."""
    inputs = _sublayer_inputs(kind, bias)
    params = [a for a in inputs if a is not None]
    g = np.random.default_rng(5).standard_normal(inputs[0].shape)

    def run(f, retain_graph=False):
        for p in params:
            p.grad = None
        y = f(*inputs)
        y.backward(g, retain_graph=retain_graph)
        return y, [p.grad.copy() for p in params]

    y_ref, g_ref = run(_op_by_op(kind, dropout))
    for retain in (False, True):
        y, grads = run(_sublayer(kind, dropout), retain)
        np.testing.assert_allclose(y.data, y_ref.data, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    y.backward(g)
    for p, b in zip(params, g_ref):
        np.testing.assert_allclose(p.grad, 2 * b, rtol=1e-10, atol=1e-12)


def test_mlp_sublayer_without_gradient_keeps_no_derivative():
    arrays = [None if a is None else a.data for a in _sublayer_inputs("mlp", True)]
    fn = transformer.MLPSublayer()
    fn.needs_input_grad = (False,) * 10
    y = fn.forward(*arrays, 1e-5, 0.0, None)
    assert fn.d is None
    np.testing.assert_array_equal(y, ops.mlp_sublayer(*arrays).data)


def test_transformer_sublayers_reject_bad_shapes():
    x, ln_w, ln_b, w_qkv, b_qkv, w_proj, b_proj = _sublayer_inputs("attention", True)
    with pytest.raises(ValueError, match="n_head=4"):
        ops.attention_sublayer(x, ln_w, ln_b, w_qkv, b_qkv, w_proj, b_proj, n_head=4)
    with pytest.raises(ValueError, match=r"x must be \(B, T, C\)"):
        ops.mlp_sublayer(x, ln_w, ln_b, t(5, 10), None, t(10, 6), None)
