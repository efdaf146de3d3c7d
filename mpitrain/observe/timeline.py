"""A per-rank timeline of a run, merged into one Chrome trace file.

With ``run.timeline = true`` every rank records what it does, and the end of the run
(or a stop by signal) writes ``RUN_DIR/timeline.json`` in the Chrome trace event format:
a process per rank, with the tracks ``compute`` (each layer's forward and backward: a
GPT's embedding, blocks and head, a CNN's top-level layers; the step's other phases),
``communication`` (every collective, named by its kind, from its start, a bucket's in a
gradient hook, until the rank sees it complete) and ``io`` (the reader thread's reads); what each shows
and how to open it: ``jobs/README.md``, "Metrics, timeline and reports".

A layer's backward is timed by gradient-ready hooks: it ends when the last of its
parameters' gradients is final, and starts where the layer before it in backward order
ended. Times are microseconds since a barrier that every rank passes at the start, so
the ranks line up to within that barrier's skew. Recording appends one tuple per event;
with the timeline off nothing is installed.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path

from mpitrain.output import write_whole

TRACKS = {"compute": 0, "communication": 1, "io": 2}


class Timeline:
    """This rank's events; :meth:`write` gathers every rank's into one file on rank 0."""

    def __init__(self, comm):
        self.comm = comm
        comm.barrier()
        self.origin = time.perf_counter()
        self.events: list[tuple] = []  # (name, category, track, start s, end s, args)
        self._lock = threading.Lock()  # the reader thread records too
        self._undo: list = []
        self._backward: dict = {}

    def add(self, name: str, category: str, track: str, start: float, end: float, **args) -> None:
        """An event between two ``time.perf_counter()`` readings."""
        with self._lock:
            self.events.append((name, category, track, start - self.origin, end - self.origin, args))

    @contextlib.contextmanager
    def span(self, name: str, category: str = "compute", **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, category, "compute", start, time.perf_counter(), **args)

    # ------------------------------------------------------ layer instrumentation
    def instrument(self, layers: list) -> None:
        """Time the forward of each ``(name, module)`` and, through gradient-ready
        hooks on its parameters, its backward. A parameter shared by two layers (a tied
        embedding) counts for the first, whose backward comes last."""
        claimed: set[int] = set()
        for name, module in layers:
            inner = module.forward

            def forward(*a, _inner=inner, _name=name, **k):
                with self.span(f"forward {_name}", "forward"):
                    return _inner(*a, **k)

            object.__setattr__(module, "forward", forward)
            self._undo.append(module)
            params = [p for p in module.parameters() if p.requires_grad and id(p) not in claimed]
            claimed.update(id(p) for p in params)
            for p in params:
                p.register_post_accumulate_grad_hook(lambda p, _name=name: self._grad_ready(_name))
            self._backward[name] = len(params)

    def _grad_ready(self, name: str) -> None:
        self._pending[name] -= 1
        if self._pending[name] == 0:
            end = time.perf_counter()
            self.add(f"backward {name}", "backward", "compute", self._since, end)
            self._since = end

    def backward_starts(self) -> None:
        """Call right before ``loss.backward()``."""
        self._since = time.perf_counter()
        self._pending = dict(self._backward)

    def close(self) -> None:
        """Take the forward wrappers off again (the hooks stay, counting into nothing)."""
        for module in self._undo:
            del module.__dict__["forward"]
        self._undo = []
        self._backward = {}

    # --------------------------------------------------------------- writing
    def write(self, path: Path) -> Path | None:
        """Gather every rank's events to rank 0 and write the trace there (collective)."""
        with self._lock:
            mine = list(self.events)
        everyone = self.comm.gather(mine)
        if self.comm.rank != 0:
            return None
        trace = []
        for rank, events in enumerate(everyone):
            trace.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
            trace.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
            for track, tid in TRACKS.items():
                trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
            for name, category, track, start, end, args in events:
                trace.append({"name": name, "cat": category, "ph": "X", "pid": rank, "tid": TRACKS[track],
                              "ts": round(start * 1e6, 3), "dur": round(max(0.0, end - start) * 1e6, 3),
                              "args": args})
        try:
            write_whole(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
        except OSError as e:  # the disk's fault (full, say): the trace only reports, the run is not lost
            print(f"warning: {path}: could not be written ({e.strerror or e}); the run has no timeline",
                  file=sys.stderr, flush=True)
            return None
        return path
