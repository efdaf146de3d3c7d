"""Writing a shard dataset directory: atomically, and only values the trainer can use.

The format and what the writer promises: ``datasets/README.md`` ("Atomic and safe",
"Only values the trainer can use"); reading and checking it: :mod:`mpitrain.data.shards`.
The writer records each shard's content and metadata SHA-256 (:mod:`mpitrain.data.integrity`)
and seals the manifest with its own checksum (:mod:`mpitrain.data.manifest`).
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import socket
from pathlib import Path

import h5py
import numpy as np

from mpitrain.data import manifest as fields
from mpitrain.data.errors import DataError
from mpitrain.data.integrity import check_ids, check_images, content_sha256, file_checksums
from mpitrain.data.manifest import (COMPRESSIONS, FORMAT, KINDS, MANIFEST, VERSION, outdated, read_manifest,
                                    write_manifest)
from mpitrain.data.shards import Dataset
from mpitrain.runtime import process_alive


def label_dtype(num_classes: int) -> np.dtype:
    return np.dtype(np.uint8 if num_classes <= 256 else np.int32)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.int32)


class DatasetWriter:
    """Write a dataset directory atomically::

        with DatasetWriter(out, "mnist", "image", classes=..., mean=..., std=...) as w:
            w.write_split("train", x_train, y_train)
            w.write_split("test", x_test, y_test)

    The shards go into a hidden directory beside ``out``, renamed into place with the
    manifest on leaving the block, removed on an error; what becomes of an existing ``out``
    (:attr:`up_to_date`: it holds this same dataset, intact) is in ``datasets/README.md``,
    "Atomic and safe". Image datasets need ``classes``, ``mean`` and ``std`` (per channel,
    of the training pixels scaled to [0, 1]); text datasets need ``vocab``.
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
        if kind == "image":
            fields.check_classes(self.out, meta.get("classes"))
            fields.check_statistics(self.out, meta.get("mean"), meta.get("std"))
        else:
            fields.check_vocab(self.out, meta.get("vocab"))
        self.name, self.kind, self.compression = name, kind, compression
        self.shard_bytes, self.chunk_bytes = int(shard_mb * 2**20), int(chunk_kb * 2**10)
        self.manifest = {"format": FORMAT, "version": VERSION, "name": name, "kind": kind,
                         "compression": compression, "source": source or {}, **meta, "splits": {}}
        self.up_to_date = False
        _recover(self.out)
        check_output_dir(self.out, name)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{_owner()}"

    def __enter__(self):
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir()
        except OSError as e:
            raise self._unwritten(e) from None
        return self

    def write_split(self, split: str, x: np.ndarray, y: np.ndarray | None = None) -> None:
        """Check the values of ``x`` (and ``y``), cut them into shards of about ``shard_mb``
        and write them."""
        if not fields.SPLIT_NAME.fullmatch(split):
            raise ValueError(f"split names are lower-case words, got {split!r}")
        if (y is None) != (self.kind == "text"):
            raise ValueError("image datasets need labels y; text datasets have none")
        if y is not None and len(y) != len(x):
            raise ValueError(f"{len(x)} samples but {len(y)} labels")
        if len(x) == 0:
            raise DataError(f"{self.name}: split {split!r} is empty")
        x, y = self._checked(split, np.asarray(x), None if y is None else np.asarray(y))
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
                for name, data in (("x", xs), ("y", ys))[: 1 if ys is None else 2]:
                    f.create_dataset(name, data=data, chunks=(min(chunk_rows, len(data)), *data.shape[1:]),
                                     compression=self.compression)
                f.attrs.update({"format_version": VERSION, "dataset": self.name, "split": split,
                                "index": index, "count": len(xs), "sample_shape": list(xs.shape[1:]),
                                "dtype": xs.dtype.str, "sha256": digest})
            shards.append({"file": file, "count": len(xs), "sha256": digest,
                           **file_checksums(self.tmp / file, ("x",) if ys is None else ("x", "y"))})
        self.manifest["splits"][split] = {
            "count": len(x), "sample_shape": list(x.shape[1:]), "x_dtype": x.dtype.str,
            "y_dtype": y.dtype.str if y is not None else None, "chunk_rows": chunk_rows, "shards": shards}

    def _checked(self, split: str, x: np.ndarray, y: np.ndarray | None):
        """``x`` and ``y`` as they will be stored, once every value the trainer will use is
        checked: uint8 images of the other splits' shape with labels in ``0..classes-1``,
        or token ids below the vocabulary size. The error names the split and the index."""
        where = f"{self.out}: split {split!r}"
        if self.kind == "text":
            vocab = len(self.manifest["vocab"])
            if x.ndim != 1 or x.dtype.kind not in "iu":
                raise DataError(f"{where}: token ids must be a 1-D integer array, got {x.dtype} {x.shape}")
            check_ids(x, vocab, "token", where)
            return x.astype(token_dtype(vocab), copy=False), None
        check_images(x, where)
        fields.check_statistics(self.out, self.manifest["mean"], self.manifest["std"], channels=x.shape[3])
        for other, meta in self.manifest["splits"].items():
            if tuple(meta["sample_shape"]) != x.shape[1:]:
                raise DataError(f"{where} has samples of shape {x.shape[1:]}, split {other!r} "
                                f"{tuple(meta['sample_shape'])}: one model must fit every split")
        classes = len(self.manifest["classes"])
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise DataError(f"{where}: labels must be a 1-D integer array, got {y.dtype} {y.shape}")
        check_ids(y, classes, "label", where)
        return x, y.astype(label_dtype(classes), copy=False)

    def __exit__(self, kind, value, tb):
        try:
            if kind is None:
                self._commit()
        except OSError as e:
            raise self._unwritten(e) from None
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if isinstance(value, OSError) and self._ours(value):  # a shard that could not be written (a full disk)
            raise self._unwritten(value) from None
        return False

    def _ours(self, error: OSError) -> bool:
        """Whether ``error`` is about the files this writer makes (or names no file): a
        source the recipe reads inside the block is not the output's fault."""
        name = getattr(error, "filename", None)
        if not name:
            return True
        name = Path(os.path.abspath(name))
        return any(name == p or p in name.parents for p in (Path(os.path.abspath(self.tmp)),
                                                              Path(os.path.abspath(self.out))))

    def _unwritten(self, error: OSError) -> DataError:
        return DataError(f"{self.out}: could not be written ({error.strerror or error}); nothing of it was kept "
                         "(what was there before, if anything, is unchanged)")

    def _commit(self) -> None:
        from mpitrain import __version__

        self.manifest["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.manifest["written_by"] = f"mpitrain {__version__}"
        write_manifest(self.tmp, self.manifest)
        for p in self.tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        if self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()  # an empty directory the user made is replaced
        if self.out.exists() and outdated(self.out) is None:
            if _content(read_manifest(self.out)) != _content(self.manifest):
                raise DataError(f"{self.out}: already holds a different build of {self.name!r} "
                                "(other content); remove it or choose another output directory")
            if _intact(self.out):
                self.up_to_date = True
                return
        if self.out.exists():  # an older format version, or a damaged copy, of this dataset
            self._replace()
        else:
            os.rename(self.tmp, self.out)  # atomic: readers see nothing or everything

    def _replace(self) -> None:
        """Put the new directory in place of ``out`` (two renames: a reader in between
        finds no dataset, never a mixed one)."""
        aside = self.out.parent / f".{self.out.name}.old-{_owner()}"
        os.rename(self.out, aside)
        try:
            os.rename(self.tmp, self.out)
        except OSError:
            os.rename(aside, self.out)  # never leave nothing
            raise
        shutil.rmtree(aside, ignore_errors=True)


def _owner() -> str:
    """This process, in the names of its build's temporary directories (host and pid:
    :func:`_recover` must tell a killed build's from a live one's, or another host's)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _recover(out: Path) -> None:
    """What a build of ``out`` killed on this host (SIGKILL, a power cut) left beside it:
    an unfinished ``.tmp-`` directory goes; an ``.old-`` one, the previous dataset moved
    aside for the new one, goes back to ``out`` if the new one never got there, and goes
    if it did. Another host's, or a live process's, are left alone."""
    pattern = re.compile(re.escape(f".{out.name}.") + r"(tmp|old)-" + re.escape(socket.gethostname()) + r"-(\d+)")
    if not out.parent.is_dir():
        return
    for path in sorted(out.parent.iterdir(), key=lambda p: p.name.startswith(f".{out.name}.tmp")):  # old first
        m = pattern.fullmatch(path.name)
        if m is None or process_alive(int(m.group(2))):
            continue
        if m.group(1) == "old" and not out.exists():
            os.rename(path, out)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _content(manifest: dict) -> dict:
    return {s: [(sh["count"], sh["sha256"]) for sh in v["shards"]] for s, v in manifest["splits"].items()}


def _intact(path: Path) -> bool:
    """Whether the dataset in ``path`` opens and verifies."""
    try:
        with Dataset(path) as ds:
            return not ds.verify()
    except DataError:
        return False


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
    try:
        other = (outdated(out) or read_manifest(out)).get("name")
    except DataError as e:
        raise DataError(f"{e} (to rebuild it here, remove {out} first)") from None
    if other != name:
        raise DataError(f"{out}: already holds the dataset {other!r}, not {name!r}; "
                        "remove it or choose another output directory")
