"""The planner's prediction beside a finished run (the lines a run ends with, printed by
:mod:`mpitrain.train.report`): the step time and the memory of its layout on this
machine against what the run measured, so that drift shows in ordinary use. ``mpitrain
plan --validate`` (:mod:`mpitrain.plan.validate`) is the thorough check; this is the one
every run makes."""

from __future__ import annotations


def error(predicted: float, measured: float) -> float:
    """(measured - predicted) / measured: how far off a prediction is, as a share of the run's."""
    return 0.0 if predicted == measured else (measured - predicted) / measured if measured else float("inf")


def end_of_run(cfg, ranks: int, step_seconds: float, states: list) -> list[str]:
    """The lines a training run ends with: the planner's step time and memory of this
    layout on this machine beside what the run measured (``states``: every rank's
    (model state counted, heap figures or None)), so drift shows in ordinary use."""
    from mpitrain import plan as planner
    from mpitrain.plan import hardware

    try:
        plan = planner.make(cfg, ranks, planner.machine(hardware.load(), "this", ranks))
    except (ValueError, OSError) as e:  # a catalogue or manifest the planner cannot read: say so, end the run
        return [f"plan: no prediction ({e})"]
    t = plan.time
    lines = [f"plan: a step {1e3 * t['step']:.3g} ms predicted (compute {1e3 * t['compute']:.3g}, exposed "
             f"communication {1e3 * t['exposed']:.3g}, bubble {1e3 * t['bubble']:.3g}), {1e3 * step_seconds:.3g} ms "
             f"measured (the mean step): {step_seconds / t['step']:.2f}x"]
    counted = [s["param_bytes"] + s["grad_bytes"] + s["optim_bytes"] + s["work_bytes"] for s, _ in states]
    rank = max(range(len(states)), key=counted.__getitem__)
    p = next(q for q in plan.ranks if rank in q.ranks)
    line = (f"plan: rank {rank}'s model state and work array {p.state + p.memory['work']:,} B predicted, "
            f"{counted[rank]:,} B counted")
    heap = states[rank][1]
    if heap is not None:
        rest = heap["rest"] - heap["parts"].get("data", 0)
        peak = heap["peak"] - heap["rest"] - heap.get("reader_growth", 0)
        line += (f"; heap at rest less the reader {rest / 1e6:.2f} MB ({error(p.rest, rest):+.1%} off), a step's "
                 f"peak above rest less what the reader read meanwhile {peak / 1e6:.2f} MB against "
                 f"{p.memory['activations'] / 1e6:.2f} MB of activations predicted")
    elsewhere = hardware.calibrated_elsewhere(plan.machine.device)  # cannot raise: this_cpu reads what it can
    return lines + [line] + ([f"plan: {elsewhere}"] if elsewhere else [])
