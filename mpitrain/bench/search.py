"""``mpitrain bench search``: how fast the planner ranks a cluster's layouts: tier 1 over
every layout at once (:mod:`mpitrain.plan.space`) against planning them one by one
(:func:`mpitrain.plan.make`: the trainer's checks, the calls of every rank; what the
search did for each layout before), in layouts a second on one core.

For each case, the best of ``repeats`` runs of tier 1 over the whole space (its table of
grids, the rows, their answers), and ``make`` on ``sample`` layouts of the same space drawn
at random, the same each run (those the trainer's checks refuse are skipped, untimed).
The cases: GPT-3 175B on 1,024 A100s with the search's knobs (``mpitrain plan --search``
ranks this one), the same with every micro-batch count and more bucket sizes, chunks and
precisions (:data:`~mpitrain.plan.space.WIDE`), and a 13B GPT (GPT-3's 13B shape, width
5,120) on 64 A100s with the wide knobs, the case Calculon's paper counts 1.2 million
layouts of (with knobs mpitrain does not have: offloading, overlap modes, selective
recomputation).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

CASES = (("gpt3-175b on 1024 A100", "gpt3-175b", 128, 8, False),
         ("gpt3-175b on 1024 A100, wide", "gpt3-175b", 128, 8, True),
         ("gpt-13b on 64 A100, wide", "gpt-13b", 8, 8, True))


def run(repeats: int = 3, sample: int = 5, log=print) -> list[dict]:
    from mpitrain.config import ConfigError
    from mpitrain.plan import machine_of, make, models, search, space
    from mpitrain.plan.data import resolve

    log("case | layouts | tier 1 s | tier 1 layouts/s | one by one: s per layout | ratio per layout")
    rows = []
    for name, model_key, nodes, per_node, wide in CASES:
        args = argparse.Namespace(config=None, model=model_key, set=[], hardware="a100-80g", nodes=nodes,
                                  per_node=per_node, ranks=None, network="ib-hdr", intra=None,
                                  memory_per_rank=None, catalogue=None)
        cfg, data, _ = models.config_of(args)
        P, machine = machine_of(args)
        knobs = space.WIDE if wide else space.KNOBS
        model = space.Gpt.of(cfg, resolve(cfg))
        best = float("inf")
        for _ in range(repeats):
            space._stages.cache_clear()  # each run cuts the model again
            tick = time.perf_counter()
            table = space.grids(model, P, knobs["chunks"])
            layouts = space.build(model, table, knobs)
            space.evaluate(model, table, layouts, machine, knobs)
            best = min(best, time.perf_counter() - tick)
        timed, seconds = 0, 0.0
        for i in np.random.default_rng(0).permutation(len(layouts)):  # the same sample each run
            sets = search.overrides(**layouts.row(i, table, knobs))
            try:
                one = models.config_of(argparse.Namespace(**{**vars(args), "set": list(sets)}))[0]
                tick = time.perf_counter()
                make(one, P, machine, data)
            except ConfigError:
                continue
            seconds += time.perf_counter() - tick
            timed += 1
            if timed == sample:
                break
        per = seconds / max(1, timed)
        row = {"case": name, "layouts": len(layouts), "tier1_s": best, "tier1_per_s": len(layouts) / best,
               "tier2_s": per, "ratio": per / (best / len(layouts))}
        log(f"{name} | {len(layouts):,} | {best:.2f} | {row['tier1_per_s']:,.0f} | {per:.3g} | {row['ratio']:,.0f}")
        rows.append(row)
    return rows
