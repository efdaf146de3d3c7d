"""Fine-tuning (unit tier): LoRA's layer against finite differences, its merge, the
adapted model at step 0, what trains and what is refused; a fine-tune from a checkpoint
on one process (frozen weights untouched, no optimizer state for them, the model state
the planner's to the byte); a LoRA checkpoint loaded into a model without adapters."""

import h5py
import numpy as np
import pytest
from test_data import text_set

from mpitrain import config, nn, rng, train
from mpitrain.config import ConfigError
from mpitrain.gradcheck import gradcheck
from mpitrain.nn import lora
from mpitrain.tensor import Tensor, default_dtype, no_grad

TOL = 1e-6


def gpt(lora_rank=0, seed=5):
    rng.manual_seed(seed)
    with default_dtype(np.float64):
        model = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8))
        if lora_rank:
            lora.adapt(model, config.fields.LORA_TARGETS, lora_rank, alpha=3.0)
    return model


def test_lora_linear_gradients_against_finite_differences():
    rng.manual_seed(1)
    with default_dtype(np.float64):
        layer = lora.LoRALinear(nn.Linear(5, 4), rank=2, alpha=5.0)
    layer.lora_B.data[...] = np.random.default_rng(0).standard_normal((2, 4))  # B = 0 would hide A's gradient
    for name, p in layer.named_parameters():
        p.name = name
    x = Tensor(np.random.default_rng(1).standard_normal((3, 2, 5)), requires_grad=True)
    errors = gradcheck(layer, [x], params=layer.parameters())
    assert set(errors) == {"input0", "weight", "bias", "lora_A", "lora_B"} and max(errors.values()) < TOL, errors


def test_adapters_start_at_the_base_model_and_merge_to_the_same_logits():
    base, adapted = gpt(), gpt(lora_rank=2)
    ids = np.random.default_rng(2).integers(0, 11, (3, 6))
    with no_grad():
        assert np.array_equal(base(ids)[0].data, adapted(ids)[0].data)  # B = 0: step 0 is the base model
        for _, p in adapted.named_parameters():
            if p.name is None and p.shape[0] == 2:  # each lora_B: something to merge
                p.data[...] = np.random.default_rng(p.size).standard_normal(p.shape)
        unmerged = adapted(ids)[0].data
        with lora.merged(adapted):
            assert not any(isinstance(m, lora.LoRALinear) for m in adapted.modules())
            assert all(b._fusable() for b in adapted.blocks)  # the fused fast path again
            merged = adapted(ids)[0].data
        assert any(isinstance(m, lora.LoRALinear) for m in adapted.modules())  # back after
    np.testing.assert_allclose(merged, unmerged, rtol=1e-12, atol=1e-12)
    names = [n for n, _ in adapted.named_parameters()]
    assert names[names.index("blocks.0.attn.c_attn.weight") + 1] == "blocks.0.attn.c_attn.lora_A"
    state = lora.merge_state(adapted.state_dict(), adapted.blocks[0].attn.c_attn.scale)
    assert set(state) == set(base.state_dict())  # the plain model's arrays


def cfg_of(d, run_dir, sets=(), steps=3):
    return config.from_dict({
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
        "data": {"path": str(d)}, "optim": {"name": "adamw", "lr": 1e-2},
        "train": {"global_batch_size": 4, "steps": steps, "eval_batches": 1, "sample_tokens": 0, "threads": 1,
                  "dtype": "float64"}, "run": {"dir": str(run_dir)}}, list(sets))


def quiet(*args):
    pass


