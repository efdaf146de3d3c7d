"""The model state a rank holds, by category, against ZeRO's formula
(:func:`mpitrain.cost.bytes_per_parameter`): the end of a training run prints it, and
``mpitrain bench memory`` measures it. :func:`model_state` counts it from the arrays
themselves, a buffer behind views (a bucket, a flat shard, a ZeRO-3 group's chunk) once.

A run also measures what it holds (:class:`HeapTrace`, ``run.trace_memory``) with
``tracemalloc``, which sees NumPy's buffers, over its first steps only: tracing slows the
steps it covers (the data reader's first reads most, allocation-heavy Python:
``mpitrain/bench/README.md``).
"""

from __future__ import annotations

import tracemalloc

import numpy as np

CATEGORIES = (("param_bytes", "parameters"), ("grad_bytes", "gradients"), ("optim_bytes", "optimizer state"))


def model_state(model, optimizer) -> dict:
    """Bytes a rank keeps between steps: ``param_bytes`` and ``grad_bytes`` (the buffers
    behind ``model``'s parameters and gradients and those of the pieces ``optimizer``
    updates, each buffer once), ``optim_bytes`` (its state; in mixed precision with the
    float32 masters) and ``work_bytes`` (its reusable work array, not model state); and
    ``parameters``, how many of the model's this rank's part has (all, or a stage's, or
    slices' sizes); ``trained``, how many of them train, and ``frozen_bytes``, the buffers of
    the others (fine-tuning's: weights alone, no gradient or optimizer state)."""
    mixed = getattr(optimizer, "masters", None) is not None  # its groups hold float32 masters (optimizer state)
    pieces = [] if optimizer is None else list(optimizer.params) if mixed else \
        [q for group in optimizer.param_groups for q in group["params"]]  # mixed: the 16-bit copies (or pieces)
    held = list(model.parameters()) + pieces
    memory = {} if optimizer is None else optimizer.memory()
    return {"param_bytes": _buffers(q.data for q in held), "grad_bytes": _buffers(q.grad for q in held),
            "optim_bytes": memory.get("optim_bytes", 0), "work_bytes": memory.get("work_bytes", 0),
            "parameters": sum(q.size for q in model.parameters()),
            "trained": sum(q.size for q in model.parameters() if q.requires_grad),
            "frozen_bytes": _buffers(q.data for q in model.parameters() if not q.requires_grad)}


def _buffers(arrays) -> int:
    """Bytes of the distinct buffers behind ``arrays`` (views counted once; a broadcast
    placeholder, which holds no memory, not at all)."""
    seen = {}
    for a in arrays:
        if a is None:
            continue
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.nbytes >= a.nbytes:  # less: a broadcast placeholder (ZeRO-3's), which holds no memory
            seen[id(root)] = root.nbytes
    return sum(seen.values())


