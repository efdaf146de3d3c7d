"""Every check of a config, each with its message naming the field: :func:`validate` (what
needs neither the ranks nor the data; run by :func:`mpitrain.config.from_dict`), and, once
they are known, :func:`check_ranks` (the ``dp x pp x tp`` grid) and
:func:`check_against_data` (the dataset's kind, sizes and shapes)."""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import math
from pathlib import Path

from mpitrain.config.fields import (CHOICES, EMBEDDED, GRID, IMAGE_ONLY_TRAIN_FIELDS, MODELS, OPTIM_FIELDS,
                                    PARALLEL_FIELDS, WHOLE_REPLICA_SYNCS,
                                    TEXT_ONLY_TRAIN_FIELDS, Config, ConfigError)
from mpitrain.schedules import SCHEDULES


# Inside :func:`planning`: the layouts mpitrain's trainer refuses for its own reasons, which GPU frameworks
# run, pass (planned only, :func:`planned_only` says why)
_PLANNING = contextvars.ContextVar("planning", default=False)
# how a GPU framework sums micro-batches' weight gradients (train.accumulation): by the products, or a pass of its own
ACCUMULATIONS = ("fused", "float32", "16-bit")


@contextlib.contextmanager
def planning():
    """Checks for a plan of a published device: what only mpitrain's trainer refuses
    (:func:`planned_only`) passes; everything else is checked as for a run."""
    token = _PLANNING.set(True)
    try:
        yield
    finally:
        _PLANNING.reset(token)


def _shape_only(cfg: Config) -> list[tuple[str, str]]:
    """(field, what) of each model field set to a shape mpitrain's GPT does not build."""
    m = cfg.model
    if m.name != "gpt":
        return []
    said = [("vocab_size", f"a vocabulary of {m.vocab_size:,} of its own (its data's decides)"),
            ("ffn_hidden", f"an MLP {m.ffn_hidden:,} wide (its MLP is 4 x n_embd)"),
            ("gated_mlp", "a gated MLP (SwiGLU)"),
            ("n_kv_head", f"grouped-query attention ({m.n_kv_head} key and value heads)"),
            ("tie_embeddings", "a head of its own (its head is the embedding)"),
            ("position_embedding", "no learned positions (rotary or ALiBi: none to learn)"),
            ("selective_recompute", "selective recomputation (attention's scores and softmax again in backward)"),
            ("flash_attention", "attention as one fused kernel (FlashAttention: mpitrain keeps its scores)")]
    default = {"vocab_size": 0, "ffn_hidden": (0, 4 * m.n_embd), "gated_mlp": False, "n_kv_head": (0, m.n_head),
               "tie_embeddings": True, "position_embedding": True, "selective_recompute": False,
               "flash_attention": False}
    return [(f, w) for f, w in said
            if getattr(m, f) not in (default[f] if isinstance(default[f], tuple) else (default[f],))]


def planned_only(cfg: Config) -> list[str]:
    """Why mpitrain's trainer would refuse ``cfg`` where GPU frameworks run it (empty: it runs)."""
    why = [what for _, what in _shape_only(cfg)]
    if cfg.train.accumulation != "fused":
        why.append(f"weight gradients summed over micro-batches by a pass of their own, {cfg.train.accumulation} "
                   "(a GPU framework's, before gradient accumulation fusion)")
    if cfg.parallel.sync == "zero3" and cfg.model.checkpoint_activations:
        why.append("ZeRO-3 with activation checkpointing (mpitrain's ZeRO-3 replays every layer in backward "
                   "already; DeepSpeed's keeps the activations unless asked to checkpoint)")
    return why


