"""Run configuration: frozen dataclasses loaded from TOML, with ``--set key=value`` overrides.

* :mod:`mpitrain.config.fields`: one dataclass per section of a config file, the ``#:``
  comment at each field saying what it means, and which choice reads which field;
* this module: reading a TOML file (:func:`load`), ``--set`` overrides, a checkpoint's
  saved config (:func:`from_saved`) and how it differs from another (:func:`changes`),
  and writing one back with where each value came from (:func:`annotated`);
* :mod:`mpitrain.config.checks`: every check, each with its message;
* :mod:`mpitrain.config.markdown`: ``jobs/CONFIG.md`` from the fields and their comments.

Everything is validated before any work starts; the first problem raises
:class:`ConfigError` naming the field (``optim.lr: must be > 0, got -1``), which the
command line prints as one line, exiting with status 2. Renamed fields (:data:`RENAMED`)
are still read, with a note (``Config.notes``) that the trainer prints.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import typing
from pathlib import Path

from mpitrain.config.checks import check_against_data, check_ranks, cut_refused, trained_names, validate
from mpitrain.config.fields import (CHOICES, EMBEDDED, GRID, MODEL_FIELDS, MODELS, OPTIM_FIELDS, PARALLEL_FIELDS,
                                    RENAMED, WHOLE_REPLICA_SYNCS, TEXT_ONLY_TRAIN_FIELDS,
                                    Config, ConfigError, DataConfig, ModelConfig, OptimConfig, ParallelConfig,
                                    RunConfig, TrainConfig, sections)
from mpitrain.config.markdown import reference

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = [
    "CHOICES", "EMBEDDED", "GRID", "MODEL_FIELDS", "MODELS", "OPTIM_FIELDS", "PARALLEL_FIELDS", "RENAMED",
    "WHOLE_REPLICA_SYNCS", "TEXT_ONLY_TRAIN_FIELDS", "Config", "ConfigError", "DataConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "RunConfig", "TrainConfig", "changes", "check_against_data", "check_ranks",
    "cut_refused", "annotated", "field_for_option", "from_dict", "from_saved", "load", "read", "reference", "sections",
    "toml_value", "trained_names", "validate"]


# the names other trainers give fields (nanoGPT's, PyTorch examples', torchrun scripts')
_OPTION_ALIASES = {"batch_size": "train.global_batch_size", "learning_rate": "optim.lr", "max_iters": "train.steps",
                   "iters": "train.steps", "warmup": "optim.warmup_steps", "warmup_iters": "optim.warmup_steps",
                   "wd": "optim.weight_decay", "optimizer": "optim.name", "model": "model.name",
                   "data": "data.path", "dataset": "data.path", "out_dir": "run.dir",
                   # the names PyTorch's examples, nanoGPT, Hugging Face, DeepSpeed and Megatron-LM give them
                   "max_steps": "train.steps", "num_train_epochs": "train.epochs", "total_steps": "train.steps",
                   "train_iters": "train.steps", "lr_warmup_steps": "optim.warmup_steps",
                   "warmup_steps": "optim.warmup_steps", "num_warmup_steps": "optim.warmup_steps",
                   "gradient_accumulation_steps": "train.micro_batches", "grad_accum": "train.micro_batches",
                   "train_batch_size": "train.global_batch_size", "global_batch_size": "train.global_batch_size",
                   "max_grad_norm": "optim.grad_clip", "clip_grad": "optim.grad_clip",
                   "gradient_clipping": "optim.grad_clip", "weight_decay": "optim.weight_decay",
                   "min_learning_rate": "optim.min_lr", "lr_decay": "optim.schedule",
                   "n_layers": "model.n_layer", "num_layers": "model.n_layer", "num_hidden_layers": "model.n_layer",
                   "n_heads": "model.n_head", "num_heads": "model.n_head", "num_attention_heads": "model.n_head",
                   "hidden_size": "model.n_embd", "d_model": "model.n_embd", "n_embed": "model.n_embd",
                   "seq_len": "model.block_size", "seq_length": "model.block_size",
                   "context_length": "model.block_size",
                   "max_position_embeddings": "model.block_size", "ffn_hidden_size": "model.ffn_hidden",
                   "intermediate_size": "model.ffn_hidden", "num_key_value_heads": "model.n_kv_head",
                   "vocab": "model.vocab_size", "eval_iters": "train.eval_batches",
                   "tensor_model_parallel_size": "parallel.tp", "pipeline_model_parallel_size": "parallel.pp",
                   "zero_stage": "parallel.sync", "micro_batches": "train.micro_batches"}


def field_for_option(option: str) -> str | None:
    """The config field (``section.field``) a command-line option such as ``--epochs``,
    ``--lr`` or ``--batch-size`` names, if one does (by its name in one section only,
    or as other trainers name it); None otherwise."""
    name = option.lstrip("-").replace("-", "_")
    if name in _OPTION_ALIASES:
        return _OPTION_ALIASES[name]
    tables = hints_of(Config)
    owners = [s.name for s in sections() if name in {f.name for f in dataclasses.fields(tables[s.name])}]
    return f"{owners[0]}.{name}" if len(owners) == 1 else None


def did_you_mean(section: str, name: str) -> str | None:
    """The field (``section.field``) an unknown ``section.name`` likely meant: as other
    trainers name it (``max_iters``: ``train.steps``), the same name in another section
    (``train.warmup_steps``: ``optim.warmup_steps``), or a near spelling in its own
    (``model.n_layers``: ``model.n_layer``); None if nothing is close."""
    tables = hints_of(Config)
    if name in _OPTION_ALIASES and _OPTION_ALIASES[name] != f"{section}.{name}":
        return _OPTION_ALIASES[name]
    owners = [s.name for s in sections() if s.name != section and name in hints_of(tables[s.name])]
    if owners:
        return f"{owners[0]}.{name}"
    own = list(hints_of(tables[section])) if section in tables else []
    close = difflib.get_close_matches(name, own, n=1, cutoff=0.75)
    return f"{section}.{close[0]}" if close else None


# ------------------------------------------------------------------- parsing
@functools.cache
def hints_of(cls) -> dict:
    """A config dataclass's fields' types (``typing.get_type_hints``, which evaluates every
    annotation anew on each call: a search of a thousand layouts read them millions of times)."""
    return typing.get_type_hints(cls)


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
    value = _value(text)
    return key.strip(), copy.deepcopy(value) if isinstance(value, (list, dict)) else value  # the cache's own stays


@functools.lru_cache(maxsize=4096)  # a search reads the same few thousand overrides for every layout
def _value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: take it as a string (--set data.path=input.txt)


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
    hints = hints_of(Config)
    tables, given = {}, set()
    known = {s.name for s in sections()}
    for section in raw:
        if section not in known:
            raise ConfigError(f"{section}: unknown section (expected one of {sorted(known)})")
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{section}: expected a table")
    for s in sections():
        cls = hints[s.name]
        field_hints = hints_of(cls)
        values = {}
        for name, value in raw.get(s.name, {}).items():
            key = f"{s.name}.{name}"
            if name not in field_hints:
                guess = did_you_mean(s.name, name)
                raise ConfigError(f"{key}: unknown field{f': did you mean {guess}?' if guess else ''} (the fields "
                                  f"of [{s.name}]: {', '.join(sorted(field_hints))})")
            values[name] = _coerce(key, value, field_hints[name])
            given.add(key)
        tables[s.name] = cls(**values)
    cfg = Config(**tables, given=frozenset(given), notes=tuple(notes))
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
    notes = _drop_unused_layout(raw, given)
    try:
        cfg = from_dict(raw, overrides, data_needed)
    except ConfigError as e:
        if str(e).split(":", 1)[0] in given:  # the user's --set, not the saved config
            raise
        raise ConfigError(f"{where}: {e}") from None
    return dataclasses.replace(cfg, notes=cfg.notes + tuple(notes)) if notes else cfg


LAYOUT_ONLY = {"pp": ("schedule", "chunks"), "tp": ("sequence_parallel",)}  # an axis -> the fields of runs cut on it


def _drop_unused_layout(raw: dict, given: dict) -> list[str]:
    """A resumed run may change its layout: the saved fields that only a pipeline (or
    tensor slicing) reads are dropped, with a note each, when the overrides make that axis
    1 (a ZB-H1 run moved to ``pp = 1``); never one the overrides give."""
    par, notes = raw.get("parallel", {}), []
    for axis, names in LAYOUT_ONLY.items():
        size = given.get(f"parallel.{axis}", par.get(axis, 1))
        for name in names:
            if size == 1 and name in par and f"parallel.{name}" not in given:
                notes.append(f"note: parallel.{name} = {par.pop(name)!r} of the saved config is dropped: it applies "
                             f"to runs with parallel.{axis} > 1, and this one has {axis} = 1")
    return notes


def toml_value(v) -> str:
    """A value as TOML writes it: a number exact (``repr`` round-trips a float), a string
    as JSON writes it (a TOML basic string too), an array; an array of arrays one row a
    line. ValueError for what TOML cannot hold (None, a number that is not finite)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)) and math.isfinite(v):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"cannot write {v!r} as TOML")
    if any(isinstance(x, (list, tuple)) for x in v):
        return "[\n" + "".join(f"    {toml_value(x)},\n" for x in v) + "]"
    return "[" + ", ".join(map(toml_value, v)) + "]"


