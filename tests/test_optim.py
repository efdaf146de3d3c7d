"""Optimizers against their update rules written out step by step, state round trips,
clipping and schedules."""

import math

import numpy as np
import pytest

from mpitrain import optim
from mpitrain.tensor import Parameter


def make_params(seed=0):
    r = np.random.default_rng(seed)
    return [Parameter(r.standard_normal((3, 4))), Parameter(r.standard_normal(5))]


def gradients(step, params):
    r = np.random.default_rng(100 + step)
    return [r.standard_normal(p.shape) for p in params]


def run(opt_factory, steps=6, params=None):
    params = params or make_params()
    opt = opt_factory(params)
    for s in range(steps):
        for p, g in zip(params, gradients(s, params)):
            p.grad = g.copy()
        opt.step()
    return [p.data.copy() for p in params], opt


def reference_sgd(lr, momentum=0.0, dampening=0.0, nesterov=False, wd=0.0, steps=6):
    params = [p.data.copy() for p in make_params()]
    bufs = [None] * len(params)
    for s in range(steps):
        for i, g in enumerate(gradients(s, params)):
            g = g + wd * params[i]
            if momentum:
                bufs[i] = g.copy() if bufs[i] is None else momentum * bufs[i] + (1 - dampening) * g
                g = g + momentum * bufs[i] if nesterov else bufs[i]
            params[i] = params[i] - lr * g
    return params


def reference_adam(lr, b1, b2, eps, wd, decoupled, steps=6):
    params = [p.data.copy() for p in make_params()]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for s in range(steps):
        t = s + 1
        for i, g in enumerate(gradients(s, params)):
            if decoupled:
                params[i] = params[i] * (1 - lr * wd)
            else:
                g = g + wd * params[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mhat, vhat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            params[i] = params[i] - lr * mhat / (np.sqrt(vhat) + eps)
    return params


@pytest.mark.parametrize("kw", [dict(), dict(momentum=0.9), dict(momentum=0.9, dampening=0.1),
                                dict(momentum=0.9, nesterov=True), dict(momentum=0.5, weight_decay=0.1)])
def test_sgd_matches_update_rule(kw):
    got, _ = run(lambda ps: optim.SGD(ps, lr=0.1, **kw))
    want = reference_sgd(0.1, kw.get("momentum", 0.0), kw.get("dampening", 0.0),
                         kw.get("nesterov", False), kw.get("weight_decay", 0.0))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("cls,decoupled", [(optim.Adam, False), (optim.AdamW, True)])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_and_adamw_match_update_rule(cls, decoupled, wd):
    got, _ = run(lambda ps: cls(ps, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd))
    want = reference_adam(0.01, 0.8, 0.95, 1e-6, wd, decoupled)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_nesterov_needs_momentum():
    with pytest.raises(ValueError):
        optim.SGD(make_params(), lr=0.1, nesterov=True)


@pytest.mark.parametrize("factory", [lambda ps: optim.AdamW(ps, lr=0.01, weight_decay=0.1),
                                     lambda ps: optim.Adam(ps, lr=0.01, weight_decay=0.1),
                                     lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)])
def test_state_dict_resume_equals_uninterrupted(factory):
    straight, _ = run(factory, steps=6)
    params = make_params()
    first, opt = run(factory, steps=3, params=params)
    state = opt.state_dict()
    params2 = [type(p)(d) for p, d in zip(params, first)]
    opt2 = factory(params2)
    opt2.load_state_dict(state)
    state["state"][0][next(iter(state["state"][0]))] += 1.0  # a copy: opt2 is unaffected
    for s in range(3, 6):
        for p, g in zip(params2, gradients(s, params2)):
            p.grad = g.copy()
        opt2.step()
    for a, b in zip(straight, params2):
        np.testing.assert_array_equal(a, b.data)


def test_state_dict_is_a_copy_and_restores_hyperparameters():
    _, opt = run(lambda ps: optim.Adam(ps, lr=0.01), steps=2)
    state = opt.state_dict()
    state["state"][0]["exp_avg"] += 1.0
    assert not np.array_equal(state["state"][0]["exp_avg"], opt.state[0]["exp_avg"])
    opt.set_lr(0.5)
    fresh = optim.Adam(make_params(), lr=0.5)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.param_groups[0]["lr"] == 0.5 and fresh.step_count == 2


