"""The random streams behind dropout and weight initialisation.

**The process-wide stream.** One ``np.random.Generator`` per process, seeded by
:func:`manual_seed`, draws the initial weights and, outside :func:`sample_streams`,
every dropout mask in call order. Its state is plain data (:func:`get_state` /
:func:`set_state`), so a checkpoint can save and restore it.

**Per-sample streams.** In call order, a sample's dropout mask depends on everything
drawn before it, so training with dropout would change with the samples sharing its
micro-batch, the micro-batches (m), the data-parallel replicas (dp), and the pipeline
stages (p) and their schedule (a stage on rank 1 never sees rank 0's draws). Inside
:func:`sample_streams` a mask is instead drawn per sample, each sample's share from its
own stream, keyed by ``(seed, step, sample, layer)``: ``sample`` its position in the
step's *global* batch, ``layer`` its index in ``model.named_layers()`` (:func:`layer`).
A sample then gets the same masks whatever shares its micro-batch, whichever rank runs
it, and whichever stage runs its layers, in whatever order. (Megatron-LM's
``CudaRNGStatesTracker`` solves a related problem for tensor parallelism: which dropout
must agree across a tensor-parallel group and which must differ.)

A stream is NumPy's SFC64 seeded by ``SeedSequence([seed, DROPOUT, step, sample, layer])``
(``DROPOUT`` tags these seeds apart from the data pipeline's), started lazily at a layer's
first mask (layers without dropout, and evaluation, cost nothing). Its raw 64-bit words are
compared with an integer threshold (:func:`_sample_mask`): SeedSequence and the bit
generators' raw streams are the parts of NumPy's random API whose output is fixed across
versions (``Generator.random`` is not promised to be), and integers need no conversion to
floats. SFC64 drew masks faster than a keyed Philox or PCG64 (``mpitrain/bench/README.md``).
"""

from __future__ import annotations

import contextlib
import math
import operator

import numpy as np

DROPOUT = 6  # seed stream tag (the data pipeline's are 1 to 5)

_generator = np.random.default_rng(0)


def manual_seed(seed: int) -> np.random.Generator:
    """Reseed the process-wide generator and return it."""
    global _generator
    _generator = np.random.default_rng(seed)
    return _generator


def generator() -> np.random.Generator:
    return _generator


def get_state() -> dict:
    """The process-wide generator's state (JSON-able; with the per-sample streams: :func:`snapshot`)."""
    return _generator.bit_generator.state


def set_state(state: dict) -> None:
    _generator.bit_generator.state = state


# ------------------------------------------------------------- per-sample streams
class _Streams:
    """One active :func:`sample_streams`: its keys, the current layer, and the current
    layer's per-sample bit generators (None until the layer's first mask)."""

    __slots__ = ("seed", "step", "samples", "layer", "gens")

    def __init__(self, seed: int, step: int, samples: list):
        self.seed, self.step, self.samples = seed, step, samples
        self.layer, self.gens = 0, None

    def start(self) -> list:
        """Fresh streams of the samples for the current layer."""
        return [np.random.SFC64(np.random.SeedSequence([self.seed, DROPOUT, self.step, s, self.layer]))
                for s in self.samples]


_streams: _Streams | None = None


def _uint64(name: str, value) -> int:
    value = operator.index(value)
    if not 0 <= value < 1 << 64:
        raise ValueError(f"rng: {name} must be in [0, 2**64), got {value}")
    return value


@contextlib.contextmanager
def sample_streams(seed: int, step: int, samples):
    """Draw dropout masks per sample while active (nested, the inner one rules until it
    exits). ``samples`` (an int array or range, length B) are the step's global batch
    positions of the micro-batch about to run forward, in its activations' leading order.
    A mask of shape (B, ...) or (B*T, ...) (sample-major, C order) is then, sample by
    sample, ``size // B`` elements of each sample's stream; successive masks within one
    layer continue the streams. ``seed``, ``step`` and the samples are integers in [0, 2**64)."""
    global _streams
    samples = np.asarray(samples)
    if samples.ndim != 1 or (samples.size and samples.dtype.kind not in "iu"):
        raise TypeError(f"sample_streams: samples must be a 1-d integer array or range, got {samples!r}")
    s = _Streams(_uint64("seed", seed), _uint64("step", step), [_uint64("sample", i) for i in samples.tolist()])
    outer, _streams = _streams, s
    try:
        yield
    finally:
        _streams = outer


