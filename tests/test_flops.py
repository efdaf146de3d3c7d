"""FLOP counting against hand-written formulas."""

import numpy as np
import pytest

from mpitrain import nn, ops, rng
from mpitrain.observe.flops import count_flops
from mpitrain.tensor import Tensor


@pytest.mark.parametrize("fast", [True, False])
def test_gpt_flops_formula(fast):
    """The fused sublayers (fast paths on) and the op-by-op block (off) count the same."""
    rng.manual_seed(0)
    B, T, C, L, V, nh = 3, 8, 16, 2, 11, 4
    model = nn.GPT(nn.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=nh, n_embd=C))
    ids = np.zeros((B, T), dtype=np.int64)
    with ops.fast_paths(fast):
        count = count_flops(lambda: model(ids, ids)[1].backward())
    N = B * T
    per_layer = 2 * N * C * 3 * C + 2 * N * C * C + 2 * 2 * N * C * 4 * C + 2 * 2 * B * T * T * C
    forward = L * per_layer + 2 * N * C * V
    assert count.forward == forward
    assert count.backward == 2 * forward


@pytest.mark.parametrize("fast", [True, False])
def test_cnn_flops_skip_the_input_gradient_of_the_first_layer(fast):
    rng.manual_seed(0)
    model = nn.ConvNet(3, 8, 10, channels=(4, 6))
    x = np.zeros((2, 8, 8, 3), dtype=np.float32)
    with ops.fast_paths(fast):
        count = count_flops(lambda: ops.cross_entropy(model(Tensor(x)), np.zeros(2, dtype=int)).backward())
    conv1 = 2 * 2 * 8 * 8 * 9 * 3 * 4
    conv2 = 2 * 2 * 8 * 8 * 9 * 4 * 6
    fc = 2 * 2 * (4 * 4 * 6) * 10
    assert count.forward == conv1 + conv2 + fc
    assert count.backward == conv1 + 2 * conv2 + 2 * fc
