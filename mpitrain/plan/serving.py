"""``mpitrain plan RUN_OR_CONFIG --inference``: the inference plan (:mod:`mpitrain.plan.inference`)
of a trained run, a config or a reference model, printed; ``--validate`` draws the same
request with ``mpitrain sample``'s code (:func:`mpitrain.train.trained.serve`) on this
machine and prints predicted | measured | error for the cache's bytes, the peak memory,
the time to first token and the time per output token."""

from __future__ import annotations

from pathlib import Path

from mpitrain.config import ConfigError
from mpitrain.plan import inference


def config_of(args):
    """(config, data shape or None, what it is called) of RUN_OR_CONFIG or ``--model``: a
    trained run's saved config as ``mpitrain sample`` reads it (a run directory's newest
    checkpoint that verifies, or a checkpoint file: :func:`mpitrain.train.trained.saved_config`)."""
    from mpitrain.plan import models

    if args.config and (Path(args.config).is_dir() or Path(args.config).suffix == ".h5"):
        from mpitrain.cli_common import _note
        from mpitrain.train.trained import saved_config

        cfg, path, _ = saved_config(args.config, args.set, warn=_note)
        return cfg, None, f"{args.config} ({path.name})"
    return models.config_of(args)


def request_of(args) -> inference.Request:
    if args.ranks and args.ranks != args.tp:
        raise ConfigError(f"-n {args.ranks}: an inference plan is of --tp {args.tp} ranks holding one model "
                          "(data-parallel copies each serve their own requests)")
    return inference.Request(args.batch, args.prompt_tokens, args.tokens, args.tp)


def shape_and_machine(args):
    """(the model's :class:`~mpitrain.plan.inference.Shape`, the machine of ``--tp`` ranks,
    the precision its products run in, the BLAS threads, what it is called)."""
    from mpitrain import plan as planner
    from mpitrain.plan.data import resolve
    from mpitrain.plan.space import Gpt

    cfg, data, source = config_of(args)
    if cfg.model.name != "gpt":
        raise ConfigError(f"--inference: plans drawing tokens from a GPT; {source} is a {cfg.model.name}")
    data = data or resolve(cfg)
    _, machine = planner.machine_of(args, args.tp, "--tp")
    gpu = bool(machine.device.sms)
    precision = cfg.train.precision if gpu else "fp32"
    itemsize = (2 if precision in ("bf16", "fp16") else 4) if gpu else 8 if cfg.train.dtype == "float64" else 4
    if cfg.model.n_head % args.tp:
        raise ConfigError(f"--tp {args.tp}: the model's {cfg.model.n_head} heads do not split over it")
    if (cfg.model.n_kv_head or cfg.model.n_head) % args.tp:
        raise ConfigError(f"--tp {args.tp}: the model's {cfg.model.n_kv_head} key and value heads (model.n_kv_head) "
                          "do not split over it")
    shape = inference.Shape.of(Gpt.of(cfg, data), itemsize)
    return shape, machine, precision, machine.threads(cfg.train.threads), source, cfg


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def text(shape, machine, r: inference.Request, a: dict, source: str, precision: str, most: int,
         served=None, targets=(None, None), note: str = "") -> str:
    m = a["memory"]
    lines = [f"inference plan: {source}, {r.batch} sequence(s), prompts of {r.prompt} token(s), {r.tokens} new "
             f"token(s) each (a context of {a['context']} of {shape.T}); tp {r.tp} on {machine.device.name}, "
             f"{precision}"]
    parts = ", ".join(f"{k.replace('_', ' ')} {_bytes(v)}" for k, v in m.items())
    lines.append(f"memory per rank: {parts}; peak {_bytes(a['peak'])} of {_bytes(machine.memory)} "
                 f"({'fits' if a['fits'] else 'does not fit'}); the KV cache is 2 x {shape.L} layers x {r.batch} x "
                 f"{a['context']} positions x {shape.kv_width // r.tp} x {shape.itemsize} B")
    gpu = bool(machine.device.sms)
    how = "profiled at these shapes" if not gpu else "bound by its products"
    lines.append(f"prefill: {a['prefill_flops']:.4g} FLOPs per rank in {_s(a['ttft'])} ({how})")
    if gpu:
        how = ("bound by the bytes it reads" if a["decode_bytes"] / machine.device.stream_bandwidth > a["decode"] / 2
               else "bound by its kernels' launches and arithmetic")
    lines.append(f"decode step: {a['decode_flops']:.4g} FLOPs per rank, reading {_bytes(a['decode_bytes'])} "
                 f"(weights {_bytes(a['weights_read'])}, the cache at the mean context), in {_s(a['decode'])} ({how})")
    slid = (f"; {a['sliding']:,} step(s) past the model's context of {shape.T}, each a prefill of its window"
            if a["sliding"] else "")
    lines.append(f"time to first token: {_s(a['ttft'])}; time per output token: {_s(a['tpot'])} on average, "
                 f"{_s(a['tpot_last'])} the last{slid}")
    lines.append(f"tokens/s: {a['tokens_per_s']:.4g} in all, {a['tokens_per_s_per_sequence']:.4g} per sequence "
                 f"(the request in {_s(a['seconds'])})")
    lines.append(f"largest batch that fits: {most:,} sequence(s) of this prompt and these tokens" if most else
                 "largest batch that fits: none (one sequence does not fit)")
    if served is not None:
        count, best = served
        wanted = " and ".join(f"{k} <= {_s(v)}" for k, v in zip(("time to first token", "time per output token"),
                                                                 targets) if v is not None)
        lines.append(f"serving: {count:,} request(s) at once meet {wanted}" +
                     (f" (time to first token {_s(best['ttft'])}, per output token {_s(best['tpot'])}, "
                      f"{best['tokens_per_s']:.4g} tokens/s in all)" if best else ": none does"))
    if note:
        lines.append(note)
    return "\n".join(lines)


def run(args) -> int:
    if args.search or args.largest or args.mfu:
        raise ConfigError("--inference: plans one request; leave out --search, --largest and --mfu")
    if args.validate:
        from mpitrain.plan import serving_check

        serving_check.check(args)
    r = request_of(args)
    shape, machine, precision, threads, source, cfg = shape_and_machine(args)
    import time

    began = time.perf_counter()
    a = inference.answer(machine, shape, r, precision, threads)
    most = inference.largest_batch(machine, shape, r, precision)
    targets = (args.ttft_target, args.tpot_target)
    served = inference.concurrent(machine, shape, r, *targets, precision, threads) if any(targets) else None
    note = "" if machine.device.sms else (
        f"this machine: a block profiled at these shapes and composed (mpitrain/plan/inference.py), in "
        f"{time.perf_counter() - began:.2g} s with {threads} BLAS thread(s)")
    if args.validate:
        from mpitrain.plan import serving_check

        def again():
            inference.profile.cache_clear()
            return inference.answer(machine, shape, r, precision, threads)
        return serving_check.run(args, cfg, shape, r, again)
    print(text(shape, machine, r, a, source, precision, most, served, targets, note))
    return 0
