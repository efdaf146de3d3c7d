"""``mpitrain plan --largest`` (mpitrain/plan/largest.py): the largest model of a family
that fits a layout, found by bisection and checked at its edge; and the layouts only GPU
frameworks run, planned and said to be."""

import subprocess
import sys

import pytest

from mpitrain import cli
from mpitrain import plan as planner
from mpitrain.config import ConfigError
from mpitrain.plan import largest, models

H100 = ["--model", "gpt-13b", "--hardware", "h100-nvl", "--set", "train.precision=bf16", "--set",
        "parallel.sync=zero3"]


def _grown(argv, how="both"):
    args = cli.build_parser().parse_args(["plan", *argv])
    cfg, data, _ = models.config_of(args)
    ranks, machine = planner.machine_of(args)
    return cfg, largest.largest(cfg, ranks, machine, data, how), machine


@pytest.mark.parametrize("how", largest.HOW)
def test_the_largest_fits_and_the_next_step_does_not(how):
    """On one 94 GB H100 and on a node of four under ZeRO-3 in bf16: the model found fits
    every rank's memory and the next step of its growth does not; width grows in whole
    heads of the family's width, depth keeps the width, both keep the proportion."""
    for n in (1, 4):
        argv = [*H100, "-n", str(n), "--gpus-per-node", str(n), "--set", f"train.global_batch_size={n}"]
        cfg, (best, above), machine = _grown(argv, how)
        m, bm, am = cfg.model, best.layout.cfg.model, above.layout.cfg.model
        assert best.largest().peak <= machine.memory < above.largest().peak
        assert bm.n_embd // bm.n_head == m.n_embd // m.n_head
        if how == "depth":
            assert (bm.n_embd, am.n_layer) == (m.n_embd, bm.n_layer + 1)
        else:
            assert am.n_head == bm.n_head + 1
        if how == "width":
            assert bm.n_layer == m.n_layer
        if how == "both":
            assert bm.n_layer == max(1, round(bm.n_embd * m.n_layer / m.n_embd))