def annotated(cfg: Config, origins: dict[str, str], header: str = "") -> str:
    """``cfg`` as a TOML file, every field of every section, each value followed by a
    comment saying where it came from (``origins``: ``section.field`` -> words; a field
    not there is at its default), and for a field the section's choice does not read (a
    CNN's ``model.channels`` in a GPT's config) that it is not read. A value at its
    default is itself a comment, as in a config file that leaves it out: the file loads
    as a config again, to the same values, given as they were. ``header``: comment lines
    above."""
    lines = [f"# {line}" for line in header.splitlines()]
    for section, table in cfg.to_dict().items():
        choice, readers = CHOICES.get(section, (None, {}))
        chosen = table.get(choice)
        values = []
        for name, value in table.items():
            origin = origins.get(f"{section}.{name}", "default")
            if chosen in readers and name != choice and name not in readers[chosen]:
                origin += f"; not read when {section}.{choice} = {toml_value(chosen)}"
            values.append((f"{'# ' * origin.startswith('default')}{name} = {toml_value(value)}", origin))
        width = max((len(text) for text, _ in values if len(text) <= 40), default=0)  # a long list: not every comment
        lines += ["", f"[{section}]", *(f"{text:<{width}}  # {origin}" for text, origin in values)]
    return "\n".join(lines).lstrip("\n") + "\n"


def _as_tuple(value):
    return tuple(value) if isinstance(value, list) else value


def changes(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """``(section.field, saved value, value now)`` for each field of a config (as
    ``Config.to_dict``) that differs from the saved one; the run directory is where the
    run is now, not a change, nor a field newer than the saved config at its default (the
    saved run ran as that default does)."""
    same = _as_tuple  # JSON and TOML give lists
    defaults = Config().to_dict()
    found = []
    for section in sorted(set(saved) | set(now)):
        before, after, default = saved.get(section, {}), now.get(section, {}), defaults.get(section, {})
        for key in sorted(set(before) | set(after)):
            old, new = same(before.get(key)), same(after.get(key))
            newer = key not in before and key in default and new == same(default[key])
            if (section, key) != ("run", "dir") and old != new and not newer:
                found.append((f"{section}.{key}", old, new))
    return found
