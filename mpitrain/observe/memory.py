"""The model state a rank holds, by category, against ZeRO's formula (Rajbhandari et al.,
SC 2020): the end of a training run prints it, and ``mpitrain bench memory`` measures it.

Per parameter, with weights of ``w`` bytes, gradients of ``g`` bytes and optimizer
state of ``s`` bytes (Adam's two moments, SGD's momentum, and in mixed precision the
float32 master weight), on ``P`` data-parallel ranks:

* ``ddp`` (and ``local``): ``w + g + s``, everything replicated: 4 + 4 + 8 = 16 with Adam in
  float32; mixed precision 2 + 2 + (4 + 8) = 16 as well (:mod:`mpitrain.precision`);
* ``zero1``: ``w + g + s/P`` (8 + 8/P with Adam);
* ``zero2``: ``w + (g + s)/P`` (4 + 12/P);
* ``zero3``: ``(w + g + s)/P`` (16/P).

A run also measures what it holds (:class:`HeapTrace`): ``tracemalloc``, which sees
NumPy's buffers, traces the heap from before the model is built through the first steps,
then stops (``run.trace_memory``; tracing slows the steps it covers, the data reader's
first reads most, allocation-heavy Python: ``mpitrain/bench/README.md``): the heap at
rest after the second step (the optimizer's state exists from the first on), split by
where it was allocated (the data reader's buffers, communication work arrays, the rest:
the model state, whose formula is above), and the peak of the third step above it
(activations, gradients in flight, buffers of the exchange).
"""

from __future__ import annotations

import tracemalloc

FORMULA_SYNCS = ("ddp", "local", "zero1", "zero2", "zero3")  # the layouts with a formula below
CATEGORIES = (("param_bytes", "parameters"), ("grad_bytes", "gradients"), ("optim_bytes", "optimizer state"))


def bytes_per_parameter(sync: str, P: int, moments: int = 2, itemsize: int = 4, mixed: bool = False) -> float | None:
    """The formula: bytes per parameter that one of ``P`` ranks holds with ``sync``, an
    optimizer of ``moments`` arrays per parameter (Adam 2, SGD with momentum 1) and
    parameters of ``itemsize`` bytes (float32 4, float64 8), or ``mixed`` precision's
    (half weights and gradients, float32 master and state). None for a layout without
    one here (parameter servers)."""
    w = g = 2 if mixed else itemsize
    s = moments * (4 if mixed else itemsize) + (4 if mixed else 0)
    shares = dict(zip(FORMULA_SYNCS, (w + g + s, w + g + s, w + g + s / P, w + (g + s) / P, (w + g + s) / P)))
    return shares.get(sync)


class HeapTrace:
    """The heap of this process from its construction (before the model is built) to the
    end of step ``REST_STEP + 1`` of the run (``after_step``), by ``tracemalloc``; does
    nothing if ``enabled`` is false or something else traces already."""

    REST_STEP = 2  # the heap at rest after this many steps: the optimizer's state exists after the first
    FRAMES = 12  # of each allocation's stack: enough to get from NumPy's Python code back into mpitrain's
    # the innermost mpitrain file of an allocation's stack -> its category (the model state: any other of
    # mpitrain's files; outside mpitrain altogether: "other", a module imported during the run)
    PLACES = (("/mpitrain/data/", "data"), ("/mpitrain/comm/", "communication"), ("/mpitrain/", "model state"))

    def __init__(self, enabled: bool = True):
        self.tracing = enabled and not tracemalloc.is_tracing()
        self.base, self.rest, self.parts, self.peak = 0, None, {}, None
        if self.tracing:
            tracemalloc.start(self.FRAMES)
            self.base = tracemalloc.get_traced_memory()[0]

    def after_step(self, done: int) -> None:
        """After this process's ``done``-th step of the run."""
        if not self.tracing:
            return
        if done == self.REST_STEP:
            self.rest = tracemalloc.get_traced_memory()[0] - self.base
            for stat in tracemalloc.take_snapshot().statistics("traceback"):
                part = self._category(stat.traceback)
                self.parts[part] = self.parts.get(part, 0) + stat.size
            tracemalloc.reset_peak()
        elif done == self.REST_STEP + 1:
            self.peak = tracemalloc.get_traced_memory()[1] - self.base
            self.stop()

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

    def figures(self) -> dict | None:
        """{"rest", "peak", "parts": {category: bytes}} once measured (None before)."""
        return None if self.peak is None else {"rest": self.rest, "peak": self.peak, "parts": self.parts}


def state_line(counted: dict, parameters: int, formula: float | None) -> str:
    """One rank's model state by category (``counted``: a sync's ``memory()``) and the
    formula's bytes per parameter beside it (None: no formula for this layout)."""
    parts = " + ".join(f"{label} {counted[key] / 1e6:.2f} MB" for key, label in CATEGORIES)
    total = sum(counted[key] for key, _ in CATEGORIES)
    line = f"model state per rank (the largest): {parts} = {total / 1e6:.2f} MB, {total / parameters:.2f} B/parameter"
    if formula is not None:
        line += f"; formula {formula:.2f} B/parameter ({total / (formula * parameters):.3f} of it)"
    return line + f"; the optimizer's work array {counted['work_bytes'] / 1e6:.2f} MB besides"


def heap_line(measured: dict, counted: dict | None, parameters: int, formula: float | None) -> str:
    """The heap a rank held, measured (:meth:`HeapTrace.figures`): at rest by category,
    its model state (less the optimizer's work array, ``counted``) beside the formula,
    and the step's peak."""
    parts = measured["parts"]
    line = (f"heap per rank (the largest, traced over steps 1-{HeapTrace.REST_STEP + 1}): at rest "
            f"{measured['rest'] / 1e6:.2f} MB = " + " + ".join(f"{name} {size / 1e6:.2f}"
                                                              for name, size in sorted(parts.items())))
    if counted is not None and formula is not None:
        state = parts.get("model state", 0) - counted["work_bytes"]
        line += (f"; model state less the work array {state / 1e6:.2f} MB, {state / (formula * parameters):.3f} "
                 f"of the formula")
    return line + (f"; a step's peak {measured['peak'] / 1e6:.2f} MB, {(measured['peak'] - measured['rest']) / 1e6:.2f}"
                   f" above rest (activations, gradients in flight, exchange buffers)")
