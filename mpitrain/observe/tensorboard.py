"""TensorBoard scalars of a run (``run.tensorboard = true``): ``RUN_DIR/tensorboard/``,
written by the rank that writes ``metrics.jsonl``, from the same records
(:mod:`mpitrain.observe.metrics`, which stays the record of the run). Written with
tensorboardX (``pip install -e ".[tensorboard]"``); ``tensorboard --logdir runs`` shows them.

Each ``train`` record gives, at its step:

* ``train/loss``, ``train/lr``, ``train/samples_per_s``, ``train/gflops_per_s``;
* over the steps since the previous record, from every rank's time-table row
  (:data:`mpitrain.train.report.TIME_FIELDS`, totals so far): ``time/comm_exposed`` and
  ``time/bubble``, each a fraction of the ranks' step time; ``time/io_stall``, the
  fraction of their step time and their waits for data together spent waiting (a rank
  waits for its batch before its step begins, so a slow read can outlast the steps); and
  ``time/step_ms/rank_<r>``, each rank's milliseconds per step;

each ``eval`` record ``eval/val_loss`` (text) or ``eval/test_accuracy`` and
``eval/test_loss`` (images). A resumed run drops the events after its checkpoint's step
(``purge_step``), as ``metrics.jsonl`` drops its records.
"""

from __future__ import annotations

from pathlib import Path

from mpitrain.config import ConfigError

SHARES = {"comm_exposed": "comm_exposed_s", "bubble": "bubble_s", "io_stall": "wait_s"}  # fractions of time


class Board:
    """A run's TensorBoard writer, fed the metrics records (:meth:`record`)."""

    def __init__(self, directory: Path, first_step: int = 0):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("run.tensorboard: needs the tensorboardX package: pip install -e \".[tensorboard]\" "
                              "(or pip install tensorboardX)") from None
        # a resumed run: the events after its checkpoint's step are the killed run's, done again.
        # TensorBoard reads the files in name order and purges only what it has read, so the
        # new file must sort after the old ones: tensorboardX names a file by the second and the
        # host, and two writers within one second on one host differ only by this count
        earlier = len(list(Path(directory).glob("events.out.tfevents.*")))
        self.writer = SummaryWriter(str(directory), purge_step=first_step + 1 if first_step else None,
                                    filename_suffix=f".{earlier:06d}")
        self.before: tuple[int, dict] | None = None  # the previous train record's step and rows, by rank

    def record(self, kind: str, fields: dict) -> None:
        step = fields.get("step")
        if kind == "train":
            for name in ("loss", "lr", "samples_per_s", "gflops_per_s"):
                self.writer.add_scalar(f"train/{name}", fields[name], step)
            self._times(step, {row["rank"]: row for row in fields.get("ranks") or ()})
        elif kind == "eval":
            views = "_flip" if fields.get("flip") else ""  # each image and its mirror: not one view's figure
            for name in ("val_loss", "test_accuracy", "test_loss"):
                if fields.get(name) is not None:
                    self.writer.add_scalar(f"eval/{name}{views}", fields[name], step)
        else:
            return
        self.writer.flush()

    def _times(self, step: int, rows: dict) -> None:
        """The shares of time, and each rank's step, over the steps since the last record."""
        if not rows:
            return
        last_step, last = self.before or (None, {})
        self.before = (step, rows)
        steps = step - last_step if last_step is not None else step
        delta = {r: {k: row[k] - last.get(r, {}).get(k, 0.0) for k in ("step_s", *SHARES.values())}
                 for r, row in rows.items()}
        busy = sum(d["step_s"] for d in delta.values())
        if steps <= 0 or busy <= 0:
            return
        waited = sum(d["wait_s"] for d in delta.values())
        for name, key in SHARES.items():  # the waits for data fall outside the steps: a share of both
            whole = busy + waited if key == "wait_s" else busy
            self.writer.add_scalar(f"time/{name}", sum(d[key] for d in delta.values()) / whole, step)
        for r, d in sorted(delta.items()):
            self.writer.add_scalar(f"time/step_ms/rank_{r}", 1000 * d["step_s"] / steps, step)

    def close(self) -> None:
        self.writer.close()
