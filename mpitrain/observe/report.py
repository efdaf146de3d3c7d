"""``mpitrain report RUN_DIR [RUN_DIR ...]``: plots and a summary from ``metrics.jsonl``
(what each plot shows: ``jobs/README.md``, "Metrics, timeline and reports").

For each run directory, into ``RUN_DIR/report/`` (or ``--out``): ``loss.png``,
``time_per_rank.png``, ``throughput.png`` and ``summary.txt`` (also printed). Given runs
of one job at several rank counts, one of them on 1 rank (``jobs/scaling_local.sh``,
``jobs/scaling_cluster.sh``), also ``scaling.png`` (:func:`_scaling`), into ``--out`` or
``scaling/`` beside the first run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed (clusters, CI)
import matplotlib.pyplot as plt

from mpitrain.cluster import bits_per_second
from mpitrain.observe.metrics import read


class ReportError(ValueError):
    """A run directory that cannot be reported on; the message names it."""


class Run:
    """The records of one run directory, by kind."""

    def __init__(self, run_dir):
        self.dir = Path(run_dir)
        path = self.dir / "metrics.jsonl"
        if not path.is_file():
            raise ReportError(f"{self.dir}: no metrics.jsonl (is it a run directory of 'mpitrain train'?)")
        self.kinds: dict[str, list] = {}
        for r in read(path):
            self.kinds.setdefault(r.get("kind"), []).append(r)
        if not self.kinds.get("start"):
            raise ReportError(f"{path}: no 'start' record: not written by this mpitrain, or empty")
        self.start = self.kinds["start"][-1]
        self.train = self.kinds.get("train", [])
        self.evals = self.kinds.get("eval", [])
        self.end = (self.kinds.get("end") or [None])[-1]
        self.ranks = int(self.start["ranks"])
        self.config = self.start["config"]
        self.name = self.dir.name
        self.sync = self.config["parallel"].get("sync") or self.config["parallel"].get("strategy")  # older: strategy

    def per_rank(self) -> list[dict]:
        """Each rank's cumulative seconds and bytes: from the end of the run, or the
        last progress record of an unfinished one."""
        last = self.end or (self.train[-1] if self.train else None)
        return last.get("ranks", []) if last else []  # a parameter server's progress records have none


def report(run_dirs, out=None, log=print) -> list[Path]:
    """Write the plots and summaries; returns the files written."""
    runs = [Run(d) for d in run_dirs]
    written = []
    for run in runs:
        target = Path(out) if out and len(runs) == 1 else run.dir / "report"
        target.mkdir(parents=True, exist_ok=True)
        written += [_loss(run, target / "loss.png"), _time_per_rank(run, target / "time_per_rank.png"),
                    _throughput(run, target / "throughput.png")]
        text = summary(run)
        (target / "summary.txt").write_text(text + "\n", encoding="utf-8")
        written.append(target / "summary.txt")
        log(text)
    if len(runs) > 1:
        target = Path(out) if out else runs[0].dir.parent / "scaling"
        target.mkdir(parents=True, exist_ok=True)
        written.append(_scaling(runs, target / "scaling.png", log))
    for path in written:
        log(f"wrote {path}")
    return written


def summary(run: Run) -> str:
    c = run.config
    lines = [(f"run {run.dir}: {c['model']['name']} on {c['data']['path'] or c['data']['name']}, "
              f"{run.ranks} rank(s), {run.sync}, global batch {c['train']['global_batch_size']}")]
    if run.train:
        t = run.train[-1]
        lines.append(f"  step {t['step']}/{run.start['total_steps']}: loss {t['loss']:.4f}, "
                     f"{t['samples_per_s']:,.0f} samples/s")
    for e in run.evals[-1:]:
        what = (f"val loss {e['val_loss']:.4f}" if e.get("val_loss") is not None
                else f"test accuracy {100 * e['test_accuracy']:.2f}%")
        lines.append(f"  evaluation at step {e['step']}: {what}")
    if run.end:
        lines.append(f"  finished: {run.end['steps_timed']} steps in {run.end['seconds']:.1f} s, "
                     f"{run.end['samples_per_s']:,.0f} samples/s, waited for data "
                     f"{100 * run.end['stall_fraction']:.2f}% of step time")
    else:
        stops = run.kinds.get("stopped")
        lines.append(f"  stopped by {stops[-1]['signal']} at step {stops[-1]['step']}" if stops else
                     "  not finished (killed, or still running)")
    for r in run.per_rank():
        bubble = r.get("bubble_s", 0.0)  # a pipeline stage's waiting for its neighbours (older runs: none)
        compute = r["step_s"] - r["comm_exposed_s"] - bubble
        lines.append(f"  rank {r['rank']}: compute {compute:.2f} s, communication exposed {r['comm_exposed_s']:.2f} s "
                     f"of {r['comm_total_s']:.2f} s, pipeline bubble {bubble:.2f} s, waiting for data "
                     f"{r['wait_s']:.2f} s, {r['bytes_sent'] / 1e6:.1f} MB sent")
    if saved := run.kinds.get("checkpoint"):
        lines.append(f"  last checkpoint: {saved[-1]['path']} (step {saved[-1]['step']})")
    return "\n".join(lines)


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
            handles += other.plot(steps, [100 * e["test_accuracy"] for e in run.evals], "o-", color="C1",
                                  label="test accuracy")
            other.set_ylabel("test accuracy (%)")
    ax.legend(handles=handles, loc="center right")  # the middle right is clear: loss falls, accuracy rises
    ax.set_title(f"{run.name}: loss ({run.ranks} rank(s))")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _time_per_rank(run: Run, path: Path) -> Path:
    rows = run.per_rank()
    ranks = [r["rank"] for r in rows]
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
    ax.set_xticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylabel("seconds")
    ax.set_title(f"{run.name}: where each rank's time went")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, never over them
    return _save(fig, path)


def _throughput(run: Run, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([t["step"] for t in run.train], [t["samples_per_s"] for t in run.train], color="C0")
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{run.name}: throughput ({run.ranks} rank(s))")
    ax.grid(alpha=0.3)
    return _save(fig, path)


@dataclass
class _Point:
    """One run of a scaling study."""

    ranks: int
    link: str  # the emulated links' rate, or "one node"
    series: str  # the strategy, and ranks per node when nodes hold several
    samples_per_s: float  # as on the cluster emulated: a time-dilated run's figure times its dilation
    comm: float  # exposed communication, share of the step time (mean of the ranks that step)
    layout: str  # "", or "N nodes x R"
    predicted: float | None = None  # the planner's samples/s for the run (mpitrain.plan.scaling)
    why: str = ""  # why there is none


def _point(run: Run, nodes_matter: bool) -> _Point:
    if run.end is None or not run.end.get("samples_per_s"):
        raise ReportError(f"{run.dir}: the run did not finish, no throughput")
    cluster = run.start.get("cluster") or {}
    staleness = run.config["parallel"].get("staleness", 0)  # only parameter servers have one other than 0
    sync = run.sync + {0: "", -1: " async"}.get(staleness, f" s={staleness}")
    per_node = cluster.get("ranks_per_node", run.ranks)
    stepping = [r for r in run.per_rank() if not r.get("serves")]  # a server's time is all communication
    comm = sum(r["comm_exposed_s"] / r["step_s"] for r in stepping if r["step_s"]) / max(1, len(stepping))
    series = sync + (f", {per_node} ranks/node" if per_node > 1 and nodes_matter else "")
    samples_per_s = run.end["samples_per_s"] * cluster.get("dilation", 1.0)
    point = _Point(run.ranks, cluster.get("rate", "one node"), series, samples_per_s, comm,
                   f" ({cluster['nodes']} nodes x {per_node})" if cluster else "")
    from mpitrain.plan.scaling import predicted

    try:
        point.predicted = predicted(run.config, run.ranks, cluster or None)
    except ValueError as e:  # a config or calibration the planner cannot use: the point stands alone
        point.why = str(e)
    return point


def _scaling(runs: list[Run], path: Path, log) -> Path:
    """Throughput and efficiency against ranks: one row per link rate (runs on one node in
    every row), one line per strategy and ranks per node; each point's exposed
    communication written beside it, and the planner's prediction for each run a dotted
    line beside it. The 1-rank run is every line's first point."""
    points = [_point(r, any(r.start.get("cluster") for r in runs)) for r in runs]  # nodes: a line each
    single = [p for p in points if p.ranks == 1]
    if not single:
        raise ReportError(f"a scaling plot needs a 1-rank run to compare with; the runs have "
                          f"{sorted(r.ranks for r in runs)} ranks")
    one = max(single, key=lambda p: p.samples_per_s)
    base = one.samples_per_s
    links = sorted({p.link for p in points if p.link != "one node"}, key=bits_per_second) or ["one node"]
    strategies = sorted({p.series.split(",")[0] for p in points if p.ranks > 1})  # one colour each, in every row
    fig, axes = plt.subplots(len(links), 2, figsize=(11, 4 * len(links)), squeeze=False)
    for (a, b), link in zip(axes, links):
        _scaling_row(a, b, link, [p for p in points if p.ranks > 1 and p.link in (link, "one node")], one, strategies)
    fig.suptitle(f"scaling of {runs[0].config['model']['name']}, global batch "
                 f"{runs[0].config['train']['global_batch_size']} (beside each point: exposed communication, "
                 f"share of the step time)")
    for p in sorted(points, key=lambda p: (p.link, p.series, p.ranks)):
        where = p.link if p.link == "one node" else f"links {p.link}"
        guess = (f"; predicted {p.predicted:,.1f} samples/s ({_off(p):+.0%} off)" if p.predicted else
                 f"; no prediction ({p.why})")
        log(f"scaling: {p.ranks} rank(s){p.layout}: {p.series}, {where}: {p.samples_per_s:,.1f} samples/s, "
            f"communication {100 * p.comm:.0f}% of step time, speed-up x{p.samples_per_s / base:.2f}, "
            f"efficiency {100 * p.samples_per_s / (p.ranks * base):.0f}%" + guess)
    held = sorted(_off(p) for p in points if p.predicted)
    if held:
        log(f"scaling: the planner against {len(held)} of {len(points)} runs: mean absolute error "
            f"{sum(map(abs, held)) / len(held):.1%}, from {held[0]:+.0%} to {held[-1]:+.0%} "
            f"(measured less predicted, over measured)")
    return _save(fig, path)


