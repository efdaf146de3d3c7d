"""Mixed precision (mpitrain/precision.py): half-precision working copies computed with in
float32, gradients rounded into half precision, the update of float32 masters with the
unscaled gradients, the loss scale, and a GPT that trains in bf16 and fp16 as in fp32."""

import numpy as np
import pytest

from mpitrain import nn, optim, rng
from mpitrain.dtypes import dtype_of, is_half
from mpitrain.precision import LossScaler, MixedPrecision
from mpitrain.tensor import Parameter, Tensor

PRECISIONS = ("bf16", "fp16")


def small_gpt():
    rng.manual_seed(0)
    return nn.GPT(nn.GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16))


def batch(seed=1, b=4, t=8, v=17):
    r = np.random.default_rng(seed)
    return r.integers(0, v, (b, t)), r.integers(0, v, (b, t))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_an_op_computes_with_the_half_weights_upcast_and_rounds_their_gradient(precision):
    half = dtype_of(precision)
    r = np.random.default_rng(0)
    w32 = r.standard_normal((5, 3)).astype(np.float32).astype(half).astype(np.float32)  # representable
    x = r.standard_normal((4, 5)).astype(np.float32)
    w = Parameter(w32)
    w.data = w32.astype(half)
    y = Tensor(x) @ w
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y.data, x @ w32)  # computed in float32, on the same numbers
    y.sum().backward()
    assert w.grad.dtype == half
    np.testing.assert_array_equal(w.grad, (x.T @ np.ones((4, 3), np.float32)).astype(half))  # rounded once
    assert is_half(w.dtype) and not is_half(np.float32)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_update_is_the_float32_optimizers_on_the_masters_with_unscaled_clipped_gradients(precision):
    half = dtype_of(precision)
    r = np.random.default_rng(3)
    shapes = [(6, 4), (4,), (3, 3)]
    model = [Parameter(r.standard_normal(s).astype(np.float32)) for s in shapes]
    reference = [Parameter(p.data.copy()) for p in model]
    groups = lambda ps: [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]  # noqa: E731
    mixed = MixedPrecision(optim.AdamW(groups(model), lr=1e-2), precision, LossScaler(2.0**10))
    plain = optim.AdamW(groups(reference), lr=1e-2)
    for step in range(4):
        for p, q in zip(model, reference):
            g = (r.standard_normal(p.shape) * 2.0**10 * (3 if step % 2 else 0.1)).astype(half)  # scaled by S
            p.grad, q.grad = g, g.astype(np.float32) / 2.0**10
        assert not mixed.check()
        optim.update(mixed, model, 1e-2, grad_clip=1.0)  # clipped on odd steps only
        optim.update(plain, reference, 1e-2, grad_clip=1.0)
        for p, m, q in zip(model, mixed.masters, reference):
            np.testing.assert_array_equal(m, q.data)  # bit for bit
            np.testing.assert_array_equal(p.data, q.data.astype(half))  # the working copy: the master rounded
    assert mixed.state_dict()["step"] == 4 and mixed.step_count == 4


def test_the_loss_scale_halves_on_an_overflow_and_doubles_after_a_clean_interval():
    s = LossScaler(2.0**16, growth_interval=3)
    for overflow, scale in [(False, 2**16), (True, 2**15), (False, 2**15), (False, 2**15), (False, 2**16),
                            (True, 2**15)]:
        s.update(overflow)
        assert s.scale == scale
    assert s.skipped == 2
    fixed = LossScaler(1.0, dynamic=False)
    fixed.update(True)
    assert fixed.scale == 1.0 and fixed.skipped == 1
    again = LossScaler()
    again.load_state_dict(s.state_dict())
    assert again.state_dict() == s.state_dict()
    with pytest.raises(ValueError, match="scale > 0"):
        LossScaler(0.0)


