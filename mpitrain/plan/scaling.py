"""The planner's figure for each run of a scaling study, drawn beside the measurement in
``mpitrain report``'s ``scaling.png``: the run's own config (its metrics' start record)
on its ranks, on the machine it ran on, one node or the emulated nodes and links of
``mpitrain cluster``."""

from __future__ import annotations

from dataclasses import replace


def predicted(config: dict, ranks: int, cluster: dict | None, catalogue=None) -> float:
    """Samples/s the planner predicts for a run of ``config`` on ``ranks`` ranks; ``cluster``:
    the emulated cluster it ran on (``nodes``, ``ranks_per_node``, ``rate``), or None for
    this machine alone. On emulated nodes every rank counts a core of its own, as the
    report's figure has it (a time-dilated run's throughput multiplied back). ValueError
    (ConfigError, HardwareError) if the planner cannot plan it."""
    from mpitrain import plan as planner
    from mpitrain.cluster import bits_per_second
    from mpitrain.config import from_saved
    from mpitrain.plan import hardware

    cfg = from_saved(config, where="the run's config")
    catalogue = catalogue or hardware.load()
    if cluster:
        per_node = int(cluster["ranks_per_node"])
        network = hardware.emulated_link(bits_per_second(cluster["rate"])) if cluster["nodes"] > 1 else ""
        machine = replace(planner.machine(catalogue, "this", ranks, per_node, network), cores=per_node)
    else:
        machine = planner.machine(catalogue, "this", ranks)
    return planner.make(cfg, ranks, machine).samples_per_s
