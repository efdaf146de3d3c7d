"""Config loading and validation: every bad input gets one message naming the field."""

import re
from pathlib import Path

import pytest

from mpitrain import config
from mpitrain.config import ConfigError

JOBS = Path(__file__).resolve().parent.parent / "jobs"


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_shipped_jobs_are_valid(tmp_path):
    for path in sorted(JOBS.glob("*.toml")):
        overrides = [f"data.path={tmp_path}"] if "\npath = " in path.read_text() else []
        cfg = config.load(path, overrides)
        assert cfg.train.global_batch_size > 0


def test_overrides_parse_toml_values_and_bare_strings(tmp_path):
    p = write(tmp_path, '[model]\nname = "gpt"\n[data]\nname = "shakespeare"\n[train]\nsteps = 10\n')
    cfg = config.load(p, ["optim.lr=3e-4", "optim.betas=[0.9, 0.95]", "model.bias=true",
                          "optim.name=adam", "train.dtype=float64"])
    assert cfg.optim.lr == 3e-4 and cfg.optim.betas == (0.9, 0.95) and cfg.model.bias
    assert cfg.optim.name == "adam" and cfg.train.dtype == "float64"
    assert cfg.to_dict()["optim"]["lr"] == 3e-4


BAD = [
    ('[train]\nepochs = 1\nbatch = 3\n', "train.batch: unknown field"),
    ('[trian]\nepochs = 1\n', "trian: unknown section"),
    ('[train]\nepochs = "two"\n', "train.epochs: expected an integer"),
    ('[train]\nepochs = 1.5\n', "train.epochs: expected an integer"),
    ('[optim]\nlr = -1.0\n[train]\nepochs = 1\n', "optim.lr: must be > 0"),
    ('[optim]\nbetas = [0.9]\n[train]\nepochs = 1\n', "optim.betas: expected a list of 2"),
    ('[train]\nepochs = 1\nsteps = 5\n', "train.steps: set exactly one"),
    ('[train]\nglobal_batch_size = 0\nepochs = 1\n', "train.global_batch_size: must be > 0"),
    ('[model]\nname = "vgg"\n[train]\nepochs = 1\n',
     "model.name: must be 'lenet', 'convnet', 'resnet' or 'gpt', got 'vgg'"),
    ('[model]\nn_layer = 3\n[train]\nepochs = 1\n', "model.n_layer: does not apply to model.name = 'lenet'"),
    ('[model]\nname = "gpt"\nn_embd = 10\nn_head = 4\n[data]\nname = "shakespeare"\n[train]\nsteps = 1\n',
     "model.n_embd: must be divisible"),
    ('[model]\nname = "gpt"\n[train]\nsteps = 1\n', "data.name: gpt trains on text"),
    ('[model]\nname = "gpt"\n[data]\nname = "text"\n[train]\nsteps = 1\n', "data.name: must be an embedded"),
    ('[model]\nname = "gpt"\n[data]\npath = "/nonexistent/x"\n[train]\nsteps = 1\n',
     "data.path: no such dataset directory"),
    ('[data]\nname = "mnist5k"\npath = "."\n[train]\nepochs = 1\n', "data.name: give data.name (an embedded dataset) or data.path"),
    ('[data]\nbuffer_mb = 0\n[train]\nepochs = 1\n', "data.buffer_mb: must be > 0"),
    ('[model]\nname = "lenet"\nchannels = [4, 8, 16]\n[train]\nepochs = 1\n', "model.channels: lenet has exactly two"),
    ('[optim]\nname = "adam"\nnesterov = true\n[train]\nepochs = 1\n', "optim.nesterov: does not apply"),
    ('[optim]\nname = "sgd"\nnesterov = true\nmomentum = 0.0\n[train]\nepochs = 1\n', "optim.nesterov: needs"),
    ('[optim]\nname = "adamw"\nmomentum = 0.5\n[train]\nepochs = 1\n', "optim.momentum: does not apply"),
    ('[optim]\nschedule = "constant"\nmin_lr = 0.1\n[train]\nepochs = 1\n', "optim.min_lr: only the cosine"),
    ('[optim]\nlr = inf\n[train]\nepochs = 1\n', "optim.lr: expected a finite number"),
    ('[data]\nval_fraction = 0.2\n[train]\nepochs = 1\n', "data.val_fraction: unknown field"),
    ('[train]\nepochs = 1\nsample_tokens = 5\n', "train.sample_tokens: applies to text models"),
    ('[train]\nepochs = 1\nseed = -1\n', "train.seed: must be >= 0"),
    ('[train]\nepochs = 1\ndtype = "float16"\n', "train.dtype: must be"),
    ('train = 3\n', "train: expected a table"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_config_names_the_field(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        config.load(write(tmp_path, text))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_override_and_files(tmp_path):
    ok = write(tmp_path, "[train]\nepochs = 1\n")
    with pytest.raises(ConfigError, match="expected section.key=value"):
        config.load(ok, ["optim.lr"])
    with pytest.raises(ConfigError, match="expected section.key"):
        config.load(ok, ["lr=1"])
    with pytest.raises(ConfigError, match="config file not found"):
        config.load(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(write(tmp_path, "[train\n"))


def test_a_config_path_that_is_a_directory_or_not_utf8_gets_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        config.load(tmp_path)
    assert str(e.value) == f"{tmp_path}: is a directory, not a config file"
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[run]\ndir = "r\u00e9sum\u00e9"\n'.encode("latin-1"))  # TOML files are UTF-8
    with pytest.raises(ConfigError) as e:
        config.load(latin1)
    assert str(e.value) == f"{latin1}: not UTF-8 text, as TOML must be (byte 0xe9 at offset 14)"


def test_an_unreadable_config_file_gets_one_line(tmp_path, monkeypatch):
    def denied(self, *args, **kwargs):  # as a file without read permission does (tests may run as root)
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(ConfigError) as e:
        config.load(tmp_path / "c.toml")
    assert str(e.value) == f"{tmp_path / 'c.toml'}: cannot read the config file (Permission denied)"


@pytest.mark.parametrize("overrides,message", [
    (["parallel.sync=fsdp"], "parallel.sync: must be 'ddp', 'zero1', 'zero2', 'zero3', 'local' or 'ps'"),
    # the old name, read as the new
    (["parallel.strategy=fsdp"], "parallel.sync: must be 'ddp', 'zero1', 'zero2', 'zero3', 'local' or 'ps'"),
    (["parallel.allreduce=tree"], "parallel.allreduce: must be 'mpi', 'ring' or 'hierarchical'"),
    (["parallel.sync=zero1", "parallel.allreduce=hierarchical"],
     "parallel.allreduce: 'hierarchical' (node-aware) is for parallel.sync = 'ddp'"),
    (["parallel.bucket_mb=0"], "parallel.bucket_mb: must be > 0"),
    (["parallel.sync=zero1", "parallel.bucket_mb=8"], "parallel.bucket_mb: does not apply to parallel.sync = 'zero1'"),
    (["parallel.sync=zero2", "parallel.accumulate=each"], "parallel.accumulate: must be 'sharded' or 'full'"),
    (["parallel.wire=fp8"], "parallel.wire: must be 'fp32', 'bf16' or 'fp16'"),
    (["parallel.wire=bf16"], "parallel.wire: 16-bit gradients on the wire need parallel.allreduce = 'ring'"),
    (["parallel.sync=zero1", "parallel.wire=bf16"], "parallel.wire: does not apply to parallel.sync = 'zero1'"),
    (["train.precision=fp8"], "train.precision: must be 'fp32', 'bf16' or 'fp16'"),
    (["train.precision=bf16", "train.dtype=float64"], "train.precision: mixed precision keeps float32 master"),
    (["train.precision=bf16", "parallel.sync=ps"], "train.precision: parameter servers train in float32"),
    (["parallel.sync=zero3", "parallel.gather=each"], "parallel.gather: must be 'layer' or 'step'"),
    (["parallel.sync=zero1", "parallel.gather=step"], "parallel.gather: does not apply to parallel.sync = 'zero1'"),
    (["train.precision=fp16", "parallel.allreduce=ring", "parallel.wire=bf16"],
     "parallel.wire: with train.precision the gradients are 16-bit already"),
    (["parallel.sync=zero3", "parallel.bucket_mb=1"], "parallel.bucket_mb: does not apply to parallel.sync = 'zero3'"),
    (["parallel.sync=zero3", "model.name=gpt", "data.name=shakespeare", "model.checkpoint_activations=true"],
     "model.checkpoint_activations: ZeRO-3 (parallel.sync = 'zero3') replays every layer in backward already"),
    (["parallel.accumulate=full"], "parallel.accumulate: does not apply to parallel.sync = 'ddp'"),
    (["parallel.sync=zero2", "parallel.progress=off"], "parallel.progress: does not apply to parallel.sync = 'zero2'"),
    (["parallel.sync=zero2", "parallel.allreduce=hierarchical"],
     "parallel.allreduce: 'hierarchical' (node-aware) is for parallel.sync = 'ddp'"),
    (["parallel.progress=thread", "parallel.thread_level=funneled"], "parallel.thread_level: the communication thread"),
    (["parallel.servers=2"], "parallel.servers: does not apply to parallel.sync = 'ddp'"),
    (["parallel.sync=local", "parallel.allreduce=ring"],
     "parallel.allreduce: does not apply to parallel.sync = 'local'"),
    (["parallel.strategy=ps", "parallel.allreduce=ring"], "parallel.allreduce: does not apply to parallel.sync = 'ps'"),
    (["parallel.strategy=ps", "parallel.sync=ps"], "parallel.strategy: is the old name of parallel.sync; give only"),
    (["parallel.pp=2", "parallel.schedule=pipedream"], "parallel.schedule: must be 'gpipe', '1f1b', "
                                                       "'interleaved' or 'zb-h1', got 'pipedream'"),
    (["parallel.pp=2", "parallel.chunks=2"], "parallel.chunks: more than one model chunk per rank needs "
                                             "parallel.schedule = 'interleaved'"),
    (["parallel.pp=2", "parallel.chunks=0"], "parallel.chunks: must be >= 1, got 0"),
    (["parallel.dp=0"], "parallel.dp: must be >= 1, or -1 for the ranks the others leave, got 0"),
    (["parallel.pp=-1"], "parallel.pp: -1 means 'the rest', but so does parallel.dp; dp takes the rest by default"),
    (["parallel.dp=1", "parallel.pp=-1", "parallel.tp=-1"], "parallel.tp: -1 means 'the rest', but so does "
                                                            "parallel.pp; only one of dp, pp, tp may be -1"),
    (["train.micro_batches=0"], "train.micro_batches: must be >= 1, got 0"),
    (["parallel.sync=ps", "parallel.servers=0"], "parallel.servers: must be >= 1"),
    (["parallel.sync=ps", "parallel.staleness=-2"], "parallel.staleness: must be >= 0, or -1 for unbounded"),
    (["parallel.sync=ps", "parallel.slow_factor=0.5"], "parallel.slow_factor: must be >= 1"),
    (["parallel.sync=ps", "optim.grad_clip=1.0"], "optim.grad_clip: parameter servers see only their shard"),
    (["parallel.sync=ps", "run.checkpoint_interval=10"], "run.checkpoint_interval: parameter-server runs write one"),
    (["run.stall_abort_s=10", "run.stall_warn_s=20"], "run.stall_abort_s: must be more than run.stall_warn_s"),
    (["run.on_nan=ignore"], "run.on_nan: must be 'stop' or 'skip'"),
    (["run.progress=tqdm"], "run.progress: must be 'auto', 'bar' or 'lines'"),
    (["run.keep=0"], "run.keep: must be >= 1"),
])
def test_parallel_fields_are_checked(overrides, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.from_dict({"train": {"steps": 1}}, overrides)


@pytest.mark.parametrize("ranks,overrides,message", [
    (2, ["parallel.servers=2"], "parallel.servers: 2 server(s) leave no worker among the 2 ranks"),
    (4, ["train.global_batch_size=64"], "train.global_batch_size: 64 is not divisible by the 3 workers"),
    (3, ["parallel.slow_worker=2"], "parallel.slow_worker: 2 is not a worker (0 .. 1)"),
])
def test_parameter_server_rank_checks(ranks, overrides, message):
    cfg = config.from_dict({"train": {"steps": 1, "global_batch_size": 12}}, ["parallel.strategy=ps", *overrides])
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.check_ranks(cfg, ranks)


@pytest.mark.parametrize("ranks,overrides,message", [
    (4, ["parallel.dp=2"], "parallel.dp: dp x pp x tp = 2 x 1 x 1 = 2, but there are the 4 ranks of this job"),
    (2, ["parallel.dp=1", "parallel.tp=-1"], "parallel.tp: tensor slicing cuts a transformer's layers; model.name "
                                             "is 'lenet'"),
    (3, ["parallel.tp=3", "model.name=gpt", "data.name=shakespeare"], "parallel.tp: the 4 attention heads "
                                                                      "(model.n_head) do not split over 3"),
    (4, ["parallel.tp=2", "parallel.progress=thread", "parallel.thread_level=serialized", "model.name=gpt",
         "data.name=shakespeare"], "parallel.thread_level: the slices' collectives and the communication thread"),
    (2, ["parallel.sequence_parallel=true"], "parallel.sequence_parallel: slices the sequence over tensor-parallel "
                                             "ranks; this run has parallel.tp = 1"),
    (4, ["parallel.tp=4", "parallel.sequence_parallel=true", "model.name=gpt", "data.name=shakespeare",
         "model.block_size=30"], "parallel.sequence_parallel: model.block_size 30 does not split over 4"),
    (2, ["parallel.schedule=gpipe"], "parallel.schedule: applies to pipeline runs (parallel.pp > 1); this one has "
                                     "pp = 1"),
    (5, ["parallel.pp=2", "parallel.sync=ps"], "parallel.sync: 'ps' (parameter servers) serves whole replicas, not "
                                               "pipeline stages (parallel.pp = 2): no parameter-server system"),
    (5, ["parallel.tp=2", "parallel.sync=ps", "model.name=gpt", "data.name=shakespeare"],
     "parallel.sync: 'ps' (parameter servers) serves whole replicas, not tensor slices (parallel.tp = 2)"),
    (2, ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.chunks=2", "train.micro_batches=3"],
     "train.micro_batches: the interleaved schedule needs a multiple of the 2 pipeline stages"),
    (2, ["parallel.pp=2", "parallel.schedule=interleaved"], "parallel.chunks: the interleaved schedule needs 2 or "
                                                            "more model chunks per rank"),
    (4, ["parallel.pp=2", "parallel.progress=thread", "parallel.thread_level=serialized"],
     "parallel.thread_level: a pipeline's sends and the communication thread call MPI at the same time"),
    (5, [], "train.global_batch_size: 12 is not divisible by the 5 ranks of this job"),
    (2, ["parallel.sync=local"], "parallel.sync: 'local' exchanges no gradients, so 2 data-parallel replicas"),
    (2, ["train.micro_batches=4"], "train.micro_batches: the 6 samples of each of the 2 data-parallel ranks "
                                   "(train.global_batch_size 12 / 2) do not split into 4 equal micro-batches; use "
                                   "1, 2, 3 or 6, or a train.global_batch_size that is a multiple of 8"),
    (4, ["parallel.sync=ps", "parallel.dp=2"], "parallel.dp: dp x pp x tp = 2 x 1 x 1 = 2, but there are the 3 "
                                               "workers of this job (4 ranks - 1 server(s))"),
])
def test_the_grid_and_the_batch_are_checked_against_the_ranks(ranks, overrides, message):
    cfg = config.from_dict({"train": {"steps": 1, "global_batch_size": 12}}, overrides)
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.check_ranks(cfg, ranks)


def test_the_grid_resolves_the_rest_and_the_old_spelling_still_reads():
    cfg = config.from_dict({"train": {"steps": 1, "global_batch_size": 12}, "parallel": {"strategy": "zero1"}})
    assert cfg.parallel.sync == "zero1" and "parallel.sync" in cfg.given
    assert cfg.notes == ("note: parallel.strategy is now spelled parallel.sync (read as parallel.sync = 'zero1')",)
    assert "strategy" not in cfg.to_dict()["parallel"]
    assert config.check_ranks(cfg, 4) == (4, 1, 1)
    assert config.check_ranks(config.from_dict({"train": {"steps": 1}}, ["parallel.dp=1", "parallel.pp=-1"]), 1) \
        == (1, 1, 1)
    ps = config.from_dict({"train": {"steps": 1, "global_batch_size": 12}}, ["parallel.sync=ps", "parallel.servers=2"])
    assert config.check_ranks(ps, 5) == (3, 1, 1)  # the workers are the grid
    micro = config.from_dict({"train": {"steps": 1, "global_batch_size": 12, "micro_batches": 3}})
    assert config.check_ranks(micro, 2) == (2, 1, 1)


def test_the_rest_of_a_grid_with_pipeline_and_tensor_axes(monkeypatch):
    """How -1 resolves with all three axes (the combinations not built yet refused after)."""
    monkeypatch.setattr(config.checks, "_check_tensor", lambda cfg, sizes: None)
    cfg = config.from_dict({"train": {"steps": 1, "global_batch_size": 12}}, ["parallel.pp=2", "parallel.tp=2"])
    assert config.check_ranks(cfg, 8) == (2, 2, 2)
    with pytest.raises(config.ConfigError, match=re.escape("parallel.dp: -1 takes the ranks the others leave, but "
                                                           "the 6 ranks of this job do not divide by pp 2 x tp 2 = 4")):
        config.check_ranks(cfg, 6)
    cfg = config.from_dict({"train": {"steps": 1, "global_batch_size": 12}},
                           ["parallel.dp=2", "parallel.pp=-1", "parallel.tp=1"])
    assert config.check_ranks(cfg, 6) == (2, 3, 1)


def test_thread_level_choice():
    from mpitrain.comm import thread_level

    assert thread_level() == "multiple"
    assert thread_level("funneled") == "funneled"
    assert thread_level("funneled", comm_thread=True) == "multiple"
    with pytest.raises(ValueError):
        thread_level("fast")


@pytest.mark.parametrize("overrides", [["parallel.pp=2", "parallel.tp=2", "train.precision=bf16"],
                                       ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
                                       ["parallel.tp=2", "parallel.sync=zero2", "parallel.sequence_parallel=true"],
                                       ["parallel.pp=2", "parallel.tp=2", "parallel.sync=zero3", "train.precision=fp16"],
                                       ["parallel.tp=2", "parallel.sync=zero3", "train.precision=bf16",
                                        "parallel.allreduce=ring"]])
def test_stages_slices_zero_and_mixed_precision_combine(overrides):
    cfg = config.from_dict({"model": {"name": "gpt", "n_head": 4}, "data": {"name": "shakespeare"},
                            "train": {"steps": 4, "global_batch_size": 8, "micro_batches": 2}}, overrides,
                           data_needed=False)
    assert config.check_ranks(cfg, 8 if "parallel.pp=2" in overrides else 4)[1:] == (
        2 if "parallel.pp=2" in overrides else 1, 2)
