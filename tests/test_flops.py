"""FLOP counting against hand-written formulas."""

import numpy as np
import pytest

from mpitrain import cost, nn, ops, rng
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
    step = cost.gpt_step_flops(B, T, C, L, V)  # Megatron's 72 B T L C^2 (1 + T/6C + V/12LC)
    assert step == pytest.approx(72 * B * T * L * C**2 * (1 + T / (6 * C) + V / (12 * L * C)), rel=1e-12)
    assert count.forward == step // 3
    assert count.backward == 2 * step // 3


@pytest.mark.parametrize("fast", [True, False])
def test_cnn_flops_skip_the_input_gradient_of_the_first_layer(fast):
    rng.manual_seed(0)
    model = nn.ConvNet(3, 8, 10, channels=(4, 6))
    x = np.zeros((2, 8, 8, 3), dtype=np.float32)
    with ops.fast_paths(fast):
        count = count_flops(lambda: ops.cross_entropy(model(Tensor(x)), np.zeros(2, dtype=int)).backward())
    conv1 = cost.conv2d_flops(2, 8, 8, 3, 3, 3, 4)
    conv2 = cost.conv2d_flops(2, 8, 8, 3, 3, 4, 6)
    fc = cost.matmul_flops(2, 4 * 4 * 6, 10)
    assert (conv1, conv2, fc) == (2 * 2 * 8 * 8 * 9 * 3 * 4, 2 * 2 * 8 * 8 * 9 * 4 * 6, 2 * 2 * (4 * 4 * 6) * 10)
    assert count.forward == conv1 + conv2 + fc
    assert count.backward == conv1 + 2 * conv2 + 2 * fc
