"""The autograd engine: accumulation, explicit upstream gradients, non-leaf gradients,
post-accumulate hooks, no_grad, graph release, dtypes; its gradients bit for bit those of
the reference walk (``reference_backward``)."""

import weakref

import numpy as np
import pytest

from mpitrain import nn, ops, rng
from mpitrain.autograd import backward, grad, reference_backward
from mpitrain.tensor import Parameter, Tensor, default_dtype, get_default_dtype, no_grad


def leaf(*shape, seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


def test_float32_default_and_float64_on_request():
    assert Tensor([1.0, 2.0]).dtype == np.float32
    assert Parameter(np.zeros(3)).dtype == np.float64  # arrays keep their dtype
    assert Tensor(np.arange(3)).dtype.kind == "i"
    with default_dtype(np.float64):
        assert Tensor([1.0]).dtype == np.float64
        assert get_default_dtype() == np.float64
    assert get_default_dtype() == np.float32
    with pytest.raises(TypeError):
        Tensor(np.arange(3), requires_grad=True)


def test_gradients_accumulate_across_backward_calls():
    x = leaf(3)
    (x * 2.0).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_allclose(x.grad, 5.0)


def test_shared_input_sums_all_paths():
    x = leaf(4)
    y = x * x + x * 3.0 + ops.exp(x)
    y.sum().backward()
    np.testing.assert_allclose(x.grad, 2 * x.data + 3 + np.exp(x.data))


def test_explicit_upstream_gradient_from_a_non_scalar():
    x = leaf(2, 3)
    y = ops.tanh(x)
    g = np.random.default_rng(1).standard_normal((2, 3))
    y.backward(g)
    np.testing.assert_allclose(x.grad, g * (1 - np.tanh(x.data) ** 2))


def test_backward_without_gradient_needs_one_element():
    with pytest.raises(RuntimeError, match="one-element"):
        (leaf(2) * 2.0).backward()
    with pytest.raises(RuntimeError, match=r"upstream gradient gave a gradient of shape \(3,\)"):
        (leaf(2) * 2.0).backward(np.ones(3))
    with pytest.raises(ValueError, match="2 tensors but 1 gradients"):
        backward([leaf(2) * 2.0, leaf(2) * 3.0], [np.ones(2)])


def test_stage_input_leaf_receives_gradient():
    """A pipeline stage's received activation: a leaf that requires grad gets .grad."""
    w = leaf(3, 2, seed=1)
    x = Tensor(np.ones((4, 3)), requires_grad=True)
    y = x @ w
    y.backward(np.ones((4, 2)))
    np.testing.assert_allclose(x.grad, np.ones((4, 2)) @ w.data.T)


def test_retain_grad_on_intermediate():
    x = leaf(3)
    h = x * 2.0
    h.retain_grad()
    (h * h).sum().backward()
    np.testing.assert_allclose(h.grad, 2 * h.data)
    np.testing.assert_allclose(x.grad, 4 * h.data)


def test_grad_function_leaves_dot_grad_alone():
    x, w = leaf(3), leaf(3, seed=1)
    h = x * w
    loss = (h * h).sum()
    gx, gh, unused = grad(loss, [x, h, leaf(2, seed=2)])
    np.testing.assert_allclose(gh, 2 * h.data)
    np.testing.assert_allclose(gx, 2 * h.data * w.data)
    assert unused is None
    assert x.grad is None and w.grad is None


def test_backward_from_several_roots():
    x = leaf(3)
    a, b = x * 2.0, x * x
    backward([a, b], [np.ones(3), np.full(3, 2.0)])
    np.testing.assert_allclose(x.grad, 2 + 4 * x.data)


def test_no_grad_records_nothing():
    x = leaf(3)
    with no_grad():
        y = x * 2.0
    assert not y.requires_grad and y.is_leaf
    z = x * 2.0
    assert z.requires_grad and not z.is_leaf


def test_graph_is_freed_unless_retained():
    x = leaf(3)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad, 4 * x.data)
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward()


