"""Run configuration: frozen dataclasses loaded from TOML, with ``--set key=value`` overrides.

One dataclass per section of a config file (``[model]``, ``[data]``, ``[optim]``, ``[train]``,
``[parallel]``, ``[run]``); the ``#:`` comment at each field says what it means, and
:func:`reference` turns those into ``jobs/CONFIG.md`` (``mpitrain config reference``).
Everything is validated before any work starts; the first problem raises
:class:`ConfigError` naming the field (``optim.lr: must be > 0, got -1``), which the
command line prints as one line, exiting with status 2. Renamed fields (:data:`RENAMED`)
are still read, with a note (``Config.notes``) that the trainer prints.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import io
import json
import math
import tokenize
import typing
from dataclasses import dataclass, field
from pathlib import Path

from mpitrain.schedules import SCHEDULES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

MODELS = ("lenet", "convnet", "resnet", "gpt")
EMBEDDED = {"mnist5k": "image", "shakespeare": "text"}  # name -> kind


class ConfigError(ValueError):
    """An invalid configuration; ``str()`` names the field."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = "lenet"  #: the model: "lenet", "convnet", "resnet" (CNNs, on images) or "gpt" (on text)
    channels: tuple[int, ...] = (16, 32)  #: convolution widths: lenet's two 5x5 layers, convnet's 3x3 layers
    hidden: int = 128  #: units of the hidden linear layer
    widths: tuple[int, ...] = (16, 32, 64)  #: the width of each stage (stride 2 between stages)
    blocks: int = 1  #: basic blocks per stage (1: ResNet-8, 3: ResNet-20)
    dropout: float = 0.0  #: dropout probability (lenet: before the classifier; gpt: attention and residuals)
    n_layer: int = 4  #: transformer blocks
    n_head: int = 4  #: attention heads per block; n_embd, and with tensor slices parallel.tp, divide by it
    n_embd: int = 128  #: the width of the residual stream
    block_size: int = 64  #: the context: tokens per training window
    bias: bool = False  #: biases in the linear layers and layer norms
    checkpoint_activations: bool = False  #: recompute each block's activations in backward instead of keeping them
    gelu: str = "tanh"  #: the MLP's GELU: "tanh" (GPT-2's approximation) or "erf" (exact, as nanoGPT today)


# which fields a choice of model, dataset or optimizer reads: setting another is an error
MODEL_FIELDS = {
    "lenet": {"name", "channels", "hidden", "dropout"},
    "convnet": {"name", "channels"},
    "resnet": {"name", "widths", "blocks"},
    "gpt": {"name", "n_layer", "n_head", "n_embd", "block_size", "bias", "dropout",
            "checkpoint_activations", "gelu"},
}
_OPTIM_COMMON = {"name", "lr", "min_lr", "schedule", "warmup_steps", "weight_decay", "grad_clip"}
OPTIM_FIELDS = {
    "sgd": _OPTIM_COMMON | {"momentum", "nesterov"},
    "adam": _OPTIM_COMMON | {"betas", "eps"},
    "adamw": _OPTIM_COMMON | {"betas", "eps"},
}
TEXT_ONLY_TRAIN_FIELDS = {"eval_batches", "sample_tokens"}
_PARALLEL_COMMON = {"dp", "pp", "tp", "sync", "thread_level", "schedule", "chunks", "sequence_parallel"}
PARALLEL_FIELDS = {  # by parallel.sync
    "ddp": _PARALLEL_COMMON | {"allreduce", "bucket_mb", "progress", "wire"},
    "zero1": _PARALLEL_COMMON | {"allreduce"},
    "zero2": _PARALLEL_COMMON | {"allreduce", "bucket_mb", "accumulate"},
    "zero3": _PARALLEL_COMMON | {"allreduce"},
    "local": _PARALLEL_COMMON,
    "ps": _PARALLEL_COMMON | {"servers", "staleness", "slow_worker", "slow_factor"},
}
# the field that makes a section's choice, and the fields each value reads
CHOICES = {"model": ("name", MODEL_FIELDS), "optim": ("name", OPTIM_FIELDS), "parallel": ("sync", PARALLEL_FIELDS)}
RENAMED = {"parallel.strategy": "parallel.sync"}  # old spelling -> new: still read, with a note
GRID = ("dp", "pp", "tp")
PIPELINE_SYNCS = ("ddp", "local")  # the gradient syncs a pipeline stage's replicas can use
PRECISION_SYNCS = ("ddp", "local")  # the gradient syncs that train in mixed precision (train.precision)
TENSOR_SYNCS = ("ddp", "local")  # the gradient syncs that combine with tensor slices (parallel.tp > 1)


