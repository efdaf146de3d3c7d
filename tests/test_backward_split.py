"""A backward pass split in two (``backward_split``, then ``WeightPass.run``), as a
zero-bubble pipeline stage runs it: the input gradients first, the parameters' later,
bit for bit what one ``backward`` gives."""

import gc
import weakref

import numpy as np
import pytest

from mpitrain import gradcheck as gradcheck_module
from mpitrain import nn, ops, rng
from mpitrain.autograd import backward_split
from mpitrain.tensor import Function, Parameter, Tensor, default_dtype, no_grad


def twins(make, dtype):
    """Two copies of one model, built from the same seed."""
    models = []
    for _ in range(2):
        with default_dtype(dtype):
            rng.manual_seed(0)
            models.append(make())
    return models


def check_split_equals_backward(make, forward, dtype, upstream=True):
    """``forward(model) -> (output, leaves)`` on each twin with the dropout masks of one
    seed; one backward on the first, a split one on the second. Between the phases the
    leaves' (and retained) gradients are final and no parameter has one; after it every
    gradient equals the one-pass result bit for bit."""
    ref, split = twins(make, dtype)
    rng.manual_seed(7)
    out, leaves = forward(ref)
    g = [np.random.default_rng(3).standard_normal(out.shape).astype(dtype)] if upstream else None
    out.backward(None if g is None else g[0])
    rng.manual_seed(7)
    out2, leaves2 = forward(split)
    weights = backward_split([out2], g)
    for a, b in zip(leaves, leaves2):
        assert b.grad is not None
        np.testing.assert_array_equal(b.grad, a.grad)
    assert all(p.grad is None for p in split.parameters())
    weights.run()
    for (name, p), q in zip(ref.named_parameters(), split.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert q.grad.dtype == dtype
            np.testing.assert_array_equal(q.grad, p.grad, err_msg=name)
    for a, b in zip(leaves, leaves2):
        np.testing.assert_array_equal(b.grad, a.grad)  # phase two leaves them alone
    assert any(p.grad is not None for p in split.parameters())


GPT = dict(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)


def batch():
    r = np.random.default_rng(1)
    return r.integers(0, 13, (3, 8)), r.integers(0, 13, (3, 8))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gpt_stage_without_head(dtype, fast, bias):
    """The blocks as a pipeline stage runs them: the received activation is a leaf."""
    ids, _ = batch()

    def stage(model):
        with no_grad():
            x = Tensor(model.embed(ids).data, requires_grad=True)
        out = x
        for block in model.blocks:
            out = block(out)
        return out, [x]

    with ops.fast_paths(fast):
        check_split_equals_backward(lambda: nn.GPT(nn.GPTConfig(**GPT, bias=bias)), stage, dtype)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_whole_gpt_with_loss(dtype, fast, checkpoint):
    """Embedding and tied head (the token embedding reaches the loss through two nodes),
    a retained intermediate (the logits), activation checkpointing (its node computes
    every gradient whatever it is asked for)."""
    ids, targets = batch()

    def whole(model):
        logits, loss = model(ids, targets)
        logits.retain_grad()
        return loss, [logits]

    with ops.fast_paths(fast):
        check_split_equals_backward(lambda: nn.GPT(nn.GPTConfig(**GPT, checkpoint_activations=checkpoint)),
                                    whole, dtype, upstream=False)


class WithLoss(nn.Module):
    """A classifier and its cross-entropy on fixed labels, as one module."""

    def __init__(self, model, labels):
        super().__init__()
        self.model, self.labels = model, labels

    def forward(self, x):
        return ops.cross_entropy(self.model(x), self.labels)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cnn(small_cnn, fast, dtype):
    make, images, labels = small_cnn
    images = images.astype(dtype)

    def classify(model):
        x = Tensor(images, requires_grad=True)
        return WithLoss(model, labels)(x), [x]

    with ops.fast_paths(fast):
        check_split_equals_backward(make, classify, dtype, upstream=False)


def test_hooks_fire_once_in_phase_two_with_the_final_gradient():
    """A parameter's hook fires in ``run``, once, in the order one backward fires them
    (the tied embedding waits for both its uses); a leaf that is not a parameter fires
    in phase one."""
    ids, targets = batch()
    ref, split = twins(lambda: nn.GPT(nn.GPTConfig(**GPT)), np.float64)
    fired = {id(ref): [], id(split): []}
    for model in (ref, split):
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, name=name, log=fired[id(model)]: log.append((name, p.grad.copy())))

    def forward(model):
        with no_grad():
            x = Tensor(model.embed(ids).data, requires_grad=True)
        x.register_post_accumulate_grad_hook(lambda x, log=fired[id(model)]: log.append(("x", x.grad.copy())))
        h = x
        for block in model.blocks:
            h = block(h)
        _, loss = model(ids, targets)  # the whole model too: the tied embedding's two uses
        return h.sum() + loss

    rng.manual_seed(7)
    forward(ref).backward()
    rng.manual_seed(7)
    weights = backward_split([forward(split)])
    assert [name for name, _ in fired[id(split)]] == ["x"]
    weights.run()
    names = [name for name, _ in fired[id(split)]]
    assert names == [name for name, _ in fired[id(ref)]]
    assert sorted(names[1:]) == sorted(name for name, _ in split.named_parameters())
    final = dict(split.named_parameters())
    for name, at_hook in fired[id(split)][1:]:
        np.testing.assert_array_equal(at_hook, final[name].grad, err_msg=name)


