"""Mutation test of the shard format: damage a small image and a small text shard set in
every way we can think of, and require each outcome to be either

* **detected**: opening, verifying or reading raises one DataError, on one line, naming
  the damaged file; or
* **harmless**: everything the trainer would read (every split's x and y, the classes,
  mean, std and vocabulary) is bit-identical to the undamaged set's.

Anything else (a raw exception, a DataError naming another file, different data read
without a word) fails the test. The damage: single-byte flips in every region of every
file (the manifest's text; each shard's superblock, object headers, attribute messages,
global heap, other metadata, data chunks and the unused tail of the last chunk, found
with h5py's low-level API), truncations and extensions, swapped, duplicated and missing
files, and edited manifests. Flipped offsets are drawn with a fixed seed, a few per
region; ``MPITRAIN_MUTATIONS=N`` draws about N mutations in all (default 200),
``MPITRAIN_MUTATIONS=all`` flips every byte of every file. Run wide with ``-s`` to see
the counts by region.
"""

import json
import os
import shutil
from collections import Counter, defaultdict

import h5py
import numpy as np
import pytest

from mpitrain.data import DataError, DatasetWriter, open_dataset

SEED = 19
MUTATIONS = os.environ.get("MPITRAIN_MUTATIONS", "200")


# ------------------------------------------------------------------ the two shard sets
def image_set(d):
    r = np.random.default_rng(0)
    x = r.integers(0, 256, (300, 6, 6, 1), dtype=np.uint8)
    y = (np.arange(300) % 10).astype(np.uint8)
    with DatasetWriter(d, "toy", "image", shard_mb=0.008, chunk_kb=2, classes=list("0123456789"),
                       mean=[0.5], std=[0.25]) as w:
        w.write_split("train", x[:240], y[:240])
        w.write_split("test", x[240:], y[240:])


def text_set(d):
    ids = (np.arange(12000) * 7 % 31).astype(np.uint8)
    with DatasetWriter(d, "toytext", "text", shard_mb=0.005, chunk_kb=2, compression="gzip",
                       vocab="abcdefghijklmnopqrstuvwxyz01234") as w:
        w.write_split("train", ids[:10000])
        w.write_split("val", ids[10000:])


def contents(d, verify: bool):
    """Everything the trainer reads of the dataset in ``d`` (opened, verified if asked)."""
    with open_dataset(d) as ds:
        if verify and (problems := ds.verify()):
            raise DataError(problems[0])
        out = {"meta": (ds.name, ds.kind, ds.classes, ds.mean, ds.std, ds.vocab)}
        for split in ds.splits.values():
            for name in split.names:
                out[split.name, name] = split.read_all(name)
        return out


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] if k == "meta" else (a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k])) for k in a)


# ------------------------------------------------------------------ regions of a shard file
ATTRIBUTES = ("format_version", "dataset", "split", "index", "count", "sample_shape", "dtype", "sha256")
LABELS = ("other metadata", "superblock", "object header", "global heap", "attribute message", "data chunk",
          "unused chunk tail")


def shard_regions(path) -> np.ndarray:
    """A label (index into LABELS) for every byte of the shard ``path``: painted in
    LABELS order, so later labels win where ranges overlap."""
    data = path.read_bytes()
    label = np.zeros(len(data), dtype=np.int8)  # other metadata: B-trees, heaps, symbol tables, free space

    def paint(name, start, stop):
        label[start:stop] = LABELS.index(name)

    with h5py.File(path, "r") as f:
        root = h5py.h5o.get_info(f.id)
        paint("superblock", 0, root.addr)
        for obj in (f, *(f[n] for n in ("x", "y") if n in f)):
            info = h5py.h5o.get_info(obj.id)
            paint("object header", info.addr, info.addr + info.hdr.space.total)
        heap = data.find(b"GCOL")  # the global heap: the values of the string attributes
        if heap >= 0:
            paint("global heap", heap, heap + int.from_bytes(data[heap + 8 : heap + 16], "little"))
        for name in ATTRIBUTES:  # version-1 attribute messages: an 8-byte message header, then the name
            at = data.find(name.encode() + b"\0")
            if at >= 16 and int.from_bytes(data[at - 16 : at - 14], "little") == 0x000C:
                paint("attribute message", at - 16, at - 8 + int.from_bytes(data[at - 14 : at - 12], "little"))
        for ds in (f[n] for n in ("x", "y") if n in f):
            row = int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize
            for i in range(ds.id.get_num_chunks()):
                c = ds.id.get_chunk_info(i)
                used = c.size if ds.compression else min(ds.chunks[0], ds.shape[0] - c.chunk_offset[0]) * row
                paint("data chunk", c.byte_offset, c.byte_offset + used)
                paint("unused chunk tail", c.byte_offset + used, c.byte_offset + c.size)
    return label


