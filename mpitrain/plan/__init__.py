"""``mpitrain plan``: what a run needs, predicted before it starts, for this machine or a
GPU cluster, and checked against the run.

From a config and a rank count the planner derives, without allocating one array of the
model (shapes only: :mod:`~mpitrain.plan.shapes`), per rank: the model state by category,
the activations at the schedule's peak, the bytes sent per step on each communicator call
by call, the FLOPs, the pipeline bubble; then, on a :class:`~mpitrain.plan.timing.Machine`
(:mod:`~mpitrain.plan.hardware`'s catalogue), the step time and its parts, samples/s, the
storage bandwidth that rate needs, and whether the peak memory fits. Every formula is
:mod:`mpitrain.cost`'s. ``--validate`` (:mod:`~mpitrain.plan.validate`) runs the config
and prints predicted | measured | error for each quantity. How to use it:
``mpitrain/plan/README.md``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from mpitrain.plan import space
from mpitrain.plan.data import resolve
from mpitrain.plan.layout import Layout
from mpitrain.plan.predict import rank_plans
from mpitrain.plan.timing import Machine, step_parts
from mpitrain.runtime import available_cores


@dataclass
class Plan:
    layout: Layout
    ranks: list  # :class:`~mpitrain.plan.predict.RankPlan`, ranks alike grouped
    machine: Machine
    time: dict  # :func:`~mpitrain.plan.timing.step_parts`
    own: dict | None = None  # the planner's own time where ``--mfu`` set the step's (:func:`at_mfu`)

    @property
    def samples_per_s(self) -> float:
        return self.layout.cfg.train.global_batch_size / self.time["step"]

    @property
    def model_flops(self) -> float:
        """FLOPs of a step over all ranks (forward and backward, no recomputation)."""
        return sum((p.flops["forward"] + p.flops["backward"]) * len(p.ranks) for p in self.ranks)

    @property
    def executed_flops(self) -> float:
        return self.model_flops + sum(p.flops["recompute"] * len(p.ranks) for p in self.ranks)

    @property
    def bytes_per_sample(self) -> int:
        lay = self.layout
        return lay.data.bytes_per_sample(lay.T, lay.cfg.data.sampling == "random")

    def largest(self):
        return max(self.ranks, key=lambda p: p.peak)


def machine(catalogue, hardware: str = "this", ranks: int = 1, per_node: int | None = None, network: str = "",
            intra: str = "", memory: float = 0.0) -> Machine:
    """The machine ``ranks`` ranks run on: ``per_node`` of them per node of ``hardware``,
    the nodes joined by ``network``. This machine ("this"): its memory shared by its ranks."""
    from mpitrain.plan.hardware import HardwareError

    device = catalogue.device(hardware)
    per_node = per_node or ranks
    nodes = -(-ranks // per_node)
    if nodes > 1 and not network:  # joining nodes by the node's own link would flatter every plan
        raise HardwareError(f"{ranks} ranks at {per_node} a node are {nodes} nodes: --network names the link between "
                            "them (e.g. ib-hdr, ib-ndr, eth-100g; emu-1g, emu-10g for mpitrain cluster's nodes)")
    outer = catalogue.link(network) if network else None
    inner = catalogue.link(intra) if intra else inside(catalogue, device, per_node, outer)
    outer = outer or inner
    if not memory:
        memory = (host_memory() or device.memory_bytes) / per_node if device.calibrated else device.memory_bytes
    # this machine's cores, ranks beyond them sharing them; nodes of this machine are emulated
    # (mpitrain cluster), each pinned to its share of the cores
    cores = max(1, available_cores() // nodes) if device.calibrated else 0
    return Machine(device, inner, outer, per_node, memory, cores=cores, switch=device.switch)


def inside(catalogue, device, per_node: int, outer=None):
    """The link joining a node's ``per_node`` ranks of ``device``: its catalogue entry's
    (``pair`` for a node of two cards a bridge joins, else ``intra``); shared memory for this
    machine's calibrated kind; for a GPU that names none, a node of one rank needs none (the
    network's, or no link at all), and more are refused rather than joined by a guess."""
    from mpitrain.plan.hardware import HardwareError, Link

    key = (device.pair if device.pair and per_node <= 2 else device.intra) or ("shm" if device.calibrated else "")
    if key:
        return catalogue.link(key)
    if per_node > 1:
        raise HardwareError(f"device {device.key} ({device.name}) names no link between the GPUs of a node: "
                            f"--intra KEY for these {per_node} a node, or intra = \"KEY\" in its [device.{device.key}] "
                            f"(links: {', '.join(catalogue.links)})")
    return outer or Link("none", "no link (one rank)", 0.0, math.inf)