@dataclass(frozen=True)
class DataConfig:
    name: str = "mnist5k"  #: an embedded dataset, built into shards on first use: "mnist5k" or "shakespeare"
    path: str = ""  #: or a shard directory made by `mpitrain data build` or `data download` (then no name)
    shift: int = 0  #: images: random translation by up to this many pixels (augmentation)
    flip: bool = False  #: images: mirror each image left to right with probability 1/2 (augmentation)
    sampling: str = "stride"  #: text: training windows every block_size tokens ("stride") or anywhere ("random")
    verify: bool = True  #: re-hash every shard's content before step 0, the shards split over the ranks
    buffer_mb: float = 32  #: reader: megabytes of samples per read round, over all ranks
    prefetch: int = 2  #: reader: rounds read ahead by the background thread


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  #: the optimizer: "sgd", "adam" or "adamw" (decoupled weight decay)
    lr: float = 1e-3  #: the peak learning rate
    min_lr: float = 0.0  #: the floor the cosine schedule decays to
    schedule: str = "cosine"  #: after warmup: "cosine" (decay to min_lr at the last step) or "constant"
    warmup_steps: int = 0  #: steps of linear warmup up to lr
    weight_decay: float = 0.0  #: weight decay of the matrices and embeddings (biases and norm scales: none)
    betas: tuple[float, float] = (0.9, 0.999)  #: the decay rates of the two moments
    eps: float = 1e-8  #: added to the square root of the second moment
    momentum: float = 0.9  #: momentum (0: none)
    nesterov: bool = False  #: Nesterov's momentum
    grad_clip: float = 0.0  #: clip the gradients to this global L2 norm; 0: no clipping


@dataclass(frozen=True)
class TrainConfig:
    global_batch_size: int = 64  #: samples per step over all ranks, the same at any rank count
    steps: int = 0  #: optimizer steps to train for (text models); or
    epochs: int = 0  #: passes over the training split (image models); exactly one of the two
    seed: int = 1337  #: seeds the initial weights, the data order and dropout
    dtype: str = "float32"  #: "float32", or "float64" (for exact comparisons in tests)
    precision: str = "fp32"  #: "fp32", or mixed precision: "bf16" or "fp16" weights and gradients, float32 masters
    log_interval: int = 50  #: steps between progress lines and metrics records
    eval_interval: int = 0  #: steps between evaluations; 0: after every epoch (images) or at the end (text)
    eval_batches: int = 0  #: text: at most this many global batches of validation windows per evaluation; 0: all
    sample_tokens: int = 300  #: text: characters the model generates at the end of the run
    threads: int = 0  #: BLAS threads per rank; 0: the cores available divided by the ranks on the node
    micro_batches: int = 1  #: each rank's part of the global batch goes through the model in this many pieces
    fast_paths: bool = True  #: the fast ops (fused transformer halves, tiled convolution, ...); false: the plain ones


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = -1  #: data-parallel replicas; -1: the ranks that pp and tp leave (with sync = ps: the workers)
    pp: int = 1  #: pipeline stages (-1: the ranks dp and tp leave)
    tp: int = 1  #: tensor slices of the GPT's layers (-1: the ranks dp and pp leave)
    schedule: str = "1f1b"  #: pp > 1: the pipeline schedule: "gpipe", "1f1b", "interleaved" or "zb-h1"
    chunks: int = 1  #: pp > 1, schedule "interleaved": model chunks per rank (virtual stages)
    sequence_parallel: bool = False  #: tp > 1: layer norms, residual adds and dropout on slices of the sequence
    sync: str = "ddp"  #: the gradient sync: "ddp", "zero1", "zero2", "zero3", "local" (dp = 1) or "ps" (servers)
    allreduce: str = "mpi"  #: "mpi" (MPI's collectives), "ring" (mpitrain's) or "hierarchical" (node-aware; ddp)
    bucket_mb: float = 4.0  #: gradient bucket size: an allreduce (zero2: a reduce-scatter) starts per full bucket
    accumulate: str = "sharded"  #: with micro-batches: reduce-scatter each ("sharded") or their sum once ("full")
    wire: str = "fp32"  #: allreduce "ring": the gradients' format on the wire, "fp32", "bf16" or "fp16" (added in fp32)
    progress: str = "test"  #: how buckets advance during backward: "test", "thread" or "none"; "off": started after it
    thread_level: str = "auto"  #: MPI thread level: "auto" (multiple), "single", "funneled", "serialized" or "multiple"
    servers: int = 1  #: the first this many ranks are parameter servers, the others workers
    staleness: int = 0  #: 0: synchronous; k > 0: a worker runs at most k steps ahead of the slowest; -1: unbounded
    slow_worker: int = -1  #: make this worker a straggler (for experiments); -1: none
    slow_factor: float = 1.0  #: ... this many times slower than its compute


@dataclass(frozen=True)
class RunConfig:
    dir: str = ""  #: run directory (checkpoints, metrics.jsonl); "" writes nothing; the CLI: `runs/<config name>`
    checkpoint_interval: int = 0  #: steps between checkpoints; 0: only at the end and when stopped by a signal
    keep: int = 3  #: the newest checkpoints kept
    on_nan: str = "stop"  #: a non-finite loss: "stop" (exit 1, naming the last good checkpoint) or "skip" the update
    timeline: bool = False  #: write timeline.json, a Chrome trace of every rank's compute, communication and I/O
    stall_warn_s: float = 60.0  #: a collective waiting this long: print which ranks are not there (0: never)
    stall_abort_s: float = 600.0  #: ... and this long: abort every rank (0: never)
    progress: str = "auto"  #: "bar": a progress bar under the lines; "lines": no bar; "auto": a bar on a terminal
    trace_memory: bool = False  #: trace the heap over the build and the first 3 steps, print it at the end (slower)
    tensorboard: bool = False  #: also write TensorBoard scalars to RUN_DIR/tensorboard (the tensorboard extra)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    given: frozenset = field(default=frozenset(), compare=False, repr=False)
    notes: tuple = field(default=(), compare=False, repr=False)  # renamed fields read, for the trainer to print

    def to_dict(self) -> dict:
        return {s.name: dataclasses.asdict(getattr(self, s.name)) for s in _sections()}


