"""The manifest of a shard dataset: its checksum, its format version, and a check of every field.

``manifest.json`` decides what a run does, so all of it is covered by ``manifest_sha256``
(``datasets/README.md``, "The manifest's checksum"), verified before any field is used.
Then every field is checked for type and range (a manifest written by another tool, or
edited and re-sealed, can still be wrong), each error naming the field. A format version 1
directory has no checksums to check its metadata against: it is refused with the command
that rebuilds it, and a build into it replaces it (:func:`outdated`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np

from mpitrain.data.errors import DataError

FORMAT = "mpitrain-shards"
VERSION = 2
MANIFEST = "manifest.json"
CHECKSUM = "manifest_sha256"
KINDS = ("image", "text")
COMPRESSIONS = (None, "gzip", "lzf")
SPLIT_NAME = re.compile(r"[a-z][a-z0-9_]*")  # split names become file names: nothing that leaves the directory
HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_STD = 0.5  # the largest standard deviation of values in [0, 1]


def checksum(manifest: dict) -> str:
    """SHA-256 of the canonical JSON of ``manifest`` without its checksum."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def write_manifest(directory: Path, manifest: dict) -> None:
    """Write ``directory/manifest.json`` with its checksum."""
    with open(Path(directory) / MANIFEST, "w", encoding="utf-8") as f:
        json.dump({**manifest, CHECKSUM: checksum(manifest)}, f, indent=1)
        f.write("\n")


def read_manifest(directory) -> dict:
    """The manifest of ``directory``, its checksum and every field checked."""
    file = Path(directory) / MANIFEST
    manifest = _load(file)
    version = manifest.get("version")
    if version != VERSION or isinstance(version, bool):
        raise _unsupported(file, manifest)
    if manifest.get(CHECKSUM) != checksum(manifest):
        raise DataError(f"{file}: damaged: its content does not match its checksum ({CHECKSUM}); "
                        "rebuild the dataset")
    check_manifest(file, manifest)
    return manifest


def outdated(directory) -> dict | None:
    """The manifest in ``directory`` if it is of an older format version (a dataset to
    rebuild), else None (none, unreadable, or current: :func:`read_manifest` tells)."""
    try:
        manifest = _load(Path(directory) / MANIFEST)
    except DataError:
        return None
    version = manifest.get("version")
    return manifest if _is_int(version) and version < VERSION else None


def _load(file: Path) -> dict:
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{file}: not found; is {file.parent} a dataset directory built by "
                        "'mpitrain data build'?") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{file}: cannot be read ({e})") from None
    try:
        manifest = json.loads(text, object_pairs_hook=_no_repeated_keys, parse_constant=_no_constant,
                              parse_float=_finite)
    except (ValueError, RecursionError) as e:
        raise DataError(f"{file}: not a valid manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{file}: not an mpitrain shard manifest (format is not {FORMAT!r})")
    return manifest


def _no_repeated_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a key appears twice: {sorted(k for k in keys if keys.count(k) > 1)[0]!r}")
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # "1e999": Python reads infinity, which no field can hold
        raise ValueError(f"{text} is beyond the range of a float")
    return value


def _unsupported(file: Path, manifest: dict) -> DataError:
    version = manifest.get("version")
    if _is_int(version) and version < VERSION:
        source = manifest.get("source")
        origin = source.get("from") if isinstance(source, dict) else None
        made = f" ({manifest.get('name')!r}, built from {origin})" if origin else ""
        return DataError(f"{file}: format version {version} has no checksums, so its metadata cannot be checked; "
                         f"rebuild it with: mpitrain data build RECIPE --src SOURCE --out {file.parent}{made}")
    return DataError(f"{file}: format version {version!r} is not supported; this mpitrain reads version {VERSION}")


# --------------------------------------------------------------------- fields
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _field(where, obj: dict, key: str, name: str, ok, want: str):
    """``obj[key]`` if ``ok`` of it; else a DataError naming the field ``name``."""
    if key not in obj:
        raise DataError(f"{where}: {name} is missing")
    value = obj[key]
    if not ok(value):
        raise DataError(f"{where}: {name} must be {want}, got {_shown(value)}")
    return value


def _count(v) -> bool:
    return _is_int(v) and v >= 1


def _integer_dtype(v, values: int) -> bool:
    """``v`` is the canonical NumPy string of an integer dtype that holds ``0..values-1``."""
    try:
        dtype = np.dtype(v) if isinstance(v, str) else None
    except (TypeError, ValueError):
        return False
    return dtype is not None and dtype.str == v and dtype.kind in "iu" and np.iinfo(dtype).max >= values - 1


def check_classes(where, classes) -> None:
    if not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)
            and len(set(classes)) == len(classes)):
        raise DataError(f"{where}: classes must be a list of distinct class names, got {_shown(classes)}")


