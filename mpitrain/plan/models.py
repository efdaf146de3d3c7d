"""Models as data: the reference models of ``models.toml`` as configs the planner can plan,
and the course notes' arithmetic (a ResNet training run, the storage-bandwidth calculator)
reproduced from its figures through :mod:`mpitrain.cost`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from pathlib import Path

from mpitrain import cost
from mpitrain.config import Config, ConfigError, from_dict, load
from mpitrain.config.checks import planning
from mpitrain.plan.data import DataShape

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

SHIPPED = Path(__file__).with_name("models.toml")
MiB, GiB = 2**20, 2**30


USER_ENV = "MPITRAIN_MODELS"
SHAPE = ("n_layer", "n_head", "n_embd", "block_size")  # every entry's
OPTIONAL = ("ffn_hidden", "gated_mlp", "n_kv_head", "tie_embeddings", "position_embedding", "bias")  # the config's
KNOWN = (*SHAPE, *OPTIONAL, "vocab", "global_batch_size", "tokens")


def user_path() -> Path:
    """A user's models: $MPITRAIN_MODELS, else ~/.config/mpitrain/models.toml."""
    return Path(os.environ.get(USER_ENV) or Path.home() / ".config" / "mpitrain" / "models.toml")


def catalogue() -> dict:
    """The shipped ``models.toml`` with a user's file (:func:`user_path`, where it exists)
    overlaid: its ``[gpt.NAME]`` entries add models or replace the shipped ones by name
    (``"from"``: each model's file)."""
    with open(SHIPPED, "rb") as f:
        shipped = tomllib.load(f)
    shipped["from"] = dict.fromkeys(shipped["gpt"], SHIPPED)
    user = user_path()
    if os.environ.get(USER_ENV) and not user.is_file():
        raise ConfigError(f"${USER_ENV}: {user}: no such models file")
    if user.is_file():
        try:
            theirs = tomllib.loads(user.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{user}: cannot read the models file ({e})") from None
        for table in theirs:
            if table != "gpt" or not isinstance(theirs[table], dict):
                raise ConfigError(f"{user}: {table}: " + ("unknown table" if table != "gpt" else "not a table") +
                                  " (a models file holds [gpt.NAME] tables)")
        for key, g in theirs.get("gpt", {}).items():
            unknown = sorted(set(g) - set(KNOWN)) if isinstance(g, dict) else ["(not a table)"]
            missing = sorted((set(SHAPE) | {"vocab", "global_batch_size", "tokens"}) - set(g)) if not unknown else []
            if unknown or missing:
                raise ConfigError(f"{user}: gpt.{key}: " + (f"unknown field(s) {', '.join(unknown)}" if unknown else
                                                             f"missing {', '.join(missing)}") + f" (known: "
                                  f"{', '.join(KNOWN)})")
            for field in ("vocab", "global_batch_size", "tokens"):  # the rest the config's own checks refuse
                if isinstance(g[field], bool) or not isinstance(g[field], (int, float)) or not 0 < g[field] < math.inf \
                        or (field != "tokens" and not isinstance(g[field], int)):
                    kind = "number" if field == "tokens" else "integer"
                    raise ConfigError(f"{user}: gpt.{key}.{field}: expected a positive {kind}, got {g[field]!r}")
        shipped["gpt"] = {**shipped["gpt"], **theirs.get("gpt", {})}
        shipped["from"].update(dict.fromkeys(theirs.get("gpt", {}), user))
    return shipped


def named(path: Path) -> str:
    """A models file as the messages name it: the shipped one by its place in the package."""
    return "mpitrain/plan/models.toml" if path == SHIPPED else str(path)


def reference(name: str, overrides=()) -> tuple[Config, DataShape]:
    """A reference GPT of ``models.toml`` (or a user's) as a config (trained for its paper's
    tokens, with its paper's batch) and its data's shape (tokens of 2 bytes); a ConfigError
    in the entry itself names its file and table."""
    models = catalogue()
    gpts = models["gpt"]
    if name not in gpts:
        files = " and ".join(dict.fromkeys(named(f) for f in models["from"].values()))
        raise ConfigError(f"--model: no reference model {name!r} in {files} (there are {', '.join(gpts)})")
    g = gpts[name]
    shape = {k: g[k] for k in (*SHAPE, *OPTIONAL) if k in g}
    raw = {"model": {"name": "gpt", **shape},
           "data": {"name": "shakespeare"}, "optim": {"name": "adamw"},
           "train": {"global_batch_size": g["global_batch_size"], "steps": 1}}
    try:
        from_dict(raw, [])
    except ConfigError as e:
        raise ConfigError(f"{named(models['from'][name])}: gpt.{name}: {e}") from None
    cfg = from_dict(raw, list(overrides))
    if not any(o.replace(" ", "").startswith("train.steps=") for o in overrides):
        B, T = cfg.train.global_batch_size, cfg.model.block_size  # the paper's tokens, at this batch
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=max(1, round(g["tokens"] / (B * T)))))
    data = DataShape(name, "text", (), g["vocab"], 2, 0, int(g["tokens"]), "models.toml")
    return cfg, data


