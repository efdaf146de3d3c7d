"""``mpitrain plan --search``: every layout of a config on ``P`` ranks that the trainer
accepts, planned, those that do not fit dropped, the rest ranked by predicted step time.

A layout is a set of ``--set`` overrides on the config (:func:`layouts`): the grid
``dp x pp x tp`` from the divisors of ``P``; the gradient sync (ddp, ZeRO-1/2/3, and a
parameter server where the grid is data-parallel only); a pipeline's schedule and
chunks; micro-batches; mixed precision; activation checkpointing; sequence parallelism;
the gradient bucket's size. Each is built by the config's own loader and checked by the
trainer's own checks (:meth:`mpitrain.plan.layout.Layout.of`), so what the search
proposes the trainer runs, and what it refuses is counted by the field its message names.
Then the planner (:func:`mpitrain.plan.make`) predicts each one's step and peak memory;
a layout whose largest rank exceeds the memory per rank is counted as "memory". The
order is the predicted step time, ties by the ``--set`` line: the same inputs give the
same table. ``--measure K`` (:mod:`mpitrain.plan.trial`) runs some of them.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from mpitrain.cli_common import DOES_NOT_FIT
from mpitrain.config import ConfigError
from mpitrain.plan.space import KNOBS

SYNCS = KNOBS["sync"]
SCHEDULES = KNOBS["schedule"]  # interleaved with KNOBS["chunks"][0] chunks
MICRO_BATCHES = KNOBS["micro_batches"]
BUCKETS_MB = KNOBS["bucket_mb"]  # ddp's and ZeRO-2's bucket: small ones start early, large ones pay fewer latencies


@dataclass(frozen=True)
class Found:
    """A layout the search planned: its overrides (in the order a command line gives them)
    and its plan."""

    sets: tuple
    plan: object  # mpitrain.plan.Plan

    @property
    def step(self) -> float:
        return self.plan.time["step"]

    @property
    def line(self) -> str:
        return " ".join(f"--set {s}" for s in self.sets)

    @property
    def peak(self) -> float:
        return self.plan.largest().peak

    def bottleneck(self) -> str:
        """The largest part of the predicted step: compute, exposed communication, bubble or I/O."""
        t = self.plan.time
        parts = {"compute": t["compute"], "communication": t["exposed"], "bubble": t["bubble"], "I/O": t["io_wait"]}
        return max(parts, key=parts.get)


def grids(P: int) -> list[tuple[int, int, int]]:
    """Every ``(dp, pp, tp)`` whose product is ``P``, data parallelism first."""
    divisors = [d for d in range(1, P + 1) if P % d == 0]
    return sorted(((P // (pp * tp), pp, tp) for pp in divisors for tp in divisors if P % (pp * tp) == 0),
                  key=lambda g: (-g[0], g[1], g[2]))


def overrides(dp: int, pp: int, tp: int, sync: str, schedule: str, micro_batches: int, bucket_mb: float = 0.0,
              precision: str = "fp32", recompute: bool = False, sequence: bool = False, chunks: int = 1) -> tuple:
    """A layout as the ``--set`` overrides that give it, in a command line's order (its
    arguments: :meth:`mpitrain.plan.space.Space.row`'s keys)."""
    pipe = () if pp == 1 else (f"parallel.schedule={schedule}",) + ((f"parallel.chunks={chunks}",) if chunks > 1
                                                                     else ())
    return ((f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.sync={sync}") + pipe
            + (f"train.micro_batches={micro_batches}",) + ((f"parallel.bucket_mb={bucket_mb:g}",) if bucket_mb else ())
            + ((f"train.precision={precision}",) if precision != "fp32" else ())
            + (("model.checkpoint_activations=true",) if recompute else ())
            + (("parallel.sequence_parallel=true",) if sequence else ()))


def layouts(cfg, P: int) -> list[tuple]:
    """The overrides of every layout to try on ``P`` ranks (some the trainer will refuse:
    the search counts those by reason). The config's own model and batch stay."""
    found = []
    gpt = cfg.model.name == "gpt"
    for dp, pp, tp in grids(P):
        syncs = SYNCS if dp > 1 else ("ddp",)
        pipes = [("-", 1)] if pp == 1 else [(s, KNOBS["chunks"][0] if s == "interleaved" else 1) for s in SCHEDULES]
        for sync, (schedule, chunks), m in itertools.product(syncs, pipes, MICRO_BATCHES):
            buckets = BUCKETS_MB if sync in ("ddp", "zero2") and dp > 1 else (0.0,)
            checkpoint = (False, True) if sync != "zero3" and gpt else (False,)
            sequence = (False, True) if tp > 1 else (False,)
            for bucket, precision, ckpt, seq in itertools.product(buckets, KNOBS["precision"], checkpoint, sequence):
                found.append(overrides(dp, pp, tp, sync, schedule, m, bucket, precision, ckpt, seq, chunks))
    if P > 1:  # a parameter server and P - 1 workers
        for m in MICRO_BATCHES:
            found.append(("parallel.dp=-1", "parallel.pp=1", "parallel.tp=1", "parallel.sync=ps",
                          "parallel.servers=1", f"train.micro_batches={m}"))
    return found


def reason(error: ConfigError) -> str:
    """What a refusal is counted as: the field its message begins with."""
    text = str(error)
    head = text.split(":", 1)[0]
    return head if head.count(".") == 1 and " " not in head else text


def search(config_of, P: int, machine, data=None, memory: float | None = None) -> tuple[list, list, Counter]:
    """(the layouts that fit, fastest first; those that do not, smallest peak first; Counter
    of every refused layout by reason). ``config_of`` maps overrides to a config
    (ConfigError if the loader refuses them); ``memory``: bytes per rank (default the
    machine's)."""
    from mpitrain import plan as planner
    from mpitrain.plan.data import resolve

    limit = memory or machine.memory
    fits, over, refused = [], [], Counter()
    base = config_of(())
    data = data or resolve(base)
    for sets in layouts(base, P):
        try:
            found = Found(sets, planner.make(config_of(sets), P, machine, data))
        except ConfigError as e:
            refused[reason(e)] += 1
            continue
        if found.peak > limit:
            refused["memory"] += 1
            over.append(found)
        else:
            fits.append(found)
    fits.sort(key=lambda f: (f.step, f.line))
    over.sort(key=lambda f: (f.peak, f.line))
    return fits, over, refused


def tiered(cfg, machine) -> bool:
    """Whether tier 1 ranks the layouts all at once (a GPT on a published device, whose
    plans are tier 1's: :attr:`mpitrain.plan.layout.Layout.textbook`), or each layout is
    planned in turn (this machine, where NumPy's details decide the ranking: tier 2; a
    CNN, whose layouts :mod:`mpitrain.plan.space` does not hold)."""
    return cfg.model.name == "gpt" and not machine.device.calibrated


@dataclass(frozen=True)
class Point:
    """A layout tier 1 answered, as the search's figure draws it."""

    peak: float
    step: float


def device_knobs(device) -> dict:
    """The search's knobs (:data:`KNOBS`) with the mixed precision ``device`` has: bf16, else
    fp16 (a V100's tensor cores), else float32 alone."""
    half = next((p for p in ("bf16", "fp16") if p in device.peak_flops), None)
    return {**KNOBS, "precision": ("fp32",) + ((half,) if half else ())}


def ranked(config_of, P: int, machine, data, limit: float, top: int = 10) -> tuple[list, tuple, Counter, str]:
    """Tier 1 over every layout at once (:mod:`mpitrain.plan.space`); then the fastest that
    fit, in order, through the trainer's checks and planned (:func:`mpitrain.plan.make`:
    tier 1's figures with the calls the trainer makes) until ``top`` pass: (those; every
    layout as a :class:`Point`, those that fit and those that do not; Counter of the
    layouts left out by reason, too large or refused by the trainer's checks; a line that
    says how many layouts tier 1 ranked and how fast)."""
    import time

    import numpy as np

    from mpitrain import plan as planner
    from mpitrain.plan import space

    tick = time.perf_counter()
    space.whole_training(config_of(()))
    model = space.Gpt.of(config_of(()), data)
    table = space.grids(model, P)
    knobs = device_knobs(machine.device)
    rows = space.build(model, table, knobs)
    out = space.evaluate(model, table, rows, machine, knobs)
    seconds = time.perf_counter() - tick
    fit = out["peak"] <= limit
    refused = Counter({"memory": int((~fit).sum())})
    fits, tick = [], time.perf_counter()
    for i in np.flatnonzero(fit)[np.argsort(out["step"][fit], kind="stable")]:
        sets = overrides(**rows.row(i, table, knobs))
        try:
            fits.append(Found(sets, planner.make(config_of(sets), P, machine, data)))
        except ConfigError as e:
            refused[reason(e)] += 1
            continue
        if len(fits) >= top:
            break
    fits.sort(key=lambda f: (f.step, f.line))
    line = (f"{len(rows):,} layouts ranked by tier 1 in {seconds:.2f} s ({len(rows) / seconds:,.0f} a second), "
            f"{int(fit.sum()):,} fit; the fastest through the trainer's checks until {len(fits):,} passed, in "
            f"{time.perf_counter() - tick:.1f} s")
    points = tuple([Point(float(x), float(t)) for x, t in zip(out["peak"][k], out["step"][k])] for k in (fit, ~fit))
    return fits, points, refused, line


def run(args) -> int:
    """The command: search, print the table; with ``--measure`` run some (:mod:`mpitrain.plan.trial`)."""
    import argparse
    import time

    from mpitrain.plan import machine_of, models
    from mpitrain.plan.hardware import emulated_link

    if args.cluster:
        if args.nodes or args.per_node or args.network:
            raise ConfigError("--cluster: gives the nodes, ranks per node and link itself; leave out --nodes, "
                              "--gpus-per-node and --network")
        nodes, per_node, rate = args.cluster
        if args.ranks and args.ranks != nodes * per_node:
            raise ConfigError(f"-n {args.ranks}: --cluster {nodes}x{per_node} has {nodes * per_node} ranks")
        from mpitrain.cluster import bits_per_second

        args = argparse.Namespace(**{**vars(args), "nodes": nodes, "per_node": per_node, "ranks": nodes * per_node,
                                     "network": emulated_link(bits_per_second(rate))})
    if args.measure and args.hardware != "this":
        raise ConfigError(f"--measure: runs here, on this machine; --hardware {args.hardware} is planned only")

    def config_of(sets):
        return models.config_of(argparse.Namespace(**{**vars(args), "set": [*args.set, *sets]}))[0]

    _, data, source = models.config_of(args)
    P, machine = machine_of(args)
    limit = args.memory_per_rank or machine.memory
    where = f"{args.cluster[0]} emulated nodes x {args.cluster[1]} at {args.cluster[2]}" if args.cluster else \
        f"{machine.device.name}"
    tick = time.perf_counter()
    if tiered(config_of(()), machine):
        fits, (fitting, over), refused, line = ranked(config_of, P, machine, data, limit, args.top)
        print(f"search: {source} on {P} rank(s), {where}: {line}")
    else:
        fits, over, refused = search(config_of, P, machine, data, limit)
        fitting = fits
        print(f"search: {source} on {P} rank(s), {where}: {len(fits) + sum(refused.values())} layouts planned in "
              f"{time.perf_counter() - tick:.1f} s")
    lines = table(fits, refused, limit, args.top, len(fitting))
    print("\n".join(lines), flush=True)
    if not fits:
        counts = ", ".join(map(str, MICRO_BATCHES))
        print(f"no layout fits (the search splits a replica's batch into {counts} micro-batches): raise "
              "--memory-per-rank, plan more ranks, or plan a layout with more micro-batches, whose activations are "
              "fewer (--set train.micro_batches=N without --search)")
        return DOES_NOT_FIT
    if args.html:
        from mpitrain.plan import page, show

        best = fits[0].plan
        text = "\n".join([*lines, "", "the fastest:", show.text(best, source)])
        figure = page.search_figure(fitting, over, limit, fits[:args.top])
        scatter = ("Every layout: step time against peak memory", figure)
        title = f"mpitrain plan --search: {source} on {P} rank(s)"
        print(f"wrote {page.write(args.html, best, text, title, [scatter])}")
    if args.measure:
        from mpitrain.plan import trial

        return trial.run(args, fits, over, limit)
    return 0


def table(fits: list, refused: Counter, limit: float, top: int = 10, fitting: int | None = None) -> list[str]:
    """The top ``top`` layouts, one line each, and the refusals by reason (``fitting``: how
    many fit, if more than ``fits``)."""
    from mpitrain.plan.show import size

    fit = len(fits) if fitting is None else fitting
    lines = [f"{fit:,} layout(s) fit in {size(limit)} per rank; refused {sum(refused.values()):,}: "
             + (", ".join(f"{why} {n:,}" for why, n in sorted(refused.items(), key=lambda kv: (-kv[1], kv[0])))
                or "none"),
             "rank | step ms | samples/s | bottleneck | peak (headroom) | layout | run it with"]
    for k, f in enumerate(fits[:top], 1):
        lines.append(f"{k} | {1e3 * f.step:.4g} | {f.plan.samples_per_s:,.0f} | {f.bottleneck()} | "
                     f"{size(f.peak)} ({100 * (1 - f.peak / limit):.0f}%) | {f.plan.layout.describe()} | {f.line}")
    return lines
