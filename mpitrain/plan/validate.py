"""``mpitrain plan --validate``: run a config for a few steps and hold every prediction
against what the run measured, per rank: predicted | measured | error.

Counted quantities must agree exactly: the bytes of parameters, gradients, optimizer
state and the optimizer's work array (:func:`mpitrain.observe.memory.model_state`), the
bytes each communicator sent in the steps (the counters), the FLOPs of a step (the op
counter), the pipeline's idle slots under unit costs (the schedule's own simulation), and
the storage need at the I/O table's samples/s. The heap (``tracemalloc``, at rest between
steps less the reader, and a step's peak above rest) and the step time are estimates,
held within a tolerance, and so is the reader's memory, measured with its queue full
(:meth:`mpitrain.data.reader.ShardReader.settle`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
from pathlib import Path

from mpitrain import cost, schedules
from mpitrain.config import ConfigError
from mpitrain.observe.prediction import error
from mpitrain.output import write_text

EXACT = ("parameters", "gradients", "optimizer state", "optimizer's work array", "dp sent", "pp sent", "tp sent",
         "FLOPs", "storage need (B/s) at the run's samples/s")
HEAP_TOLERANCE = 0.05  # the heap at rest and a step's peak above it (estimates)
TIME_TOLERANCE = 0.20


def tolerance(what: str) -> float:
    """How far a row may be off: counted quantities not at all. A bound
    ("..., at most", "..., at least": the peak depends on messages' timing) holds one way."""
    if what in EXACT or what.startswith("idle"):
        return 0.0
    return HEAP_TOLERANCE


def holds(what: str, predicted: float, measured: float) -> bool:
    """Whether a row is within its tolerance (:func:`tolerance`); a bound, on its side."""
    limit, e = tolerance(what), error(predicted, measured)
    if what.endswith(", at most"):
        return bool(e <= limit + 1e-12)  # (a NumPy figure makes a NumPy bool, which JSON cannot write)
    if what.endswith(", at least"):
        return bool(e >= -limit - 1e-12)
    return bool(abs(e) <= limit + 1e-12)


NEED = re.compile(r"needs ([\d.]+) MB/s per rank \((\d+) B/sample x ([\d,]+) samples/s\)")  # the I/O table's
WINDOW = 5  # steps per timed window: the step time is the median window's, after the first (warming up)


def overrides(cfg, steps: int, run_dir: str, trace: bool) -> object:
    """``cfg`` cut to ``steps`` steps, no evaluation or sample, a metrics record every
    :data:`WINDOW` steps, tracing the heap if ``trace``."""
    train = {"log_interval": WINDOW, "eval_interval": 0, "steps": steps, "epochs": 0}
    if cfg.model.name == "gpt":
        train.update(eval_batches=1, sample_tokens=0)
    run = dataclasses.replace(cfg.run, dir=run_dir, trace_memory=trace, checkpoint_interval=0, timeline=False,
                              progress="lines")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train), run=run)