def test_gradcheck_of_the_split_path(monkeypatch):
    """Finite differences against the split path (gradcheck's backward replaced by it),
    on a composition where a parameter is used twice and the input needs a gradient."""
    calls = []

    def split_backward(outputs, upstream):
        calls.append(len(outputs))
        backward_split(outputs, upstream).run()

    monkeypatch.setattr(gradcheck_module, "backward", split_backward)
    r = np.random.default_rng(4)
    w, b, ln_w = (Parameter(r.standard_normal(s), name=n) for s, n in (((3, 3), "w"), ((3,), "b"), ((3,), "ln_w")))
    x = Tensor(r.standard_normal((4, 3)), requires_grad=True)

    def f(x):
        h = ops.tanh(ops.linear(x, w, b))
        return ops.layer_norm(ops.matmul(h, w) + x * 0.5, ln_w)  # w twice

    errors = gradcheck_module.gradcheck(f, [x], params=[w, b, ln_w])
    assert calls == [1]
    assert set(errors) == {"input0", "w", "b", "ln_w"} and max(errors.values()) < 1e-6, errors


class Spy(Function):
    """``x * w``, recording how the engine calls its backward."""

    calls = []

    def forward(self, x, w):
        self.x, self.w = x, w
        return x * w

    def backward(self, g):
        Spy.calls.append((self.needs_input_grad, self.last_backward))
        need = self.needs_input_grad
        return (g * self.w if need[0] else None), (g * self.x if need[1] else None)


def test_phase_one_masks_parameters_and_keeps_their_nodes():
    """Phase one asks a node for its other inputs (last_backward false when it has a
    parameter input: it runs again) and gives it its recorded flags back; a node whose
    inputs are all parameters is not called. Phase two asks for the parameters, then
    frees the nodes."""
    Spy.calls = []
    w, v = Parameter(np.array([2.0, 3.0])), Parameter(np.array([5.0, 7.0]))
    x = Tensor(np.array([1.0, -1.0]), requires_grad=True)
    wv = Spy.apply(v, w)  # parameters only
    a, b = Spy.apply(x, wv), Spy.apply(x, w)
    nodes = {"wv": wv._ctx, "a": a._ctx, "b": b._ctx}
    weights = backward_split([a + b], [np.ones(2)])
    assert sorted(Spy.calls) == [((True, False), False), ((True, True), True)]
    np.testing.assert_array_equal(x.grad, [5 * 2 + 2, 7 * 3 + 3])  # v w + w
    assert w.grad is None and v.grad is None
    assert not nodes["a"].__dict__  # no parameter input: freed in phase one
    assert nodes["b"].needs_input_grad == nodes["wv"].needs_input_grad == (True, True)
    Spy.calls = []
    weights.run()
    assert sorted(Spy.calls) == [((False, True), True), ((True, True), True)]
    np.testing.assert_array_equal(w.grad, [1 + 1 * 5, -1 + -1 * 7])  # x + x v
    np.testing.assert_array_equal(v.grad, [1 * 2, -1 * 3])  # x w
    assert not nodes["b"].__dict__ and not nodes["wv"].__dict__


def test_a_weight_pass_never_run_holds_only_the_kept_nodes():
    w = Parameter(np.ones((4, 4)))
    x = Tensor(np.ones((2, 4)), requires_grad=True)
    h = x @ w
    y = ops.tanh(h)
    matmul, tanh = weakref.ref(h._ctx), weakref.ref(y._ctx)
    weights = backward_split([y], [np.ones((2, 4))])
    del h, y
    gc.collect()
    assert tanh() is None and matmul() is not None and matmul().__dict__
    del weights
    gc.collect()
    assert matmul() is None


def test_errors():
    w = Parameter(np.ones(3))
    x = Tensor(np.ones(3), requires_grad=True)
    weights = backward_split([(x * w).sum()])
    weights.run()
    with pytest.raises(RuntimeError, match=r"run\(\) called twice"):
        weights.run()
    np.testing.assert_array_equal(w.grad, np.ones(3))  # the second call changed nothing
    with pytest.raises(ValueError, match="from a Parameter"):
        backward_split([w], [np.ones(3)])
    with pytest.raises(RuntimeError, match="one-element tensor"):
        backward_split([x * w])


def test_accumulation_order_is_the_one_pass_order():
    """A parameter and an input each used by many nodes, in float32: their gradients are
    sums of many terms, which round differently in another order."""
    r = np.random.default_rng(6)
    data, scales = r.standard_normal((2, 64)).astype(np.float32), r.standard_normal(12).astype(np.float32)

    def run(split):
        w, x = Parameter(data[0]), Tensor(data[1], requires_grad=True)
        y = sum(ops.tanh(x * w * float(c) + x) for c in scales)
        if split:
            backward_split([y], [np.ones(64, np.float32)]).run()
        else:
            y.backward(np.ones(64, np.float32))
        return w.grad, x.grad

    for a, b in zip(run(False), run(True)):
        np.testing.assert_array_equal(b, a)