def test_an_overflowed_gradient_is_seen_and_refused():
    p = Parameter(np.ones(3, np.float32))
    mixed = MixedPrecision(optim.SGD([p], lr=0.1), "fp16")
    p.grad = np.array([1.0, np.inf, 0.0], np.float16)
    assert mixed.check()
    with pytest.raises(FloatingPointError, match="skip the step"):
        mixed.step()
    with pytest.raises(ValueError, match="bf16 or fp16"):
        MixedPrecision(optim.SGD([Parameter(np.ones(2, np.float32))], lr=0.1), "fp32")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_gpt_trains_in_half_precision_as_in_float32(precision):
    """The same GPT, 15 AdamW steps with clipping: the mixed-precision loss follows the
    float32 one to a few half-precision roundings."""
    x, y = batch()
    losses = {}
    for which in ("fp32", precision):
        model = small_gpt()
        opt = optim.AdamW(optim.decay_groups(model.named_parameters(), 0.1), lr=3e-3)
        if which != "fp32":
            opt = MixedPrecision(opt, which)
            assert {p.dtype for p in model.parameters()} == {dtype_of(which)}
        losses[which] = []
        for _ in range(15):
            loss = model(x, y)[1]
            losses[which].append(loss.item())
            scale = getattr(opt, "scaler", LossScaler(1.0)).scale
            loss.backward(np.array(scale, np.float32))
            if which != "fp32":
                assert not opt.check()
            optim.update(opt, model.parameters(), None, grad_clip=1.0)
            opt.zero_grad()
    a, b = np.array(losses["fp32"]), np.array(losses[precision])
    assert a[-1] < a[0] - 0.5  # it learns
    np.testing.assert_allclose(b, a, rtol=2e-3)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpointed_blocks_round_each_gradient_once_as_plain_backward_does(precision):
    """Activation checkpointing replays each block and takes its weights' gradients with
    :func:`mpitrain.autograd.grad`; those come back in float32 and are rounded once, as
    they are added into the half ``.grad``: over two accumulated micro-batches the
    gradients are plain backward's, bit for bit (rounding them in ``grad`` as well would
    round each micro-batch's twice)."""
    grads = {}
    for checkpointed in (False, True):
        rng.manual_seed(0)
        model = nn.GPT(nn.GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16,
                                    checkpoint_activations=checkpointed))
        MixedPrecision(optim.AdamW(model.parameters(), lr=1e-3), precision)
        for seed in (1, 2):
            x, y = batch(seed)
            (model(x, y)[1] * 512.0).backward()
        grads[checkpointed] = [p.grad for p in model.parameters()]
    for plain, replayed in zip(grads[False], grads[True]):
        assert replayed.dtype == dtype_of(precision)
        np.testing.assert_array_equal(replayed, plain)


def test_checkpoints_see_the_float32_masters():
    model = small_gpt()
    mixed = MixedPrecision(optim.AdamW(model.parameters(), lr=1e-3), "bf16")
    before = {k: v.copy() for k, v in zip(range(len(mixed.masters)), mixed.masters)}
    with mixed.masters_in_model():
        state = model.state_dict()
        assert {a.dtype for a in state.values()} == {np.dtype(np.float32)}
        model.load_state_dict({k: v + 1 for k, v in state.items()})
    for i, (p, m) in enumerate(zip(model.parameters(), mixed.masters)):
        np.testing.assert_array_equal(m, before[i] + 1)  # loaded into the masters
        np.testing.assert_array_equal(p.data, m.astype(p.dtype))  # and the working copies rounded from them


def test_the_model_state_formula_is_zeros_and_mixed_precisions():
    from mpitrain.cost import bytes_per_parameter

    for P in (1, 2, 4):
        assert [bytes_per_parameter(s, P) for s in ("ddp", "zero1", "zero2", "zero3")] == \
            [16, 8 + 8 / P, 4 + 12 / P, 16 / P]
        assert bytes_per_parameter("ddp", P, mixed=True) == 2 + 2 + 12
    assert bytes_per_parameter("local", 1, moments=1, itemsize=8) == 8 + 8 + 8  # SGD with momentum, float64
    assert bytes_per_parameter("ps", 2) is None  # parameter servers: no formula here