def _sections():
    return [f for f in dataclasses.fields(Config) if f.name not in ("given", "notes")]


# the names other trainers give fields (nanoGPT's, PyTorch examples', torchrun scripts')
_OPTION_ALIASES = {"batch_size": "train.global_batch_size", "learning_rate": "optim.lr", "max_iters": "train.steps",
                   "iters": "train.steps", "warmup": "optim.warmup_steps", "warmup_iters": "optim.warmup_steps",
                   "wd": "optim.weight_decay", "optimizer": "optim.name", "model": "model.name",
                   "data": "data.path", "dataset": "data.path", "out_dir": "run.dir"}


def field_for_option(option: str) -> str | None:
    """The config field (``section.field``) a command-line option such as ``--epochs``,
    ``--lr`` or ``--batch-size`` names, if one does (by its name in one section only,
    or as other trainers name it); None otherwise."""
    name = option.lstrip("-").replace("-", "_")
    if name in _OPTION_ALIASES:
        return _OPTION_ALIASES[name]
    tables = typing.get_type_hints(Config)
    owners = [s.name for s in _sections() if name in {f.name for f in dataclasses.fields(tables[s.name])}]
    return f"{owners[0]}.{name}" if len(owners) == 1 else None


# ------------------------------------------------------------------- parsing
# what a TOML value must be for a field of each scalar type, as the error says it (a bool is an int in Python)
_SCALARS = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), "a finite number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _coerce(key: str, value, annotation):
    """Check a TOML value against a field's annotation and convert lists to tuples."""
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if args[-1] is not Ellipsis and len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {len(value)}")
        return tuple(_coerce(key, v, args[0]) for v in value)
    ok, expected = _SCALARS[annotation]
    if not ok(value):
        raise ConfigError(f"{key}: expected {expected}, got {value!r}")
    return float(value) if annotation is float else value


def _parse_override(item: str) -> tuple[str, object]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, text = item.split("=", 1)
    try:
        return key.strip(), tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return key.strip(), text  # a bare word: take it as a string (--set data.path=input.txt)


def from_dict(raw: dict, overrides: list[str] = (), data_needed: bool = True) -> Config:
    """Build and validate a Config from a parsed TOML document and ``key=value`` overrides."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        key, value = _parse_override(item)
        if key.count(".") != 1:
            raise ConfigError(f"--set {key}: expected section.key (e.g. optim.lr)")
        section, name = key.split(".")
        if not isinstance(raw.setdefault(section, {}), dict):
            raise ConfigError(f"{section}: expected a table")
        raw[section][name] = value

    notes = _renamed(raw)
    hints = typing.get_type_hints(Config)
    sections, given = {}, set()
    known = {s.name for s in _sections()}
    for section in raw:
        if section not in known:
            raise ConfigError(f"{section}: unknown section (expected one of {sorted(known)})")
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{section}: expected a table")
    for s in _sections():
        cls = hints[s.name]
        field_hints = typing.get_type_hints(cls)
        values = {}
        for name, value in raw.get(s.name, {}).items():
            key = f"{s.name}.{name}"
            if name not in field_hints:
                raise ConfigError(f"{key}: unknown field (expected one of {sorted(field_hints)})")
            values[name] = _coerce(key, value, field_hints[name])
            given.add(key)
        sections[s.name] = cls(**values)
    cfg = Config(**sections, given=frozenset(given), notes=tuple(notes))
    validate(cfg, data_needed)
    return cfg


def _renamed(raw: dict) -> list[str]:
    """Move fields given under an old name (:data:`RENAMED`) to the new one, in place; a note for each."""
    notes = []
    for old, new in RENAMED.items():
        section, name = old.split(".")
        new_name = new.split(".")[1]
        table = raw.get(section)
        if isinstance(table, dict) and name in table:
            if new_name in table:
                raise ConfigError(f"{old}: is the old name of {new}; give only {new}")
            table[new_name] = table.pop(name)
            notes.append(f"note: {old} is now spelled {new} (read as {new} = {table[new_name]!r})")
    return notes


def load(path, overrides: list[str] = (), data_needed: bool = True) -> Config:
    """Read a TOML config file and apply overrides; raises ConfigError naming the problem.
    ``data_needed=False`` (the planner) accepts a ``data.path`` that does not exist yet."""
    return from_dict(read(path), overrides, data_needed)


def read(path) -> dict:
    """A TOML config file's tables, unchecked; raises ConfigError naming the file."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except OSError as e:  # no permission, an I/O error, ...
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text, as TOML must be (byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


def from_saved(saved: dict, overrides: list[str] = (), where: str = "the saved config",
               data_needed: bool = True) -> Config:
    """The Config saved in a checkpoint (``Config.to_dict``, every field) with ``overrides``
    applied. Fields at their defaults are left out, so that only what was set counts as
    given, and so are saved fields that do not apply to a choice the overrides make (a
    parameter server's ``parallel.staleness`` when ``--set parallel.sync=ddp`` resumes its
    checkpoint); an error in the saved values names ``where``."""
    defaults = Config().to_dict()
    try:
        raw = {section: {k: v for k, v in fields.items() if _as_tuple(v) != defaults.get(section, {}).get(k)}
               for section, fields in saved.items()}
    except AttributeError:
        raise ConfigError(f"{where}: not a table of sections") from None
    given = dict(_parse_override(item) for item in overrides)
    for section, (choice, fields) in CHOICES.items():
        chosen = given.get(f"{section}.{choice}", saved.get(section, {}).get(choice))
        if f"{section}.{choice}" in given and chosen in fields and section in raw:
            raw[section] = {k: v for k, v in raw[section].items() if k in fields[chosen]}
    try:
        return from_dict(raw, overrides, data_needed)
    except ConfigError as e:
        if str(e).split(":", 1)[0] in given:  # the user's --set, not the saved config
            raise
        raise ConfigError(f"{where}: {e}") from None


def _as_tuple(value):
    return tuple(value) if isinstance(value, list) else value


# ---------------------------------------------------------------- validation
def _require(ok: bool, key: str, message: str, value) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}, got {value!r}")


