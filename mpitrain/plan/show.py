"""The plan as text: what ``mpitrain plan`` prints."""

from __future__ import annotations

import math
import re

from mpitrain import cost
from mpitrain.config.checks import planned_only
from mpitrain.plan import gpu, hardware
from mpitrain.plan.hardware import calibrated_elsewhere

MB = 1e6
CATEGORIES = ("parameters", "gradients", "optimizer state", "masters", "work", "buffers", "objects", "reader",
              "activations", "framework")


def size(nbytes: float) -> str:
    """Bytes in the largest decimal unit that keeps them above 1."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}" if nbytes < 100 * scale else f"{nbytes / scale:,.0f} {unit}"
    return f"{nbytes:.0f} B"


def ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``; many ranks at a stride as ``0-120 by 8 (16)``."""
    ranks = sorted(ranks)
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    if len(ranks) > 4 and len(steps) == 1 and steps != {1}:
        return f"{ranks[0]}-{ranks[-1]} by {steps.pop()} ({len(ranks)})"
    out, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out) if len(out) <= 4 else f"{out[0]}, {out[1]}, ..., {out[-1]} ({len(ranks)})"


def header(plan, source: str) -> list[str]:
    lay, mc = plan.layout, plan.machine
    data = lay.data
    what = f"a vocabulary of {data.ids:,}" if data.kind == "text" else f"{data.ids:,} classes"
    known = "" if data.source != "assumed" else " (not built here: its recipe's figures)"
    nodes = math.ceil(lay.P / mc.per_node)
    links = (mc.intra.name if nodes == 1 else f"{mc.inter.name} between nodes" if mc.per_node == 1 else
             f"{mc.intra.name} inside a node, {mc.inter.name} between nodes")
    precision = hardware.PRECISION_OF[mc.multiplies_in(lay.cfg.train.dtype, lay.cfg.train.precision)]
    said = []
    if mc.device.sms:  # the GPU model's products' rate, at the fastest shape
        said.append(f"products at up to {sig(gpu.sustained(mc.device, precision) / 1e12)} TFLOP/s in {precision}")
    elif not mc.device.calibrated:  # a catalogue entry without the GPU model's figures: every product at the peak
        said.append(f"every product at its {precision} peak, an upper bound: its entry gives no sms for the GPU "
                    "model")
    if precision in mc.device.sustained:  # the notes' figure
        x = mc.device.sustained[precision]
        said.append(f"sustained, as published: {sig(x / 1e12)} TFLOP/s, {100 * x / mc.device.peak(precision):.0f}% "
                    "of its peak")
    use = f" ({'; '.join(said)})" if said else ""
    elsewhere = calibrated_elsewhere(mc.device)
    why = planned_only(lay.cfg)
    only = [f"planned only (GPU frameworks run it, mpitrain's trainer does not): {'; '.join(why)}"] if why else []
    return [f"plan: {source} on {lay.describe()}", *only,
            f"model: {lay.cfg.model.name}, {lay.whole:,} parameters; data: {data.name}{known}, {what}, "
            f"{plan.bytes_per_sample:,} B per sample read", *[line for line in (lay.tuning(),) if line],
            f"machine: {nodes} node(s) x {mc.per_node} rank(s) of {mc.device.name}{use}; {links}; "
            f"memory per rank {size(mc.memory)}", *([f"note: {elsewhere}"] if elsewhere else []),
            *([f"note: --memory-per-rank {size(mc.memory)} is more than the device's {size(mc.device.memory_bytes)} "
               f"({mc.device.name})"] if not mc.device.calibrated and mc.memory > mc.device.memory_bytes else [])]


def categories(plan) -> tuple:
    """The memory categories of ``plan``'s ranks: :data:`CATEGORIES`, the framework's
    allowance on a GPU's alone (:func:`mpitrain.plan.gpu.framework_bytes`)."""
    return CATEGORIES if plan.layout.textbook else CATEGORIES[:-1]


def rank_table(plan) -> list[str]:
    """Per rank (alike grouped): model state by category, activations, peak, bytes, FLOPs."""
    axes = [a for a in ("dp", "pp", "tp") if any(a in p.sent for p in plan.ranks)]
    shown = categories(plan)
    head = ("ranks | part | numbers | " + " | ".join(shown) + " | peak | "
            + "".join(f"{a} MB/step | " for a in axes) + "GFLOP/step")
    lines = ["per rank (ranks alike grouped):", head]
    for p in plan.ranks:
        mem = " | ".join(size(p.memory[k]) for k in shown)
        sent = "".join(f"{p.sent.get(a, 0) / MB:.3f} | " for a in axes)
        gflop = (p.flops["forward"] + p.flops["backward"] + p.flops["recompute"]) / 1e9
        lines.append(f"{ranks_text(p.ranks)} | {p.where} | {p.parameters:,} | {mem} | {size(p.peak)} | {sent}"
                     f"{gflop:.4g}")
    return lines


