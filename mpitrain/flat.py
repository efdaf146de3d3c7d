"""Flat layouts: parameters laid end to end in one contiguous array.

Every strategy moves gradients, and ZeRO and the parameter servers also parameters, as
flat contiguous buffers, so that one buffer method sends many parameters without
pickling or copying; the layout helpers are here, once, for every strategy. A
:class:`Flat` owns such a buffer for a list of parameters and makes each parameter's
``.grad`` (and, if asked, ``.data``) a view into it: backward accumulates straight into
the buffer, and an optimizer updating ``.data`` updates the buffer. Element
``offsets[i]`` of the buffer is the first of parameter ``i``; checkpoints store
optimizer state in the same coordinates (:func:`offsets`), which is what makes them
independent of how a run split the state.

This module is part of the base: it knows arrays and parameters, never MPI.
"""

from __future__ import annotations

import numpy as np


def offsets(params) -> np.ndarray:
    """(len(params) + 1,) where each parameter starts in the flat layout, and the end."""
    return np.cumsum([0] + [p.size for p in params])


def pieces(offsets: np.ndarray, indices=None) -> list[tuple[int, int, int]]:
    """``(i, lo, hi)``: where parameter ``i`` lies in a flat layout of ``offsets``, for
    each of ``indices`` (all by default): the pieces of optimizer state a checkpoint
    reads and writes."""
    indices = range(len(offsets) - 1) if indices is None else indices
    return [(i, int(offsets[i]), int(offsets[i + 1])) for i in indices]


def one_dtype(params, what: str) -> np.dtype:
    """The dtype all ``params`` share; ``what`` names the caller in the error."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"{what} keeps parameters in one flat array of one dtype, got {sorted(map(str, dtypes))}")
    return dtypes.pop()


class Flat:
    """``params`` end to end: ``grad`` (n,) holds their gradients and each ``p.grad``
    becomes a view into it (an existing gradient is copied in, else zero); with
    ``data=True``, ``data`` (n,) holds their values likewise (``p.data`` a view).
    ``grad=False`` leaves the gradients alone (``grad`` is None: ZeRO-2 keeps no whole
    gradient). ``dtype`` is the arrays' dtype when ``params`` is empty."""

    def __init__(self, params, data: bool = False, what: str = "a flat layout", dtype=None, grad: bool = True):
        self.params = list(params)
        dtype = one_dtype(self.params, what) if self.params else np.dtype(dtype)
        self.offsets = offsets(self.params)  # (len(params) + 1,)
        n = int(self.offsets[-1])
        self.grad = np.zeros(n, dtype=dtype) if grad else None  # (n,)
        self.data = np.empty(n, dtype=dtype) if data else None  # (n,)
        for p, lo, hi in zip(self.params, self.offsets[:-1], self.offsets[1:]):
            if data:
                self.data[lo:hi] = p.data.reshape(-1)
                p.data = self.data[lo:hi].reshape(p.shape)
            if grad:
                view = self.grad[lo:hi].reshape(p.shape)
                if p.grad is not None:
                    view[...] = p.grad
                p.grad = view


def buckets(params, cap_bytes: int, kind=None) -> list[list]:
    """``params`` in their order, cut into consecutive groups of one dtype and at most
    ``cap_bytes`` each (a parameter larger than the cap is a group of its own); with
    ``kind`` (a parameter -> a label), of one kind each too."""
    groups: list[list] = []
    size = 0
    kind = kind or (lambda p: None)
    for p in params:
        if (not groups or size + p.data.nbytes > cap_bytes or groups[-1][0].dtype != p.dtype
                or kind(groups[-1][0]) != kind(p)):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.data.nbytes
    return groups


class Buckets:
    """Gradients exchanged in buckets started during backward (data parallelism's and
    ZeRO-2's): ``params`` grouped as backward completes them (:func:`buckets`), and the
    gradient-ready hook that counts a bucket down and calls ``start(i)`` once bucket ``i``
    is complete and every one before it has started, so every rank starts them in the same
    order (their collectives must match); then ``progress()``, if given, moves what is in
    flight. ``early=False`` only counts (all start in :meth:`flush`); while ``counting`` is
    false (micro-batches accumulating) the hooks do nothing. ``kind``: as :func:`buckets`."""

    def __init__(self, params, cap_bytes: int, start, progress=None, early: bool = True, kind=None):
        params = list(params)
        self.groups = buckets(reversed(params), cap_bytes, kind)  # bucket i's parameters, as backward completes them
        self._of = {id(p): i for i, group in enumerate(self.groups) for p in group}
        self.start, self.progress, self.early, self.counting = start, progress, early, True
        self.waiting = [len(group) for group in self.groups]  # parameters of this pass not ready yet
        self.next = 0  # the first bucket not started in this pass
        for p in params:
            p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p) -> None:
        """The gradient of ``p`` is complete for this backward pass."""
        if not self.counting:
            return
        i = self._of[id(p)]
        if self.waiting[i] == 0:
            raise RuntimeError("a second backward before finish(): call finish() after each backward, "
                               "or accumulate inside no_sync()")
        self.waiting[i] -= 1
        while self.early and self.next < len(self.groups) and self.waiting[self.next] == 0:
            self.start(self.next)
            self.next += 1
        if self.progress is not None:
            self.progress()

    def flush(self) -> None:
        """The end of a backward pass: start every bucket not started yet (a parameter that
        took no part in the forward leaves its bucket incomplete); count afresh."""
        while self.next < len(self.groups):
            self.start(self.next)
            self.next += 1
        self.waiting = [len(group) for group in self.groups]
        self.next = 0
