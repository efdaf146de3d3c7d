"""What makes a shard's bytes and values trustworthy: its two checksums, and value checks.

A shard file is two kinds of bytes (``datasets/README.md``, "Format, version 2"): its
**data chunks**, covered by the content ``sha256`` that :meth:`Dataset.verify` re-hashes,
and its **metadata**, every other byte, covered by ``metadata_sha256``. Opening a shard
hashes those few kilobytes *before* h5py reads the file, as HDF5 trusts its metadata and
one flipped byte there can end the process ("Why these choices"): a damaged one is one
:class:`DataError` naming the file, at open. Values are checked where the model indexes
with them (:func:`check_ids`) and where it scales them (:func:`check_images`).
"""

from __future__ import annotations

import hashlib
import os

import h5py
import numpy as np

from mpitrain.data.errors import DataError

READ_BLOCK = 1 << 20  # bytes per read when hashing metadata


def content_sha256(x: np.ndarray, y: np.ndarray | None) -> str:
    """SHA-256 of the C-order bytes of ``x`` followed by those of ``y``."""
    h = hashlib.sha256(np.ascontiguousarray(x).data)
    if y is not None:
        h.update(np.ascontiguousarray(y).data)
    return h.hexdigest()


def data_ranges(f: h5py.File, names) -> list[list[int]]:
    """The ``[start, stop)`` byte ranges of every chunk of the datasets ``names``,
    adjacent chunks merged (a freshly written shard has one or two ranges)."""
    chunks = sorted((c.byte_offset, c.byte_offset + c.size)
                    for n in names for c in (f[n].id.get_chunk_info(i) for i in range(f[n].id.get_num_chunks())))
    merged: list[list[int]] = []
    for start, stop in chunks:
        if merged and start == merged[-1][1]:
            merged[-1][1] = stop
        else:
            merged.append([start, stop])
    return merged


def metadata_sha256(path, size: int, ranges) -> str:
    """SHA-256 of the bytes of the file ``path`` (``size`` bytes) outside ``ranges``."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        at = 0
        for start, stop in [*ranges, (size, size)]:
            while at < start:
                block = os.pread(fd, min(READ_BLOCK, start - at), at)
                if not block:
                    raise DataError(f"{path}: truncated: ends at byte {at}, the manifest says {size}")
                h.update(block)
                at += len(block)
            at = stop
    finally:
        os.close(fd)
    return h.hexdigest()


def file_checksums(path, names) -> dict:
    """What the manifest records of a shard file just written: its size, the byte ranges
    of the chunks of the datasets ``names``, and the SHA-256 of every other byte."""
    with h5py.File(path, "r") as f:
        ranges = data_ranges(f, names)
    size = os.path.getsize(path)
    return {"bytes": size, "data_ranges": ranges, "metadata_sha256": metadata_sha256(path, size, ranges)}


def check_metadata(path, size: int, ranges, want: str) -> None:
    """Raise DataError unless the metadata of the shard ``path`` hashes to ``want``."""
    if metadata_sha256(path, size, ranges) != want:
        raise DataError(f"{path}: damaged: the SHA-256 of its HDF5 metadata (superblock, object headers, "
                        "attributes, chunk index) differs from the manifest's: damaged, or a shard of another build")


def check_ids(values: np.ndarray, limit: int, what: str, where: str, first: int = 0) -> None:
    """Raise DataError unless every id of the 1-D ``values`` is in ``0..limit-1``. The
    message names ``where`` and the first offending index (``first`` is the index of
    ``values[0]``); ``what`` is "label" or "token". One pass over unsigned ids (they
    cannot be negative), two over signed ones: this runs on every read of the reader."""
    if not len(values) or ((values.dtype.kind == "u" or values.min() >= 0) and values.max() < limit):
        return
    bad = int(np.flatnonzero((values < 0) | (values >= limit))[0])
    unit = "classes" if what == "label" else "characters in the vocabulary"
    raise DataError(f"{where}: {what} {values[bad]} at index {first + bad} is outside 0..{limit - 1} ({limit} {unit})")


def check_images(x: np.ndarray, where: str) -> None:
    """Images must be uint8 ``(N, H, W, C)``: the trainer scales pixel values 0-255 by the
    dataset's mean and std, so floats (already scaled or not) or wider integers would
    be scaled wrong without a word."""
    if x.dtype != np.uint8 or x.ndim != 4:
        raise DataError(f"{where}: images must be uint8 (N, H, W, C) pixel values 0-255 (the trainer scales "
                        f"them by the dataset's mean and std), got {x.dtype} {x.shape}")