def calls_table(plan) -> list[str]:
    """Each group's calls by communicator, calls alike (a model's buckets, its blocks'
    groups) on one row; a group whose calls are another's is not repeated."""
    lines = ["communication per step, call by call (per rank):",
             "ranks | axis | what | collective (algorithm) | MB per call | calls | MB sent"]
    shown = set()
    for p in plan.ranks:
        rows: dict = {}
        for c in p.calls:  # calls alike: the same kind, size and name but for a number (a bucket's, a block's)
            key = (c.axis, c.collective, c.algorithm, c.nbytes, re.sub(r"\d+", "#", c.what))
            what, count, sent, n = rows.get(key, (c.what, 0, 0, 0))
            rows[key] = (what, count + c.count, sent + c.sent, n + 1)
        if tuple(rows.items()) in shown:
            continue
        shown.add(tuple(rows.items()))
        for (axis, collective, algorithm, nbytes, _), (what, count, sent, n) in rows.items():
            what = what if n == 1 else f"{what} and {n - 1} alike"
            lines.append(f"{ranks_text(p.ranks)} | {axis} | {what} | {collective} ({algorithm}) | {nbytes / MB:.4f} | "
                         f"{count} | {sent / MB:.4f}")
    return lines if len(lines) > 2 else ["communication per step: none (one replica, no stages, no slices)"]