def measure(cfg, comm, steps: int, trace: bool) -> tuple:
    """Train ``cfg`` for ``steps`` steps on ``comm``: (the run's result, figures on rank 0;
    the seconds of a step, the median of the timed windows after the first; the I/O
    tables' (need MB/s, B/sample, samples/s))."""
    from mpitrain import train

    lines = []
    with tempfile.TemporaryDirectory(prefix="mpitrain-validate-") as tmp:
        run_dir = comm.bcast(tmp if comm.rank == 0 else None) + "/run"
        result = train.train(overrides(cfg, steps, run_dir, trace), log=lambda line: lines.append(str(line)),
                             comm=comm)
        rates = []
        if comm.rank == 0:
            with open(f"{run_dir}/metrics.jsonl") as f:
                rates = [r["samples_per_s"] for r in map(json.loads, f) if r.get("kind") == "train"]
        comm.barrier()  # the files stay until rank 0 has read them
    later = sorted(rates[1:] or rates)
    seconds = cfg.train.global_batch_size / later[len(later) // 2] if later else float("nan")
    storage = [tuple(float(x.replace(",", "")) for x in m.groups()) for m in map(NEED.search, lines) if m]
    return result, seconds, storage


def compare(plan, result, storage=()) -> list[tuple]:
    """Rows (rank, quantity, predicted, measured) of the counted quantities and the heap."""
    lay = plan.layout
    by_rank = {r: p for p in plan.ranks for r in p.ranks}
    steps = result.steps - result.start_step
    rows = []
    for rank, (state, heap) in enumerate(result.states):
        p = by_rank[rank]
        time_row = result.timing[rank]
        rows += [(rank, "parameters", p.memory["parameters"], state["param_bytes"]),
                 (rank, "gradients", p.memory["gradients"], state["grad_bytes"]),
                 (rank, "optimizer state", p.memory["optimizer state"] + p.memory["masters"], state["optim_bytes"])]
        for axis, (sent, _) in time_row[-1].items():
            rows.append((rank, f"{axis} sent", p.sent.get(axis, 0), sent / steps))
        if heap is not None:
            rest = p.rest
            peak = heap["peak"] - heap["rest"] - heap.get("reader_growth", 0)  # the reader's rounds are its row
            data = heap["parts"].get("data", 0)
            rows += [(rank, "optimizer's work array", p.memory["work"], state["work_bytes"]),
                     (rank, "heap at rest less the reader", rest, heap["rest"] - data),
                     *([(rank, "heap peak above rest", p.memory["activations"], peak)] if not any(p.bounds) else
                       [(rank, f"heap peak above rest, at {w}", bound, peak) for w, bound in zip(("least", "most"),
                                                                                             p.bounds)]),
                     (rank, "reader, its queue full", p.memory["reader"], data)]
    for _, per_sample, rate in storage[:1]:  # the I/O table's need (its factors: its MB/s is rounded), at its rate
        rows.append(("all", "storage need (B/s) at the run's samples/s", plan.bytes_per_sample * rate,
                     per_sample * rate))
    mean = sum((p.flops["forward"] + p.flops["backward"] + p.flops["recompute"]) * len(p.ranks)
               for p in plan.ranks if p.stage != "server") / (lay.P - lay.servers)
    rows.append(("mean", "FLOPs", mean, result.flops))
    if lay.pp > 1:
        sim = schedules.simulate([schedules.schedule(lay.par.schedule, lay.pp, lay.m, r, lay.v)
                                  for r in range(lay.pp)], lay.pp, lay.v)
        formula = cost.pipeline_idle(lay.par.schedule, lay.pp, lay.m, lay.v)
        for r, idle in enumerate(sim.idle):
            rows.append((r, "idle slots (unit costs)", formula, idle))
    return rows


def estimates(plan) -> dict:
    """Tier 1's answer (:mod:`mpitrain.plan.estimate`) to each row it answers, by (rank,
    quantity): a model's state by category, activations (the heap's peak above rest) and
    bytes sent on each communicator on each rank, the ranks' mean FLOPs, and the step time
    (:func:`mpitrain.plan.space.of_layout`, at this machine's GEMM rate); none with
    parameter servers."""
    from mpitrain.plan import estimate, space

    lay = plan.layout
    if lay.servers:
        return {}
    out, flops = {}, []
    for s in range(lay.pp):
        for r in range(lay.tp):
            memory, f, sent = estimate.of_layout(lay, s, r)
            memory, sent = ({k: float(x) for k, x in d.items()} for d in (memory, sent))  # NumPy's numbers: JSON's
            flops += [sum(f.values())] * lay.dp
            for d in range(lay.dp):
                rank = lay.rank_of(s, d, r)
                out.update({(rank, "parameters"): memory["parameters"], (rank, "gradients"): memory["gradients"],
                            (rank, "optimizer state"): memory["optimizer state"] + memory["masters"],
                            (rank, "heap peak above rest"): memory["activations"],
                            **{(rank, f"{axis} sent"): sent[axis] for axis in ("dp", "pp", "tp")}})
    out["mean", "FLOPs"] = float(sum(flops) / len(flops))
    step = space.of_layout(lay, plan.machine)
    if step is not None:
        out["all", "step time (s)"] = step["step"]
    return out


def table(rows, step_time=None, textbook=None) -> tuple[str, bool]:
    """The printed table, and whether every row is within its tolerance; with
    ``textbook`` (:func:`estimates`) tier 1's answer beside tier 2's (its predictions,
    which the error and the tolerance are of), "-" where it has none."""
    lines = ["rank | quantity | " + ("estimate | exact | " if textbook else "predicted | ") + "measured | error | holds"]
    ok = True
    for rank, what, predicted, measured in rows:
        e, good = error(predicted, measured), holds(what, predicted, measured)
        ok &= good
        held = "yes" if good else "NO"
        said = textbook.get((rank, what.split(",")[0])) if textbook else None  # a bound's row: the peak's figure
        first = "" if not textbook else "- | " if said is None else f"{said:,.0f} | "
        lines.append(f"{rank} | {what} | {first}{predicted:,.0f} | {measured:,.0f} | {100 * e:+.2f}% | {held}")
    if step_time is not None:
        predicted, measured = step_time
        e = error(predicted, measured)
        said = textbook.get(("all", "step time (s)")) if textbook else None
        first = "" if not textbook else "- | " if said is None else f"{said:.4f} | "
        lines.append(f"all | step time (s) | {first}{predicted:.4f} | {measured:.4f} | "
                     f"{100 * e:+.1f}% | {'yes' if abs(e) <= TIME_TOLERANCE else 'NO'} (estimate, never asserted)")
    return "\n".join(lines), ok


def run(args) -> int:
    """The command: plan on the job's ranks, measure, print; exit 1 if a counted quantity
    disagrees or the heap is off by more than its tolerance."""
    from mpitrain.comm import library, world
    from mpitrain.plan import from_args
    from mpitrain.plan.models import config_of

    par = config_of(args)[0].parallel
    comm = world(par.thread_level, comm_thread=par.progress == "thread")
    if args.ranks and args.ranks != comm.size:
        raise ConfigError(f"-n {args.ranks}: --validate runs on the job's {comm.size} rank(s); launch it with "
                          f"mpiexec -n {args.ranks}")
    plan, source = from_args(args, ranks=comm.size)
    cfg = plan.layout.cfg
    counted, _, storage = measure(cfg, comm, 4, trace=True)
    # timed with rounds of 1 MB, so that the reader's first rounds (read ahead, on the cores that compute)
    # do not fill the few steps timed; a long run reads those once in thousands of steps
    quick = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, buffer_mb=min(cfg.data.buffer_mb, 1.0)))
    _, seconds, _ = measure(quick, comm, WINDOW * max(3, args.steps // WINDOW), trace=False)
    if comm.rank != 0:
        return 0
    rows = compare(plan, counted, storage)
    textbook = estimates(plan)
    text, ok = table(rows, (plan.time["step"], seconds), textbook)
    print(f"validate: {source} on {plan.layout.describe()}, under {library()}\n{text}")
    if args.html:
        from mpitrain.plan import page, show

        page.write(args.html, plan, f"{text}\n\n{show.text(plan, source)}", f"mpitrain plan --validate: {source}",
                   [("Predicted against measured", page.validate_figure(rows))])
        print(f"wrote {args.html}")
    if args.json:  # for mpitrain bench plan: each row with its tolerance and error
        found = {"rows": [[*r, tolerance(r[1]), error(r[2], r[3]), holds(*r[1:])] for r in rows],
                 "step": [plan.time["step"], seconds], "mpi": library(),
                 "estimates": [[rank, what, value] for (rank, what), value in textbook.items()]}
        write_text(args.json, json.dumps(found))
    return 0 if ok else 1


def launched(what: list, sets, extra: list, steps: int, ranks: int, out: Path, launch) -> dict | None:
    """``mpitrain plan WHAT --validate`` (``what``: a config, or ``--model NAME``) with ``sets``
    overrides and ``extra`` arguments, on ``ranks`` ranks through ``launch`` (command list,
    ranks -> exit status); its JSON rows ({"rows", "step"}), or None if it failed (its output
    is printed)."""
    import sys

    argv = [sys.executable, "-m", "mpitrain", "plan", *what, "--validate", "--steps", str(steps), "--json", str(out),
            *extra, *(a for s in sets for a in ("--set", s))]
    sys.stdout.flush()
    launch(argv, ranks)
    return json.loads(out.read_text()) if out.exists() else None