def host_memory() -> float:
    """Bytes of this machine's memory (``/proc/meminfo``), or 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) if hasattr(os, "sysconf") else 0.0


def make(cfg, ranks: int, machine: Machine, data=None) -> Plan:
    """The plan of ``cfg`` on ``ranks`` ranks of ``machine`` (ConfigError if the trainer
    would refuse the layout)."""
    data = data or resolve(cfg)
    if cfg.model.name == "gpt" and cfg.model.vocab_size:  # a vocabulary of its own (planned only): the model's
        data = replace(data, ids=cfg.model.vocab_size)
    lay = Layout.of(cfg, ranks, data, machine.threads(cfg.train.threads), native=not machine.device.calibrated)
    plans = rank_plans(lay, machine.objects)
    if lay.textbook:  # a GPU: tier 1's memory and time, as its frameworks run it
        plans, time = space.textbook(lay, plans, machine)
        return Plan(lay, plans, machine, time)
    return Plan(lay, plans, machine, step_parts(lay, plans, machine))


def from_args(args, ranks: int | None = None) -> tuple[Plan, str]:
    """(the plan ``mpitrain plan``'s arguments describe, what it plans: the config's path
    or the model's name)."""
    from mpitrain.plan import models

    cfg, data, source = models.config_of(args)
    P, mc = machine_of(args, ranks)
    plan = make(cfg, P, mc, data)
    return (at_mfu(plan, args.mfu) if getattr(args, "mfu", None) else plan), source


def at_mfu(plan: Plan, mfu: float) -> Plan:
    """``plan`` with its step set to the one whose model FLOPs reach ``mfu`` of the device's
    peak (of the precision it multiplies in) on every rank: each part of the planner's step
    scaled alike; its own kept in ``own``. A published device's only (ConfigError)."""
    from mpitrain.config import ConfigError
    from mpitrain.plan.hardware import PRECISION_OF

    mc, lay = plan.machine, plan.layout
    if mc.device.calibrated:
        raise ConfigError("--mfu: sets a published device's step (a GPU of the catalogue); this machine's is measured")
    peak = mc.device.peak_flops[PRECISION_OF[mc.multiplies_in(lay.cfg.train.dtype, lay.cfg.train.precision)]]
    executed = plan.executed_flops / plan.model_flops  # recomputation: the hardware's FLOPs per model FLOP
    if mfu * executed > 1 + 1e-12:
        most = math.floor(1000 / executed) / 1000  # rounded down: the figure said is one that is taken
        raise ConfigError(f"--mfu {mfu:g}: with its recomputation the GPUs would execute {mfu * executed:.1%} of "
                          f"their peak (HFU); this layout's MFU is {most:g} at most")
    step = plan.model_flops / lay.P / (mfu * peak)
    scale = step / plan.time["step"]
    return replace(plan, time={k: v * scale for k, v in plan.time.items()}, own=dict(plan.time))


def machine_of(args, ranks: int | None = None, said: str = "-n") -> tuple[int, Machine]:
    """(ranks of the job, the machine they run on) from ``mpitrain plan``'s -n, --nodes,
    --gpus-per-node, --network, --hardware and the rest; ``ranks``, where another option
    gave them (``said``: its name in the messages)."""
    from mpitrain.config import ConfigError
    from mpitrain.plan import hardware

    per_node = args.per_node
    P = ranks or args.ranks or (args.nodes or 1) * (per_node or 1)
    if args.nodes and per_node and args.ranks and args.ranks != args.nodes * per_node:
        raise ConfigError(f"-n {args.ranks} is not --nodes {args.nodes} x --gpus-per-node {per_node}")
    if args.nodes and not per_node:
        if P % args.nodes:
            raise ConfigError(f"{said} {P} ranks do not share --nodes {args.nodes} evenly: give a multiple of "
                              f"{args.nodes} ranks")
        per_node = P // args.nodes
    if per_node and P > per_node and P % per_node:
        raise ConfigError(f"{said} {P} is not a whole number of nodes of --gpus-per-node {per_node} ({P // per_node} "
                          f"and {P % per_node} rank(s) over): give a multiple of {per_node} ranks")
    per_node = min(per_node, P) if per_node else per_node  # one node, partly used: its ranks
    catalogue = hardware.load(args.catalogue)
    mc = machine(catalogue, args.hardware, P, per_node, args.network or "", args.intra or "",
                 args.memory_per_rank or 0.0)
    return P, mc
