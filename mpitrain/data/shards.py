"""The HDF5 shard format: opening and checking a dataset directory, reading rows.

The format (a manifest and HDF5 shards of ``x`` and, for labelled data, ``y``), what
opening checks and the reasons for each choice: ``datasets/README.md``. The manifest's
fields are checked by :mod:`mpitrain.data.manifest`, a shard's bytes by
:mod:`mpitrain.data.integrity` (its metadata before h5py reads it); writing is
:mod:`mpitrain.data.writer`. :meth:`Dataset.verify` re-hashes content and checks values,
split over ranks by the caller (this module never calls MPI). Any failure is one
:class:`DataError` naming the file.

Rows are read with ``os.preadv`` straight from the file offsets of unfiltered chunks
(HDF5 records them; h5py reports them), which avoids h5py's per-call selection cost
(``mpitrain/bench/README.md``) and releases the GIL for the prefetch thread.
Compressed chunks are read through h5py, which decompresses them.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from mpitrain.data.errors import DataError, reading
from mpitrain.data.integrity import check_ids, check_metadata, content_sha256
from mpitrain.data.manifest import MANIFEST, VERSION, read_manifest

# the format's names, imported from here by the recipes and the tests
__all__ = ["MANIFEST", "VERSION", "DataError", "Dataset", "Split", "open_dataset"]


class _Shard:
    """One open shard file: h5py for metadata and compressed reads, a raw file
    descriptor and chunk offsets for unfiltered reads."""

    def __init__(self, path: Path, names: tuple[str, ...]):
        self.path = path
        self.h5 = h5py.File(path, "r")
        try:
            self.datasets = {n: self.h5[n] for n in names}
            self.chunks = {n: _chunk_offsets(ds) for n, ds in self.datasets.items()}
            self.fd = os.open(path, os.O_RDONLY)
        except BaseException:
            self.h5.close()
            raise

    def read(self, name: str, start: int, stop: int, out: np.ndarray) -> int:
        """Rows [start, stop) of dataset ``name`` into ``out`` (len stop - start); returns bytes read."""
        offsets = self.chunks[name]
        if offsets is None:  # filtered: h5py reads and decompresses whole chunks
            self.datasets[name].read_direct(out, np.s_[start:stop], np.s_[0 : stop - start])
            return out.nbytes
        rows_per_chunk, row_bytes, file_offsets = offsets
        flat = out.reshape(-1).view(np.uint8)
        done, row = 0, start
        while row < stop:
            k = row // rows_per_chunk
            # extend the run over following chunks that lie right after this one in the file
            end_k = k
            while ((end_k + 1) * rows_per_chunk < stop and file_offsets[end_k + 1]
                   == file_offsets[end_k] + rows_per_chunk * row_bytes):
                end_k += 1
            run_stop = min(stop, (end_k + 1) * rows_per_chunk)
            position = file_offsets[k] + (row - k * rows_per_chunk) * row_bytes
            n = (run_stop - row) * row_bytes
            if os.preadv(self.fd, [flat[done : done + n]], position) != n:
                raise DataError(f"{self.path}: short read at byte {position} (file truncated?)")
            done += n
            row = run_stop
        return done

    def close(self) -> None:
        self.h5.close()
        os.close(self.fd)


def _chunk_offsets(ds: h5py.Dataset):
    """(rows per chunk, bytes per row, file offset of every chunk) for an unfiltered
    chunked dataset stored in native byte order; None where h5py must do the reading."""
    if ds.chunks is None or ds.compression or ds.fletcher32 or ds.shuffle or ds.scaleoffset:
        return None
    if ds.dtype.byteorder not in ("=", "|") and ds.dtype != ds.dtype.newbyteorder("="):
        return None
    if ds.chunks[1:] != ds.shape[1:]:
        return None  # chunks must hold whole rows for a row range to be contiguous
    info = [ds.id.get_chunk_info(i) for i in range(ds.id.get_num_chunks())]
    if [c.chunk_offset[0] for c in info] != list(range(0, ds.shape[0], ds.chunks[0])):
        return None
    offsets = np.array([c.byte_offset for c in info], dtype=np.int64)
    return ds.chunks[0], int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize, offsets


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest says of one shard file."""

    path: Path
    index: int  # in its split
    first: int  # index in the split of the shard's first row
    count: int
    bytes: int
    sha256: str  # of the content
    data_ranges: tuple  # ((start, stop), ...): the byte ranges of the data chunks
    metadata_sha256: str  # of every byte outside them


