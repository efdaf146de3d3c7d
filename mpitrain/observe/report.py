"""``mpitrain report RUN_DIR [RUN_DIR ...]``: plots and a summary from ``metrics.jsonl``
(what each plot shows: ``jobs/README.md``, "Metrics, timeline and reports").

For each run directory, into ``RUN_DIR/report/`` (or ``--out``): ``loss.png``,
``time_per_rank.png``, ``throughput.png`` and ``summary.txt`` (also printed), each naming
the layout that ran (:func:`~mpitrain.observe.records.layout`; the run's records:
:mod:`mpitrain.observe.records`). A resumed run is several segments, one per ``start``
record: the summary and the time plot count every segment's steps and time, and the
plots against steps mark where each segment began. A resume may change the layout (2
ranks, then 1): the header names each layout with its steps, and each rank has a row
and a bar per layout. A run that diverged says where (its ``diverged`` record). Given runs
of one job at several rank counts, one of them on 1 rank (``jobs/scaling_local.sh``,
``jobs/scaling_cluster.sh``), also ``scaling.png`` (:mod:`mpitrain.observe.scaling`), into
``--out`` or ``scaling/`` beside the first run.
"""

from __future__ import annotations

import os
from pathlib import Path

from mpitrain.observe import records
from mpitrain.observe.records import ReportError, Run, layout, plt

__all__ = ["ReportError", "Run", "layout", "report", "summary"]

MIRRORED = " (each image and its mirror)"  # an evaluation of two views (train.eval_flip): not one view's figure


def _folder(target: Path) -> Path:
    """``target``, made if missing: a ReportError naming it if it is a file or cannot be written."""
    if target.exists() and not target.is_dir():
        raise ReportError(f"{target}: is a file; the report needs a folder there")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"{target}: cannot make the report's folder: {e.strerror}") from None
    if not os.access(target, os.W_OK):
        raise ReportError(f"{target}: cannot write the report there (no permission)")
    return target


def report(run_dirs, out=None, log=print) -> list[Path]:
    """Write the plots and summaries; returns the files written."""
    if out and Path(out).exists() and not Path(out).is_dir():  # before anything is read: nothing written over
        raise ReportError(f"--out {out}: is a file; name a folder for the plots and the summary")
    runs = [Run(d) for d in run_dirs]
    written = []
    for run in runs:
        target = _folder(Path(out) if out and len(runs) == 1 else run.dir / "report")
        try:
            written += [_loss(run, target / "loss.png"), _time_per_rank(run, target / "time_per_rank.png"),
                        _throughput(run, target / "throughput.png")]
            text = summary(run)
            (target / "summary.txt").write_text(text + "\n", encoding="utf-8")
        except OSError as e:  # a full disk, a folder whose permissions changed under us
            raise ReportError(f"{target}: cannot write the report: {e.strerror or e}") from None
        written.append(target / "summary.txt")
        log(text)
    if len(runs) > 1:
        target = _folder(Path(out) if out else runs[0].dir.parent / "scaling")
        from mpitrain.observe.scaling import scaling

        written.append(scaling(runs, target / "scaling.png", log))
    for path in written:
        log(f"wrote {path}")
    return written


def summary(run: Run) -> str:
    c = run.config
    groups = run.by_layout()
    what = f"run {run.dir}: {c['model']['name']} on {c['data']['path'] or c['data']['name']}"
    batch = f"global batch {c['train']['global_batch_size']}"
    lines = [f"{what}, {run.described()}, {batch}" if len(groups) < 2 else
             f"{what}, {batch}; its layout changed on resume: {run.described()}"]
    if run.train:
        t = run.train[-1]
        lines.append(f"  step {t['step']}/{run.start['total_steps']}: loss {t['loss']:.4f}, "
                     f"{t['samples_per_s']:,.0f} samples/s")
    for e in run.evals[-1:]:
        what = (f"val loss {e['val_loss']:.4f}" if e.get("val_loss") is not None
                else f"test accuracy {100 * e['test_accuracy']:.2f}%{MIRRORED if e.get('flip') else ''}")
        lines.append(f"  evaluation at step {e['step']}: {what}")
    lines.append(_outcome(run))
    for steps, _, rows in groups:
        where = f", steps {steps}" if len(groups) > 1 else ""
        for r in rows:
            bubble = r.get("bubble_s", 0.0)  # a pipeline stage's waiting for its neighbours (older runs: none)
            compute = r["step_s"] - r["comm_exposed_s"] - bubble
            lines.append(f"  rank {r['rank']}{where}: compute {compute:.2f} s, communication exposed "
                         f"{r['comm_exposed_s']:.2f} s of {r['comm_total_s']:.2f} s, pipeline bubble {bubble:.2f} s, "
                         f"waiting for data {r['wait_s']:.2f} s, {r['bytes_sent'] / 1e6:.1f} MB sent")
    if saved := run.kinds.get("checkpoint"):
        lines.append(f"  last checkpoint: {saved[-1]['path']} (step {saved[-1]['step']})")
    return "\n".join(lines)


