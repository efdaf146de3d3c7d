"""The random stream behind dropout and weight initialisation.

One ``np.random.Generator`` per process, seeded by :func:`manual_seed`. Its state is
plain data (:func:`get_state` / :func:`set_state`), so activation checkpointing can
replay a block's dropout masks exactly and a checkpoint can restore the stream.
"""

from __future__ import annotations

import numpy as np

_generator = np.random.default_rng(0)


def manual_seed(seed: int) -> np.random.Generator:
    """Reseed the process-wide generator and return it."""
    global _generator
    _generator = np.random.default_rng(seed)
    return _generator


def generator() -> np.random.Generator:
    return _generator


def get_state() -> dict:
    return _generator.bit_generator.state


def set_state(state: dict) -> None:
    _generator.bit_generator.state = state


def dropout_mask(gen: np.random.Generator, shape: tuple, p: float, dtype) -> np.ndarray:
    """Inverted-dropout mask: 0 with probability p, else 1/(1-p) (expected value 1)."""
    mask = gen.random(shape, dtype=np.float32) >= p
    out = mask.astype(dtype)
    out *= 1.0 / (1.0 - p)
    return out