def manifest_regions(path) -> dict:
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    blank = np.isin(data, list(b" \n"))
    return {"manifest whitespace": np.flatnonzero(blank), "manifest tokens": np.flatnonzero(~blank)}


def flips(d, budget, rng):
    """(region, file, description, {file: damaged bytes}) single-byte flips: every byte
    (budget None) or about ``budget`` spread evenly over the (file, region) pairs."""
    places = {}
    for path in sorted(d.iterdir()):
        if path.suffix == ".h5":
            label = shard_regions(path)
            places.update({(path.name, name): np.flatnonzero(label == k) for k, name in enumerate(LABELS)})
        else:
            places.update({(path.name, name): where for name, where in manifest_regions(path).items()})
    places = {k: v for k, v in places.items() if len(v)}
    per = None if budget is None else max(1, budget // len(places))
    for (file, region), where in places.items():
        data = (d / file).read_bytes()
        chosen = where if per is None or per >= len(where) else np.sort(rng.choice(where, per, replace=False))
        for offset in chosen:
            damaged = bytearray(data)
            mask = int(rng.integers(1, 256))
            damaged[offset] ^= mask
            yield region, file, f"byte {offset} ^= 0x{mask:02x}", {file: bytes(damaged)}


# ------------------------------------------------------------------ the other damage
def manifest_edits(kind):
    """(description, edit) of the manifest dict, applied without re-sealing its checksum."""
    def shard(m, key, value):
        next(iter(m["splits"].values()))["shards"][0][key] = value

    first = lambda m: next(iter(m["splits"].values()))  # noqa: E731
    edits = [
        ("count + 1", lambda m: first(m).update(count=first(m)["count"] + 1)),
        ("null count", lambda m: first(m).update(count=None)),
        ("string count", lambda m: first(m).update(count=str(first(m)["count"]))),
        ("no x_dtype", lambda m: first(m).pop("x_dtype")),
        ("chunk_rows changed", lambda m: first(m).update(chunk_rows=first(m)["chunk_rows"] + 1)),
        ("shards reordered", lambda m: first(m)["shards"].reverse()),
        ("shard sha256 changed", lambda m: shard(m, "sha256", "0" * 64)),
        ("shard metadata_sha256 changed", lambda m: shard(m, "metadata_sha256", "0" * 64)),
        ("shard data_ranges changed", lambda m: shard(m, "data_ranges", [[0, 1]])),
        ("shard bytes changed", lambda m: shard(m, "bytes", 1)),
        ("unknown key added", lambda m: m.update(note="hello")),
        ("checksum removed", lambda m: m.pop("manifest_sha256", None)),
        ("version 1", lambda m: m.update(version=1)),
        ("compression changed", lambda m: m.update(compression="lzf")),
        ("kind changed", lambda m: m.update(kind="text" if kind == "image" else "image")),
    ]
    if kind == "image":
        edits += [("extra class", lambda m: m["classes"].append("10")), ("removed class", lambda m: m["classes"].pop()),
                  ("renamed class", lambda m: m["classes"].__setitem__(0, "zero")),
                  ("changed mean", lambda m: m.update(mean=[0.51])), ("changed std", lambda m: m.update(std=[0.3]))]
    else:
        edits += [("swapped vocabulary", lambda m: m.update(vocab=m["vocab"][1] + m["vocab"][0] + m["vocab"][2:])),
                  ("removed character", lambda m: m.update(vocab=m["vocab"][:-1])),
                  ("added character", lambda m: m.update(vocab=m["vocab"] + "!"))]
    return edits


def structural(d, kind):
    """(region, files named, description, {file: bytes or None (missing)}) of every damage but flips."""
    shards = sorted(p.name for p in d.glob("*.h5"))
    data = {p.name: p.read_bytes() for p in d.iterdir()}
    manifest = json.loads(data["manifest.json"])
    for name in shards:
        size = len(data[name])
        for keep in sorted({0, 8, 96, size // 2, size - 1}):
            yield "truncated", name, f"{name} cut to {keep} bytes", {name: data[name][:keep]}
        yield "extended", name, f"{name} + 1 byte", {name: data[name] + b"\0"}
        yield "missing", name, f"{name} missing", {name: None}
    yield "missing", "manifest.json", "manifest.json missing", {"manifest.json": None}
    yield "truncated", "manifest.json", "manifest.json cut in half", \
        {"manifest.json": data["manifest.json"][: len(data["manifest.json"]) // 2]}
    for a, b in ((shards[0], shards[1]), (shards[0], shards[-1])):
        yield "swapped", f"{a} {b}", f"{a} <-> {b}", {a: data[b], b: data[a]}
        yield "duplicated", a, f"{b} copied over {a}", {a: data[b]}
    for description, edit in manifest_edits(kind):
        m = json.loads(data["manifest.json"])
        edit(m)
        yield "manifest edited", "manifest.json", description, {"manifest.json": json.dumps(m, indent=1).encode()}
    reordered = json.dumps(dict(reversed(manifest.items())), indent=3).encode() + b"\n\n"
    yield "manifest edited", "", "keys reordered, re-indented (harmless)", {"manifest.json": reordered}
    yield "extra file", "", "an unlisted file added (harmless)", {"notes.txt": b"not a shard"}


# ------------------------------------------------------------------ running one mutation
def outcome(d, changes: dict, named: str, reference) -> str:
    """Apply ``changes`` ({file: bytes, or None to remove it}) to ``d``, judge, restore."""
    saved = {f: (d / f).read_bytes() if (d / f).exists() else None for f in changes}
    try:
        for f, content in changes.items():
            if content is None:
                (d / f).unlink()
            else:
                (d / f).write_bytes(content)
        return judge(d, named.split(), reference)
    finally:
        for f, content in saved.items():
            if content is None:
                (d / f).unlink(missing_ok=True)
            else:
                (d / f).write_bytes(content)


def judge(d, files, reference) -> str:
    """"detected at open/read", "detected by verify", "harmless", or what went wrong."""
    for verify in (False, True):  # without verify first: what a run with data.verify = false reads
        try:
            got = contents(d, verify)
        except DataError as e:
            message = str(e)
            if "\n" in message or not files or not any(str(d / f) in message for f in files):
                return f"FAILED: DataError not naming {files} on one line: {message}"
            return "detected by verify" if verify else "detected at open/read"
        except Exception as e:  # noqa: BLE001 - any other exception is the failure this test looks for
            return f"FAILED: raw {type(e).__name__}: {e}"
        if same(got, reference):
            return "harmless"
    return "FAILED: undetected: the data read differs"


@pytest.mark.parametrize("kind, make", [("image", image_set), ("text", text_set)])
def test_every_damage_is_detected_or_harmless(tmp_path, kind, make):
    d = tmp_path / kind
    make(d)
    reference = contents(d, verify=True)
    rng = np.random.default_rng(SEED)
    budget = None if MUTATIONS == "all" else int(MUTATIONS) // 2  # this set's half
    mutations = list(structural(d, kind))
    if budget is not None:
        budget = max(0, budget - len(mutations))
    mutations += [(region, file, description, changes) for region, file, description, changes in flips(d, budget, rng)]
    counts: dict[str, Counter] = defaultdict(Counter)
    failures = []
    for region, named, description, changes in mutations:
        result = outcome(d, changes, named, reference)
        counts[region][result.split(":")[0]] += 1
        if result.startswith("FAILED"):
            failures.append(f"{region}: {description}: {result}")
    print(f"\n{kind}: {len(mutations)} mutations")
    for region, c in counts.items():
        print(f"  {region:>20}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    assert not failures, f"{len(failures)} of {len(mutations)} failed:\n" + "\n".join(failures[:20])
    assert same(contents(d, verify=True), reference)  # every mutation was undone
    shutil.rmtree(d)