def sig(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, in plain notation (thousands separated)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    places = digits - 1 - math.floor(math.log10(abs(x)))
    return f"{round(x, places):,.{max(0, places)}f}"


def duration(seconds: float) -> str:
    """Seconds to 3 significant digits, in ms below a second and us below a millisecond."""
    if seconds and abs(seconds) < 1e-3:
        return f"{sig(1e6 * seconds)} us"
    return f"{sig(1e3 * seconds)} ms" if abs(seconds) < 1 else f"{sig(seconds)} s"


def time_lines(plan) -> list[str]:
    lay, t, mc = plan.layout, plan.time, plan.machine
    lines = []
    if lay.pp > 1:
        p, m, v = lay.pp, lay.m, lay.v
        idle = cost.pipeline_idle(lay.par.schedule, p, m, v)
        lines.append(f"pipeline: {lay.par.schedule}, {p} stages x {m} micro-batches"
                     f"{f' x {v} chunks' if v > 1 else ''}: bubble {duration(t['bubble'])}, "
                     f"{100 * t['bubble'] / t['step']:.1f}% of the step ({idle:g} idle units of F + B + W per rank "
                     f"beside the {m} of its micro-batches); activations of up to "
                     f"{max(q.held for q in plan.ranks):g} micro-batch(es) held")
    flops, executed = plan.model_flops, plan.executed_flops
    B = lay.cfg.train.global_batch_size
    lines.append(f"FLOPs per step: {flops / 1e9:,.4g} GFLOP (model), {executed / 1e9:,.4g} executed "
                 f"(with recomputation); {flops / B / 1e9:,.4g} GFLOP per sample")
    tier = " (tier 1: as GPU frameworks run it)" if lay.textbook else ""
    if plan.own is not None:  # --mfu set the step
        own = plan.own["step"]
        tier = (f" (set by --mfu {100 * flops / t['step'] / lay.P / _peak(plan):.0f}%, every part scaled; the "
                f"planner's own: {duration(own)}, MFU {100 * flops / own / lay.P / _peak(plan):.1f}%)")
    lines.append(f"step time{tier}: {duration(t['step'])} = compute {duration(t['compute'])} + exposed "
                 f"communication {duration(t['exposed'])} + bubble {duration(t['bubble'])} + I/O wait "
                 f"{duration(t['io_wait'])} (communication in all {duration(t['comm_total'])})")
    rate = flops / t["step"] / lay.P  # the model's FLOPs: recomputation is work, not progress
    tokens = f", {sig(plan.samples_per_s * lay.T)} tokens/s" if lay.T else ""
    unit, scale = ("TFLOP/s", 1e12) if rate >= 1e12 else ("GFLOP/s", 1e9)
    said = (f"throughput: {sig(plan.samples_per_s)} samples/s{tokens}; {sig(rate / scale)} model {unit} per rank "
            f"(without recomputation), {sig(executed / t['step'] / lay.P / scale)} executed")
    if not mc.device.calibrated:  # the share of the device's peak in what it multiplies in
        precision = hardware.PRECISION_OF[mc.multiplies_in(lay.cfg.train.dtype, lay.cfg.train.precision)]
        peak = _peak(plan)
        said += (f"; MFU {100 * rate / peak:.1f}%, HFU {100 * executed / t['step'] / lay.P / peak:.1f}% of the "
                 f"{precision} peak {sig(peak / 1e12)} TFLOP/s")
    lines.append(said)
    per_rank = cost.storage_bandwidth(plan.bytes_per_sample, plan.samples_per_s / max(1, lay.dp))
    lines.append(f"storage: {plan.bytes_per_sample:,} B/sample x {sig(plan.samples_per_s / max(1, lay.dp))} "
                 f"samples/s per reading rank = {size(per_rank)}/s per rank, "
                 f"{size(per_rank * lay.dp * mc.per_node / lay.P)}/s per node, "
                 f"{size(per_rank * lay.dp)}/s in all; "
                 f"{flops / B / plan.bytes_per_sample:,.0f} FLOP per byte read")
    return lines


def _peak(plan) -> float:
    """FLOP/s of a published device's peak in the precision its products run in."""
    mc, train = plan.machine, plan.layout.cfg.train
    return mc.device.peak_flops[hardware.PRECISION_OF[mc.multiplies_in(train.dtype, train.precision)]]


def run_lines(plan) -> list[str]:
    """The whole run: its steps (or epochs), FLOPs, PFLOP/s-days and time."""
    lay, tr = plan.layout, plan.layout.cfg.train
    B = tr.global_batch_size
    if lay.data.kind == "text":
        steps, amount = tr.steps, f"{tr.steps:,} steps x {B * lay.T:,} tokens"
    else:
        steps = tr.epochs * (lay.data.train // B)
        amount = f"{tr.epochs} epoch(s) x {lay.data.train // B:,} steps"
    if not steps:
        return []
    total = plan.model_flops * steps
    seconds = plan.time["step"] * steps
    return [f"the run: {amount}: {total:.3g} FLOPs = {cost.pflops_days(total):.3g} PFLOP/s-days; "
            f"{_duration(seconds)} on these {lay.P} rank(s)"]


def _duration(seconds: float) -> str:
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.3g} s"


def memory_table(plan) -> list[str]:
    """The largest rank's peak under each gradient sync, with and without activation
    checkpointing (a layout the trainer refuses: its reason), planned as the plan is; and
    ZeRO's formula for mixed precision with Adam (K = 12)."""
    import dataclasses

    from mpitrain import plan as planner
    from mpitrain.config import ConfigError
    from mpitrain.plan.models import zero_table

    lay = plan.layout
    cfg = lay.cfg
    lines = ["memory per rank (the largest) by sync" + (" | without checkpointing | with" if cfg.model.name == "gpt"
                                                        else " | peak")]
    for sync in ("ddp", "zero1", "zero2", "zero3"):
        cells = []
        for ckpt in ((False, True) if cfg.model.name == "gpt" else (cfg.model.checkpoint_activations,)):
            c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sync=sync),
                                    model=dataclasses.replace(cfg.model, checkpoint_activations=ckpt))
            try:
                top = planner.make(c, lay.P, plan.machine, lay.data).largest()
                cells.append(f"{size(top.peak)}{' (fits)' if top.peak <= plan.machine.memory else ''}")
            except ConfigError as e:
                cells.append(f"refused: {str(e).split(':')[0]}")
        lines.append(f"{sync} | " + " | ".join(cells))
    z = zero_table(lay.whole / (lay.pp * lay.tp), lay.dp)
    lines.append("ZeRO's formula in mixed precision (2-byte weights and gradients, K = 12), model state per rank: "
                 + ", ".join(f"{k} {size(v)}" for k, v in z.items()))
    return lines


