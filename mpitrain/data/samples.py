"""What one sample of a split is to :class:`mpitrain.data.reader.ShardReader`: an image
and its label (:class:`Images`), or a window of ``T + 1`` tokens (:class:`Windows`), placed
every ``T`` tokens ("stride") or at random tokens ("random", :func:`random_starts`); how
each is read, and how a step's batch is handed out (as int64 ids)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

from mpitrain.data.shards import DataError, Split

if TYPE_CHECKING:
    from mpitrain.data.reader import EpochPlan

READER = 5  # seed stream tag (see loader.py for 1-4)
SAMPLING = ("stride", "random")  # how text windows are placed (see the module docstring)
_STARTS = 1  # sub-stream of READER: the random windows' starts
GAP, STRETCH = 4096, 1 << 20  # random windows: read as one stretch across gaps under GAP bytes, up to STRETCH


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele et al., OOPSLA 2014) on uint64s: a bijection whose
    outputs pass as independent uniform draws for consecutive inputs. Wrapping
    arithmetic is meant."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def random_starts(seed: int, epoch: int, slots: np.ndarray, span: int) -> np.ndarray:
    """(len(slots),) the first token of each window slot of ``epoch`` in ``"random"``
    sampling, uniform in ``[0, span)``: a function of (seed, epoch, slot) alone."""
    key = np.random.default_rng((seed, READER, epoch, _STARTS)).integers(2**63, dtype=np.uint64)
    return (_splitmix64(np.asarray(slots, dtype=np.uint64) ^ key) % np.uint64(span)).astype(np.int64)


class Images:
    """Samples are rows of ``x`` with labels ``y``."""

    def __init__(self, split: Split):
        self.split, self.sample_shape, self.n = split, split.sample_shape, split.count
        self.dtype, self.label_dtype = split.x_dtype, split.y_dtype

    def read(self, first: int, stop: int, x: np.ndarray, y: np.ndarray, plan: EpochPlan) -> int:
        return self.split.read("x", first, stop, x) + self.split.read("y", first, stop, y)

    def pair(self, x: np.ndarray, y: np.ndarray):
        """One step's (b, ...) images as stored and (b,) labels as int64."""
        return x, y.astype(np.int64)


class Windows:
    """Samples are windows of ``T + 1`` tokens, starting every ``T`` tokens or at random
    (``sampling``)."""

    def __init__(self, split: Split, T: int, sampling: str = "stride"):
        if split.count < T + 1:
            raise DataError(f"{split.shards[0].path.parent}: split {split.name!r} has {split.count} tokens, "
                            f"fewer than block_size + 1 = {T + 1}")
        self.split, self.T, self.sampling, self.sample_shape = split, T, sampling, (T + 1,)
        self.dtype, self.label_dtype = split.x_dtype, np.dtype(np.uint8)  # no labels: targets are tokens
        self.n = max(1, (split.count - T) // T)  # windows, the same number for every token offset

    def token_offset(self, draw: float) -> int:
        """Where window 0 starts: in [0, T), and never so late that the last window
        would run past the last token."""
        slack = self.split.count - 1 - self.n * self.T  # spare tokens, >= T - 1 for long texts
        return int(draw * (min(slack, self.T - 1) + 1))

    def read(self, first: int, stop: int, x: np.ndarray, y: np.ndarray, plan: EpochPlan) -> int:
        T = self.T
        if self.sampling == "random":
            starts = random_starts(plan.seed, plan.epoch, np.arange(first, stop), self.split.count - T)
            return self._scattered(starts, x)
        t0 = self.token_offset(plan.token_offset_draw)
        tokens = np.empty((stop - first) * T + 1, dtype=self.dtype)
        got = self.split.read("x", t0 + first * T, t0 + stop * T + 1, tokens)
        x[: stop - first] = np.lib.stride_tricks.as_strided(
            tokens, (stop - first, T + 1), (T * tokens.itemsize, tokens.itemsize), writeable=False)
        return got

    def _scattered(self, starts: np.ndarray, x: np.ndarray) -> int:
        """Windows at ``starts`` into the rows of ``x``. Windows less than :data:`GAP` bytes
        apart are read as one stretch of at most :data:`STRETCH` bytes and cut out of it
        (one read of 65 bytes costs about what one of 4 KiB does); returns the bytes read,
        gaps included."""
        T, item = self.T, self.dtype.itemsize
        order = np.argsort(starts, kind="stable")
        at = starts[order]  # (n,) ascending
        group = np.concatenate([[0], np.cumsum(np.diff(at) > GAP // item)])  # (n,) gaps split groups
        first = at[np.searchsorted(group, group)]  # (n,) its group's first start
        piece = (at - first) // max(1, STRETCH // item - T - 1)  # (n,) ... and groups split into stretches
        cuts = np.flatnonzero((np.diff(group) != 0) | (np.diff(piece) != 0)) + 1
        span = np.arange(T + 1)
        nbytes = 0
        for i, j in itertools.pairwise([0, *cuts.tolist(), len(at)]):
            lo, hi = int(at[i]), int(at[j - 1]) + T + 1
            tokens = np.empty(hi - lo, dtype=self.dtype)
            nbytes += self.split.read("x", lo, hi, tokens)
            x[order[i:j]] = tokens[(at[i:j] - lo)[:, None] + span]
        return nbytes

    def pair(self, x: np.ndarray, y: np.ndarray):
        """One step's (b, T + 1) windows -> (b, T) inputs and targets as int64."""
        w = x.astype(np.int64)
        return w[:, :-1], w[:, 1:]
