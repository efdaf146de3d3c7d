"""Helpers the recipes share: hashing sources, per-channel statistics, a fixed shuffle."""

from __future__ import annotations

import hashlib

import numpy as np

from mpitrain.data.integrity import check_images
from mpitrain.data.writer import DatasetWriter

SHUFFLE_SEED = 20251121  # class-sorted sources are shuffled once, with this seed


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def channel_stats(images: np.ndarray, chunk: int = 4096) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation of uint8 (N, H, W, C) images scaled to [0, 1],
    accumulated exactly in integers a chunk at a time (no float copy of the whole set)."""
    c = images.shape[-1]
    total = np.zeros(c, dtype=np.int64)
    squares = np.zeros(c, dtype=np.int64)
    for i in range(0, len(images), chunk):
        block = images[i : i + chunk].reshape(-1, c).astype(np.int64)  # (n*H*W, C)
        total += block.sum(axis=0)
        squares += (block * block).sum(axis=0)
    n = images.size // c
    mean = total / n
    std = np.sqrt(squares / n - mean**2)
    return [round(float(v) / 255, 6) for v in mean], [round(float(v) / 255, 6) for v in std]


def shuffled(x: np.ndarray, y: np.ndarray, seed: int = SHUFFLE_SEED):
    order = np.random.default_rng(seed).permutation(len(x))
    return x[order], y[order]


def write_images(out, name: str, splits: dict, classes, source: dict, **options) -> DatasetWriter:
    """Write image splits {split: (x uint8 (N, H, W, C), y int)} with statistics of 'train'.
    The labels go to the writer as they are: it checks their range, then narrows them."""
    x_train = splits["train"][0]
    check_images(x_train, f"{out}: split 'train'")  # before the statistics are taken of it
    mean, std = channel_stats(x_train)
    with DatasetWriter(out, name, "image", classes=list(classes), mean=mean, std=std, source=source,
                       **options) as w:
        for split, (x, y) in splits.items():
            w.write_split(split, x, np.asarray(y))
    return w
