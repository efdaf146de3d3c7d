"""Layers, models and activation checkpointing: float64 gradient checks and module behaviour."""

import numpy as np
import pytest

from mpitrain import nn, ops, rng
from mpitrain.gradcheck import gradcheck
from mpitrain.ops.transformer import AttentionSublayer
from mpitrain.tensor import Tensor, default_dtype, no_grad, observe_ops

TOL = 1e-6


@pytest.fixture(autouse=True)
def float64():
    with default_dtype(np.float64):
        rng.manual_seed(0)
        yield


def check_module(module, *inputs, max_points=None, reseed=None):
    def f(*xs):
        if reseed is not None:
            rng.manual_seed(reseed)  # the same dropout masks on every evaluation
        return module(*xs)

    params = module.parameters()
    for name, p in module.named_parameters():
        p.name = name
    errors = gradcheck(f, inputs, params=params, max_points=max_points)
    assert max(errors.values()) < TOL, errors
    return errors


def image(*shape, seed=0, grad=True):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=grad)


# ----------------------------------------------------------------------- layers
def test_linear_and_sequential():
    check_module(nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 3, bias=False)), image(2, 3, 4))


def test_conv_batchnorm_pool_stack_in_train_mode():
    model = nn.Sequential(nn.Conv2d(2, 3, 3, stride=1, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.AvgPool2d(2),
                          nn.Flatten(), nn.Linear(4, 2))
    check_module(model, image(3, 8, 8, 2))


def test_layernorm_embedding_dropout():
    emb, ln, drop = nn.Embedding(7, 6), nn.LayerNorm(6), nn.Dropout(0.3)
    ids = np.array([[1, 5, 1], [6, 0, 2]])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.ln, self.drop = emb, ln, drop

        def forward(self, ids):
            return self.drop(self.ln(self.emb(ids)))

    check_module(Net(), ids, reseed=3)


def test_batchnorm_train_and_eval_modes():
    bn = nn.BatchNorm2d(3)
    x = np.random.default_rng(0).standard_normal((16, 4, 4, 3)) * 3 + 2
    y = bn(Tensor(x)).data
    np.testing.assert_allclose(y.reshape(-1, 3).mean(0), 0, atol=1e-12)
    np.testing.assert_allclose(bn.running_mean, 0.1 * x.reshape(-1, 3).mean(0))
    bn.eval()
    before = bn.running_mean.copy()
    y_eval = bn(Tensor(x)).data
    np.testing.assert_array_equal(bn.running_mean, before)
    expected = (x - bn.running_mean) / np.sqrt(bn.running_var + bn.eps)
    np.testing.assert_allclose(y_eval, expected)
    check_module(bn, image(4, 3, 3, 3))


# ----------------------------------------------------------------------- models
def test_lenet_gradcheck():
    check_module(nn.LeNet(1, 8, 4, channels=(2, 3), hidden=5), image(2, 8, 8, 1), max_points=40)


def test_convnet_gradcheck():
    check_module(nn.ConvNet(3, 6, 4, channels=(2, 3)), image(2, 6, 6, 3), max_points=40)


def test_resnet_gradcheck_and_shapes():
    model = nn.ResNet(3, 8, 5, widths=(2, 4), blocks=2)
    assert model(image(2, 8, 8, 3, grad=False)).shape == (2, 5)
    check_module(model, image(2, 8, 8, 3), max_points=30)


def tiny_gpt(**kw):
    cfg = dict(vocab_size=7, block_size=6, n_layer=2, n_head=2, n_embd=8, dropout=0.0, bias=True)
    cfg.update(kw)
    return nn.GPT(nn.GPTConfig(**cfg))


def gpt_loss(model, ids, targets):
    return model(ids, targets)[1]


IDS = np.random.default_rng(1).integers(0, 7, (2, 5))
TARGETS = np.random.default_rng(2).integers(0, 7, (2, 5))


class GPTLoss(nn.Module):
    """The loss of a fixed batch as a module without inputs, for check_module."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self):
        return gpt_loss(self.model, IDS, TARGETS)


def test_gpt_gradcheck_with_dropout():
    model = tiny_gpt(dropout=0.2)
    check_module(GPTLoss(model), max_points=25, reseed=11)


def test_gpt_structure_tied_head_and_layers():
    model = tiny_gpt()
    names = [n for n, _ in model.named_parameters()]
    assert "embed.wte.weight" in names and not any(n.startswith("head.wte") for n in names)
    assert model.head.wte is model.embed.wte.weight
    layers = model.layers()
    assert layers[0] is model.embed and layers[-1] is model.head and len(layers) == 4
    assert [n for n, _ in model.named_layers()] == ["embed", "block 0", "block 1", "head"]
    assert [m for _, m in model.named_layers()] == layers
    lenet = nn.LeNet(1, 8, 5, channels=(2, 3), hidden=4)
    assert [n for n, _ in lenet.named_layers()] == [str(i) for i in range(len(lenet))]
    ids = np.zeros((1, 6), dtype=np.int64)
    x = ids
    for layer in layers:
        x = layer(x)
    np.testing.assert_allclose(x.data, model(ids)[0].data)
    with pytest.raises(ValueError, match="block_size"):
        model(np.zeros((1, 7), dtype=np.int64))


def test_gpt_block_fused_halves_equal_its_submodules_op_by_op():
    """Block.forward runs each half as one fused op with the fast paths on, and through
    its submodules op by op with them off (nanoGPT's two lines): both routes exist and
    give equal outputs and gradients, bit for bit, with dropout in training."""
    block = tiny_gpt(dropout=0.3).blocks[0]
    x = image(2, 5, 8)
    g = np.random.default_rng(3).standard_normal(x.shape)

    def run(forward, fast):
        block.zero_grad(set_to_none=True)
        x.grad = None
        rng.manual_seed(4)
        seen = set()
        with ops.fast_paths(fast), observe_ops(lambda cls, args, kwargs: seen.add(cls)):
            y = forward(x)
            y.backward(g)
        return (y.data, x.grad.copy(), {n: p.grad.copy() for n, p in block.named_parameters()}), seen

    def op_by_op(x):
        x = x + block.attn(block.ln_1(x))
        return x + block.mlp(block.ln_2(x))

    (fused, fused_ops), (plain, plain_ops) = run(block, True), run(block, False)
    reference, _ = run(op_by_op, True)
    assert AttentionSublayer in fused_ops and AttentionSublayer not in plain_ops
    for result in (fused, plain):
        np.testing.assert_array_equal(result[0], reference[0])
        np.testing.assert_array_equal(result[1], reference[1])
        for name, grad in reference[2].items():
            np.testing.assert_array_equal(result[2][name], grad, err_msg=name)


def test_gpt_generate_is_seeded_and_keeps_the_prompt():
    model = tiny_gpt()
    prompt = np.array([[1, 2]])
    a = model.generate(prompt, 8, generator=np.random.default_rng(0))
    b = model.generate(prompt, 8, generator=np.random.default_rng(0))
    assert a.shape == (1, 10) and np.array_equal(a, b) and np.array_equal(a[:, :2], prompt)
    assert model.training


# ------------------------------------------------------- activation checkpointing
def _grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {n: p.grad.copy() for n, p in model.named_parameters()}


def test_checkpointing_gives_the_same_gradients_with_dropout():
    ids = np.random.default_rng(1).integers(0, 7, (3, 6))
    targets = np.random.default_rng(2).integers(0, 7, (3, 6))
    rng.manual_seed(5)
    plain = tiny_gpt(dropout=0.3)
    rng.manual_seed(5)
    ckpt = tiny_gpt(dropout=0.3, checkpoint_activations=True)
    rng.manual_seed(9)
    g_plain = _grads(plain, lambda: gpt_loss(plain, ids, targets))
    rng.manual_seed(9)
    g_ckpt = _grads(ckpt, lambda: gpt_loss(ckpt, ids, targets))
    assert g_plain.keys() == g_ckpt.keys()
    for name in g_plain:
        np.testing.assert_allclose(g_ckpt[name], g_plain[name], rtol=1e-12, atol=1e-14, err_msg=name)


def test_checkpointing_gradcheck_and_tied_weight_hook():
    model = tiny_gpt(checkpoint_activations=True)
    check_module(GPTLoss(model), max_points=25)

    fired = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.setdefault(name, p.grad.copy()))
    model.zero_grad()
    gpt_loss(model, IDS, TARGETS).backward()
    assert set(fired) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(fired[name], p.grad, err_msg=name)  # final when fired


def test_checkpoint_updates_batchnorm_statistics_once():
    block = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2))
    reference = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2))
    reference.load_state_dict(block.state_dict())
    x = image(4, 5, 5, 2)
    nn.checkpoint(block, x).sum().backward()
    reference(x).sum()
    np.testing.assert_allclose(block[1].running_mean, reference[1].running_mean)
    np.testing.assert_allclose(block[1].running_var, reference[1].running_var)


def test_checkpoint_is_a_plain_call_without_grad():
    block = nn.Linear(3, 3)
    with no_grad():
        y = nn.checkpoint(block, Tensor(np.ones((2, 3))))
    assert y.is_leaf


# ------------------------------------------------------------------ module state
def test_state_dict_round_trip_and_strictness():
    a, b = nn.ResNet(3, 8, 4, widths=(2, 4)), nn.ResNet(3, 8, 4, widths=(2, 4))
    a.train()
    a(image(2, 8, 8, 3, grad=False))  # moves running statistics
    state = a.state_dict()
    assert any(k.endswith("running_mean") for k in state)
    b.load_state_dict(state)
    for (n1, x1), (n2, x2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n1 == n2
        np.testing.assert_array_equal(x1, x2)
    with pytest.raises(KeyError, match="missing"):
        b.load_state_dict({k: v for k, v in state.items() if "fc" not in k})
    state["fc.weight"] = np.zeros((1, 1))
    with pytest.raises(ValueError, match="fc.weight"):
        b.load_state_dict(state)


def test_load_state_dict_writes_in_place():
    layer = nn.Linear(2, 2)
    before = layer.weight.data
    layer.load_state_dict({"weight": np.ones((2, 2)), "bias": np.zeros(2)})
    assert layer.weight.data is before and np.all(before == 1)


def test_zero_grad_keeps_buffers_and_train_eval_recurse():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    ops.sum(model(Tensor(np.ones((1, 2))))).backward()
    g = model[0].weight.grad
    model.zero_grad()
    assert model[0].weight.grad is g and not g.any()
    model.eval()
    assert not model[1].training
    model.zero_grad(set_to_none=True)
    assert model[0].weight.grad is None


def test_module_requires_super_init():
    class Bad(nn.Module):
        def __init__(self):
            self.x = 1

    with pytest.raises(RuntimeError, match="super"):
        Bad()


def test_reassigning_a_buffer_keeps_it_registered_and_ordered():
    bn = nn.BatchNorm2d(3)
    names = list(bn.state_dict())
    bn.running_mean = np.full(3, 2.0)
    assert list(bn.state_dict()) == names
    np.testing.assert_array_equal(bn.state_dict()["running_mean"], 2.0)
    with pytest.raises(TypeError, match="buffer"):
        bn.running_var = None
    layer = nn.Linear(2, 2)
    order = [n for n, _ in layer.named_parameters()]
    layer.weight = nn.Parameter(np.zeros((2, 2)))
    assert [n for n, _ in layer.named_parameters()] == order