def _scaling_row(a, b, link: str, here: list, one: _Point, strategies: list) -> None:
    """One link rate's throughput (``a``) and efficiency (``b``): a line per series from
    the 1-rank run ``one`` (nodes of several ranks: from their first point), the planner's
    dotted beside it."""
    base = one.samples_per_s
    for k, series in enumerate(sorted({p.series for p in here})):
        line = sorted([p for p in here if p.series == series], key=lambda p: p.ranks)
        if "ranks/node" not in series:
            line = [_Point(1, link, series, base, 0.0, "", one.predicted)] + line
        ranks = [p.ranks for p in line]
        efficiency = [100 * p.samples_per_s / (p.ranks * base) for p in line]
        colour = f"C{strategies.index(series.split(',')[0])}"
        style = dict(color=colour, marker="o", ls="--" if "ranks/node" in series else "-")
        a.plot(ranks, [p.samples_per_s for p in line], label=series, **style)
        b.plot(ranks, efficiency, label=series, **style)
        guess = [(p.ranks, p.predicted) for p in line if p.predicted]
        if guess and one.predicted:  # the planner's line: its samples/s, its own efficiency
            dotted = dict(color=colour, marker="x", ls=":", lw=1)
            a.plot(*zip(*guess), **dotted)
            b.plot([r for r, _ in guess], [100 * x / (r * one.predicted) for r, x in guess], **dotted)
        for p, e in zip(line, efficiency):
            if p.ranks > 1:
                b.annotate(f"{100 * p.comm:.0f}%", (p.ranks, e), textcoords="offset points", fontsize=7,
                           xytext=(5, 9 * (k % 3) - 9), color=colour)  # staggered: points often meet
    ticks = sorted({1, *(p.ranks for p in here)})
    for ax in (a, b):
        ax.set_xlabel("ranks")
        ax.set_xticks(ticks)
        ax.grid(alpha=0.3)
    a.set_ylabel("samples/s")
    a.set_ylim(bottom=0)
    if any(p.predicted for p in here):
        a.plot([], [], color="grey", marker="x", ls=":", lw=1, label="predicted (mpitrain plan)")
    a.set_title(f"throughput, links {link}")
    a.legend(fontsize=8)
    b.axhline(100, color="grey", lw=0.8, ls="--")
    b.set_ylabel("parallel efficiency (%)")
    # at least 0 to 110%, so the 100% line has room; above that when a run is superlinear
    # (its part of the data fits a faster cache, or the 1-rank run had more to contend with)
    top = max([100 * p.samples_per_s / (p.ranks * base) for p in here], default=100)
    b.set_ylim(0, max(110, 1.1 * top))
    b.set_title(f"efficiency X(P) / (P X(1)), links {link}")


def _off(p: _Point) -> float:
    """The prediction's error as ``mpitrain plan --validate`` gives it: (measured - predicted) / measured."""
    return (p.samples_per_s - p.predicted) / p.samples_per_s


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
