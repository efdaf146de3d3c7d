"""In-memory batches for images and text, determined by seeds alone.

Every random choice (epoch order, augmentation shifts, text windows) comes from a
generator seeded with ``(seed, stream, epoch or step)``, never from global state, so a
run can be repeated exactly and a later rank can draw the same global batch. The
stream tags keep these draws independent of each other and of weight initialisation,
which uses the bare ``seed`` (NumPy pads seed tuples with zeros, so ``(seed, 0)`` would
be the same stream as ``seed``).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from mpitrain.data.sources import ImageData, TextData

IMAGE_EPOCHS, TEXT_TRAIN, TEXT_VAL, SAMPLING = 1, 2, 3, 4  # seed stream tags


def normalize(images: np.ndarray, mean, std, dtype) -> np.ndarray:
    """uint8 (B, H, W, C) -> float (B, H, W, C), per channel (x/255 - mean) / std."""
    scale = (1.0 / (255.0 * np.asarray(std))).astype(dtype)
    offset = (np.asarray(mean) / np.asarray(std)).astype(dtype)
    out = images.astype(dtype)
    out *= scale
    out -= offset
    return out


def random_shift(images: np.ndarray, max_shift: int, rng: np.random.Generator) -> np.ndarray:
    """Translate each image by its own random (dy, dx) in [-max_shift, max_shift],
    filling with zeros: one padded copy and one gather, no loop over images."""
    B, H, W, C = images.shape
    s = max_shift
    padded = np.zeros((B, H + 2 * s, W + 2 * s, C), dtype=images.dtype)
    padded[:, s : s + H, s : s + W] = images
    dy, dx = rng.integers(0, 2 * s + 1, size=(2, B))  # (B,) each
    rows = dy[:, None] + np.arange(H)  # (B, H)
    cols = dx[:, None] + np.arange(W)  # (B, W)
    return padded[np.arange(B)[:, None, None], rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)


class ImageBatches:
    """Shuffled minibatches of an image split; the last partial batch of an epoch is dropped."""

    def __init__(self, data: ImageData, batch_size: int, seed: int, dtype, shift: int = 0):
        if batch_size > len(data.x_train):
            raise ValueError(f"batch size {batch_size} exceeds the {len(data.x_train)} training images")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.dtype, self.shift = np.dtype(dtype), shift
        self.steps_per_epoch = len(data.x_train) // batch_size

    def epoch(self, epoch: int):
        """Yield (images (B, H, W, C) float, labels (B,)) for one epoch."""
        rng = np.random.default_rng((self.seed, IMAGE_EPOCHS, epoch))
        order = rng.permutation(len(self.data.x_train))
        for i in range(self.steps_per_epoch):
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
            x = self.data.x_train[idx]
            if self.shift:
                x = random_shift(x, self.shift, rng)
            yield normalize(x, self.data.mean, self.data.std, self.dtype), self.data.y_train[idx]

    def test_batches(self, batch_size: int = 500):
        x, y = self.data.x_test, self.data.y_test
        for i in range(0, len(x), batch_size):
            images = normalize(x[i : i + batch_size], self.data.mean, self.data.std, self.dtype)
            yield images, y[i : i + batch_size]


class TextBatches:
    """Random windows of ``block_size + 1`` tokens: inputs and next-token targets.

    ``batch(step)`` draws the windows from a generator seeded by the step, so the batch
    of a step does not depend on what came before it."""

    def __init__(self, data: TextData, batch_size: int, block_size: int, seed: int):
        for split in ("train", "val"):
            n = len(getattr(data, split))
            if n < block_size + 1:
                raise ValueError(f"{data.name} {split} split has {n} tokens, "
                                 f"fewer than block_size + 1 = {block_size + 1}")
        self.data, self.batch_size, self.block_size, self.seed = data, batch_size, block_size, seed

    def _windows(self, ids: np.ndarray, rng: np.random.Generator, count: int):
        windows = sliding_window_view(ids, self.block_size + 1)  # (N - T, T + 1) view
        chunk = windows[rng.integers(0, len(windows), size=count)]  # (count, T + 1)
        return chunk[:, :-1], chunk[:, 1:]

    def batch(self, step: int):
        """(inputs (B, T), targets (B, T)) for a training step."""
        return self._windows(self.data.train, np.random.default_rng((self.seed, TEXT_TRAIN, step)),
                             self.batch_size)

    def val_batches(self, count: int):
        """``count`` fixed batches of validation windows (the same at every evaluation)."""
        rng = np.random.default_rng((self.seed, TEXT_VAL))
        for _ in range(count):
            yield self._windows(self.data.val, rng, self.batch_size)