class Split:
    """One split of a dataset: its rows spread over shards, read by global row index.
    Reads check the ids the model indexes with (labels; text: token ids)."""

    def __init__(self, dataset: Dataset, name: str, meta: dict):  # meta: checked by mpitrain.data.manifest
        self.name, self.count, self.chunk_rows = name, meta["count"], meta["chunk_rows"]
        self.sample_shape = tuple(meta["sample_shape"])
        self.x_dtype = np.dtype(meta["x_dtype"])
        self.y_dtype = np.dtype(meta["y_dtype"]) if meta["y_dtype"] else None
        # the dataset ("x" or "y") holding ids below self.ids, the size of what they index
        self.checked, self.ids = ("x", len(dataset.vocab)) if self.y_dtype is None else ("y", len(dataset.classes))
        firsts = [0, *itertools.accumulate(s["count"] for s in meta["shards"])]  # of each shard's rows in the split
        self.shards = tuple(ShardInfo(dataset.path / s["file"], index, firsts[index], s["count"], s["bytes"],
                                      s["sha256"], tuple(map(tuple, s["data_ranges"])), s["metadata_sha256"])
                            for index, s in enumerate(meta["shards"]))
        self._starts = np.array(firsts[:-1], dtype=np.int64)
        self._open: dict[int, _Shard] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return ("x",) if self.y_dtype is None else ("x", "y")

    @property
    def sample_bytes(self) -> int:
        """Bytes stored per sample (x and its label)."""
        x = int(np.prod(self.sample_shape, dtype=np.int64)) * self.x_dtype.itemsize
        return x + (self.y_dtype.itemsize if self.y_dtype is not None else 0)

    def shard_file(self, index: int) -> _Shard:
        if index not in self._open:
            with reading(self.shards[index].path):
                self._open[index] = _Shard(self.shards[index].path, self.names)
        return self._open[index]

    def read(self, name: str, start: int, stop: int, out: np.ndarray, check: bool = True) -> int:
        """Rows [start, stop) of the split (0 <= start <= stop <= count) into ``out``;
        returns the bytes read. Only the shards holding those rows are opened. With
        ``check``, ids read (labels; text: tokens) must be in range (:meth:`check`)."""
        total, first = 0, start
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            s = self.shards[i]
            end = min(stop, s.first + s.count)
            rows = out[start - first : end - first]
            with reading(s.path):
                total += self.shard_file(i).read(name, start - s.first, end - s.first, rows)
            if check and name == self.checked:
                self.check(rows, start, s.path)
            start, i = end, i + 1
        return total

    def check(self, ids: np.ndarray, first: int, path: Path) -> None:
        """Raise DataError unless ``ids`` (rows ``first, first + 1, ...`` of the split,
        read from ``path``) are all in ``0..self.ids-1``: a max, and a min of signed ids."""
        check_ids(ids, self.ids, "label" if self.checked == "y" else "token", f"{path}: split {self.name!r}", first)

    def read_all(self, name: str, shard: ShardInfo | None = None, check: bool = True) -> np.ndarray:
        """Dataset ``name`` ("x" or "y") of the whole split, or of one ``shard`` of it, as a new array."""
        first, count = (0, self.count) if shard is None else (shard.first, shard.count)
        out = np.empty((count, *self.sample_shape) if name == "x" else (count,),
                       dtype=self.x_dtype if name == "x" else self.y_dtype)
        self.read(name, first, first + count, out, check)
        return out

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


