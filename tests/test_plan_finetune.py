"""The planner's FLOPs of fine-tuning (``ModelShape.tuned``): what backward runs when some
parameters are frozen or LoRA's adapters train, against the formula and against the
products a real step counts (:mod:`mpitrain.observe.flops`)."""

from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
import pytest

from mpitrain import config, nn, rng
from mpitrain.cost import attention_flops, matmul_flops
from mpitrain.nn import lora
from mpitrain.observe.flops import count_flops
from mpitrain.plan import shapes
from mpitrain.train.finetune import freeze

V, T, L, H, C = 11, 6, 2, 2, 8


@pytest.mark.parametrize("model", [shapes.gpt(84, 64, 2, 4, 32), shapes.gpt(84, 16, 2, 4, 32, bias=True, gated=True,
                                                                             tied=False, kv=2, ffn=40),
                                   shapes.lenet((28, 28, 1), 10), shapes.resnet((16, 16, 3), 10, (4, 8), 2)])
def test_everything_training_is_training(model):
    tuned = model.tuned(set(model.parameters()))
    assert [x.backward for x in tuned.layers] == [x.backward for x in model.layers]
    assert all(x.graph for x in tuned.layers) and [x.grad_in for x in tuned.layers][:2] == [False, True]


def test_a_frozen_linear_runs_its_input_gradient_alone():
    model = shapes.lenet((28, 28, 1), 10)  # layers 0 and 2 convolutions, 5 and 8 linear
    by = {x.name: x for x in model.tuned({"0.weight", "0.bias"}).layers}
    assert by["0"].backward == by["0"].forward  # the data's: the weight gradient alone
    assert by["5"].backward == by["5"].forward and by["8"].backward == by["8"].forward  # the input's alone
    by = {x.name: x for x in model.tuned({"8.weight"}).layers}  # nothing before it trains: no input gradient
    assert by["8"].backward == by["8"].forward and by["8"].graph and not by["8"].grad_in
    assert all(by[n].backward == 0 and not by[n].graph for n in ("0", "2", "5"))


def test_lora_adds_its_two_products_and_their_backward():
    r, plain = 4, shapes.gpt(V, T, L, H, C)
    model = shapes.gpt(V, T, L, H, C, lora=(r, ["blocks.*.attn.c_attn"]))
    tuned = model.tuned({n for n in model.parameters() if lora.is_adapter(n)})
    a, b = matmul_flops(T, C, r), matmul_flops(T, r, 3 * C)  # x A, (x A) B
    block, base = tuned.layers[1], plain.layers[1]
    assert block.forward == base.forward + a + b
    attention, proj, mlp = attention_flops(1, T, C), matmul_flops(T, C, C), 2 * matmul_flops(T, C, 4 * C)
    # frozen x W: none; x A: A's gradient; (x A) B: both; then attention's two and the rest's input gradients
    assert block.backward == a + 2 * b + 2 * attention + proj + mlp
    # its input needs one: x W the input's gradient, x A and (x A) B both, attention's two products both
    assert tuned.layers[2].backward == tuned.layers[2].forward + a + b + attention
    assert tuned.layers[-1].backward == tuned.layers[-1].forward  # the head: tied and frozen, the input's alone


def real_gpt(rank, targets):
    rng.manual_seed(3)
    model = nn.GPT(nn.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C))
    if rank:
        lora.adapt(model, targets, rank)
    return model


@pytest.mark.parametrize("rank, trainable", [(4, ()), (0, ("blocks.1.*", "head.*")), (0, ("blocks.0.mlp.*",)),
                                             (2, ("embed.wpe.weight",))])
def test_counted_flops_are_a_real_steps(rank, trainable):
    targets = list(config.fields.LORA_TARGETS)
    model = real_gpt(rank, targets)
    names = [n for n, _ in model.named_parameters()]
    trained = {n for n in names if (rank and lora.is_adapter(n)) or any(fnmatchcase(n, p) for p in trainable)}
    freeze(model, trained)
    ids = np.random.default_rng(0).integers(0, V, (2, T))

    def step():
        model(ids, ids)[1].backward()

    counted = count_flops(step)
    shape = shapes.gpt(V, T, L, H, C, lora=(rank, targets)).tuned(trained)
    assert set(shape.parameters()) == set(names)
    assert 2 * sum(x.forward for x in shape.layers) == counted.forward
    assert 2 * sum(x.backward for x in shape.layers) == counted.backward


def test_a_gpu_search_refuses_a_fine_tuning_config_naming_its_fields():
    """Tier 1's columns count every parameter as training: a fine-tuning config is refused
    there, with the --set that searches it as full training."""
    from mpitrain.config import ConfigError
    from mpitrain.plan import space

    cfg = config.load(Path(__file__).parents[1] / "jobs" / "shakespeare_gpt.toml",
                      ["model.lora_rank=4", 'train.trainable=["head.*"]'], data_needed=False)
    with pytest.raises(ConfigError, match=r"--search: train.trainable and model.lora_rank: a fine-tuning config is "
                                          r"not searched on a GPU .* --set train.trainable=\[\] --set model.lora_rank=0"):
        space.whole_training(cfg)