def _outcome(run: Run) -> str:
    """How the run ended (finished, stopped, diverged, or not yet), with a resumed run's
    figures summed over its segments."""
    end = run.end if run.segments and run.end in run.segments[-1] else None  # the last segment's own end
    summed = ""
    if run.resumed:
        steps, seconds, samples = run.steps_and_seconds()
        rate = f", {samples / seconds:,.0f} samples/s" if seconds else ""
        summed = (f"{steps} steps in {len(run.segments)} segments (resumed at step {', '.join(map(str, run.resumed))}"
                  f"): {seconds:.1f} s of steps{rate}, summed over the segments")
    if end is not None:
        last = (f"{end['steps_timed']} steps in {end['seconds']:.1f} s, " if not summed else
                f"; the last segment {end['steps_timed']} steps in {end['seconds']:.1f} s, ")
        rate = "" if summed else f"{end['samples_per_s']:,.0f} samples/s, "
        return f"  finished: {summed}{last}{rate}waited for data {100 * end['stall_fraction']:.2f}% of step time"
    diverged = [r for r in run.segments[-1] if r.get("kind") == "diverged"] if run.segments else []
    stops = [r for r in run.segments[-1] if r.get("kind") == "stopped"] if run.segments else []
    if diverged:
        d = diverged[-1]
        how = (f"diverged: loss {d['loss']} at step {d['step']}; last good checkpoint: "
               f"{d.get('checkpoint') or 'none'}")
    elif stops:
        how = f"stopped by {stops[-1]['signal']} at step {stops[-1]['step']}"
    else:
        how = "not finished (killed, or still running)"
    return f"  {how}" + (f"; so far {summed}" if summed else "")


def _loss(run: Run, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([t["step"] for t in run.train], [t["loss"] for t in run.train], label="training loss", color="C0")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    handles = ax.get_lines()
    if run.evals:
        steps = [e["step"] for e in run.evals]
        if run.evals[-1].get("val_loss") is not None:
            handles += ax.plot(steps, [e["val_loss"] for e in run.evals], "o-", color="C1", label="validation loss")
        else:
            # the test loss on the loss axis (runs of older versions recorded none), the accuracy on its own
            tested = [(e["step"], e["test_loss"]) for e in run.evals if e.get("test_loss") is not None]
            if tested:
                handles += ax.plot(*zip(*tested), "s--", color="C2", label="test loss")
            other = ax.twinx()
            mirrored = MIRRORED if any(e.get("flip") for e in run.evals) else ""
            handles += other.plot(steps, [100 * e["test_accuracy"] for e in run.evals], "o-", color="C1",
                                  label=f"test accuracy{mirrored}")
            other.set_ylabel("test accuracy (%)")
    ax.legend(handles=handles, loc="center right")  # the middle right is clear: loss falls, accuracy rises
    ax.set_title(f"{run.name}: loss\n{run.described()}", fontsize=10)
    _mark_resumes(run, ax)
    ax.grid(alpha=0.3)
    return records.save(fig, path)  # through the module: a test may stand in for it


def _mark_resumes(run: Run, ax) -> None:
    """A dashed line at each step where a resumed segment began."""
    for k, step in enumerate(run.resumed):
        ax.axvline(step, color="grey", ls="--", lw=0.8, label="resumed" if k == 0 else None)
        ax.annotate("resumed", (step, 1), xycoords=("data", "axes fraction"), xytext=(2, -10),
                    textcoords="offset points", fontsize=7, color="grey")


def _time_per_rank(run: Run, path: Path) -> Path:
    groups = run.by_layout()
    rows = [r for _, _, rs in groups for r in rs]
    labels = [f"rank {r['rank']}" + (f"\nsteps {steps}" if len(groups) > 1 else "")
              for steps, _, rs in groups for r in rs]
    ranks = list(range(len(rows)))
    bubble = [r.get("bubble_s", 0.0) for r in rows]  # a pipeline stage's waiting (older runs: none)
    compute = [r["step_s"] - r["comm_exposed_s"] - b for r, b in zip(rows, bubble)]
    exposed, wait = [r["comm_exposed_s"] for r in rows], [r["wait_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(rows) + 5), 4))
    width = 0.38
    left, bottom = [r - width / 2 for r in ranks], [0.0] * len(rows)
    for part, label, colour in ((compute, "compute", "C0"), (exposed, "communication (exposed)", "C3"),
                                (bubble, "pipeline bubble", "C7"), (wait, "waiting for data", "C2")):
        ax.bar(left, part, width, bottom=bottom, label=label, color=colour)  # stacked
        bottom = [a + b for a, b in zip(bottom, part)]
    right = [r + width / 2 for r in ranks]
    ax.bar(right, [r["comm_total_s"] for r in rows], width, label="communication (total)", color="C3", alpha=0.4)
    ax.bar(right, [r["read_s"] for r in rows], width, bottom=[r["comm_total_s"] for r in rows],
           label="reading (background)", color="C2", alpha=0.4)
    ax.set_xticks(ranks, labels)
    ax.set_ylabel("seconds")
    segments = f" over {len(run.segments)} segments (resumed at step {', '.join(map(str, run.resumed))})" \
        if run.resumed else ""
    ax.set_title(f"{run.name}: where each rank's time went{segments}\n{run.described()}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, never over them
    return records.save(fig, path)  # through the module: a test may stand in for it


def _throughput(run: Run, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([t["step"] for t in run.train], [t["samples_per_s"] for t in run.train], color="C0")
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{run.name}: throughput\n{run.described()}", fontsize=10)
    _mark_resumes(run, ax)
    ax.grid(alpha=0.3)
    return records.save(fig, path)  # through the module: a test may stand in for it
