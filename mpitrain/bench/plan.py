"""``mpitrain bench plan``: the planner against the run, layout by layout.

For each layout of :data:`LAYOUTS` it runs ``mpitrain plan CONFIG --validate`` (the run
traced once for the counted quantities and the heap, timed once in windows of 5 steps,
:mod:`mpitrain.plan.validate`) on shared memory, and with ``--network RATE ...`` across
2 emulated nodes of :mod:`mpitrain.cluster` linked at each rate (the planner told the
link: ``emu-1g``, ``emu-10g``), then prints one row per layout and link: the step time
by tier 1 (the textbook, at this machine's GEMM rate), predicted by tier 2 and measured,
tier 2's error, whether every counted quantity was exact, and
the largest heap errors. Run it without ``mpiexec``: it starts its own ranks.

First it calibrates this machine and each link (:func:`mpitrain.plan.calibrate.calibrate`)
into a file of its own that every validation reads: a machine's speed drifts between
hours, so predictions are checked against the machine as it is in the same sitting
(``--catalogue`` uses a calibration already made).
The figures: ``mpitrain/bench/README.md``, "The planner against the run".
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from mpitrain.cluster import Cluster, bits_per_second, describe, mpiexec
from mpitrain.plan.hardware import emulated_link
from mpitrain.plan.validate import launched

# name -> (ranks, --set overrides); the layouts of the table that two cores can time
LAYOUTS = {
    "one process": (1, []),
    "ddp": (2, []),
    "zero1": (2, ["parallel.sync=zero1"]),
    "zero2, 2 micro-batches": (2, ["parallel.sync=zero2", "train.micro_batches=2"]),
    "zero3": (2, ["parallel.sync=zero3"]),
    "pp 2, gpipe, m 4": (2, ["parallel.pp=2", "parallel.schedule=gpipe", "train.micro_batches=4"]),
    "pp 2, 1f1b, m 4": (2, ["parallel.pp=2", "train.micro_batches=4"]),
    "pp 2, zb-h1, m 4": (2, ["parallel.pp=2", "parallel.schedule=zb-h1", "train.micro_batches=4"]),
    "pp 2, interleaved x 2": (2, ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.chunks=2",
                                  "train.micro_batches=4"]),
    "tp 2": (2, ["parallel.tp=2"]),
    "tp 2, sequence parallel": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "bf16": (2, ["train.precision=bf16"]),
    "activation checkpointing": (2, ["model.checkpoint_activations=true"]),
}


def one(config: str, name: str, steps: int, launch, link_args: list[str], out: Path) -> dict | None:
    """One layout's validation through ``launch`` (a command list -> exit status)."""
    ranks, sets = LAYOUTS[name]
    return launched([config], sets, link_args, steps, ranks, out, launch)


def row(name: str, link: str, found: dict | None) -> str:
    if found is None:
        return f"{name:26} | {link:13} | the run failed (its output is above)"
    predicted, measured = found["step"]
    tier1 = next((v for rank, what, v in found.get("estimates", []) if what == "step time (s)"), None)
    exact = all(r[2] == r[3] for r in found["rows"] if r[4] == 0)
    rest = max((abs(r[5]) for r in found["rows"] if r[1] == "heap at rest less the reader"), default=float("nan"))
    peak = [r for r in found["rows"] if r[1] == "heap peak above rest"]
    bounds = [r for r in found["rows"] if r[1].startswith("heap peak above rest, at ")]  # timing decides
    shown = (f"{100 * max(abs(r[5]) for r in peak):5.1f}%" if peak else
             "within its bounds" if all(r[6] for r in bounds) else "outside its bounds")
    textbook = "      -" if tier1 is None else f"{1e3 * tier1:7.1f}"
    return (f"{name:26} | {link:13} | {textbook} | {1e3 * predicted:7.1f} | {1e3 * measured:7.1f} | "
            f"{100 * (measured - predicted) / measured:+6.1f}% | {'yes' if exact else 'NO':>5} | "
            f"{100 * rest:5.1f}% | {shown}")


def run(config: str, steps: int, rates: list[str], names: list[str], catalogue: str | None = None,
        log=print) -> int:
    """The table of ``names`` on shared memory and at each of ``rates``; 0 if every run
    succeeded. ``catalogue``: a calibration to use (default: measure one first)."""
    with tempfile.TemporaryDirectory(prefix="mpitrain-bench-plan-") as tmp:
        if catalogue is None:
            from mpitrain.plan.calibrate import calibrate

            catalogue = str(Path(tmp) / "hardware.toml")
            log("calibrating this machine and its links first (mpitrain plan --calibrate) ...")
            calibrate(links=("shm",), rates_gbit=[bits_per_second(r) / 1e9 for r in rates], out=catalogue,
                      log=lambda line: None)
        return _table(config, steps, rates, names, ["--catalogue", catalogue], Path(tmp), log)


def _table(config: str, steps: int, rates: list[str], names: list[str], common: list[str], tmp: Path,
           log) -> int:
    log("layout                     | link          | tier 1 ms | predicted ms | measured ms | error | exact | "
        "heap at rest | heap peak   (predicted: tier 2's; error of the step time: (measured - predicted) / measured; "
        "heap: the largest rank's)")
    rows = []

    def shared(argv, ranks):
        return subprocess.run([mpiexec(), "-n", str(ranks), *argv], check=False).returncode

    for k, name in enumerate(names):
        rows.append(row(name, "shared memory", one(config, name, steps, shared, common, tmp / f"s{k}.json")))
    for rate in rates:
        with Cluster(nodes=2, ranks=1, rate=rate) as cluster:
            log(describe(cluster))
            for k, name in enumerate(n for n in names if LAYOUTS[n][0] == 2):
                args = [*common, "--nodes", "2", "--gpus-per-node", "1", "--network", emulated_link(bits_per_second(rate))]
                found = one(config, name, steps, lambda argv, ranks: cluster.run(argv), args, tmp / f"{rate}-{k}.json")
                rows.append(row(name, f"2 nodes, {rate}", found))
    log("\n".join(rows))
    return 0 if all("failed" not in r for r in rows) else 1