def check_statistics(where, mean, std, channels: int | None = None) -> None:
    """Per-channel mean and std of the training pixels scaled to [0, 1]: what
    :func:`mpitrain.data.loader.normalize` divides by must be finite and positive."""
    for name, values, ok, within in (("mean", mean, lambda v: 0 <= v <= 1, "[0, 1]"),
                                     ("std", std, lambda v: 0 < v <= MAX_STD, f"(0, {MAX_STD}]")):
        if not (isinstance(values, list) and values and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and ok(v)
                for v in values)):
            raise DataError(f"{where}: {name} must be a list of per-channel statistics of the pixels scaled to "
                            f"[0, 1], each in {within}, got {_shown(values)}")
    channels = channels or len(mean)
    for name, values in (("mean", mean), ("std", std)):
        if len(values) != channels:
            raise DataError(f"{where}: {name} must be one value per channel ({channels} channel(s)), "
                            f"got {_shown(values)}")


def check_vocab(where, vocab) -> None:
    if not (isinstance(vocab, str) and vocab and len(set(vocab)) == len(vocab)):
        raise DataError(f"{where}: vocab must be a non-empty string of distinct characters, got {_shown(vocab)}")


def check_manifest(file: Path, m: dict) -> None:
    """Every field that decides a run, for type, range and consistency."""
    _field(file, m, "name", "name", lambda v: isinstance(v, str) and v, "a non-empty string")
    kind = _field(file, m, "kind", "kind", lambda v: v in KINDS, f"one of {KINDS}")
    _field(file, m, "compression", "compression", lambda v: v in COMPRESSIONS, f"one of {COMPRESSIONS}")
    if kind == "image":
        check_classes(file, m.get("classes"))
        ids = len(m["classes"])
    else:
        check_vocab(file, m.get("vocab"))
        ids = len(m["vocab"])
    splits = _field(file, m, "splits", "splits", lambda v: isinstance(v, dict) and v and all(
        SPLIT_NAME.fullmatch(s) and isinstance(meta, dict) for s, meta in v.items()),
        "an object of splits named in lower case")
    for name, split in splits.items():
        _check_split(file, kind, name, split, ids)
    first, meta = next(iter(splits.items()))
    for name, split in splits.items():  # one model fits every split
        for key in ("sample_shape", "x_dtype"):
            _field(file, split, key, f"splits.{name}.{key}", lambda v: v == meta[key],
                   f"{meta[key]!r} like split {first!r}")
    if kind == "image":
        check_statistics(file, m.get("mean"), m.get("std"), channels=meta["sample_shape"][2])


def _check_split(file: Path, kind: str, name: str, split: dict, ids: int) -> None:
    f = f"splits.{name}"
    count = _field(file, split, "count", f"{f}.count", _count, "an integer >= 1")
    if kind == "image":
        _field(file, split, "sample_shape", f"{f}.sample_shape",
               lambda v: isinstance(v, list) and len(v) == 3 and all(_count(n) for n in v), "[height, width, channels]")
        _field(file, split, "x_dtype", f"{f}.x_dtype", lambda v: v == "|u1", "'|u1' (uint8 pixels)")
        _field(file, split, "y_dtype", f"{f}.y_dtype", lambda v: _integer_dtype(v, ids),
               f"an integer dtype holding labels 0..{ids - 1}")
    else:
        _field(file, split, "sample_shape", f"{f}.sample_shape", lambda v: v == [], "[] (a stream of tokens)")
        _field(file, split, "x_dtype", f"{f}.x_dtype", lambda v: _integer_dtype(v, ids),
               f"an integer dtype holding token ids 0..{ids - 1}")
        _field(file, split, "y_dtype", f"{f}.y_dtype", lambda v: v is None, "null (text has no labels)")
    _field(file, split, "chunk_rows", f"{f}.chunk_rows", _count, "an integer >= 1")
    shards = _field(file, split, "shards", f"{f}.shards", lambda v: isinstance(v, list) and v and all(
        isinstance(s, dict) for s in v), "a non-empty list of shards")
    for i, shard in enumerate(shards):
        _check_shard(file, f"{f}.shards[{i}]", f"{name}-{i:05d}.h5", shard)
    total = sum(s["count"] for s in shards)
    if total != count:
        raise DataError(f"{file}: {f}.count is {count} but its shards hold {total} samples")


def _check_shard(file: Path, f: str, name: str, shard: dict) -> None:
    _field(file, shard, "file", f"{f}.file", lambda v: v == name, repr(name))
    _field(file, shard, "count", f"{f}.count", _count, "an integer >= 1")
    size = _field(file, shard, "bytes", f"{f}.bytes", _count, "an integer >= 1")
    for key in ("sha256", "metadata_sha256"):
        _field(file, shard, key, f"{f}.{key}", lambda v: isinstance(v, str) and HEX64.fullmatch(v),
               "64 lower-case hexadecimal digits")

    def ranges(v) -> bool:  # increasing [start, stop) pairs inside the file
        if not (isinstance(v, list) and all(isinstance(r, list) and len(r) == 2 and all(map(_is_int, r)) for r in v)):
            return False
        bounds = [b for r in v for b in r]
        return all(a < b for a, b in v) and bounds == sorted(bounds) and (not v or (v[0][0] >= 0 and v[-1][1] <= size))

    _field(file, shard, "data_ranges", f"{f}.data_ranges", ranges,
           "increasing [start, stop) byte ranges inside the file")