def test_intermediates_no_backward_needs_are_freed_during_forward():
    """The graph links to an intermediate without holding its array: a residual add's
    input and GELU's pre-activation go as soon as nothing else holds them, and the
    gradients are unchanged."""
    x = leaf(4, 6)
    w = leaf(6, 6, seed=1)
    pre = ops.linear(x, w)  # GELU keeps its derivative, not this
    pre_array = weakref.ref(pre.data)
    h = ops.gelu(pre)
    del pre
    assert pre_array() is None
    res = h * 3.0
    res_array = weakref.ref(res.data)
    out = res + x  # a residual add keeps no input
    del res
    assert res_array() is None
    out.sum().backward()

    xr, wr = leaf(4, 6), leaf(6, 6, seed=1)
    (ops.gelu(ops.linear(xr, wr)) * 3.0 + xr).sum().backward()
    np.testing.assert_array_equal(x.grad, xr.grad)
    np.testing.assert_array_equal(w.grad, wr.grad)


def test_grad_that_is_a_view_stays_a_view():
    """Accumulation writes into the existing .grad, so views into a flat buffer survive."""
    flat = np.zeros(5)
    a = Parameter(np.ones(2))
    b = Parameter(np.ones(3))
    a.grad, b.grad = flat[:2], flat[2:]
    (a * 3.0).sum().backward()
    (b * 4.0).sum().backward()
    np.testing.assert_allclose(flat, [3, 3, 4, 4, 4])
    assert a.grad.base is flat


def test_post_accumulate_hooks_fire_once_when_complete():
    """Each parameter's hook fires once per backward, after all of its uses delivered,
    and for a chain of layers in reverse order of use."""
    w1, w2, w3 = (Parameter(np.random.default_rng(i).standard_normal((4, 4))) for i in range(3))
    fired = []

    def hook(p):
        fired.append((p.name, p.grad.copy()))

    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        w.name = name
        w.register_post_accumulate_grad_hook(hook)
    x = Tensor(np.ones((2, 4)))
    h = ops.tanh(x @ w1)
    h = ops.tanh(h @ w2) + h @ w1  # w1 used twice: its hook waits for both uses
    loss = ops.sum(ops.tanh(h @ w3))
    loss.backward()
    assert [n for n, _ in fired] == ["w3", "w2", "w1"]
    for (_, at_hook), w in zip(fired, (w3, w2, w1)):
        np.testing.assert_array_equal(at_hook, w.grad)
    fired.clear()
    ops.sum(x @ w1).backward()
    assert [n for n, _ in fired] == ["w1"]


def test_hooks_only_on_leaves():
    with pytest.raises(RuntimeError):
        (leaf(2) * 2.0).register_post_accumulate_grad_hook(lambda p: None)


def test_split_outputs_used_partially():
    x = leaf(6)
    a, b, c = ops.split(x, 3)
    (a * 2.0 + c * 3.0).sum().backward()
    np.testing.assert_allclose(x.grad, [2, 2, 0, 0, 3, 3])


def test_a_backward_returning_the_wrong_shape_is_named():
    from mpitrain.tensor import Function

    class Broken(Function):
        def forward(self, x):
            return x * 2

        def backward(self, g):
            return g[:1]

    with pytest.raises(RuntimeError, match="Broken.backward gave a gradient of shape"):
        Broken.apply(leaf(3)).backward(np.ones(3))


def test_handed_out_gradients_are_private_and_writable():
    a, b = leaf(3), leaf(3, seed=1)
    h = a + b
    h.retain_grad()
    g = np.ones(3)
    h.backward(g)
    assert h.grad is not g and a.grad is not b.grad
    a.zero_grad()
    h.grad *= 2  # writable, and nobody else's
    assert np.all(b.grad == 1) and np.all(g == 1)
    x, y = leaf(3), leaf(3, seed=1)
    gx, gy = grad(x + y, [x, y], [g])
    gx *= 10
    assert np.all(gy == 1) and np.all(g == 1)


def test_gradients_have_the_layout_of_their_tensor():
    """A transpose hands its input a transposed view as gradient; .grad and grad()
    still hand out C-ordered arrays, as optimizers and flat buffers expect (an F-ordered
    .grad made every later optimizer pass strided)."""
    x, w = leaf(5, 3), leaf(5, 4, seed=1)
    (x.T @ w).sum().backward()
    (gx,) = grad((x.T @ w).sum(), [x])
    for g in (x.grad, gx):
        assert g.flags.c_contiguous
        np.testing.assert_allclose(g, w.data.sum(axis=1)[:, None].repeat(3, axis=1))


