"""Finite-difference gradient checking for ops, layers and whole models.

``gradcheck(f, inputs)`` compares the gradients that backpropagation computes with
central differences ``(L(x + h) - L(x - h)) / 2h`` of ``L = sum(f(inputs) * G)`` for a
fixed random upstream gradient ``G``. Use float64 inputs: with ``h = 1e-6`` the
difference quotient is then accurate to about 1e-9 relative, so a correct backward pass
agrees to far better than the 1e-6 that the checks require, and a wrong one does not.
"""

from __future__ import annotations

import numpy as np

from mpitrain.autograd import backward
from mpitrain.tensor import Tensor, no_grad


SCALE_FLOOR = 1e-3


def _relative_error(analytic: np.ndarray, numeric: np.ndarray) -> float:
    """Largest absolute difference, relative to the larger gradient's largest entry. The
    scale never goes below ``SCALE_FLOOR``: a gradient that is exactly zero (a bias
    followed by batch norm) has only round-off, about 1e-10, in its difference quotient,
    which is not an error; a wrong gradient of any size that matters still fails."""
    scale = max(np.abs(analytic).max(initial=0.0), np.abs(numeric).max(initial=0.0), SCALE_FLOOR)
    return float(np.abs(analytic - numeric).max(initial=0.0) / scale)


def gradcheck(f, inputs, *, h: float = 1e-6, seed: int = 20160101, max_points: int | None = None, params=()) -> dict:
    """Check d f(*inputs) against finite differences; return relative errors by name.
    ``inputs`` are tensors (those with ``requires_grad`` are checked); ``params`` are
    further tensors that ``f`` uses internally (a module's parameters), checked too.
    ``f`` must be deterministic (seed any dropout inside it). ``max_points`` limits how
    many elements per tensor are perturbed (chosen at random); by default all are."""
    rng = np.random.default_rng(seed)
    checked = [(f"input{i}", t) for i, t in enumerate(inputs) if isinstance(t, Tensor) and t.requires_grad]
    checked += [(getattr(p, "name", None) or f"param{i}", p) for i, p in enumerate(params)]
    for _, t in checked:
        if t.dtype != np.float64 or not t.data.flags.c_contiguous:
            raise TypeError(f"gradcheck needs contiguous float64 tensors ({t!r})")
        t.grad = None

    def outputs(res) -> list:
        return list(res) if isinstance(res, (tuple, list)) else [res]

    first = outputs(f(*inputs))
    used = [i for i, o in enumerate(first) if isinstance(o, Tensor) and o.requires_grad]
    if not used:
        raise ValueError("gradcheck: no output of f depends on a checked input (the graph is cut)")
    outs = [first[i] for i in used]
    upstream = [rng.standard_normal(o.shape) for o in outs]
    backward(outs, upstream)
    analytic = {name: (t.grad.copy() if t.grad is not None else np.zeros(t.shape)) for name, t in checked}

    def loss() -> float:
        with no_grad():
            res = outputs(f(*inputs))
        return float(sum(np.sum(res[i].data * u) for i, u in zip(used, upstream)))

    errors = {}
    for name, t in checked:
        flat = t.data.reshape(-1)  # a view: perturbing it perturbs the tensor
        points = np.arange(flat.size)
        if max_points is not None and flat.size > max_points:
            points = rng.choice(flat.size, max_points, replace=False)
        numeric = np.zeros(len(points))
        for n, i in enumerate(points):
            saved = flat[i]
            flat[i] = saved + h
            up = loss()
            flat[i] = saved - h
            down = loss()
            flat[i] = saved
            numeric[n] = (up - down) / (2 * h)
        errors[name] = _relative_error(analytic[name].reshape(-1)[points], numeric)
    return errors