def validate(cfg: Config, data_needed: bool = True) -> None:
    """Every check that needs neither the ranks nor the data (with ``data_needed``, that
    ``data.path`` exists); the first problem raises."""
    _validate_choices(cfg)
    _validate_data(cfg, data_needed)
    for check in (_validate_model, _validate_optim, _validate_train, _validate_parallel, _validate_run):
        check(cfg)


def _validate_choices(cfg: Config) -> None:
    """The named choices, and no field given that they do not read."""
    m, o, par = cfg.model, cfg.optim, cfg.parallel
    _require(m.name in MODELS, "model.name", f"must be one of {list(MODELS)}", m.name)
    _require(o.name in OPTIM_FIELDS, "optim.name", f"must be one of {sorted(OPTIM_FIELDS)}", o.name)
    _require(par.sync in PARALLEL_FIELDS, "parallel.sync", f"must be one of {list(PARALLEL_FIELDS)}", par.sync)
    for key in sorted(cfg.given):
        section, name = key.split(".")
        if section in CHOICES:
            choice, table = CHOICES[section]
            chosen = getattr(getattr(cfg, section), choice)
            if name not in table[chosen]:
                raise ConfigError(f"{key}: does not apply to {section}.{choice} = {chosen!r}")
        if key == "optim.min_lr" and o.schedule != "cosine":
            raise ConfigError(f"{key}: only the cosine schedule decays to a minimum")
        if section == "train" and name in TEXT_ONLY_TRAIN_FIELDS and m.name != "gpt":
            raise ConfigError(f"{key}: applies to text models (model.name = 'gpt') only")


def _validate_data(cfg: Config, data_needed: bool = True) -> None:
    from mpitrain.data.reader import SAMPLING  # here: the reader brings NumPy and h5py

    m, d = cfg.model, cfg.data
    text_model = m.name == "gpt"
    if d.path:
        _require("data.name" not in cfg.given, "data.name",
                 "give data.name (an embedded dataset) or data.path (a shard directory), not both", d.name)
        _require(Path(d.path).is_dir() or not data_needed, "data.path",
                 "no such dataset directory (build one with 'mpitrain data build')", d.path)
    else:
        _require(d.name in EMBEDDED, "data.name",
                 f"must be an embedded dataset {sorted(EMBEDDED)}, or set data.path", d.name)
        _require(text_model == (EMBEDDED[d.name] == "text"), "data.name",
                 f"gpt trains on text (shakespeare), the CNNs on images (mnist5k); model.name is {m.name!r}", d.name)
    _require(d.shift >= 0, "data.shift", "must be >= 0", d.shift)
    _require(d.sampling in SAMPLING, "data.sampling", f"must be one of {', '.join(SAMPLING)}", d.sampling)
    _require(text_model or "data.sampling" not in cfg.given, "data.sampling",
             "places text windows: applies to text models (model.name = 'gpt') only", d.sampling)
    _require(d.buffer_mb > 0, "data.buffer_mb", "must be > 0", d.buffer_mb)
    _require(d.prefetch > 0, "data.prefetch", "must be > 0", d.prefetch)


def _validate_model(cfg: Config) -> None:
    m = cfg.model
    _require(len(m.channels) > 0 and all(c > 0 for c in m.channels), "model.channels",
             "must be positive channel counts", list(m.channels))
    _require(m.name != "lenet" or len(m.channels) == 2, "model.channels",
             "lenet has exactly two convolution layers", list(m.channels))
    _require(m.hidden > 0, "model.hidden", "must be > 0", m.hidden)
    _require(len(m.widths) > 0 and all(w > 0 for w in m.widths), "model.widths",
             "must be positive widths", list(m.widths))
    _require(m.blocks > 0, "model.blocks", "must be > 0", m.blocks)
    _require(0.0 <= m.dropout < 1.0, "model.dropout", "must be in [0, 1)", m.dropout)
    for name in ("n_layer", "n_head", "n_embd", "block_size"):
        _require(getattr(m, name) > 0, f"model.{name}", "must be > 0", getattr(m, name))
    _require(m.n_embd % m.n_head == 0, "model.n_embd", f"must be divisible by model.n_head = {m.n_head}", m.n_embd)
    _require(m.gelu in ("tanh", "erf"), "model.gelu", "must be tanh or erf", m.gelu)