class HeapTrace:
    """The heap of this process from its construction (before the model is built) to the
    end of step ``REST_STEP + 1`` of the run (``after_step``), by ``tracemalloc``: at rest
    after step ``REST_STEP``, split by where it was allocated (``PLACES``; the model state,
    :func:`mpitrain.cost.bytes_per_parameter`'s, is the rest), and the peak of the next step above it
    (activations, gradients in flight, buffers of the exchange). The training reader
    (``reader``) is measured full (:meth:`~mpitrain.data.reader.ShardReader.settle`), its
    thread held in the step that follows (:meth:`~mpitrain.data.reader.ShardReader.hold`).
    Does nothing if ``enabled`` is false or something else traces already."""

    REST_STEP = 2  # the heap at rest after this many steps: the optimizer's state exists after the first
    FRAMES = 12  # of each allocation's stack: enough to get from NumPy's Python code back into mpitrain's
    # the innermost mpitrain file of an allocation's stack -> its category (the model state: any other of
    # mpitrain's files; outside mpitrain altogether: "other", a module imported during the run)
    PLACES = (("/mpitrain/data/", "data"), ("/mpitrain/comm/", "communication"), ("/mpitrain/", "model state"))

    def __init__(self, enabled: bool = True):
        self.tracing = enabled and not tracemalloc.is_tracing()
        self.base, self.rest, self.parts, self.peak, self.reader_growth = 0, None, {}, None, 0
        self.reader = None  # the training reader (hold, release): its thread begins no round in the measured step
        if self.tracing:
            tracemalloc.start(self.FRAMES)
            self.base = tracemalloc.get_traced_memory()[0]

    def after_step(self, done: int) -> None:
        """After this process's ``done``-th step of the run."""
        if not self.tracing:
            return
        if done == self.REST_STEP:
            if self.reader is not None:  # at rest with its queue full; then no round gathered in the step
                self.reader.settle()
                self.reader.hold()
            self.rest = tracemalloc.get_traced_memory()[0] - self.base
            self.parts = self._parts()
            tracemalloc.reset_peak()
        elif done == self.REST_STEP + 1:
            self.peak = tracemalloc.get_traced_memory()[1] - self.base
            # the reader's thread reads ahead on its own schedule: what it added in the step is its own
            self.reader_growth = max(0, self._parts().get("data", 0) - self.parts.get("data", 0))
            self.stop()

    def _parts(self) -> dict:
        """{category: bytes} of what is allocated now."""
        parts: dict = {}
        for stat in tracemalloc.take_snapshot().statistics("traceback"):
            part = self._category(stat.traceback)
            parts[part] = parts.get(part, 0) + stat.size
        return parts

    def _category(self, traceback) -> str:
        for frame in reversed(traceback):  # from the innermost frame out
            where = frame.filename.replace("\\", "/")
            for place, name in self.PLACES:
                if place in where:
                    return name
        return "other"

    def stop(self) -> None:
        if self.tracing:
            tracemalloc.stop()
            self.tracing = False
        if self.reader is not None:
            self.reader.release()
            self.reader = None

    def figures(self) -> dict | None:
        """{"rest", "peak", "parts": {category: bytes}, "reader_growth": what the reader's thread
        added during the step after rest} once measured (None before)."""
        return None if self.peak is None else {"rest": self.rest, "peak": self.peak, "parts": self.parts,
                                               "reader_growth": self.reader_growth}


def state_line(counted: dict, parameters: int, formula: float | None) -> str:
    """One rank's model state by category (``counted``: :func:`model_state`'s) and the
    formula's bytes per parameter beside it (None: no formula for this layout)."""
    parts = " + ".join(f"{label} {counted[key] / 1e6:.2f} MB" for key, label in CATEGORIES)
    total = sum(counted[key] for key, _ in CATEGORIES)
    line = f"model state per rank (the largest): {parts} = {total / 1e6:.2f} MB, {total / parameters:.2f} B/parameter"
    if formula is not None:
        share = total / _expected(counted, parameters, formula)
        line += f"; formula {_formula(counted, parameters, formula)} ({share:.3f} of it)"
    return line + f"; the optimizer's work array {counted['work_bytes'] / 1e6:.2f} MB besides"


def _expected(counted: dict, parameters: int, formula: float) -> float:
    """Bytes of model state by the formula: its bytes per parameter for those that train
    (all, unless fine-tuning froze some), the frozen ones' weights as held."""
    return formula * counted.get("trained", parameters) + counted.get("frozen_bytes", 0)


def _formula(counted: dict, parameters: int, formula: float) -> str:
    """The formula's words: its bytes per parameter, and what of them train."""
    trained = counted.get("trained", parameters)
    if trained == parameters:
        return f"{formula:.2f} B/parameter"
    return (f"{formula:.2f} B/parameter of the {trained:,} that train, the frozen "
            f"{counted['frozen_bytes'] / 1e6:.2f} MB of weights alone")


def heap_line(measured: dict, counted: dict, parameters: int, formula: float | None) -> str:
    """The heap a rank held, measured (:meth:`HeapTrace.figures`): at rest by category,
    its model state (less the optimizer's work array, ``counted``) beside the formula,
    and the step's peak."""
    parts = measured["parts"]
    line = (f"heap per rank (the largest, traced over steps 1-{HeapTrace.REST_STEP + 1}): at rest "
            f"{measured['rest'] / 1e6:.2f} MB = " + " + ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(parts.items())))
    if formula is not None:
        state = parts.get("model state", 0) - counted["work_bytes"]
        line += (f"; model state less the work array {state / 1e6:.2f} MB, "
                 f"{state / _expected(counted, parameters, formula):.3f} of the formula")
    return line + (f"; a step's peak {measured['peak'] / 1e6:.2f} MB, {(measured['peak'] - measured['rest']) / 1e6:.2f}"
                   f" above rest (activations, gradients in flight, exchange buffers)")
