"""``mpitrain plan RUN_OR_CONFIG --inference --validate``: the inference plan held against the
request drawn for real on this machine (``mpitrain sample``'s code,
:func:`mpitrain.train.trained.serve`): predicted | measured | error for the cache's bytes
(exact), the peak memory per rank and the time to first token and per output token (each
within its :data:`TOLERANCE`). A shared machine's speed drifts by more than that over
seconds: the request is drawn :data:`REQUESTS` times, each planned again just before it
(the profile afresh), and the error is the median of the pairs' (the paired timer's way).
A run directory's weights, or a config's as its seed draws them (the times are the
shapes'). Under ``mpiexec -n T`` with ``--tp T``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mpitrain.config import ConfigError

REQUESTS = 9  # the request drawn this many times, each planned again just before
TOLERANCE = {"KV cache bytes": 0.0, "peak memory per rank": 0.05, "time to first token": 0.20,
             "time per output token": 0.20}


def measured(args, r, plan) -> list:
    """[(the plan, the request's figures)], ``REQUESTS`` pairs (rank 0's; others: []): the
    request drawn for real (once to warm up, the first calls' imports and caches), each time
    just after ``plan()`` planned it again, so that both see the machine as it is then."""
    from mpitrain.comm import world
    from mpitrain.train import trained

    comm = world()
    if comm.size != r.tp:
        raise ConfigError(f"--validate: draws on the job's {comm.size} rank(s), but --tp is {r.tp}: launch it with "
                          f"mpiexec -n {r.tp}")
    quiet = lambda *a: None  # noqa: E731
    extra = [f"train.global_batch_size={comm.size}"]
    if Path(args.config).is_dir() or Path(args.config).suffix == ".h5":
        run, _, _ = trained.load(args.config, comm, quiet, args.set + extra)
    else:
        run = trained.built(args.config, comm, quiet, args.set + extra)
    pairs = []
    try:
        prompts = [trained.opening(run, r.prompt)] * r.batch
        trained.serve(run, comm, prompts, 2, tp=r.tp, measure_peak=False)  # warm (and slice the model, once)
        for k in range(REQUESTS):
            planned = plan()
            pairs.append((planned, trained.serve(run, comm, prompts, r.tokens, tp=r.tp, measure_peak=not k)[1]))
    finally:
        run.close()
    return pairs if comm.rank == 0 else []


def error(predicted: float, measured: float) -> float:
    return predicted / measured - 1 if measured else (0.0 if predicted == measured else float("inf"))


def check(args) -> None:
    """What ``--validate`` cannot draw, refused before anything is planned."""
    if not args.config or args.model:
        raise ConfigError("--inference --validate: draws from a run directory or a config's model (not --model: a "
                          "reference model is planned only)")
    if args.hardware != "this":
        raise ConfigError("--inference --validate: measures on this machine; leave out --hardware")


def run(args, cfg, shape, r, plan) -> int:
    """Print the rows; exit 1 if one is off by more than its bound. ``plan()``: the request's
    plan (:func:`mpitrain.plan.inference.answer`), profiled afresh."""
    pairs = measured(args, r, plan)
    if not pairs:
        return 0
    a, got = pairs[0]
    timed = {"time to first token": [(p["ttft"], m["ttft_s"]) for p, m in pairs],
             "time per output token": [(p["tpot"], m["tpot_s"]["mean"]) for p, m in pairs]}
    rows = [("KV cache bytes", a["memory"]["kv_cache"], got["kv_cache_bytes"], None),
            ("peak memory per rank", a["peak"], got["peak_bytes"], None)]
    rows += [(what, float(np.median([p for p, _ in v])), float(np.median([m for _, m in v])),
              float(np.median([error(p, m) for p, m in v]))) for what, v in timed.items()]
    lines = [f"validate: inference of {args.config}, {r.batch} sequence(s), prompts of {r.prompt} token(s), "
             f"{r.tokens} new each, tp {r.tp}; times: the medians of {REQUESTS} requests, each planned just before "
             "(the error: the median of the pairs')", "quantity | predicted | measured | error | holds (bound)"]
    ok = True
    for what, p, m, e in rows:
        e = error(p, m) if e is None else e
        holds = abs(e) <= TOLERANCE[what] + 1e-12
        ok &= holds
        fmt = (lambda v: f"{v:,.0f} B") if "bytes" in what or "memory" in what else (lambda v: f"{v * 1e3:.4g} ms")
        lines.append(f"{what} | {fmt(p)} | {fmt(m)} | {e:+.1%} | {'yes' if holds else 'no'} "
                     f"({'exact' if not TOLERANCE[what] else f'{TOLERANCE[what]:.0%}'})")
    print("\n".join(lines))
    return 0 if ok else 1