def _validate_optim(cfg: Config) -> None:
    o = cfg.optim
    _require(o.lr > 0, "optim.lr", "must be > 0", o.lr)
    _require(0 <= o.min_lr <= o.lr, "optim.min_lr", f"must be in [0, optim.lr = {o.lr}]", o.min_lr)
    _require(o.schedule in ("cosine", "constant"), "optim.schedule", "must be 'cosine' or 'constant'", o.schedule)
    _require(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0", o.warmup_steps)
    _require(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0", o.weight_decay)
    _require(all(0 <= b < 1 for b in o.betas), "optim.betas", "must be two numbers in [0, 1)", list(o.betas))
    _require(o.eps > 0, "optim.eps", "must be > 0", o.eps)
    _require(0 <= o.momentum < 1, "optim.momentum", "must be in [0, 1)", o.momentum)
    _require(not o.nesterov or o.momentum > 0, "optim.nesterov", "needs optim.momentum > 0", o.nesterov)
    _require(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)", o.grad_clip)


def _validate_train(cfg: Config) -> None:
    t, text_model = cfg.train, cfg.model.name == "gpt"
    _require(t.global_batch_size > 0, "train.global_batch_size", "must be > 0", t.global_batch_size)
    _require(t.seed >= 0, "train.seed", "must be >= 0", t.seed)
    _require(t.steps >= 0 and t.epochs >= 0 and (t.steps > 0) != (t.epochs > 0), "train.steps",
             f"set exactly one of train.steps and train.epochs (epochs = {t.epochs})", t.steps)
    _require(not (text_model and t.epochs), "train.epochs", "text models train for train.steps", t.epochs)
    _require(t.dtype in ("float32", "float64"), "train.dtype", "must be 'float32' or 'float64'", t.dtype)
    _require(t.precision in ("fp32", "bf16", "fp16"), "train.precision", "must be 'fp32', 'bf16' or 'fp16'",
             t.precision)
    _require(t.precision == "fp32" or t.dtype == "float32", "train.precision",
             "mixed precision keeps float32 master weights: it needs train.dtype = 'float32'", t.precision)
    _require(t.log_interval > 0, "train.log_interval", "must be > 0", t.log_interval)
    _require(t.eval_interval >= 0, "train.eval_interval", "must be >= 0", t.eval_interval)
    _require(t.eval_batches >= 0, "train.eval_batches", "must be >= 0 (0: the whole split)", t.eval_batches)
    _require(t.sample_tokens >= 0, "train.sample_tokens", "must be >= 0", t.sample_tokens)
    _require(t.threads >= 0, "train.threads", "must be >= 0 (0: automatic)", t.threads)
    _require(t.micro_batches >= 1, "train.micro_batches", "must be >= 1", t.micro_batches)


def _validate_parallel(cfg: Config) -> None:
    par, o = cfg.parallel, cfg.optim
    _validate_grid(cfg)
    _require(par.allreduce in ("mpi", "ring", "hierarchical"), "parallel.allreduce",
             "must be 'mpi', 'ring' or 'hierarchical'", par.allreduce)
    _require(par.allreduce != "hierarchical" or par.sync == "ddp", "parallel.allreduce",
             "'hierarchical' (node-aware) is for parallel.sync = 'ddp'", par.allreduce)
    _require(par.bucket_mb > 0, "parallel.bucket_mb", "must be > 0", par.bucket_mb)
    _require(par.accumulate in ("sharded", "full"), "parallel.accumulate", "must be 'sharded' or 'full'",
             par.accumulate)
    _require(par.wire in ("fp32", "bf16", "fp16"), "parallel.wire", "must be 'fp32', 'bf16' or 'fp16'", par.wire)
    _require(par.wire == "fp32" or par.allreduce == "ring", "parallel.wire",
             "16-bit gradients on the wire need parallel.allreduce = 'ring' (MPI cannot add them in fp32)", par.wire)
    _require(cfg.train.precision == "fp32" or par.sync in PRECISION_SYNCS, "train.precision",
             f"mixed precision works with parallel.sync = {' or '.join(map(repr, PRECISION_SYNCS))} for now, "
             f"not {par.sync!r}", cfg.train.precision)
    _require(cfg.train.precision == "fp32" or par.wire == "fp32", "parallel.wire",
             "with train.precision the gradients are 16-bit already; parallel.wire is for float32 training",
             par.wire)
    _require(cfg.train.precision == "fp32" or par.allreduce != "hierarchical", "parallel.allreduce",
             "mixed precision works with 'ring' (16-bit words on the wire) or 'mpi' (float32), not 'hierarchical'",
             par.allreduce)
    _require(par.sync != "zero3" or not cfg.model.checkpoint_activations, "model.checkpoint_activations",
             "ZeRO-3 (parallel.sync = 'zero3') replays every layer in backward already; leave it false",
             cfg.model.checkpoint_activations)
    _require(par.progress in ("test", "thread", "none", "off"), "parallel.progress",
             "must be 'test', 'thread', 'none' or 'off'", par.progress)
    _require(par.thread_level in ("auto", "single", "funneled", "serialized", "multiple"), "parallel.thread_level",
             "must be auto, single, funneled, serialized or multiple", par.thread_level)
    _require(par.progress != "thread" or par.thread_level in ("auto", "serialized", "multiple"),
             "parallel.thread_level", "the communication thread (parallel.progress = 'thread') needs "
             "'serialized' or 'multiple'", par.thread_level)

    _require(par.schedule in SCHEDULES, "parallel.schedule", f"must be one of {list(SCHEDULES)}", par.schedule)
    _require(par.chunks >= 1, "parallel.chunks", "must be >= 1", par.chunks)
    _require(par.chunks == 1 or par.schedule == "interleaved", "parallel.chunks",
             "more than one model chunk per rank needs parallel.schedule = 'interleaved'", par.chunks)
    _require(par.servers >= 1, "parallel.servers", "must be >= 1", par.servers)
    _require(par.staleness >= -1, "parallel.staleness", "must be >= 0, or -1 for unbounded", par.staleness)
    _require(par.slow_factor >= 1, "parallel.slow_factor", "must be >= 1", par.slow_factor)
    if par.sync == "ps":
        _require(o.grad_clip == 0, "optim.grad_clip", "parameter servers see only their shard of the gradient: "
                 "global-norm clipping is not available with parallel.sync = 'ps'", o.grad_clip)
        _require("run.checkpoint_interval" not in cfg.given, "run.checkpoint_interval",
                 "parameter-server runs write one checkpoint, at the end", cfg.run.checkpoint_interval)


def _validate_run(cfg: Config) -> None:
    r = cfg.run
    _require(r.checkpoint_interval >= 0, "run.checkpoint_interval", "must be >= 0 (0: at the end only)",
             r.checkpoint_interval)
    _require(r.keep >= 1, "run.keep", "must be >= 1", r.keep)
    _require(r.on_nan in ("stop", "skip"), "run.on_nan", "must be 'stop' or 'skip'", r.on_nan)
    _require(r.progress in ("auto", "bar", "lines"), "run.progress", "must be 'auto', 'bar' or 'lines'", r.progress)
    _require(r.stall_warn_s >= 0, "run.stall_warn_s", "must be >= 0 (0: never)", r.stall_warn_s)
    _require(r.stall_abort_s >= 0, "run.stall_abort_s", "must be >= 0 (0: never)", r.stall_abort_s)
    _require(not (r.stall_abort_s and r.stall_warn_s) or r.stall_abort_s > r.stall_warn_s, "run.stall_abort_s",
             f"must be more than run.stall_warn_s = {r.stall_warn_s}", r.stall_abort_s)
    _require(not r.dir or not Path(r.dir).exists() or Path(r.dir).is_dir(), "run.dir",
             "exists and is not a directory", r.dir)
    _require(not r.tensorboard or importlib.util.find_spec("tensorboardX") is not None, "run.tensorboard",
             "needs the tensorboardX package: pip install -e \".[tensorboard]\" (or pip install tensorboardX)",
             r.tensorboard)


def _validate_grid(cfg: Config) -> None:
    """dp, pp, tp: positive, or -1 for "the rest" (one of them at most: dp, by default)."""
    par = cfg.parallel
    for name in GRID:
        value = getattr(par, name)
        _require(value >= 1 or value == -1, f"parallel.{name}", "must be >= 1, or -1 for the ranks the others leave",
                 value)
    rest = [n for n in GRID if getattr(par, n) == -1]
    if len(rest) > 1:
        how = "dp takes the rest by default: set parallel.dp to a number" if "parallel.dp" not in cfg.given else \
            f"only one of {', '.join(GRID)} may be -1"
        raise ConfigError(f"parallel.{rest[1]}: -1 means 'the rest', but so does parallel.{rest[0]}; {how}")


def check_ranks(cfg: Config, ranks: int) -> tuple[int, int, int]:
    """The checks that need the number of ranks (after MPI starts, before any
    collective); returns the grid ``(dp, pp, tp)`` with "the rest" resolved."""
    par = cfg.parallel
    ps = par.sync == "ps"
    workers = ranks - par.servers if ps else ranks
    if workers < 1:
        raise ConfigError(f"parallel.servers: {par.servers} server(s) leave no worker among the {ranks} ranks "
                          "of this job")
    who = f"{workers} workers of this job ({ranks} ranks - {par.servers} server(s))" if ps else \
        f"{ranks} ranks of this job"
    sizes = {n: getattr(par, n) for n in GRID}
    rest = [n for n in GRID if sizes[n] == -1]
    known = math.prod(v for v in sizes.values() if v != -1)
    if rest and workers % known == 0:
        sizes[rest[0]] = workers // known
    if math.prod(sizes.values()) != workers:
        if rest:
            others = " x ".join(f"{n} {sizes[n]}" for n in GRID if n != rest[0])
            raise ConfigError(f"parallel.{rest[0]}: -1 takes the ranks the others leave, but the {who} do not "
                              f"divide by {others} = {known}")
        shown = " x ".join(str(sizes[n]) for n in GRID)
        raise ConfigError(f"parallel.dp: dp x pp x tp = {shown} = {known}, but there are the {who}: the grid must "
                          "use every one (-1 takes the rest)")
    _check_pipeline(cfg, sizes["pp"])
    _check_tensor(cfg, sizes)
    if cfg.train.precision != "fp32" and (sizes["pp"] > 1 or sizes["tp"] > 1):
        raise ConfigError(f"train.precision: mixed precision ({cfg.train.precision!r}) trains data-parallel grids "
                          f"for now, not pipeline stages or tensor slices (pp = {sizes['pp']}, tp = {sizes['tp']})")
    if par.sync == "local" and sizes["dp"] > 1:
        raise ConfigError(f"parallel.sync: 'local' exchanges no gradients, so {sizes['dp']} data-parallel replicas "
                          "would drift apart; use 'ddp' or 'zero1'")
    _check_batch(cfg, sizes["dp"], "workers" if ps else "data-parallel ranks", who)
    if ps and par.slow_worker >= workers:
        raise ConfigError(f"parallel.slow_worker: {par.slow_worker} is not a worker (0 .. {workers - 1})")
    return sizes["dp"], sizes["pp"], sizes["tp"]


def cut_refused(cfg: Config, error: ValueError) -> ConfigError:
    """The config error of a pipeline whose model the cut cannot split (``error``, from
    :func:`mpitrain.schedules.balance`), as the trainer and the planner give it."""
    return ConfigError(f"{'parallel.chunks' if cfg.parallel.chunks > 1 else 'parallel.pp'}: {error}")


def _check_pipeline(cfg: Config, pp: int) -> None:
    """A pipeline's schedule and sync; no pipeline settings without one."""
    par, m = cfg.parallel, cfg.train.micro_batches
    if pp == 1:
        for name in ("schedule", "chunks"):
            if f"parallel.{name}" in cfg.given:
                raise ConfigError(f"parallel.{name}: applies to pipeline runs (parallel.pp > 1); this one has pp = 1")
        return
    if par.sync not in PIPELINE_SYNCS:
        raise ConfigError(f"parallel.sync: {par.sync!r} does not combine with pipeline stages (parallel.pp = {pp}) "
                          f"yet; use one of {list(PIPELINE_SYNCS)}")
    if par.schedule == "interleaved" and par.chunks < 2:
        raise ConfigError("parallel.chunks: the interleaved schedule needs 2 or more model chunks per rank "
                          f"(got {par.chunks}; with one it is 1F1B: parallel.schedule = '1f1b')")
    if par.progress == "thread" and par.thread_level not in ("auto", "multiple"):
        raise ConfigError(f"parallel.thread_level: a pipeline's sends and the communication thread call MPI at "
                          f"the same time (parallel.progress = 'thread'): 'multiple' is needed, got "
                          f"{par.thread_level!r}")
    if par.schedule == "interleaved" and m % pp:
        raise ConfigError(f"train.micro_batches: the interleaved schedule needs a multiple of the {pp} pipeline "
                          f"stages (as in Megatron-LM), got {m}")


def _check_tensor(cfg: Config, sizes: dict) -> None:
    """Tensor slicing: the GPT's, its heads over the ranks; what it does not combine with yet."""
    tp, par = sizes["tp"], cfg.parallel
    if tp == 1:
        if par.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel: slices the sequence over tensor-parallel ranks; this run "
                              "has parallel.tp = 1")
        return
    if cfg.model.name != "gpt":
        raise ConfigError(f"parallel.tp: tensor slicing cuts a transformer's layers; model.name is "
                          f"{cfg.model.name!r} (use dp or pp for the CNNs)")
    if cfg.model.n_head % tp:
        raise ConfigError(f"parallel.tp: the {cfg.model.n_head} attention heads (model.n_head) do not split over "
                          f"{tp} tensor-parallel ranks")
    if par.sync not in TENSOR_SYNCS:
        raise ConfigError(f"parallel.sync: {par.sync!r} does not combine with tensor slicing (parallel.tp = {tp}) "
                          f"yet; use {' or '.join(map(repr, TENSOR_SYNCS))}")
    if par.progress == "thread" and par.thread_level not in ("auto", "multiple"):
        raise ConfigError(f"parallel.thread_level: the slices' collectives and the communication thread call MPI "
                          f"at the same time (parallel.progress = 'thread'): 'multiple' is needed, got "
                          f"{par.thread_level!r}")
    if par.sequence_parallel and cfg.model.block_size % tp:
        raise ConfigError(f"parallel.sequence_parallel: model.block_size {cfg.model.block_size} does not split over "
                          f"{tp} tensor-parallel ranks")
    if par.sequence_parallel and sizes["pp"] > 1:
        raise ConfigError("parallel.sequence_parallel: does not combine with pipeline stages (parallel.pp > 1) yet")


def _check_batch(cfg: Config, dp: int, ranks: str, who: str) -> None:
    """The global batch splits over the ``dp`` replicas, each part into micro-batches."""
    B, m = cfg.train.global_batch_size, cfg.train.micro_batches
    if B % dp:
        where = f"the {who}" if cfg.parallel.dp == -1 else f"dp = {dp} {ranks}"
        raise ConfigError(f"train.global_batch_size: {B} is not divisible by {where}; the global batch stays the "
                          f"same at any rank count, each of the {ranks} takes B / {dp}")
    if (B // dp) % m:
        raise ConfigError(f"train.micro_batches: the {B // dp} samples of each of the {dp} {ranks} "
                          f"(train.global_batch_size {B} / {dp}) do not split into {m} equal micro-batches")


def check_against_data(cfg: Config, data) -> None:
    """The checks that need the data (an opened :class:`mpitrain.data.Dataset`, open on
    every rank): raise ConfigError naming the field. What the model is built from (the
    training split's sample shape, the classes, the vocabulary) the opened dataset
    guarantees to fit every split (``open_data`` checks the values before step 0)."""
    text_model = cfg.model.name == "gpt"
    if text_model != (data.kind == "text"):
        raise ConfigError(f"data.path: {data.path} holds {data.kind} data ({data.name}), but model.name "
                          f"{cfg.model.name!r} trains on {'text' if text_model else 'images'}")
    if text_model:
        for key in ("data.shift", "data.flip"):
            if key in cfg.given:
                raise ConfigError(f"{key}: augmentation applies to image data only")
        shortest = min(s.count for s in data.splits.values())
        if cfg.model.block_size + 1 > shortest:
            raise ConfigError(f"model.block_size: windows of block_size + 1 = {cfg.model.block_size + 1} "
                              f"tokens do not fit the {shortest}-token split of {data.name}")
        for split in ("train", "val"):
            data.split(split)
        return
    train = data.split("train")
    data.split("test")
    if cfg.train.global_batch_size > train.count:
        raise ConfigError(f"train.global_batch_size: must be at most the {train.count} training images of "
                          f"{data.name}, got {cfg.train.global_batch_size}")
    if train.sample_shape[0] != train.sample_shape[1]:  # (H, W, C): the dataset checked
        raise ConfigError(f"data.path: the CNNs expect square (H, W, C) images, {data.name} has {train.sample_shape}")


# ----------------------------------------------------------------- reference
_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", tuple[int, ...]: "list of integers",
               tuple[float, float]: "list of 2 numbers"}
_INTRO = ("Generated from `mpitrain/config.py` by `mpitrain config reference --out jobs/CONFIG.md` (edit the code; a "
          "test compares the two). A field left out takes its default; `--set section.field=VALUE` sets one (TOML "
          "syntax). How to run a config: [README.md](README.md).")


def reference() -> str:
    """The configuration reference, ``jobs/CONFIG.md``, in Markdown: every field with its
    type, its default (as TOML), its meaning (the ``#:`` comment at it, on its line or on
    the lines above; ValueError if there is none), and, in the sections with a choice
    (``model.name``, ``optim.name``, ``parallel.sync``), the choices that read it."""
    source = Path(__file__).read_text(encoding="utf-8")
    comments = {t.start[0]: (t.string[2:].strip(), t.line.lstrip().startswith("#"))  # line: (text, on its own)
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.string.startswith("#:")}
    fields = {(c.name, n.target.id): n for c in ast.parse(source).body if isinstance(c, ast.ClassDef)
              for n in c.body if isinstance(n, ast.AnnAssign)}
    out = ["# Configuration reference", "", _INTRO, ""]
    for section in _sections():
        cls = typing.get_type_hints(Config)[section.name]
        choice, table = CHOICES.get(section.name, (None, {}))
        out += [f"## [{section.name}]", ""]
        if choice:
            out += [f"*applies to*: the values of `{section.name}.{choice}` that read the field; others refuse it.", ""]
        out += ["| field | type | default |" + " applies to |" * bool(choice) + " meaning |",
                "|---|---|---|" + "---|" * bool(choice) + "---|"]
        for name, annotation in typing.get_type_hints(cls).items():
            node, above = fields[cls.__name__, name], []
            while comments.get(node.lineno - 1 - len(above), ("", False))[1]:
                above.insert(0, comments[node.lineno - 1 - len(above)][0])
            meaning = " ".join(above) or comments.get(node.end_lineno, ("",))[0]
            if not meaning:
                raise ValueError(f"{section.name}.{name}: no '#:' comment at the field says what it means")
            readers = [value for value, read in table.items() if name in read]
            applies = f" {'all' if len(readers) == len(table) else ', '.join(readers)} |" if choice else ""
            out.append(f"| `{name}` | {_TYPE_NAMES[annotation]} | `{json.dumps(getattr(cls(), name))}` |{applies} "
                       f"{meaning.replace('|', chr(92) + '|')} |")
        out.append("")
    either = lambda names: " or ".join(f'`"{n}"`' for n in names)  # noqa: E731
    return "\n".join(out + [
        "## Combinations", "",
        f"- `train.{'`, `train.'.join(sorted(TEXT_ONLY_TRAIN_FIELDS))}`: text models (`model.name = \"gpt\"`).",
        f"- `parallel.pp` > 1: `parallel.sync` is {either(PIPELINE_SYNCS)}.",
        f"- `parallel.tp` > 1: `model.name = \"gpt\"`, and `parallel.sync` is {either(TENSOR_SYNCS)}.",
        f"- `train.precision` other than `\"fp32\"`: `parallel.sync` is {either(PRECISION_SYNCS)}, with no "
        "pipeline stages or tensor slices.",
        *(f"- `{old}` is the old name of `{new}`: still read, with a note." for old, new in RENAMED.items()), "",
        "Every check, each with its message, is in `mpitrain/config.py`: `validate`, and, once the ranks and the "
        "data are known, `check_ranks` and `check_against_data`.", ""])
