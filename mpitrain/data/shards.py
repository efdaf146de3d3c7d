"""The HDF5 shard format: writing a dataset directory, opening and checking one, reading rows.

A dataset directory holds ``manifest.json`` and one or more HDF5 shards per split
(``train-00000.h5``, ``test-00000.h5``, ...). The full specification, with the reasons
for each choice, is ``datasets/README.md``; in short:

* a shard holds ``x`` (samples, first axis = sample) and, for labelled data, ``y``
  (one integer label per sample), both chunked along the first axis and optionally
  compressed; its attributes repeat what the manifest says about it (format version,
  dataset, split, index, count, sample shape, dtype, SHA-256 of its content);
* a text dataset stores its split as one token-id stream in ``x`` (sample shape ``()``,
  one row per token) and has no ``y``: targets are the next tokens;
* the content SHA-256 is taken over the C-order bytes of ``x`` followed by ``y``, so it
  does not depend on chunking or compression.

Writing is atomic: everything goes into a hidden temporary directory next to the
output, which is renamed into place only when complete, so a failed or interrupted
build leaves nothing behind. Opening checks the structure of every shard (present,
full length, readable, attributes agree with the manifest); :meth:`Dataset.verify`
re-hashes content, split over ranks by the caller (this module never calls MPI).

Rows are read with ``os.preadv`` straight from the file offsets of unfiltered chunks
(HDF5 records them; h5py reports them), which avoids h5py's per-call selection cost
(about 80 us, a third of the time of a 0.5 MB read) and releases the GIL for the
prefetch thread. Compressed chunks are read through h5py, which decompresses them.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

FORMAT = "mpitrain-shards"
VERSION = 1
MANIFEST = "manifest.json"
KINDS = ("image", "text")
COMPRESSIONS = (None, "gzip", "lzf")


class DataError(RuntimeError):
    """Missing, damaged or inconsistent data; the message names the file and the problem."""


def content_sha256(x: np.ndarray, y: np.ndarray | None) -> str:
    h = hashlib.sha256(np.ascontiguousarray(x).data)
    if y is not None:
        h.update(np.ascontiguousarray(y).data)
    return h.hexdigest()


def label_dtype(num_classes: int) -> np.dtype:
    return np.dtype(np.uint8 if num_classes <= 256 else np.int32)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.int32)


# --------------------------------------------------------------------- writing
class DatasetWriter:
    """Write a dataset directory atomically::

        with DatasetWriter(out, "mnist", "image", classes=..., mean=..., std=...) as w:
            w.write_split("train", x_train, y_train)
            w.write_split("test", x_test, y_test)

    On leaving the block without an error the manifest is written and the directory
    renamed into place; on an error the temporary directory is removed. If ``out``
    already holds this same dataset (equal content hashes) the new copy is discarded
    and :attr:`up_to_date` is set; if it holds anything else, :class:`DataError`.
    """

    def __init__(self, out, name: str, kind: str, *, shard_mb: float = 16, compression: str | None = None,
                 chunk_kb: float = 1024, source: dict | None = None, **meta):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if shard_mb <= 0 or chunk_kb <= 0:
            raise ValueError("shard_mb and chunk_kb must be positive")
        self.out = Path(out)
        self.name, self.kind = name, kind
        self.shard_bytes, self.chunk_bytes = int(shard_mb * 2**20), int(chunk_kb * 2**10)
        self.compression = compression
        self.manifest = {"format": FORMAT, "version": VERSION, "name": name, "kind": kind,
                         "compression": compression, "source": source or {}, **meta, "splits": {}}
        self.up_to_date = False
        check_output_dir(self.out, name)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"

    def __enter__(self):
        self.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self

    def write_split(self, split: str, x: np.ndarray, y: np.ndarray | None = None) -> None:
        """Cut ``x`` (and ``y``) into shards of about ``shard_mb`` and write them."""
        if (y is None) != (self.kind == "text"):
            raise ValueError("image datasets need labels y; text datasets have none")
        if y is not None and len(y) != len(x):
            raise ValueError(f"{len(x)} samples but {len(y)} labels")
        if len(x) == 0:
            raise DataError(f"{self.name}: split {split!r} is empty")
        row_bytes = max(1, x[:1].nbytes + (y[:1].nbytes if y is not None else 0))
        per_shard = max(1, self.shard_bytes // row_bytes)
        chunk_rows = max(1, min(per_shard, self.chunk_bytes // max(1, x[:1].nbytes)))
        shards = []
        for index, start in enumerate(range(0, len(x), per_shard)):
            xs = x[start : start + per_shard]
            ys = y[start : start + per_shard] if y is not None else None
            file = f"{split}-{index:05d}.h5"
            digest = content_sha256(xs, ys)
            with h5py.File(self.tmp / file, "w") as f:
                kw = {"chunks": (min(chunk_rows, len(xs)), *xs.shape[1:]), "compression": self.compression}
                f.create_dataset("x", data=xs, **kw)
                if ys is not None:
                    f.create_dataset("y", data=ys, chunks=(min(chunk_rows, len(ys)),),
                                     compression=self.compression)
                f.attrs.update({"format_version": VERSION, "dataset": self.name, "split": split,
                                "index": index, "count": len(xs), "sample_shape": list(xs.shape[1:]),
                                "dtype": xs.dtype.str, "sha256": digest})
            shards.append({"file": file, "count": len(xs), "bytes": (self.tmp / file).stat().st_size,
                           "sha256": digest})
        self.manifest["splits"][split] = {
            "count": len(x), "sample_shape": list(x.shape[1:]), "x_dtype": x.dtype.str,
            "y_dtype": y.dtype.str if y is not None else None, "chunk_rows": chunk_rows, "shards": shards}

    def __exit__(self, kind, value, tb):
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        try:
            self._commit()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False

    def _commit(self) -> None:
        from mpitrain import __version__

        self.manifest["created"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self.manifest["written_by"] = f"mpitrain {__version__}"
        with open(self.tmp / MANIFEST, "w", encoding="utf-8") as f:
            json.dump(self.manifest, f, indent=1)
            f.write("\n")
        for p in self.tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        if self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()  # an empty directory the user made is replaced
        if self.out.exists():
            existing = read_manifest(self.out)
            if _content(existing) != _content(self.manifest):
                raise DataError(f"{self.out}: already holds a different build of {self.name!r} "
                                "(other content); remove it or choose another output directory")
            self.up_to_date = True
            return
        os.rename(self.tmp, self.out)  # atomic: readers see nothing or everything


def _content(manifest: dict) -> dict:
    return {s: [(sh["count"], sh["sha256"]) for sh in v["shards"]] for s, v in manifest["splits"].items()}


def check_output_dir(out: Path, name: str) -> None:
    """Refuse an output directory that holds anything but an earlier build of ``name``."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    if not (out / MANIFEST).exists():
        if any(out.iterdir()):
            raise DataError(f"{out}: not empty and not a dataset directory (no {MANIFEST}); "
                            "choose another output directory")
        return  # an empty directory: replaced by the finished one at commit
    other = read_manifest(out).get("name")
    if other != name:
        raise DataError(f"{out}: already holds the dataset {other!r}, not {name!r}; "
                        "remove it or choose another output directory")