def either(values) -> str:
    """Choices as every message words them: ``'a', 'b' or 'c'`` (numbers unquoted)."""
    words = [repr(v) if isinstance(v, str) else str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


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
    _require(m.name in MODELS, "model.name", f"must be {either(MODELS)}", m.name)
    _require(o.name in OPTIM_FIELDS, "optim.name", f"must be {either(sorted(OPTIM_FIELDS))}", o.name)
    _require(par.sync in PARALLEL_FIELDS, "parallel.sync", f"must be {either(PARALLEL_FIELDS)}", par.sync)
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
        if section == "train" and name in IMAGE_ONLY_TRAIN_FIELDS and m.name == "gpt":
            raise ConfigError(f"{key}: applies to image models only (this is model.name = 'gpt')")


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
    _require(d.sampling in SAMPLING, "data.sampling", f"must be {either(SAMPLING)}", d.sampling)
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
    _require(m.gelu in ("tanh", "erf"), "model.gelu", "must be 'tanh' or 'erf'", m.gelu)
    for name in ("vocab_size", "ffn_hidden", "n_kv_head"):
        _require(getattr(m, name) >= 0, f"model.{name}", "must be >= 0 (0: the default)", getattr(m, name))
    _require(not m.n_kv_head or m.n_head % m.n_kv_head == 0, "model.n_kv_head",
             f"must divide model.n_head = {m.n_head} (each key and value head serves as many query heads)",
             m.n_kv_head)
    _require(not (m.selective_recompute and m.checkpoint_activations), "model.selective_recompute",
             "recomputes part of each block; model.checkpoint_activations recomputes all of it: give one", True)
    _require(m.lora_rank >= 0, "model.lora_rank", "must be >= 0 (0: no adapters)", m.lora_rank)
    _require(m.lora_alpha >= 0, "model.lora_alpha", "must be >= 0 (0: model.lora_rank, a scale of 1)", m.lora_alpha)
    _require(len(m.lora_targets) > 0 and all(isinstance(t, str) and t for t in m.lora_targets), "model.lora_targets",
             "must name one or more Linear layers (globs such as 'blocks.*.attn.c_attn')", list(m.lora_targets))
    for key in ("model.lora_alpha", "model.lora_targets"):
        _require(m.lora_rank > 0 or key not in cfg.given, key, "applies to LoRA adapters: set model.lora_rank > 0",
                 getattr(m, key.split(".")[1]))
    for field, why in _shape_only(cfg):
        _require(_PLANNING.get(), f"model.{field}", f"mpitrain's GPT cannot have {why}: a shape only `mpitrain "
                 "plan --hardware GPU` plans", getattr(m, field))


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
    _require(t.accumulation in ACCUMULATIONS, "train.accumulation", f"must be {either(ACCUMULATIONS)}", t.accumulation)
    _require(t.accumulation == "fused" or _PLANNING.get(), "train.accumulation", "says how a GPU framework sums each "
             "micro-batch's weight gradients: only `mpitrain plan --hardware GPU` plans it", t.accumulation)
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
    _require(all(isinstance(p, str) and p for p in t.trainable) and len(set(t.trainable)) == len(t.trainable),
             "train.trainable", "must be distinct globs on parameter names (such as 'head.*')", list(t.trainable))
    _require(0 <= t.label_smoothing <= 1, "train.label_smoothing", "must be in [0, 1] (0: none)", t.label_smoothing)
    _require(not t.eval_flip or cfg.data.flip or text_model, "train.eval_flip",
             "scores each image's mirror too, which the model sees in training only with data.flip = true",
             t.eval_flip)


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
    _require(par.gather in ("layer", "step"), "parallel.gather", "must be 'layer' or 'step'", par.gather)
    _require(cfg.train.precision == "fp32" or par.sync != "ps", "train.precision",
             "parameter servers train in float32 (their workers push and pull float32 numbers): use "
             "parallel.sync = 'ddp' or a ZeRO stage for mixed precision", cfg.train.precision)
    _require(cfg.train.precision == "fp32" or par.wire == "fp32", "parallel.wire",
             "with train.precision the gradients are 16-bit already; parallel.wire is for float32 training",
             par.wire)
    _require(par.sync != "zero3" or not cfg.model.checkpoint_activations or _PLANNING.get(),
             "model.checkpoint_activations", "ZeRO-3 (parallel.sync = 'zero3') replays every layer in backward "
             "already; leave it false", cfg.model.checkpoint_activations)
    _require(par.progress in ("test", "thread", "none", "off"), "parallel.progress",
             "must be 'test', 'thread', 'none' or 'off'", par.progress)
    _require(par.thread_level in ("auto", "single", "funneled", "serialized", "multiple"), "parallel.thread_level",
             "must be 'auto', 'single', 'funneled', 'serialized' or 'multiple'", par.thread_level)
    _require(par.progress != "thread" or par.thread_level in ("auto", "serialized", "multiple"),
             "parallel.thread_level", "the communication thread (parallel.progress = 'thread') needs "
             "'serialized' or 'multiple'", par.thread_level)

    _require(par.schedule in SCHEDULES, "parallel.schedule", f"must be {either(SCHEDULES)}", par.schedule)
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
    _whole_replicas(par, f"pipeline stages (parallel.pp = {pp})")
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


def _whole_replicas(par, parts: str) -> None:
    """The one combination that does not exist: parameter servers with parts of the model."""
    if par.sync in WHOLE_REPLICA_SYNCS:
        raise ConfigError(f"parallel.sync: {par.sync!r} (parameter servers) serves whole replicas, not "
                          f"{parts}: no parameter-server system shards a model that way; use 'ddp' or a ZeRO stage")


def _check_tensor(cfg: Config, sizes: dict) -> None:
    """Tensor slicing: the GPT's, its heads over the ranks."""
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
    if cfg.model.n_kv_head % tp:
        raise ConfigError(f"parallel.tp: the {cfg.model.n_kv_head} key and value heads (model.n_kv_head) do not "
                          f"split over {tp} tensor-parallel ranks")
    _whole_replicas(par, f"tensor slices (parallel.tp = {tp})")
    if cfg.model.lora_rank:
        raise ConfigError(f"model.lora_rank: LoRA adapters on tensor slices (parallel.tp = {tp}) are not supported: "
                          "an adapter would be sliced with its layer; use parallel.dp or parallel.pp (train.trainable "
                          "freezes parameters on slices too)")
    if par.progress == "thread" and par.thread_level not in ("auto", "multiple"):
        raise ConfigError(f"parallel.thread_level: the slices' collectives and the communication thread call MPI "
                          f"at the same time (parallel.progress = 'thread'): 'multiple' is needed, got "
                          f"{par.thread_level!r}")
    if par.sequence_parallel and cfg.model.block_size % tp:
        raise ConfigError(f"parallel.sequence_parallel: model.block_size {cfg.model.block_size} does not split over "
                          f"{tp} tensor-parallel ranks")


def _check_batch(cfg: Config, dp: int, ranks: str, who: str) -> None:
    """The global batch splits over the ``dp`` replicas, each part into micro-batches."""
    B, m = cfg.train.global_batch_size, cfg.train.micro_batches
    if B % dp:
        where = f"the {who}" if cfg.parallel.dp == -1 else f"dp = {dp} {ranks}"
        raise ConfigError(f"train.global_batch_size: {B} is not divisible by {where}; the global batch stays the "
                          f"same at any rank count, each of the {ranks} takes B / {dp}")
    if (B // dp) % m:
        fits = [k for k in range(1, B // dp + 1) if (B // dp) % k == 0]
        raise ConfigError(f"train.micro_batches: the {B // dp} samples of each of the {dp} {ranks} "
                          f"(train.global_batch_size {B} / {dp}) do not split into {m} equal micro-batches; "
                          f"use {either(fits)}, or a train.global_batch_size that is a multiple of {dp * m}")


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


def trained_names(cfg: Config, names) -> list[str]:
    """The parameters of ``names`` (the model's, adapters included) that train, in their
    order: those ``train.trainable`` matches, all of them when it is empty; with LoRA
    adapters (``model.lora_rank``) the adapters and those ``train.trainable`` adds. A
    pattern that matches nothing is a ConfigError naming it and some names there are."""
    from mpitrain.nn.lora import is_adapter, matching  # here: nn brings NumPy's ops

    names = list(names)
    chosen, unmatched = matching(names, cfg.train.trainable)
    if unmatched:
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
        raise ConfigError(f"train.trainable: {unmatched[0]!r} matches no parameter; the model's are {shown}")
    lora = cfg.model.name == "gpt" and cfg.model.lora_rank > 0
    if not cfg.train.trainable and not lora:
        return names
    keep = set(chosen) | ({n for n in names if is_adapter(n)} if lora else set())
    return [n for n in names if n in keep]