def test_what_trains_and_what_is_refused(tmp_path):
    names = ["embed.wte.weight", "blocks.0.attn.c_attn.weight", "blocks.0.attn.c_attn.lora_A", "head.ln_f.weight"]
    cfg = cfg_of(tmp_path, "")
    assert config.trained_names(cfg, names) == names  # nothing said: everything trains
    assert config.trained_names(cfg_of(tmp_path, "", ["model.lora_rank=2"]), names) == [names[2]]
    assert config.trained_names(cfg_of(tmp_path, "", ["model.lora_rank=2", 'train.trainable=["head.*"]']),
                                names) == names[2:]
    with pytest.raises(ConfigError, match=r"^train\.trainable: 'blocks\.9\.\*' matches no parameter; the model's "
                                          r"are embed\.wte\.weight, "):
        config.trained_names(cfg_of(tmp_path, "", ['train.trainable=["blocks.9.*"]']), names)
    for sets, field in ((["model.lora_alpha=2"], "model.lora_alpha"), (["model.lora_rank=-1"], "model.lora_rank"),
                        (["model.lora_rank=2", "model.lora_targets=[]"], "model.lora_targets"),
                        (['train.trainable=["head.*", "head.*"]'], "train.trainable")):
        with pytest.raises(ConfigError, match=rf"^{field}: "):
            cfg_of(tmp_path, "", sets)
    with pytest.raises(ConfigError, match=r"^model\.lora_rank: LoRA adapters on tensor slices \(parallel\.tp = 2\)"):
        config.check_ranks(cfg_of(tmp_path, "", ["model.lora_rank=2", "parallel.tp=2", "parallel.dp=1"]), 2)
    with pytest.raises(ConfigError, match=r"^model\.lora_targets: 'blocks\.\*\.nope' matches no Linear layer; "
                                          r"the model's are blocks\.0\.attn\.c_attn"):
        model = gpt()
        from mpitrain.train import finetune
        finetune.prepare(cfg_of(tmp_path, "", ["model.lora_rank=2", 'model.lora_targets=["blocks.*.nope"]']), model)


def arrays(path):
    with h5py.File(path, "r") as f:
        model = {n: f["model"][n][()] for n in f["model"] if isinstance(f["model"][n], h5py.Dataset)}
        for n in f["model"]:
            if isinstance(f["model"][n], h5py.Group):
                f["model"][n].visititems(lambda k, o, n=n: model.__setitem__(f"{n}/{k}", o[()])
                                         if isinstance(o, h5py.Dataset) else None)
        return {k.replace("/", "."): v for k, v in model.items()}, f["optim/has_state"][()]


def test_fine_tune_from_a_checkpoint_on_one_process(tmp_path):
    d = tmp_path / "d"
    text_set(d, n=2000)
    base = train.train(cfg_of(d, tmp_path / "base"), log=quiet).checkpoint
    before, _ = arrays(base)
    lines = []
    tuned = train.train(cfg_of(d, tmp_path / "lora", ["model.lora_rank=2", 'train.trainable=["head.ln_f.*"]']),
                        log=lines.append, origin=base)
    after, has_state = arrays(tuned.checkpoint)
    adapters = [n for n in after if lora.is_adapter(n)]
    assert len(adapters) == 2 * 4 * 2 and not set(adapters) & set(before)  # they started fresh
    trained = adapters + ["head.ln_f.weight"]
    for n in before:
        assert np.array_equal(before[n], after[n]) == (n not in trained), n
    assert len(has_state) == len(trained) and has_state.all()  # the optimizer's: what trains, nothing else
    assert "\nfine-tuning: 1,040 of 7,872 parameters train (13.21%" in lines[0], lines[0]
    (state, _), = tuned.states
    p = next(line for line in lines if line.startswith("plan: rank 0's model state"))
    counted = state["param_bytes"] + state["grad_bytes"] + state["optim_bytes"] + state["work_bytes"]
    assert f"{counted:,} B predicted, {counted:,} B counted" in p, p
    # the fine-tuned run's weights into the plain model: its adapters merged into their layers
    plain = train.train(cfg_of(d, tmp_path / "plain", steps=1), log=quiet, origin=tuned.checkpoint)
    assert plain.checkpoint
    from mpitrain.train import trained as using

    a, _, _ = using.load(tuned.checkpoint, __import__("mpitrain.comm", fromlist=["SingleComm"]).SingleComm(), quiet)
    ids = np.arange(8)[None, :] % 31
    with no_grad(), lora.merged(a.model):
        want = a.model(ids)[0].data
    a.close()
    restored = train.build.build_model(cfg_of(d, ""), a.data)
    merged = lora.merge_state(after, lora.scale(2, 0))
    restored.load_state_dict(merged)
    with no_grad():
        np.testing.assert_allclose(restored(ids)[0].data, want, rtol=1e-12, atol=1e-12)