# --------------------------------------------------------------------- reading
def read_manifest(path: Path) -> dict:
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{file}: not found; is {path} a dataset directory built by "
                        "'mpitrain data build'?") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{file}: not a valid manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{file}: not an mpitrain shard manifest (format is not {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise DataError(f"{file}: format version {manifest.get('version')!r} is not supported; "
                        f"this mpitrain reads version {VERSION}")
    try:
        for key in ("name", "kind", "splits"):
            manifest[key]
        for split in manifest["splits"].values():
            for key in ("count", "sample_shape", "x_dtype", "y_dtype", "chunk_rows"):
                split[key]
            for shard in split["shards"]:
                for key in ("file", "count", "bytes", "sha256"):
                    shard[key]
    except (KeyError, TypeError) as e:
        raise DataError(f"{file}: incomplete manifest (missing {e})") from None
    return manifest


class _Shard:
    """One open shard file: h5py for metadata and compressed reads, a raw file
    descriptor and chunk offsets for unfiltered reads."""

    def __init__(self, path: Path, names: tuple[str, ...]):
        self.path = path
        self.h5 = h5py.File(path, "r")
        self.fd = os.open(path, os.O_RDONLY)
        self.datasets = {n: self.h5[n] for n in names}
        self.chunks = {n: _chunk_offsets(ds) for n, ds in self.datasets.items()}

    def read(self, name: str, start: int, stop: int, out: np.ndarray) -> int:
        """Rows [start, stop) of dataset ``name`` into ``out`` (len stop - start); returns bytes read."""
        offsets = self.chunks[name]
        if offsets is None:  # filtered: h5py reads and decompresses whole chunks
            self.datasets[name].read_direct(out, np.s_[start:stop], np.s_[0 : stop - start])
            return out.nbytes
        rows_per_chunk, row_bytes, file_offsets = offsets
        flat = out.reshape(-1).view(np.uint8)
        done = 0
        row = start
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
            got = os.preadv(self.fd, [flat[done : done + n]], position)
            if got != n:
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
    path: Path
    first: int  # index in the split of the shard's first row
    count: int
    bytes: int
    sha256: str


class Split:
    """One split of a dataset: its rows spread over shards, read by global row index."""

    def __init__(self, dataset: Dataset, name: str, meta: dict):
        self.name = name
        self.count = int(meta["count"])
        self.sample_shape = tuple(meta["sample_shape"])
        self.x_dtype = np.dtype(meta["x_dtype"])
        self.y_dtype = np.dtype(meta["y_dtype"]) if meta["y_dtype"] else None
        self.chunk_rows = int(meta["chunk_rows"])
        first, shards = 0, []
        for s in meta["shards"]:
            shards.append(ShardInfo(dataset.path / s["file"], first, int(s["count"]), int(s["bytes"]), s["sha256"]))
            first += int(s["count"])
        if first != self.count:
            raise DataError(f"{dataset.path / MANIFEST}: split {name!r} has count {self.count} but its "
                            f"shards hold {first} samples")
        self.shards = tuple(shards)
        self._starts = np.array([s.first for s in shards], dtype=np.int64)
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
            try:
                self._open[index] = _Shard(self.shards[index].path, self.names)
            except OSError as e:
                raise DataError(f"{self.shards[index].path}: cannot be read ({e})") from None
        return self._open[index]

    def read(self, name: str, start: int, stop: int, out: np.ndarray) -> int:
        """Rows [start, stop) of the split (0 <= start <= stop <= count) into ``out``;
        returns the bytes read. Only the shards holding those rows are opened."""
        done, total = 0, 0
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            s = self.shards[i]
            end = min(stop, s.first + s.count)
            n = end - start
            total += self.shard_file(i).read(name, start - s.first, end - s.first, out[done : done + n])
            done += n
            start = end
            i += 1
        return total

    def read_all(self, name: str) -> np.ndarray:
        dtype = self.x_dtype if name == "x" else self.y_dtype
        out = np.empty((self.count, *(self.sample_shape if name == "x" else ())), dtype=dtype)
        self.read(name, 0, self.count, out)
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
        self.manifest = read_manifest(self.path)
        m = self.manifest
        self.name, self.kind = m["name"], m["kind"]
        if self.kind not in KINDS:
            raise DataError(f"{self.path / MANIFEST}: unknown kind {self.kind!r}")
        self.splits = {name: Split(self, name, meta) for name, meta in m["splits"].items()}
        for split in self.splits.values():
            for info in split.shards:
                self._check_structure(split, info)

    # metadata the trainer uses
    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.manifest.get("classes", ()))

    @property
    def vocab(self) -> str:
        return self.manifest.get("vocab", "")

    @property
    def mean(self) -> tuple[float, ...]:
        return tuple(self.manifest.get("mean", ()))

    @property
    def std(self) -> tuple[float, ...]:
        return tuple(self.manifest.get("std", ()))

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
        p = info.path
        if not p.is_file():
            raise DataError(f"{p}: missing (listed in {self.path / MANIFEST})")
        size = p.stat().st_size
        if size != info.bytes:
            raise DataError(f"{p}: {'truncated' if size < info.bytes else 'wrong size'}: "
                            f"{size} bytes, the manifest says {info.bytes}")
        try:
            with h5py.File(p, "r") as f:
                attrs = dict(f.attrs)
                shapes = {n: f[n].shape for n in split.names if n in f}
                dtypes = {n: f[n].dtype for n in split.names if n in f}
        except OSError as e:
            raise DataError(f"{p}: not a readable HDF5 file ({e})") from None
        attrs = {k: v.item() if isinstance(v, np.generic) else v for k, v in attrs.items()}
        version = attrs.get("format_version")
        if version != VERSION:
            raise DataError(f"{p}: shard format version {version!r} is not supported; "
                            f"this mpitrain reads version {VERSION}")
        for key, want in (("dataset", self.name), ("split", split.name)):
            if attrs.get(key) != want:
                raise DataError(f"{p}: belongs to {key} {attrs.get(key)!r}, the manifest says {want!r}")
        for n in split.names:
            if n not in shapes:
                raise DataError(f"{p}: has no dataset {n!r}")
        want_x = (info.count, *split.sample_shape)
        if attrs.get("count") != info.count or shapes["x"] != want_x:
            raise DataError(f"{p}: holds {shapes['x'][0] if shapes['x'] else 0} samples (count attribute "
                            f"{attrs.get('count')}), the manifest says {info.count}")
        if "y" in shapes and shapes["y"] != (info.count,):
            raise DataError(f"{p}: holds {shapes['y'][0]} labels for {info.count} samples")
        for n, want in (("x", split.x_dtype), ("y", split.y_dtype)):
            if n in dtypes and dtypes[n] != want:
                raise DataError(f"{p}: {n} has dtype {dtypes[n]}, the manifest says {want}")
        if attrs.get("sha256") != info.sha256:
            raise DataError(f"{p}: its SHA-256 attribute differs from the manifest's: "
                            "the shard belongs to another build")

    def shard_list(self) -> list[tuple[Split, int]]:
        return [(s, i) for s in self.splits.values() for i in range(len(s.shards))]

    def verify(self, rank: int = 0, size: int = 1) -> list[str]:
        """Re-hash the content of shards ``rank, rank + size, ...`` (all of them for one
        process) and return one message per damaged shard (empty: all good)."""
        problems = []
        for split, i in self.shard_list()[rank::size]:
            info = split.shards[i]
            try:
                x = np.empty((info.count, *split.sample_shape), dtype=split.x_dtype)
                split.read("x", info.first, info.first + info.count, x)
                y = None
                if split.y_dtype is not None:
                    y = np.empty(info.count, dtype=split.y_dtype)
                    split.read("y", info.first, info.first + info.count, y)
            except (OSError, DataError) as e:
                problems.append(f"{info.path}: damaged, cannot be read ({e})")
                continue
            if content_sha256(x, y) != info.sha256:
                problems.append(f"{info.path}: damaged: the SHA-256 of its content differs from the "
                                "manifest's; rebuild the dataset")
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
