"""Turning the reader's raw batches into model inputs: normalisation and augmentation.

Augmentation draws from a generator seeded by ``(seed, AUGMENT, epoch, step)`` for the
whole *global* batch and each rank keeps the draws of its own batch positions, so the
augmented global batch is the same at any rank count. The stream tags keep these draws
independent of each other and of weight initialisation, which uses the bare ``seed``
(NumPy pads seed tuples with zeros, so ``(seed, 0)`` would be the same stream as ``seed``).
"""

from __future__ import annotations

import numpy as np

AUGMENT, SAMPLING, FLIP = 1, 4, 6  # seed stream tags; the reader uses 5


def normalize(images: np.ndarray, mean, std, dtype) -> np.ndarray:
    """uint8 (B, H, W, C) -> float (B, H, W, C), per channel (x/255 - mean) / std."""
    scale = (1.0 / (255.0 * np.asarray(std))).astype(dtype)
    offset = (np.asarray(mean) / np.asarray(std)).astype(dtype)
    out = images.astype(dtype)
    out *= scale
    out -= offset
    return out


def random_shift(images: np.ndarray, dy: np.ndarray, dx: np.ndarray, max_shift: int) -> np.ndarray:
    """Translate image ``i`` by ``(dy[i] - max_shift, dx[i] - max_shift)`` pixels, filling
    with zeros: one padded copy and one gather, no loop over images."""
    B, H, W, C = images.shape
    s = max_shift
    padded = np.zeros((B, H + 2 * s, W + 2 * s, C), dtype=images.dtype)
    padded[:, s : s + H, s : s + W] = images
    rows = dy[:, None] + np.arange(H)  # (B, H)
    cols = dx[:, None] + np.arange(W)  # (B, W)
    return padded[np.arange(B)[:, None, None], rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)


def flips(seed: int, epoch: int, step: int, global_batch: int, lanes: np.ndarray) -> np.ndarray:
    """Which samples at global-batch positions ``lanes`` are mirrored left to right (each
    with probability 1/2), from a stream of their own: turning flips on leaves the shifts
    as they were."""
    return np.random.default_rng((seed, FLIP, epoch, step)).random(global_batch)[lanes] < 0.5


def random_flip(images: np.ndarray, mirrored: np.ndarray) -> np.ndarray:
    """(B, H, W, C) images with those where ``mirrored`` reversed along W."""
    return np.where(mirrored[:, None, None, None], images[:, :, ::-1], images)


def shifts(seed: int, epoch: int, step: int, global_batch: int, max_shift: int, lanes: np.ndarray):
    """(dy, dx) of the samples at global-batch positions ``lanes``, each in [0, 2*max_shift]."""
    rng = np.random.default_rng((seed, AUGMENT, epoch, step))
    d = rng.integers(0, 2 * max_shift + 1, size=(2, global_batch))  # (2, B)
    return d[0, lanes], d[1, lanes]