@contextlib.contextmanager
def layer(index: int):
    """``with rng.layer(i):`` the forward of layer ``i`` of ``model.named_layers()`` is
    running. Inside :func:`sample_streams`, entering starts fresh per-sample streams keyed
    with layer ``i``, and leaving resumes the enclosing layer's streams; masks drawn with
    no ``layer`` active use layer 0. Outside ``sample_streams`` this does nothing."""
    index, s = _uint64("layer", index), _streams
    if s is None:
        yield
        return
    saved = s.layer, s.gens
    s.layer, s.gens = index, None
    try:
        yield
    finally:
        s.layer, s.gens = saved


def snapshot():
    """Everything a dropout mask is drawn from: the process-wide generator's state and the
    active per-sample streams (which, their layer, how far each has drawn); :func:`restore`
    puts it back, so checkpointing replays a block's masks exactly, wherever backward runs."""
    s = _streams
    frame = None if s is None else (s, s.layer, None if s.gens is None else [g.state for g in s.gens])
    return _generator.bit_generator.state, frame


def restore(snap) -> None:
    """Make the streams of ``snap = snapshot()`` active again, each where it was."""
    global _streams
    state, frame = snap
    _generator.bit_generator.state = state
    if frame is None:
        _streams = None
        return
    s, index, states = frame
    s.layer, s.gens = index, None
    if states is not None:
        s.gens = s.start()  # then moved to where they were
        for g, st in zip(s.gens, states):
            g.state = st
    _streams = s


# ------------------------------------------------------------------------ masks
_rows: tuple | None = None  # (lo, hi, total): the masks drawn are rows lo..hi of axis 1 of masks of `total` rows


@contextlib.contextmanager
def rows(lo: int, hi: int, total: int):
    """Masks drawn inside are rows ``lo .. hi`` (axis 1, the sequence) of the masks of ``total`` rows one
    process draws: a rank that holds a slice of the sequence (sequence parallelism) drops what one process does."""
    global _rows
    outer, _rows = _rows, (lo, hi, total)
    try:
        yield
    finally:
        _rows = outer


def dropout_mask(gen: np.random.Generator | None, shape: tuple, p: float, dtype) -> np.ndarray:
    """Inverted-dropout mask: 0 with probability p, else 1/(1-p) (expected value 1), drawn
    from ``gen`` if given, else from the per-sample streams inside :func:`sample_streams`,
    else from the process-wide generator; inside :func:`rows`, the rows of the whole mask."""
    if _rows is not None:
        lo, hi, total = _rows
        if len(shape) < 2 or shape[1] != hi - lo:
            raise ValueError(f"dropout mask of shape {tuple(shape)} inside rng.rows({lo}, {hi}, {total})")
        whole = _draw(gen, (shape[0], total, *shape[2:]), p, dtype)
        return np.ascontiguousarray(whole[:, lo:hi])
    return _draw(gen, shape, p, dtype)


def _draw(gen, shape: tuple, p: float, dtype) -> np.ndarray:
    if gen is None and _streams is not None:
        return _sample_mask(_streams, shape, p, dtype)
    out = ((_generator if gen is None else gen).random(shape, dtype=np.float32) >= p).astype(dtype)
    out *= 1.0 / (1.0 - p)
    return out


def _sample_mask(s: _Streams, shape: tuple, p: float, dtype) -> np.ndarray:
    """Sample ``i``'s ``n = size // B`` elements: its next ``ceil(n/2)`` words, as
    little-endian 32-bit halves ``u``, kept where ``u >= ceil(p * 2**32)``."""
    B = len(s.samples)
    if not shape or B == 0 or shape[0] % B:
        raise ValueError(f"dropout mask of shape {tuple(shape)}: its leading dimension must be a multiple "
                         f"of the {B} samples of sample_streams")
    if s.gens is None:
        s.gens = s.start()
    n = math.prod(shape) // B
    threshold = np.uint32(min(math.ceil(p * 2.0**32), 2**32 - 1))
    out = np.empty((B, n), dtype=dtype)
    for g, row in zip(s.gens, out):
        u = g.random_raw((n + 1) // 2).astype("<u8", copy=False).view("<u4")[:n]
        np.greater_equal(u, threshold, out=row)
    out *= 1.0 / (1.0 - p)
    return out.reshape(shape)
