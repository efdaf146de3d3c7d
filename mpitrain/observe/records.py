"""A run directory as ``mpitrain report`` and its scaling study read it (:class:`Run`: the
records of ``metrics.jsonl``, by kind and by segment), the few words that name the
layout that ran (:func:`layout`), and how their figures are saved (:func:`save`).
:mod:`mpitrain.observe.report` and :mod:`mpitrain.observe.scaling` both build on it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed (clusters, CI)
import matplotlib.pyplot as plt

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
        self.segments: list[list[dict]] = []  # a resumed run's: one per start record, its records
        for r in read(path):
            self.kinds.setdefault(r.get("kind"), []).append(r)
            if r.get("kind") == "start" or not self.segments:
                self.segments.append([])
            self.segments[-1].append(r)
        if not self.kinds.get("start"):
            raise ReportError(f"{path}: no 'start' record: not written by this mpitrain, or empty")
        self.start = self.kinds["start"][-1]
        self.train = self.kinds.get("train", [])
        self.evals = self.kinds.get("eval", [])
        self.end = (self.kinds.get("end") or [None])[-1]
        missing = [k for k in ("ranks", "config") if k not in self.start]
        config = self.start.get("config")
        if not missing and not (isinstance(config, dict) and {"model", "data", "train", "parallel"} <= set(config)):
            missing = ["config's sections"]
        if missing:
            raise ReportError(f"{path}: its 'start' record has no {' or '.join(repr(k) for k in missing)}: not written "
                              "by this mpitrain, or damaged")
        self.ranks = int(self.start["ranks"])
        self.config = self.start["config"]
        self.name = self.dir.name
        self.sync = self.config["parallel"].get("sync") or self.config["parallel"].get("strategy")  # older: strategy
        self.layout = layout(self.config, self.ranks)
        self.resumed = [seg[0]["step"] for seg in self.segments[1:] if seg[0].get("kind") == "start"]
        self._figures: list[Segment] | None = None

    def segment_figures(self) -> list[Segment]:
        """What each segment ran and reached (:class:`Segment`), in order (read once)."""
        if self._figures is not None:
            return self._figures
        found = []
        for seg in self.segments:
            start = seg[0] if seg[0].get("kind") == "start" else self.start
            first = seg[0].get("step", 0) if seg[0].get("kind") == "start" else 0
            reached = [r["step"] for r in seg if r.get("kind") in ("train", "checkpoint", "stopped", "end", "diverged")]
            timed = next((r for r in reversed(seg) if r.get("kind") in ("train", "end") and r.get("ranks")), None)
            steps = 0 if timed is None else timed["step"] - first
            if timed is not None and timed["kind"] == "end":  # the steps this process timed
                steps = timed.get("steps_timed", steps)
            config, ranks = start.get("config", self.config), int(start.get("ranks", self.ranks))
            found.append(Segment(first, max(reached, default=first), ranks, layout(config, ranks),
                                 [] if timed is None else timed["ranks"], steps, config["train"]["global_batch_size"]))
        self._figures = found
        return found

    def per_rank(self) -> list[dict]:
        """Each rank's seconds and bytes over every segment on the last segment's layout
        (the one a scaling study plots): each segment's from its end, or its last
        progress record (a segment that was killed; a parameter server's progress records
        have none)."""
        last = (self.ranks, self.layout)
        return _summed([s for s in self.segment_figures() if (s.ranks, s.layout) == last])

    def by_layout(self) -> list[tuple[str, list[Segment], list[dict]]]:
        """The run's segments grouped by the layout they ran (a resume may change it), in
        the order each first ran: (the steps they cover, as ``0-40, 80-120``, the
        segments, each rank's figures summed over them)."""
        groups: dict[tuple[int, str], list[Segment]] = {}
        for seg in self.segment_figures():
            groups.setdefault((seg.ranks, seg.layout), []).append(seg)
        return [(", ".join(f"{s.first}-{s.reached}" for s in segs), segs, _summed(segs)) for segs in groups.values()]

    def described(self) -> str:
        """The ranks and layout that ran, in a few words: one layout, or each with its steps."""
        groups = self.by_layout()
        if len(groups) < 2:
            return f"{self.ranks} rank(s), {self.layout}"
        return "; ".join(f"steps {steps} on {segs[0].ranks} rank(s) ({segs[0].layout})" for steps, segs, _ in groups)

    def steps_and_seconds(self) -> tuple[int, float, float]:
        """Over every segment: the steps reached, the seconds of the steps timed (each
        segment's slowest rank's, to its last record of them) and the samples of those
        steps (a segment killed before its first progress record has steps, but no
        seconds to rate them by)."""
        steps = seconds = samples = 0.0
        for seg in self.segment_figures():
            steps += seg.reached - seg.first
            seconds += seg.seconds
            samples += seg.timed * seg.global_batch
        return int(steps), seconds, samples


@dataclass
class Segment:
    """One segment of a run (a start, and its records to the next start)."""

    first: int  # the step it began at
    reached: int  # the last step it reached
    ranks: int
    layout: str
    rows: list[dict]  # each rank's figures at its last progress record ([] when it reached none)
    timed: int  # the steps those figures cover
    global_batch: int

    @property
    def seconds(self) -> float:
        """Its seconds of steps: the slowest stepping rank's (a server's are all communication)."""
        return max((row["step_s"] for row in self.rows if not row.get("serves")), default=0.0)


def _summed(segments: list[Segment]) -> list[dict]:
    """Each rank's numeric figures summed over ``segments``, by rank."""
    total: dict[int, dict] = {}
    for seg in segments:
        for row in seg.rows:
            into = total.setdefault(row["rank"], {"rank": row["rank"]})
            for key, value in row.items():
                if key != "rank" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    into[key] = into.get(key, 0) + value
                elif key not in into:
                    into[key] = value
    return [total[r] for r in sorted(total)]


def layout(config: dict, ranks: int) -> str:
    """What ran, in a few words: the grid (``dp x pp x tp``) and the gradient sync, the
    pipeline schedule and micro-batches, the precision (``"ddp"`` for a config this
    mpitrain cannot read)."""
    from mpitrain.config import ConfigError, check_ranks, from_saved

    try:
        cfg = from_saved(config, data_needed=False)  # the data may have moved since
        dp, pp, tp = check_ranks(cfg, ranks)
    except (ConfigError, TypeError, ValueError):  # an older run's config
        return config.get("parallel", {}).get("sync", "?")
    par, t = cfg.parallel, cfg.train
    servers = ranks - dp * pp * tp  # the ranks the grid leaves: parameter servers
    words = [f"dp {dp} x pp {pp} x tp {tp}", par.sync + (f" ({servers} server(s))" if servers else "")]
    if pp > 1:
        words.append(par.schedule + (f" x{par.chunks} chunks" if par.schedule == "interleaved" else ""))
    if t.micro_batches > 1:
        words.append(f"{t.micro_batches} micro-batches")
    if tp > 1 and par.sequence_parallel:
        words.append("sequence parallel")
    if t.precision != "fp32":
        words.append(f"{t.precision} mixed precision")
    return ", ".join(words)


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
