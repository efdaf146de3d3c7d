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
"""

from __future__ import annotations

CATEGORIES = (("param_bytes", "parameters"), ("grad_bytes", "gradients"), ("optim_bytes", "optimizer state"))


def bytes_per_parameter(sync: str, P: int, moments: int = 2, itemsize: int = 4, mixed: bool = False) -> float:
    """The formula: bytes per parameter that one of ``P`` ranks holds with ``sync``, an
    optimizer of ``moments`` arrays per parameter (Adam 2, SGD with momentum 1) and
    parameters of ``itemsize`` bytes (float32 4, float64 8), or ``mixed`` precision's
    (half weights and gradients, float32 master and state)."""
    w = g = 2 if mixed else itemsize
    s = moments * (4 if mixed else itemsize) + (4 if mixed else 0)
    shares = {"ddp": w + g + s, "local": w + g + s, "zero1": w + g + s / P, "zero2": w + (g + s) / P,
              "zero3": (w + g + s) / P}
    if sync not in shares:
        raise ValueError(f"no model-state formula for {sync!r}")
    return shares[sync]


def state_line(counted: dict, parameters: int, formula: float | None) -> str:
    """One rank's model state by category (``counted``: a sync's ``memory()``) and the
    formula's bytes per parameter beside it (None: no formula for this layout)."""
    parts = " + ".join(f"{label} {counted[key] / 1e6:.2f} MB" for key, label in CATEGORIES)
    total = sum(counted[key] for key, _ in CATEGORIES)
    line = f"model state per rank (the largest): {parts} = {total / 1e6:.2f} MB, {total / parameters:.2f} B/parameter"
    if formula is not None:
        line += f"; formula {formula:.2f} B/parameter ({total / (formula * parameters):.3f} of it)"
    return line + f"; the optimizer's work array {counted['work_bytes'] / 1e6:.2f} MB besides"
