"""The scaling study of ``mpitrain report`` (given runs of one job at several rank counts,
one of them on 1 rank: ``jobs/scaling_local.sh``, ``jobs/scaling_cluster.sh``):
``scaling.png``, throughput and parallel efficiency against ranks, a row per link rate
of the emulated clusters the runs ran on, a line per strategy, the planner's prediction
dotted beside each; and a line per point, printed.

Repeated runs of one point (the same ranks, strategy, nodes and links) are one point: the
median throughput, with the spread of the runs (bars on the plot, the range printed).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from mpitrain.cluster import bits_per_second
from mpitrain.observe import records
from mpitrain.observe.records import ReportError, Run, plt


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
    threads: int | None = None  # BLAS threads per rank (runs before it was recorded: None)
    runs: int = 1  # repeats of the point: samples_per_s is their median, low and high their range
    low: float = 0.0
    high: float = 0.0

    def efficiency(self, one: "_Point") -> tuple[float, float, float]:
        """Against the 1-rank point ``one``: X(P) / (P X(1)), and its range over the
        repeats of both (the slowest of these against the fastest 1-rank run, and the
        other way)."""
        P = self.ranks
        return (self.samples_per_s / (P * one.samples_per_s), self.low / (P * one.high), self.high / (P * one.low))


def _grouped(points: list[_Point]) -> list[_Point]:
    """Repeats of one point (the same ranks, series, links and nodes) as one: the median
    samples/s, the range; the other figures of the run nearest the median."""
    groups: dict[tuple, list[_Point]] = {}
    for p in points:
        groups.setdefault((p.ranks, p.link, p.series, p.layout), []).append(p)
    merged = []
    for same in groups.values():
        rates = [p.samples_per_s for p in same]
        mid = statistics.median(rates)
        near = min(same, key=lambda p: abs(p.samples_per_s - mid))
        merged.append(replace(near, samples_per_s=mid, runs=len(same), low=min(rates), high=max(rates)))
    return merged


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
                   f" ({cluster['nodes']} nodes x {per_node})" if cluster else "", threads=run.start.get("threads"),
                   low=samples_per_s, high=samples_per_s)
    from mpitrain.plan.scaling import predicted

    try:
        point.predicted = predicted(run.config, run.ranks, cluster or None)
    except ValueError as e:  # a config or calibration the planner cannot use: the point stands alone
        point.why = str(e)
    return point


def scaling(runs: list[Run], path, log):
    """Throughput and efficiency against ranks: one row per link rate (runs on one node in
    every row), one line per strategy and ranks per node; each point's exposed
    communication written beside it, and the planner's prediction for each run a dotted
    line beside it. The 1-rank run is every line's first point."""
    points = _grouped([_point(r, any(r.start.get("cluster") for r in runs)) for r in runs])  # nodes: a line each
    single = [p for p in points if p.ranks == 1]
    if not single:
        raise ReportError(f"a scaling plot needs a 1-rank run to compare with; the runs have "
                          f"{sorted(r.ranks for r in runs)} ranks")
    one = max(single, key=lambda p: p.samples_per_s)
    links = sorted({p.link for p in points if p.link != "one node"}, key=bits_per_second) or ["one node"]
    strategies = sorted({p.series.split(",")[0] for p in points if p.ranks > 1})  # one colour each, in every row
    fig, axes = plt.subplots(len(links), 2, figsize=(11, 4 * len(links)), squeeze=False)
    for (a, b), link in zip(axes, links):
        _scaling_row(a, b, link, [p for p in points if p.ranks > 1 and p.link in (link, "one node")], one, strategies)
    fig.suptitle(f"scaling of {runs[0].config['model']['name']}, global batch "
                 f"{runs[0].config['train']['global_batch_size']} (beside each point: exposed communication, "
                 f"share of the step time)")
    for p in sorted(points, key=lambda p: (p.link, p.series, p.ranks)):
        log(_line(p, one))
    if above := [p for p in points if p.ranks > 1 and p.efficiency(one)[0] > 1]:
        log(_above_100(above, one))
    held = sorted(_off(p) for p in points if p.predicted)
    if held:
        log(f"scaling: the planner against {len(held)} of {len(points)} runs: mean absolute error "
            f"{sum(map(abs, held)) / len(held):.1%}, from {held[0]:+.0%} to {held[-1]:+.0%} "
            f"(measured less predicted, over measured)")
        from mpitrain.plan import hardware
        if elsewhere := hardware.calibrated_elsewhere(hardware.load().device("this")):
            log(f"scaling: {elsewhere}")
    return records.save(fig, path)  # through the module: a test may stand in for it


