"""``mpitrain plan --search --measure K``: the search's ranking held against runs.

It runs the predicted top ``K`` layouts and ``K`` others drawn at random (seeded: the
same search draws the same ones) from the rest that fit (of layouts that differ in the
bucket size alone, the one the planner prefers), each through
``mpitrain plan CONFIG --validate`` for a few steps (on shared memory under ``mpiexec``, or
across the emulated nodes of ``--cluster``, :class:`mpitrain.cluster.Cluster`), and the
closest of the layouts refused for memory, to see whether they indeed exceed it. It
prints predicted | measured | rank per layout, Spearman's rank correlation of the two
step times, and whether the predicted best was the measured best (if not, how much
slower it ran); and writes ``search.csv``, ``search.json`` and ``search.png``
(predicted against measured step time, the line y = x, each point labelled) to ``--out``.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from mpitrain.output import OutputError
from mpitrain.plan.validate import launched

SEED = 0  # the random others: the same search, the same draw
INTERRUPTED = (130, 143, -2, -15)  # a run's exit status after Ctrl-C or SIGTERM: the search stops there


def distinct(found: list) -> list:
    """The first of each group of layouts that differ in the gradient bucket's size alone
    (the planner's preferred size, since ``found`` is in its order): two of them measured
    side by side would rank the run's noise, not the model's prediction."""
    seen, kept = set(), []
    for f in found:
        key = tuple(s for s in f.sets if not s.startswith("parallel.bucket_mb="))
        if key not in seen:
            seen.add(key)
            kept.append(f)
    return kept


def chosen(fits: list, k: int) -> list:
    """The top ``k`` distinct layouts and ``k`` others drawn at random from the rest, in
    predicted order."""
    fits = distinct(fits)
    rest = fits[k:]
    draw = np.random.default_rng(SEED).choice(len(rest), size=min(k, len(rest)), replace=False) if rest else []
    return fits[:k] + [rest[i] for i in sorted(draw)]


def measure(args, found, steps: int, out: Path, launch, repeat: int = 1) -> dict | None:
    """One layout's validation run, its JSON written to ``out``: {"step": [predicted,
    measured], "rows": ..., "runs": every launch's step} (None if every launch failed;
    their output is printed). With ``repeat``, the fastest of that many launches: ranks
    that take turns on a core settle into a slow rhythm in some launches and keep it
    for the whole run (measured: mpitrain/bench/README.md, "mpitrain plan --search --measure")."""
    extra = ["--catalogue", args.catalogue] if args.catalogue else []
    if args.cluster:
        extra += ["--nodes", str(args.cluster[0]), "--gpus-per-node", str(args.cluster[1]), "--network", args.network]
    what = [args.config] if args.config else ["--model", args.model]
    runs = [launched(what, [*args.set, *found.sets], extra, steps, found.plan.layout.P, out.with_suffix(f".{k}.json"),
                     launch) for k in range(repeat)]
    runs = [r for r in runs if r is not None]
    if not runs:
        return None
    best = min(runs, key=lambda r: r["step"][1])
    return {**best, "runs": [r["step"][1] for r in runs]}


def peak(result: dict) -> float:
    """The largest rank's measured heap: at rest (with the reader) plus a step's peak above it."""
    rows = result["rows"]
    by_rank: dict = {}
    for rank, what, _, measured, *_ in rows:
        if what in ("heap at rest less the reader", "reader, its queue full") or \
                what.startswith("heap peak above rest"):
            key = "peak" if what.startswith("heap peak") else what
            by_rank.setdefault(rank, {})[key] = measured
    return max(sum(v.values()) for v in by_rank.values()) if by_rank else float("nan")


def run(args, fits: list, over: list, limit: float) -> int:
    from mpitrain.cluster import Cluster, describe, mpiexec
    from mpitrain.plan.show import size

    picks = chosen(fits, args.measure)
    tried = distinct(over)[: args.measure]
    with tempfile.TemporaryDirectory(prefix="mpitrain-search-") as tmp:
        def shared(argv, ranks):
            return subprocess.run([mpiexec(), "-n", str(ranks), *argv], check=False).returncode

        def each(start):
            def launch(argv, ranks):
                status = start(argv, ranks)
                if status in INTERRUPTED:  # the user stopped it: not one failed layout among others
                    raise KeyboardInterrupt
                return status

            return ([measure(args, f, args.steps, Path(tmp) / f"t{k}.json", launch, args.repeat)
                     for k, f in enumerate(picks)],
                    [measure(args, f, 5, Path(tmp) / f"m{k}.json", launch) for k, f in enumerate(tried)])

        if args.cluster:
            nodes, per_node, rate = args.cluster
            with Cluster(nodes=nodes, ranks=per_node, rate=rate) as cluster:
                print(describe(cluster), flush=True)
                results, forced = each(lambda argv, ranks: cluster.run(argv))
        else:
            results, forced = each(shared)
    rows = [(f, r["step"][0], r["step"][1], peak(r), r["runs"]) for f, r in zip(picks, results) if r is not None]
    failed = len(picks) - len(rows)
    lines, summary = _table(rows, fits)
    print("\n".join(lines))
    for f, r in zip(tried, forced):
        got = "the run failed" if r is None else f"measured {size(peak(r))}, " + \
            ("over the limit: yes" if peak(r) > limit else "over the limit: NO")
        print(f"refused for memory ({size(f.peak)} predicted > {size(limit)}), forced: {got} | {f.line}")
    try:
        _write(Path(args.out), rows, [fits.index(r[0]) + 1 for r in rows], summary, args)
    except OSError as e:  # a disk that filled during the runs: the table above is printed, say what is not
        raise OutputError(f"{args.out}: could not be written ({e.strerror or e}); the table above is the "
                          "measurement") from None
    print(f"wrote {Path(args.out) / 'search.csv'}, search.json and search.png")
    return 1 if failed else 0


def _table(rows: list, fits: list) -> tuple[list[str], dict]:
    measured = [r[2] for r in rows]
    order = np.argsort(measured, kind="stable")
    rank_of = {int(k): n + 1 for n, k in enumerate(order)}
    lines = ["predicted rank | measured rank | predicted ms | measured ms | error | layout"]
    for k, (f, predicted, got, *_) in enumerate(rows):
        lines.append(f"{fits.index(f) + 1} | {rank_of[k]} | {1e3 * predicted:.4g} | {1e3 * got:.4g} | "
                     f"{100 * (got - predicted) / got:+.1f}% | {f.line}")
    rho = spearman([r[1] for r in rows], measured)
    best = min(range(len(rows)), key=lambda k: rows[k][1]) if rows else None
    summary = {"spearman": rho, "layouts": len(rows)}
    if best is not None:
        slower = rows[best][2] / min(measured) - 1
        summary.update(predicted_best=rows[best][0].line, slower_than_measured_best=slower)
        lines.append(f"Spearman's rank correlation {rho:.3f} over {len(rows)} layouts; the predicted best "
                     + ("was the measured best" if slower <= 0 else
                        f"ran {100 * slower:.1f}% slower than the measured best ({rows[int(order[0])][0].line})"))
    return lines, summary


def _where(args) -> str:
    if args.cluster:
        nodes, per_node, rate = args.cluster
        return f"{nodes} emulated nodes x {per_node} at {rate}"
    return f"{args.ranks or 'the job'}'s ranks, shared memory"


def _write(out: Path, rows: list, ranks: list, summary: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    records = [{"predicted_rank": k, "layout": f.line, "describe": f.plan.layout.describe(), "predicted_s": p,
                "measured_s": m, "measured_peak_bytes": peak_bytes, "launches_s": " ".join(f"{x:.6g}" for x in runs)}
               for k, (f, p, m, peak_bytes, runs) in zip(ranks, rows)]
    with open(out / "search.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(records[0]) if records else ["layout"])
        writer.writeheader()
        writer.writerows(records)
    (out / "search.json").write_text(json.dumps({"summary": summary, "layouts": records}, indent=1))
    fig, ax = plt.subplots(figsize=(7, 6))
    xs, ys = [1e3 * r[1] for r in rows], [1e3 * r[2] for r in rows]
    ax.scatter(xs, ys)
    for k, x, y in zip(ranks, xs, ys):  # each point by its predicted rank (the CSV names its layout)
        ax.annotate(f"#{k}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    hi = max(xs + ys, default=1) * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=1, label="y = x")
    ax.set(xlim=(0, hi), ylim=(0, hi), xlabel="predicted step (ms)", ylabel="measured step (ms)",
           title=f"{args.config or args.model} on {_where(args)}: Spearman {summary['spearman']:.2f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "search.png", dpi=120)
    plt.close(fig)


def spearman(a, b) -> float:
    """Spearman's rank correlation of two sequences (ties share their mean rank)."""
    def ranks(x):
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for value in np.unique(x):  # ties: their mean rank
            same = x == value
            r[same] = r[same].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])