def test_largest_prints_its_model_assumptions_plan_and_training_time(tmp_path):
    """The command line: the model and its neighbour that does not fit, what it assumes, its
    plan, the days to train it on each token count; a ZeRO-3 layout with checkpointing on a
    GPU is planned and said to be planned only; the flags that do not go together refused."""
    page = tmp_path / "largest.html"
    argv = [*H100, "-n", "4", "--gpus-per-node", "4", "--set", "train.global_batch_size=4", "--set",
            "model.checkpoint_activations=true", "--largest", "--train-tokens", "300e9,1e12", "--html", str(page)]
    out = subprocess.run([sys.executable, "-m", "mpitrain", "plan", *argv], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("largest: gpt-13b (mpitrain/plan/models.toml) grown in width (heads of 128) and "
                               "depth") and "B parameters; its largest rank peaks at" in lines[0]
    assert lines[1].startswith("assumes: 4 rank(s), dp 4 x pp 1 x tp 1, zero3") and "framework's allowance" in lines[1]
    assert any(line.startswith("planned only (GPU frameworks run it, mpitrain's trainer does not): ZeRO-3 with "
                               "activation checkpointing")
               for line in lines)
    trains = [line for line in lines if line.startswith("to train it on")]
    assert [t.split(":")[0] for t in trains] == ["to train it on 3e+11 tokens", "to train it on 1e+12 tokens"]
    days = [float(t.split(", ")[1].split(" days")[0].replace(",", "")) for t in trains]
    assert days[1] == pytest.approx(days[0] * 1e12 / 3e11, rel=0.01)
    assert lines[-1] == f"wrote {page}" and lines[0] in page.read_text(encoding="utf-8")  # the page, its first line
    assert any(line.startswith("memory per rank (the largest) by sync") for line in lines)  # a GPU plan's table
    for bad, said in (([*H100, "--train-tokens", "1e9"], "--train-tokens: goes with --largest"),
                      ([*H100, "--largest", "--train-tokens", "1.5"], "--train-tokens 1.5: fewer than one step's "
                                                                      "2,097,152 tokens"),
                      ([*H100, "--largest", "--search"], "--largest: plans the grown model"),
                      (["jobs/mnist_lenet.toml", "--largest"], "--largest: grows a GPT (its heads and layers); "
                                                               "model.name is 'lenet'")):
        run = subprocess.run([sys.executable, "-m", "mpitrain", "plan", *bad], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode != 0 and said in run.stderr, run.stderr


def test_only_a_gpu_plan_takes_what_only_mpitrains_trainer_refuses():
    """ZeRO-3 with activation checkpointing: planned on a GPU, with the reason it is planned
    only; refused for this machine, whose plans are of mpitrain's trainer."""
    sets = ["--set", "parallel.sync=zero3", "--set", "model.checkpoint_activations=true"]
    gpu = planner.from_args(cli.build_parser().parse_args(["plan", "--model", "gpt2", "--hardware", "a100-80g",
                                                           "-n", "8", *sets]))[0]
    assert gpu.layout.par.sync == "zero3" and gpu.layout.cfg.model.checkpoint_activations
    with pytest.raises(ConfigError, match="ZeRO-3 .* replays every layer in backward already"):
        planner.from_args(cli.build_parser().parse_args(["plan", "jobs/shakespeare_gpt.toml", "-n", "2", *sets]))


# each reference model's parameters as its paper or its released weights count them; mpitrain's shape
# differs only where said (BLOOM's embedding layer norm: 2 x 14,336 numbers; OPT's and GPT-3's papers round)
PUBLISHED = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
             "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800,
             "bloom-176b": 176_247_271_424 - 2 * 14336, "megatron-1t": 1.008e12, "opt-175b": 175e9,
             "gpt3-175b": 175e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_reference_models_have_their_papers_parameters(name):
    """Llama 2 and 3 (SwiGLU, grouped-query attention, untied heads, no learned positions),
    BLOOM, OPT, Megatron-LM's and GPT-3's largest: each planned on a GPU with its published
    parameter count (exactly where the weights' count is published, within 0.25% where the
    paper rounds), and said to be planned only where mpitrain's trainer has not the shape."""
    from mpitrain.plan import show

    args = cli.build_parser().parse_args(["plan", "--model", name, "--hardware", "h100"])
    plan = planner.from_args(args)[0]
    published = PUBLISHED[name]
    if isinstance(published, int):
        assert plan.layout.whole == published
    else:
        assert plan.layout.whole == pytest.approx(published, rel=2.5e-3)
    said = show.header(plan, name)
    assert any(line.startswith("planned only") for line in said) == name.startswith(("llama", "bloom"))


def test_a_models_shape_a_trainer_cannot_build_is_refused_for_this_machine_and_a_user_adds_models(tmp_path,
                                                                                                  monkeypatch):
    """A SwiGLU model planned for this machine (mpitrain's trainer) is refused, naming the
    field; a user's models file adds a model (and a broken one is refused, naming it)."""
    with pytest.raises(ConfigError, match="model.ffn_hidden: mpitrain.s GPT cannot have an MLP 11,008 wide"):
        planner.from_args(cli.build_parser().parse_args(["plan", "--model", "llama2-7b"]))
    mine = tmp_path / "models.toml"
    mine.write_text("[gpt.tiny-llama]\nn_layer = 2\nn_head = 4\nn_embd = 256\nblock_size = 128\nvocab = 1000\n"
                    "global_batch_size = 8\ntokens = 1e9\nffn_hidden = 512\ngated_mlp = true\nn_kv_head = 2\n"
                    "tie_embeddings = false\nposition_embedding = false\n")
    monkeypatch.setenv(models.USER_ENV, str(mine))
    plan = planner.from_args(cli.build_parser().parse_args(["plan", "--model", "tiny-llama", "--hardware", "h100"]))[0]
    qkv, mlp = 256 * (256 + 2 * 2 * 64), 3 * 256 * 512
    assert plan.layout.whole == 2 * 1000 * 256 + 2 * (qkv + 256 * 256 + mlp + 2 * 256) + 256
    mine.write_text("[gpt.broken]\nn_layer = 2\nwidth = 3\n")
    with pytest.raises(ConfigError, match="models.toml: gpt.broken: unknown field\\(s\\) width"):
        models.catalogue()


@pytest.mark.parametrize("name, sets", [("llama2-70b", ["parallel.tp=8", "parallel.pp=4"]),
                                        ("llama3-8b", ["parallel.tp=2"]), ("bloom-176b", ["parallel.pp=2"])])
def test_tier_1s_formulas_count_the_new_shapes_as_their_layers_do(name, sets):
    """Each rank's FLOPs by tier 1's formula (cost.gpt_block_flops with the MLP's width,
    its gate, the keys' and values' width) equal the sum over its layers' products; its
    parameters' model state is ZeRO's formula over the layers' parameters; the activations
    shrink by the keys' and values' share with grouped-query attention, as the formula's
    terms say."""
    from mpitrain import cost
    from mpitrain.plan import estimate

    argv = ["plan", "--model", name, "--hardware", "h100", "-n", "64", *[x for s in sets for x in ("--set", s)],
            "--set", "train.precision=bf16"]
    plan = planner.from_args(cli.build_parser().parse_args(argv))[0]
    lay = plan.layout
    for p in plan.ranks:
        rest, r = divmod(p.ranks[0], lay.tp)
        s = rest // lay.dp
        _, flops, _ = estimate.of_layout(lay, s, r)
        samples = lay.micro_batch * lay.m
        walked = samples * sum(x.forward for x in lay.layers(s, r))
        head = [x for x in lay.layers(s, r) if x.name == "head"]
        uneven = samples * 2 * lay.T * lay.cfg.model.n_embd * (head[0].gemm[2] - lay.data.ids / lay.tp) if head else 0
        assert flops["forward"] == pytest.approx(walked - uneven, rel=1e-12), (p.ranks, s, r)
    m = lay.cfg.model
    s_, b, h, a = lay.T, 1, m.n_embd, m.n_head
    kvw = (m.n_kv_head or a) * h // a
    full = cost.transformer_block_activation_bytes(s_, b, h, a, ffn=m.ffn_hidden, gated=m.gated_mlp)
    grouped = cost.transformer_block_activation_bytes(s_, b, h, a, ffn=m.ffn_hidden, kv=kvw, gated=m.gated_mlp)
    assert full - grouped == 4 * s_ * b * (h - kvw)


def test_a_grouped_query_model_and_a_pipeline_grow_in_the_steps_their_layout_takes(tmp_path):
    """Llama 3 8B on eight H100s grows in steps of its 8 key and value heads, its MLP kept
    3.5 times the width (what the assumes line says); a 16-stage pipeline's smallest model
    has a layer a stage (the notes' GPT-3 layout finds a model, where it said none fits); a
    layout the trainer refuses is its own one-line error, exit 2, not "does not fit"."""
    llama = ["--model", "llama3-8b", "--hardware", "h100", "-n", "8", "--set", "train.precision=bf16", "--set",
             "parallel.sync=zero3", "--set", "model.checkpoint_activations=true", "--set", "train.global_batch_size=8"]
    cfg, (best, above), machine = _grown(llama)
    bm, am = best.layout.cfg.model, above.layout.cfg.model
    assert bm.n_head % 8 == 0 and am.n_head == bm.n_head + 8 and bm.n_kv_head == 8
    assert bm.ffn_hidden == round(14336 * bm.n_head / 32) and best.largest().peak <= machine.memory
    gpt3 = ["--model", "gpt3-175b", "--hardware", "a100-80g", "--gpus-per-node", "8", "--nodes", "128", "--network",
            "ib-hdr", "--set", "parallel.tp=8", "--set", "parallel.pp=16", "--set", "parallel.sync=zero1", "--set",
            "train.precision=bf16", "--set", "model.checkpoint_activations=true", "--set", "train.micro_batches=64"]
    _, (best, _), _ = _grown(gpt3)
    assert best is not None and best.layout.cfg.model.n_layer >= 16 and best.layout.whole > 175e9
    _, (smallest, _), _ = _grown(gpt3, "depth")
    assert smallest.layout.cfg.model.n_layer >= 16
    out = subprocess.run([sys.executable, "-m", "mpitrain", "plan", *llama, "--largest"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "; the MLP 3.5 x the width; 8 key and value heads;" in out.stdout, out.stderr
    gpt2 = ["--model", "gpt2", "--hardware", "h100", "-n", "8", "--set", "train.precision=bf16"]
    _, (rest, _), _ = _grown([*gpt2, "--set", "parallel.dp=1", "--set", "parallel.pp=-1", "--set",
                              "train.micro_batches=8"])  # "the rest" of the ranks: 8 stages, a layer each at least
    assert rest.layout.pp == 8 and rest.layout.cfg.model.n_layer >= 8
    _, (mha, after), _ = _grown([*gpt2, "--set", "model.n_kv_head=12"], "width")  # given, but one a head
    plain = _grown(gpt2, "width")[1][0]
    assert mha.layout.whole == plain.layout.whole and mha.layout.cfg.model.n_kv_head == mha.layout.cfg.model.n_head
    assert after.layout.cfg.model.n_head == mha.layout.cfg.model.n_head + 1
    none = subprocess.run([sys.executable, "-m", "mpitrain", "plan", "--model", "llama3-8b", "--hardware", "h100", "-n",
                           "8", "--set", "train.precision=bf16", "--largest", "--html", str(tmp_path / "x.html")],
                          capture_output=True, text=True, timeout=120)
    assert none.returncode == 3 and none.stdout.rstrip().endswith("; no page written")
    assert not (tmp_path / "x.html").exists()
    bad = subprocess.run([sys.executable, "-m", "mpitrain", "plan", "--model", "gpt2", "--hardware", "h100", "-n", "8",
                          "--set", "train.micro_batches=3", "--largest"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("mpitrain: error: train.micro_batches: ") and not bad.stdout


def test_a_users_models_file_is_named_for_what_it_holds_and_its_mistakes(tmp_path, monkeypatch, capsys):
    """A user's model is credited to their file; its wrong values, a field the config
    refuses, and a table that is not [gpt.NAME] are each one line naming the file and the
    table; a name in neither file lists both files; the help lists every shipped model."""
    mine = tmp_path / "models.toml"
    entry = ("[gpt.mine]\nn_layer = 2\nn_head = 2\nn_embd = 128\nblock_size = 64\nvocab = 500\n"
             "global_batch_size = 8\ntokens = 1e6\n")
    monkeypatch.setenv(models.USER_ENV, str(mine))
    mine.write_text(entry)
    assert cli.main(["plan", "--model", "mine", "--hardware", "h100"]) == 0
    assert capsys.readouterr().out.startswith(f"plan: mine ({mine}) on 1 rank(s)")
    for text, said in (("gpt = 3\n", "gpt: not a table (a models file holds [gpt.NAME] tables)"),
                       (entry.replace("vocab = 500", "vocab = 0"),
                        "gpt.mine.vocab: expected a positive integer, got 0"),
                       (entry.replace("tokens = 1e6", "tokens = -1"), "gpt.mine.tokens: expected a positive number"),
                       (entry.replace("n_layer = 2", 'n_layer = "2"'), "gpt.mine: model.n_layer: expected an integer"),
                       (entry + "[cnn.other]\nx = 1\n", "cnn: unknown table (a models file holds [gpt.NAME] tables)")):
        mine.write_text(text)
        assert cli.main(["plan", "--model", "mine", "--hardware", "h100"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mpitrain: error: {mine}: {said}") and err.count("\n") == 1, err
    mine.write_text(entry)
    with pytest.raises(ConfigError, match=f"no reference model 'other' in mpitrain/plan/models.toml and {mine} "):
        models.reference("other")
    shipped = [line.strip()[5:-1] for line in open(models.SHIPPED, encoding="utf-8") if line.startswith("[gpt.")]
    helped = " ".join(subprocess.run([sys.executable, "-m", "mpitrain", "plan", "--help"], capture_output=True,
                                     text=True, timeout=60).stdout.split())
    assert len(shipped) == 15 and all(f"{name}," in helped or f"{name})" in helped for name in shipped)