def tiers_table(plan) -> list[str]:
    """Tier 1's answer beside tier 2's, per rank, with the named corrections between them
    (plan/README.md, "Two tiers"): the activations (:func:`mpitrain.plan.peak.corrections`),
    the bytes (:func:`mpitrain.plan.traffic.corrections`), the compute's parts
    (:func:`mpitrain.plan.timing.compute_parts`), and the step's
    (:func:`mpitrain.plan.timing.step_corrections`)."""
    from mpitrain.plan import estimate, peak, space, timing, traffic

    lay = plan.layout
    if lay.textbook:
        return ["tiers: tier 1 (the textbook, as GPU frameworks run it) answers this device's memory and time: "
                "no corrections"]
    if lay.servers:
        return ["tiers: tier 1 has no model of parameter servers: tier 2's plan alone"]
    workers = [p for p in plan.ranks if p.stage != "server"]
    coords = [divmod(p.ranks[0], lay.tp) for p in workers]  # (pipeline rank x dp + d, slice)
    tier1 = [estimate.of_layout(lay, rest // lay.dp, r) for rest, r in coords]  # (memory, FLOPs, bytes)
    fixes = list(peak.ACTIVATION_CORRECTIONS)
    lines = ["activations by tier (tier 1 + tier 2's named corrections = tier 2):",
             "ranks | tier 1 | " + " | ".join(fixes) + " | tier 2"]
    for p, (rest, r), one in zip(workers, coords, tier1):
        textbook = one[0]["activations"]
        said = peak.corrections(lay, rest // lay.dp, r, textbook)
        lines.append(f"{ranks_text(p.ranks)} | {size(textbook)} | "
                     + " | ".join(("+" if said[k] > 0 else "") + size(said[k]) if said[k] else "0" for k in fixes)
                     + f" | {size(p.memory['activations'])}")
    named = list(traffic.BYTES_CORRECTIONS)
    lines += ["bytes sent a step by tier, MB (tier 1 + tier 2's named corrections = tier 2):",
              "ranks | axis | tier 1 | " + " | ".join(named) + " | tier 2"]
    for p, (_, r), one in zip(workers, coords, tier1):
        sent, said = one[2], traffic.corrections(lay, p.calls, r)
        lines += [f"{ranks_text(p.ranks)} | {axis} | {sent[axis] / MB:.4g} | "
                  + " | ".join(f"{said[axis][k] / MB:+.4g}" if said[axis][k] else "0" for k in named)
                  + f" | {p.sent.get(axis, 0) / MB:.4g}" for axis in ("dp", "pp", "tp") if p.sent.get(axis)]
    ms = lambda x: f"{1e3 * x:.3g}"  # noqa: E731
    lines += ["compute by part, ms a step (tier 2's products, at each shape's rate, and its named corrections):",
              "ranks | products | " + " | ".join(timing.CORRECTIONS) + " | tier 2"]
    for p in workers:
        parts = timing.compute_parts(lay, p, plan.machine)
        lines.append(f"{ranks_text(p.ranks)} | " + " | ".join(ms(x) for x in parts.values())
                     + f" | {ms(sum(parts.values()))}")
    one = space.of_layout(lay, plan.machine)
    if one is None:
        return lines + [f"step: tier 1 has no answer for {lay.par.sync} (tier 2's alone)"]
    said = timing.step_corrections(plan, one)
    return lines + ["step, ms (tier 1 + tier 2's named corrections = tier 2):",
                    "tier 1 | " + " | ".join(said) + " | tier 2",
                    f"{ms(one['step'])} | " + " | ".join(f"{1e3 * x:+.3g}" if x else "0" for x in said.values())
                    + f" | {ms(plan.time['step'])}"]


def verdict(plan) -> str:
    """One line: fits, or which ranks exceed the memory and by how much."""
    limit = plan.machine.memory
    over = [p for p in plan.ranks if p.peak > limit]
    top = plan.largest()
    if not over:
        return (f"verdict: fits: the largest rank ({ranks_text(top.ranks)}, {top.where}) peaks at {size(top.peak)} "
                f"of {size(limit)} ({100 * top.peak / limit:.1f}%)")
    worst = max(over, key=lambda p: p.peak)
    return (f"verdict: does not fit: rank(s) {ranks_text([r for p in over for r in p.ranks])} exceed the "
            f"{size(limit)} per rank; the largest ({ranks_text(worst.ranks)}, {worst.where}) needs "
            f"{size(worst.peak)}, {size(worst.peak - limit)} too much")


def text(plan, source: str, memory: bool = False, tiers: bool = False) -> str:
    """Everything; with ``memory`` the memory under each sync (re-planned: a second or so at
    a thousand ranks); with ``tiers`` tier 1's answer and tier 2's corrections to it."""
    return "\n".join(header(plan, source) + rank_table(plan) + calls_table(plan) + time_lines(plan)
                      + run_lines(plan) + (memory_table(plan) if memory else []) + (tiers_table(plan) if tiers else [])
                      + [verdict(plan)])