def test_load_state_dict_checks_shapes_and_counts():
    _, opt = run(lambda ps: optim.Adam(ps), steps=1)
    state = opt.state_dict()
    state["state"][1]["exp_avg"] = np.zeros(7)
    with pytest.raises(ValueError, match="shape"):
        optim.Adam(make_params()).load_state_dict(state)
    with pytest.raises(ValueError, match="2 parameters, optimizer has 1"):
        optim.Adam(make_params()[:1]).load_state_dict(opt.state_dict())


def test_clip_leaves_non_finite_gradients_for_the_caller():
    p = Parameter(np.zeros(2))
    p.grad = np.array([np.inf, 1.0])
    assert optim.clip_grad_norm([p], 1.0) == np.inf
    assert p.grad[1] == 1.0


def test_param_groups_and_decay_groups():
    w, b = Parameter(np.ones((2, 2))), Parameter(np.ones(2))
    groups = optim.decay_groups([("w", w), ("b", b)], 0.5)
    opt = optim.AdamW(groups, lr=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    w.grad, b.grad = np.zeros((2, 2)), np.zeros(2)
    opt.step()
    np.testing.assert_allclose(w.data, 1 - 0.1 * 0.5)  # decayed; zero gradient moves nothing else
    np.testing.assert_allclose(b.data, 1.0)
    opt.set_lr(0.01)
    assert all(g["lr"] == 0.01 for g in opt.param_groups)


def test_clip_grad_norm():
    a, b = Parameter(np.zeros(2)), Parameter(np.zeros(1))
    a.grad, b.grad = np.array([3.0, 0.0]), np.array([4.0])
    assert optim.clip_grad_norm([a, b], 10.0) == pytest.approx(5.0)
    np.testing.assert_allclose(a.grad, [3, 0])
    assert optim.clip_grad_norm([a, b], 1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(np.sqrt((a.grad**2).sum() + (b.grad**2).sum()), 1.0, rtol=1e-5)


def test_warmup_cosine_schedule():
    s = optim.WarmupCosine(1e-3, warmup_steps=10, decay_steps=110, min_lr=1e-4)
    assert s(0) == pytest.approx(1e-3 / 11)
    assert s(9) == pytest.approx(1e-3 * 10 / 11)
    assert s(10) == pytest.approx(1e-3)
    assert s(60) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 9e-4)
    assert s(110) == s(500) == pytest.approx(1e-4)
    lrs = [s(i) for i in range(10, 111)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))
    assert optim.Constant(0.1, warmup_steps=1)(0) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        optim.WarmupCosine(1e-3, warmup_steps=10, decay_steps=5)


def test_over_updates_views_with_fresh_state_and_the_same_rule():
    """``over`` (how ZeRO-1 and parameter servers update their flat shards): the pieces
    it is given are updated in place exactly as the full optimizer updates the same
    numbers, and the full optimizer is left alone."""
    full_params, ref_params = make_params(), make_params()
    full = optim.AdamW(full_params, lr=0.1, weight_decay=0.1)
    ref = optim.AdamW(ref_params, lr=0.1, weight_decay=0.1)
    flat = np.concatenate([p.data.reshape(-1) for p in full_params])  # (17,)
    flat_grad = np.zeros_like(flat)
    shard = full.over(lambda p: (flat[:12].reshape(3, 4), flat_grad[:12].reshape(3, 4))
                      if p is full_params[0] else None)
    assert [len(g["params"]) for g in shard.param_groups] == [1] and shard.state == {}
    for step in range(3):
        g = gradients(step, ref_params)
        ref_params[0].grad = g[0]
        ref.step()
        flat_grad[:12] = g[0].reshape(-1)
        shard.step()
    np.testing.assert_allclose(flat[:12].reshape(3, 4), ref_params[0].data, rtol=1e-12)
    np.testing.assert_array_equal(full_params[0].data, make_params()[0].data)
    assert full.state == {} and full.param_groups[0]["params"] == full_params
