"""Mutations of a checkpoint: each is either detected or provably harmless.

A small GPT run writes checkpoints (AdamW state, dropout's random stream, the config).
Then, one at a time: single-byte flips at offsets drawn from every region of the file
(mpitrain's header and the padding after it, HDF5's superblock, object headers and
B-trees, the attributes' values, the array chunks, the rest), truncations, a checkpoint
copied over another, and missing files.
Each outcome must be one of:

* **detected**: :func:`mpitrain.checkpoint.check` raises CheckpointError naming the
  file (a resume then takes the one before, with a warning: tested end to end below);
* **harmless**: the file still checks, and everything a resume reads from it (every
  array, the step, epoch, random stream, optimizer counters, config) is bit-identical
  to the undamaged file's, so the resumed run is the same run.

Anything else (a change that loads) fails. The suite draws ``MPITRAIN_MUTATIONS``
offsets per region (default 24); run it wide by hand, for example
``MPITRAIN_MUTATIONS=100000 python -m pytest -q --timeout=0 tests/test_checkpoint_mutation.py -s``
(every byte of the file, each flipped once), which prints the counts.
"""

import os
import random
import shutil
from collections import Counter

import h5py
import numpy as np
import pytest
from conftest import WORDS, small_text
from test_checkpoint import arrays, assert_identical, gpt, quiet

from mpitrain import checkpoint, train

PER_REGION = int(os.environ.get("MPITRAIN_MUTATIONS", "24"))
DECISIVE = ("step", "epoch", "epoch_step", "format_version")  # plus the JSON attributes


def regions(path) -> dict[str, list[int]]:
    """Byte offsets of the file by what is kept there."""
    data = path.read_bytes()
    block = checkpoint.format.read_header(path)["userblock"]
    header = data.index(b"\0")  # the header's text; zeros pad the userblock after it
    chunks, attr_bytes = set(), set()
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and obj.chunks:
                for i in range(obj.id.get_num_chunks()):
                    info = obj.id.get_chunk_info(i)
                    chunks.update(range(info.byte_offset, info.byte_offset + info.size))  # absolute offsets
        f.visititems(visit)
        for value in f.attrs.values():
            raw = value.encode() if isinstance(value, str) else None
            where = data.find(raw, block) if raw else -1
            if where >= 0:
                attr_bytes.update(range(where, where + len(raw)))
    superblock = set(range(block, block + 96))
    known = chunks | attr_bytes | superblock
    rest = [i for i in range(block, len(data)) if i not in known]
    return {"header": list(range(header)), "userblock padding": list(range(header, block)),
            "HDF5 superblock": sorted(superblock), "attributes": sorted(attr_bytes),
            "array chunks": sorted(chunks), "HDF5 headers and the rest": rest}


def loaded(path) -> dict:
    """Everything a resume takes from a checkpoint."""
    attrs = checkpoint.check(path)
    return {"arrays": arrays(path), "attrs": {k: attrs[k] for k in DECISIVE}, "json": attrs["json"]}


def same(a: dict, b: dict) -> bool:
    return (a["attrs"] == b["attrs"] and a["json"] == b["json"] and a["arrays"].keys() == b["arrays"].keys()
            and all(np.array_equal(a["arrays"][k], b["arrays"][k]) for k in a["arrays"]))


def outcome(path, original: dict) -> str:
    try:
        state = loaded(path)
    except checkpoint.CheckpointError as e:
        assert str(path) in str(e)
        return "detected"
    assert same(state, original), f"{path}: a mutation that loads and changes the run"
    return "harmless"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("mutation")
    small_text(root / "shards", 400, WORDS[:3])
    train.train(gpt(root / "shards", root / "run", "train.steps=12"), log=quiet)
    return root


def test_every_single_byte_flip_is_detected_or_harmless(saved, tmp_path):
    path = checkpoint.path_for(saved / "run", 12)
    original, data = loaded(path), path.read_bytes()
    counts, rng = Counter(), random.Random(19)
    target = tmp_path / path.name
    for region, offsets in regions(path).items():
        for offset in (offsets if PER_REGION >= len(offsets) else rng.sample(offsets, PER_REGION)):
            mutated = bytearray(data)
            mutated[offset] ^= 1 << rng.randrange(8)
            target.write_bytes(mutated)
            counts[region, outcome(target, original)] += 1
    print("\nsingle-byte flips:", dict(sorted(counts.items())))
    assert sum(n for (_, what), n in counts.items() if what == "detected") > 0


def test_truncations_and_swapped_or_missing_files_are_detected_or_harmless(saved, tmp_path):
    path = checkpoint.path_for(saved / "run", 12)
    original, data = loaded(path), path.read_bytes()
    target = tmp_path / path.name
    counts = Counter()
    for keep in sorted({0, 1, 8, 96, len(data) // 3, len(data) // 2, len(data) - 1} |
                       {random.Random(keep).randrange(len(data)) for keep in range(PER_REGION)}):
        target.write_bytes(data[:keep])
        counts["truncated", outcome(target, original)] += 1
    shutil.copy(checkpoint.path_for(saved / "run", 8), target)  # another step's file under this name
    counts["swapped", outcome(target, original)] += 1
    print("\ntruncated and swapped:", dict(sorted(counts.items())))
    assert counts["swapped", "detected"] == 1 and counts["truncated", "harmless"] == 0


@pytest.mark.parametrize("how", ["flipped attribute", "missing"])
def test_a_run_resumed_past_damage_ends_bit_identical(saved, tmp_path, how):
    """Detected damage to the newest checkpoint, or its loss: the resume takes the one
    before, and the run ends with the uninterrupted run's bits."""
    run = tmp_path / "run"
    shutil.copytree(saved / "run" / "checkpoints", run / "checkpoints")
    newest = checkpoint.path_for(run, 12)
    if how == "missing":
        newest.unlink()
    else:  # a digit of the optimizer's step count, a JSON attribute
        raw = bytearray(newest.read_bytes())
        raw[raw.index(b'"step_count": ') + 14] ^= 0x01
        newest.write_bytes(raw)
    again = train.train(gpt(saved / "shards", run, "train.steps=12"), log=quiet, warn=quiet, resume=True)
    assert again.start_step == 8
    assert_identical(checkpoint.path_for(saved / "run", 12), checkpoint.path_for(run, 12))