def config_of(args) -> tuple[Config, DataShape | None, str]:
    """(config, data shape or None to read the config's, what it is called) from the
    command line's CONFIG or ``--model``."""
    if args.model and args.config:
        raise ConfigError(f"--model: plans a reference model instead of a config; give one of {args.config} and "
                          f"--model {args.model}")
    published = getattr(args, "hardware", "this") != "this"  # a GPU: what only mpitrain's trainer refuses is planned
    with planning() if published else contextlib.nullcontext():
        if args.model:
            cfg, data = reference(args.model, args.set)
            return cfg, data, f"{args.model} ({named(catalogue()['from'][args.model])})"
        if not args.config:
            raise ConfigError("plan: give a CONFIG file (e.g. jobs/shakespeare_gpt.toml) or --model NAME")
        return load(args.config, args.set, data_needed=False), None, args.config


# ------------------------------------------------------------------- the notes' arithmetic
def resnet_run(notes: dict) -> dict:
    """The notes' ResNet training run: FLOPs, PFLOP/s-days, FLOPs per byte read, and the
    machine time on their GPUs."""
    r = notes["resnet-run"]
    per_sample = cost.training_flops(r["multiply_adds"])
    total = per_sample * r["images"] * r["epochs"]
    seconds = cost.machine_seconds(total, r["gpus"], r["tflops"] * 1e12, r["utilization"])
    return {"flops": total, "pflops_days": cost.pflops_days(total), "flop_per_byte": per_sample / r["bytes_per_sample"],
            "seconds": seconds, "days": seconds / 86400}


def calculator(notes: dict, peaks: dict) -> dict:
    """{(model, accelerator): bytes/s} of the notes' calculator: bytes per sample over FLOPs
    per sample times the accelerator's FLOP/s (``peaks``: TFLOP/s by accelerator)."""
    out = {}
    for model, m in notes["calculator"].items():
        for acc, tflops in peaks.items():
            out[model, acc] = cost.accelerator_storage_bandwidth(m["mib"] * MiB, m["gi_flop"] * GiB, tflops * 1e12)
    return out


def notes_text(peaks: dict, h100=None) -> str:
    """What ``mpitrain plan --notes`` prints; with ``h100`` (the catalogue's device) the
    calculator's H100 figure set beside the dense BF16 peak and the sustained rate."""
    notes = catalogue()["notes"]
    r = resnet_run(notes)
    run = notes["resnet-run"]
    lines = [f"ResNet run: {run['multiply_adds']:.3g} multiply-adds x 2 x 3 x {run['images']:.3g} images x "
             f"{run['epochs']} epochs = {r['flops']:.3g} FLOPs = {r['pflops_days']:.3g} PFLOP/s-days; "
             f"{r['flop_per_byte'] / 1e3:,.0f} kFLOP per byte of a {run['bytes_per_sample']:,}-byte sample",
             f"  on {run['gpus']} GPUs of {run['tflops']} TFLOP/s at {100 * run['utilization']:.0f}%: "
             f"{r['days']:.3g} days",
             "storage bandwidth that keeps an accelerator busy (bytes/sample / FLOPs/sample x FLOP/s):",
             "model | " + " | ".join(f"{a} {t:g} TFLOP/s" for a, t in peaks.items())]
    table = calculator(notes, peaks)
    for model in notes["calculator"]:
        lines.append(f"{model} | " + " | ".join(f"{table[model, a] / 1e6:,.0f} MB/s" for a in peaks))
    for model, m in notes["calculator"].items():
        if "measured_tflops" in m:
            lo, hi = (cost.accelerator_storage_bandwidth(m["mib"] * MiB, m["gi_flop"] * GiB, t * 1e12)
                      for t in m["measured_tflops"])
            lines.append(f"{model} at the measured {m['measured_tflops'][0]}-{m['measured_tflops'][1]} TFLOP/s: "
                         f"{lo / 1e9:.2g}-{hi / 1e9:.2g} GB/s")
    if h100 is not None and "H100" in peaks:  # the calculator's H100 is FP8 with sparsity: 4x the dense bf16 peak
        rates = {"dense BF16 peak": h100.peak_flops["bf16"], "sustained BF16": h100.sustained.get("bf16", 0.0)}
        rates = {k: v for k, v in rates.items() if v}
        def needs(v: float) -> str:  # each model's bytes/s at v FLOP/s
            rate = lambda m: cost.accelerator_storage_bandwidth(m["mib"] * MiB, m["gi_flop"] * GiB, v)  # noqa: E731
            return ", ".join(f"{model} {rate(m) / 1e6:,.0f} MB/s" for model, m in notes["calculator"].items())

        lines.append(f"the calculator's H100 {peaks['H100']:g} TFLOP/s is FP8 with sparsity (the datasheet's); "
                     "a model trains in BF16, dense: "
                     + "; ".join(f"at its {k} {v / 1e12:g} TFLOP/s {needs(v)}" for k, v in rates.items()))
    return "\n".join(lines)


def zero_table(parameters: float, P: int, K: int = 12) -> dict:
    """ZeRO's table (Rajbhandari et al. 2020, figure 1): model state per device of a model of
    ``parameters`` on ``P`` devices with ``K`` bytes of optimizer state per parameter (mixed
    precision Adam: 12), for data parallelism and stages 1-3 (:func:`mpitrain.cost.bytes_per_parameter`
    with fp16 weights and gradients)."""
    return {sync: parameters * cost.bytes_per_parameter(sync, P, moments=(K - 4) // 4, mixed=True)
            for sync in ("ddp", "zero1", "zero2", "zero3")}