def test_grad_leaves_retained_intermediates_alone():
    x = leaf(3)
    h = x * 2.0
    h.retain_grad()
    grad((h * h).sum(), [x])
    assert h.grad is None


def test_float32_stays_float32_with_numpy_constants():
    x = Tensor(np.ones(3, dtype=np.float32), requires_grad=True)
    for y in (x * np.float64(2), x / np.float64(2), x + np.arange(3), x * np.int64(3),
              2.0 ** x, np.float64(3) - x):
        assert y.dtype == np.float32
        gx, = grad(y, [x], [np.ones(3, np.float32)])
        assert gx.dtype == np.float32


def test_negative_and_bad_axes():
    x = leaf(2, 3, 4)
    y = ops.transpose(x, (-1, 0, 1))
    assert y.shape == (4, 2, 3)
    y.backward(np.arange(24.0).reshape(4, 2, 3))
    np.testing.assert_array_equal(x.grad, np.arange(24.0).reshape(4, 2, 3).transpose(1, 2, 0))
    with pytest.raises(np.exceptions.AxisError):
        ops.sum(x, axis=3)
    with pytest.raises(ValueError, match="permutation"):
        ops.transpose(x, (0, 0, 1))


def test_nested_observers_with_equal_values():
    from mpitrain.observe.flops import FlopCount
    from mpitrain.tensor import observe_ops

    with observe_ops(FlopCount()):
        with observe_ops(FlopCount()):
            ops.matmul(leaf(2, 2), leaf(2, 2))


def check_engine_equals_reference(make, forward, dtype):
    """``forward(model) -> (loss, inputs)`` once; the reference walk's gradients, then the
    engine's on the same graph (the reference frees nothing, and with ``last_backward``
    false no fused op writes over what it saved), every parameter's and input's bit for
    bit."""
    with default_dtype(dtype):
        rng.manual_seed(0)
        model = make()
    rng.manual_seed(7)
    loss, inputs = forward(model)
    leaves = dict(model.named_parameters(), **{f"input{i}": x for i, x in enumerate(inputs)})
    reference_backward(loss)
    expected = {name: t.grad for name, t in leaves.items()}
    assert all(g is not None and g.dtype == dtype for g in expected.values())
    for t in leaves.values():
        t.grad = None
    loss.backward()
    for name, t in leaves.items():
        assert t.grad.shape == expected[name].shape and t.grad.tobytes() == expected[name].tobytes(), name


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_engine_equals_the_reference_walk_on_the_gpt(dtype, fast, checkpoint):
    """Dropout on (one forward: both walks see its masks), the tied token embedding
    reached through two nodes, activation checkpointing's node."""
    cfg = dict(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1, bias=True)
    r = np.random.default_rng(1)
    ids, targets = r.integers(0, 13, (3, 8)), r.integers(0, 13, (3, 8))

    def whole(model):
        return model(ids, targets)[1], []

    with ops.fast_paths(fast):
        check_engine_equals_reference(lambda: nn.GPT(nn.GPTConfig(**cfg, checkpoint_activations=checkpoint)),
                                      whole, dtype)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_engine_equals_the_reference_walk_on_cnns(small_cnn, fast, dtype):
    make, images, labels = small_cnn
    images = images.astype(dtype)

    def classify(model):
        x = Tensor(images, requires_grad=True)
        return ops.cross_entropy(model(x), labels), [x]

    with ops.fast_paths(fast):
        check_engine_equals_reference(make, classify, dtype)


def test_the_engine_equals_the_reference_walk_where_the_order_of_a_sum_counts():
    """A parameter, an input and an intermediate each used by many nodes, in float32:
    their gradients are sums of many terms, which round differently in another order
    (the reference visiting a node's inputs first to last gives other bits here)."""
    r = np.random.default_rng(6)
    data, scales = r.standard_normal((2, 64)).astype(np.float32), r.standard_normal(12).astype(np.float32)
    w, x = Parameter(data[0]), Tensor(data[1], requires_grad=True)
    h = ops.tanh(x * w)  # (64,) an intermediate every term uses
    y = sum(ops.tanh(h * float(c) + x * w + x) for c in scales).sum()
    reference_backward(y)
    expected = w.grad, x.grad
    w.grad = x.grad = None
    y.backward()
    for a, b in zip((w.grad, x.grad), expected):
        assert a.tobytes() == b.tobytes()
