"""The metrics file of a run: ``RUN_DIR/metrics.jsonl``, one JSON record per line.

Every record has ``kind`` and ``time`` (Unix seconds); the kinds the trainer writes:

* ``start``, once per process (a resumed run adds one): ``step`` (0, or the
  checkpoint's), ``total_steps``, ``steps_per_epoch``, ``ranks``, ``threads`` (BLAS
  threads per rank), the resolved ``config``,
  ``run`` (the run's identity: :mod:`mpitrain.train.identity`);
* ``train``, each ``train.log_interval`` steps: ``step``, ``epoch``, ``loss`` (mean over
  the steps since the last record), ``lr``, ``samples_per_s``, ``gflops_per_s``, and
  ``ranks``: each rank's time-table row so far (:data:`mpitrain.train.report.TIME_FIELDS`);
* ``eval``: ``step``, ``val_loss`` (text) or ``test_accuracy`` and ``test_loss`` (images);
* ``checkpoint``: ``step``, ``path``, ``why``; ``stopped``: ``step``, ``signal``;
* ``diverged``: ``step``, ``loss`` (as text: ``"nan"``, ``"inf"``), ``checkpoint`` (the
  last good one, or null), when a loss that is not finite stops the run (``run.on_nan``);
* ``end``: the run's totals (``steps_timed`` by this process) and the same ``ranks``.

A resumed run keeps the records up to its checkpoint's step and drops the later ones
(the killed run's steps, which it does again), so the file reads as one run. In a
parameter-server run worker 0 writes the file (the servers never see a loss): its
``train`` records are its own steps, with ``samples_per_s`` its rate times the number
of workers (exact when synchronous), and ``end`` adds the ``staleness`` histogram.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from mpitrain.output import write_whole


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


class MetricsLog:
    """Append records to ``path`` (None: write nothing, as on ranks other than 0). The
    file only reports: when the disk refuses it (full, say), ``warn`` says so once and
    the run goes on without it (its checkpoints, which decide the run, fail loudly)."""

    def __init__(self, path: Path | None, first_step: int = 0, mirror=None, warn=None):
        self.path = path
        self.mirror = mirror  # also given every record (observe/tensorboard.py's Board), or None
        self.warn = warn or (lambda message: print(message, file=sys.stderr, flush=True))
        if path is None:
            return
        kept = []
        if first_step and path.exists():
            for record in read(path):
                step, kind = record.get("step", 0), record.get("kind")
                # the resumed run evaluates at its first step again (and ends again)
                if step < first_step or (step == first_step and kind not in ("eval", "end")):
                    kept.append(json.dumps(record) + "\n")
        try:
            write_whole(path, "".join(kept))
        except OSError as e:
            self._lost(e, "it is left as it was")

    def write(self, kind: str, **fields) -> None:
        if self.path is None:
            return
        line = json.dumps({"kind": kind, "time": round(time.time(), 3), **fields}, default=_plain)
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as e:
            at = f" (step {fields['step']})" if "step" in fields else ""
            self._lost(e, f"its records end before this {kind} record{at}")
        if self.mirror is not None:
            self.mirror.record(kind, json.loads(line))  # as the file has it: plain numbers

    def _lost(self, error: OSError, kept: str) -> None:
        self.warn(f"warning: {self.path}: could not be written ({error.strerror or error}); {kept}, and the run "
                  "goes on without it")
        self.path = None


def read(path) -> list[dict]:
    """The records of a metrics file, skipping a line cut short when a run was killed
    (or otherwise not a record: the file only reports, nothing about a run depends on it)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