class Dataset:
    """An opened dataset directory: the manifest, checked against every shard's structure.
    ``with open_dataset(path) as ds:`` closes its open shard files on leaving."""

    def __init__(self, path):
        self.path = Path(path)
        self.manifest = m = read_manifest(self.path)
        self.name, self.kind = m["name"], m["kind"]
        # what the trainer uses: image datasets have classes and statistics, text ones a vocabulary
        self.classes, self.vocab = tuple(m.get("classes", ())), m.get("vocab", "")
        self.mean, self.std = tuple(m.get("mean", ())), tuple(m.get("std", ()))
        self.splits = {name: Split(self, name, meta) for name, meta in m["splits"].items()}
        for split in self.splits.values():
            for info in split.shards:
                self._check_structure(split, info)

    def split(self, name: str) -> Split:
        if name not in self.splits:
            raise DataError(f"{self.path}: has no split {name!r} (it has {sorted(self.splits)})")
        return self.splits[name]

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.vocab)}
        try:
            return np.array([index[c] for c in text], dtype=np.int64)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary of {self.name}") from None

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] for i in np.asarray(ids).reshape(-1))

    def _check_structure(self, split: Split, info: ShardInfo) -> None:
        """The file is the one the manifest describes: present, of its size, its metadata
        unchanged (hashed before h5py parses it), then its attributes and layout."""
        p = info.path
        with reading(p):  # a file that cannot be opened (permissions, I/O errors)
            if not p.is_file():
                raise DataError(f"{p}: missing (listed in {self.path / MANIFEST})")
            size = p.stat().st_size
            if size != info.bytes:
                raise DataError(f"{p}: {'truncated' if size < info.bytes else 'wrong size'}: "
                                f"{size} bytes, the manifest says {info.bytes}")
            check_metadata(p, info.bytes, info.data_ranges, info.metadata_sha256)
        with reading(p, "not a readable HDF5 file"), h5py.File(p, "r") as f:
            attrs = {k: v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v for k, v in f.attrs.items()}
            layout = {n: (f[n].shape, f[n].dtype, f[n].chunks, f[n].compression) for n in split.names if n in f}
        if (version := attrs.get("format_version")) != VERSION:
            raise DataError(f"{p}: shard format version {version!r} is not supported; "
                            f"this mpitrain reads version {VERSION}")
        rows = min(split.chunk_rows, info.count)
        for n, shape, dtype in (("x", (info.count, *split.sample_shape), split.x_dtype),
                                ("y", (info.count,), split.y_dtype))[: len(split.names)]:
            if n not in layout:
                raise DataError(f"{p}: has no dataset {n!r}")
            if layout[n][0] != shape:
                raise DataError(f"{p}: {n} has shape {layout[n][0]}, the manifest says {shape}")
            want = (shape, dtype, (rows, *shape[1:]), self.manifest["compression"])
            if layout[n] != want:
                raise DataError(f"{p}: {n} is stored as (shape, dtype, chunks, compression) {layout[n]}, "
                                f"the manifest says {want}")
        for key, want in (("dataset", self.name), ("split", split.name), ("index", info.index),
                          ("count", info.count), ("sample_shape", list(split.sample_shape)),
                          ("dtype", split.x_dtype.str), ("sha256", info.sha256)):
            if attrs.get(key) != want:
                raise DataError(f"{p}: its attribute {key} is {attrs.get(key)!r}, the manifest says {want!r}")

    def _shards(self, rank: int, size: int, splits=None):
        """(split, shard) of shards ``rank, rank + size, ...`` of ``splits`` (default all)."""
        every = [(s, info) for s in self.splits.values() if splits is None or s.name in splits for info in s.shards]
        return every[rank::size]

    def verify(self, rank: int = 0, size: int = 1) -> list[str]:
        """Re-hash the content of shards ``rank, rank + size, ...`` (all of them for one
        process) and check their labels or token ids; one message per bad shard (empty:
        all good)."""
        problems = []
        for split, info in self._shards(rank, size):
            try:
                x = split.read_all("x", info, check=False)
                y = split.read_all("y", info, check=False) if split.y_dtype is not None else None
                if content_sha256(x, y) != info.sha256:  # damage first: it would explain bad values
                    raise DataError(f"{info.path}: damaged: the SHA-256 of its content differs from the "
                                    "manifest's; rebuild the dataset")
                split.check(y if split.checked == "y" else x, info.first, info.path)
            except DataError as e:
                problems.append(str(e))
        return problems

    def check_values(self, split: str, rank: int = 0, size: int = 1) -> list[str]:
        """Check the labels (text: token ids) of the shards ``rank, rank + size, ...`` of
        ``split``, without re-hashing; one message per bad shard."""
        s = self.split(split)
        problems = []
        for _, info in self._shards(rank, size, (split,)):
            try:
                s.read_all(s.checked, info)
            except DataError as e:
                problems.append(str(e))
        return problems

    def close(self) -> None:
        for s in self.splits.values():
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_dataset(path) -> Dataset:
    """Open a dataset directory, checking the manifest and every shard's structure."""
    if not Path(path).is_dir():
        raise DataError(f"{path}: no such dataset directory")
    return Dataset(path)