def _line(p: _Point, one: _Point) -> str:
    """A point as printed: its throughput, communication, speed-up, efficiency (each with
    its range over repeats) and the planner's prediction."""
    where = p.link if p.link == "one node" else f"links {p.link}"
    spread = f" (median of {p.runs} runs, {p.low:,.1f} to {p.high:,.1f})" if p.runs > 1 else ""
    e, low, high = p.efficiency(one)
    e_spread = f" ({100 * low:.0f}% to {100 * high:.0f}%)" if p.runs > 1 or one.runs > 1 else ""
    guess = (f"; predicted {p.predicted:,.1f} samples/s ({_off(p):+.0%} off)" if p.predicted else
             f"; no prediction ({p.why})")
    return (f"scaling: {p.ranks} rank(s){p.layout}: {p.series}, {where}: {p.samples_per_s:,.1f} samples/s{spread}, "
            f"communication {100 * p.comm:.0f}% of step time, speed-up x{p.samples_per_s / one.samples_per_s:.2f}, "
            f"efficiency {100 * e:.0f}%{e_spread}" + guess)


def _above_100(above: list[_Point], one: _Point) -> str:
    """Why an efficiency passed a hundred percent: what the runs recorded that makes a rank of the
    P-rank run faster than the 1-rank run."""
    at = ", ".join(f"{p.ranks} ranks ({p.series})" for p in above)
    threads = {p.threads for p in above}
    if one.threads and None not in threads and max(threads) < one.threads:  # None: a run that did not record them
        why = (f"the 1-rank run used {one.threads} BLAS threads on its one process, each of the others' ranks "
               f"{'/'.join(map(str, sorted(threads)))}; a step split over threads runs slower per core than "
               "the same cores as separate ranks, so X(1) understates one core's worth (train.threads=1 on "
               "every run measures the ranks alone)")
    else:
        why = ("each rank of those runs went faster than the 1-rank run: its share of the batch fits a faster "
               "cache, or the 1-rank run had more to contend with (its spread over repeats says which)")
    return f"scaling: efficiency above 100% at {at}: {why}"


def _scaling_row(a, b, link: str, here: list, one: _Point, strategies: list) -> None:
    """One link rate's throughput (``a``) and efficiency (``b``): a line per series from
    the 1-rank run ``one`` (nodes of several ranks: from their first point), the planner's
    dotted beside it."""
    for k, series in enumerate(sorted({p.series for p in here})):
        line = sorted([p for p in here if p.series == series], key=lambda p: p.ranks)
        if "ranks/node" not in series:
            line = [replace(one, link=link, series=series, comm=0.0, layout="")] + line
        ranks = [p.ranks for p in line]
        efficiency = [100 * p.efficiency(one)[0] for p in line]
        colour = f"C{strategies.index(series.split(',')[0])}"
        style = dict(color=colour, marker="o", ls="--" if "ranks/node" in series else "-")
        a.plot(ranks, [p.samples_per_s for p in line], label=series, **style)
        b.plot(ranks, efficiency, label=series, **style)
        for p in line:  # the range over repeats
            if p.runs > 1 or one.runs > 1:
                a.vlines(p.ranks, p.low, p.high, color=colour, lw=3, alpha=0.35)
                b.vlines(p.ranks, *(100 * e for e in p.efficiency(one)[1:]), color=colour, lw=3, alpha=0.35)
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
    top = max([100 * p.efficiency(one)[2] for p in here], default=100)
    b.set_ylim(0, max(110, 1.1 * top))
    b.set_title(f"efficiency X(P) / (P X(1)), links {link}")


def _off(p: _Point) -> float:
    """The prediction's error as ``mpitrain plan --validate`` gives it: (measured - predicted) / measured."""
    return (p.samples_per_s - p.predicted) / p.samples_per_s
