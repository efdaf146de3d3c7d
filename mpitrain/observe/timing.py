"""Where each rank's training time went: what its communicators counted in the training
steps, and the end-of-run table."""

from __future__ import annotations


class Traffic:
    """Bytes sent and seconds blocked and busy on each of a rank's communicators inside its
    training steps, not evaluations, checkpoints or the checks at the end: the growth of
    their counters (:class:`mpitrain.comm.CommStats`, ``axes``: "dp" | "pp" | "tp" -> the
    counter) from each step's :meth:`begin` to its :meth:`end`."""

    def __init__(self, axes: dict):
        self.axes = axes
        self.in_steps = {name: [0, 0.0, 0.0] for name in axes}  # name -> [bytes, seconds blocked, seconds busy]
        self._mark: dict | None = None

    def begin(self) -> None:
        self._mark = {name: stats.totals() for name, stats in self.axes.items()}

    def end(self) -> None:
        if self._mark is None:
            return
        for name, stats in self.axes.items():
            for k, (now, then) in enumerate(zip(stats.totals(), self._mark[name])):
                self.in_steps[name][k] += now - then
        self._mark = None

    def seconds(self) -> tuple[float, float, float]:
        """(exposed, total, bubble): the seconds blocked on the data- and tensor-parallel
        communicators; the larger of those and the seconds their collectives were busy
        (what overlap hid, and did not); the seconds blocked on the pipeline's (waiting
        for the neighbouring stages, and the sums over them)."""
        exposed = sum(v[1] for name, v in self.in_steps.items() if name != "pp")
        busy = sum(v[2] for name, v in self.in_steps.items() if name != "pp")
        return exposed, max(exposed, busy), self.in_steps.get("pp", [0, 0.0, 0.0])[1]

    def by_axis(self) -> dict:
        """{axis: (bytes sent, seconds blocked)}."""
        return {name: (v[0], v[1]) for name, v in self.in_steps.items()}


def time_table(rows, steps: int) -> str:
    """The table of every rank's row (:func:`mpitrain.train.report.time_row`) over ``steps``
    steps (:meth:`Traffic.seconds` defines exposed, total and the bubble: the seconds
    blocked on the pipeline's communicator, waiting for the neighbouring stages and the
    sums over them). Compute is what is left of the step seconds after exposed
    communication and the bubble; reads run on the reader's thread beside the steps,
    waiting is the loop stalled on data (outside the steps). A run with stages or slices
    gets a second table: each communicator's bytes and seconds blocked in the steps."""
    lines = ["time per rank: rank | steps s | compute s | comm exposed s | comm total s | hidden | bubble s | "
             "read s (background) | waiting s | MB sent | MB/step"]
    for rank, step_s, exposed, total, read, wait, sent, bubble, _, _ in rows:
        hidden = f"{100 * max(0.0, 1 - exposed / total):.1f}%" if total > 0 else "-"
        lines.append(f"{rank:19d} | {step_s:7.2f} | {step_s - exposed - bubble:9.2f} | {exposed:14.3f} | "
                     f"{total:12.3f} | {hidden:>6} | {bubble:8.3f} | {read:19.3f} | {wait:9.3f} | "
                     f"{sent / 1e6:7.1f} | {sent / 1e6 / steps:7.3f}")
    axes = [a for a in ("dp", "pp", "tp") if any(a in row[-1] for row in rows)]
    if axes != ["dp"]:  # a grid with stages or slices: where the bytes and seconds went
        lines.append("per communicator: rank | " + " | ".join(f"{a} MB/step | {a} s" for a in axes))
        for row in rows:
            cells = [(f"{row[-1][a][0] / 1e6 / steps:9.3f} | {row[-1][a][1]:6.2f}" if a in row[-1] else
                      f"{'-':>9} | {'-':>6}") for a in axes]
            lines.append(f"{row[0]:22d} | " + " | ".join(cells))
    return "\n".join(lines)
