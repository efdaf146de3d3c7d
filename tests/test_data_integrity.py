"""Integrity of shard datasets (issue 19, "nothing silent, nothing lost"): every field that
decides a run is covered by a checksum, every damage or inconsistency is one DataError
naming the file, and the values the model indexes with are checked before they are used."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_data import image_set, text_set

from mpitrain import config
from mpitrain.comm import SingleComm
from mpitrain.data import DataError, DatasetWriter, ShardReader, open_dataset
from mpitrain.train import build

MANIFEST = "manifest.json"


def edit_manifest(d, change, reseal=False):
    """Apply ``change`` to the manifest of ``d``. Without ``reseal`` the checksum is left
    as it was, as damage would leave it; with it the checksum agrees with the edit, as a
    tool that wrote a wrong manifest would leave it."""
    manifest = json.loads((d / MANIFEST).read_text())
    change(manifest)
    if reseal:
        from mpitrain.data.manifest import write_manifest

        write_manifest(d, manifest)
    else:
        (d / MANIFEST).write_text(json.dumps(manifest, indent=1))


def opened_and_verified(d):
    """What the trainer does with data.verify = true: open (every shard's structure),
    then re-hash and check every shard."""
    with open_dataset(d) as ds:
        problems = ds.verify()
        if problems:
            raise DataError(problems[0])


def image(tmp_path):
    image_set(tmp_path / "d")
    return tmp_path / "d"


def text(tmp_path):
    text_set(tmp_path / "d")
    return tmp_path / "d"


# ------------------------------------------------------------------ the manifest's checksum
def swap_vocab(m):
    m["vocab"] = m["vocab"][1] + m["vocab"][0] + m["vocab"][2:]


def swap_shards(m):
    shards = m["splits"]["train"]["shards"]
    shards[0], shards[1] = shards[1], shards[0]


@pytest.mark.parametrize("make, change", [
    (text, swap_vocab),
    (text, lambda m: m.update(vocab=m["vocab"][:-1])),
    (image, lambda m: m["classes"].append("10")),
    (image, lambda m: m["classes"].pop()),
    (image, lambda m: m.update(mean=[0.6])),
    (image, lambda m: m.update(std=[0.2])),
    (image, lambda m: m["splits"]["train"].update(chunk_rows=7)),
    (image, swap_shards),
    (image, lambda m: m.update(name="other")),
], ids=["swapped vocabulary characters", "removed character", "extra class", "removed class", "changed mean",
        "changed std", "changed chunk rows", "swapped shard entries", "renamed"])
def test_a_changed_manifest_field_is_a_damaged_manifest(tmp_path, make, change):
    d = make(tmp_path)
    edit_manifest(d, change)
    with pytest.raises(DataError, match=r"manifest\.json: damaged"):
        open_dataset(d)


def test_whitespace_and_key_order_do_not_matter(tmp_path):
    d = image(tmp_path)
    manifest = json.loads((d / MANIFEST).read_text())
    (d / MANIFEST).write_text(json.dumps(dict(reversed(manifest.items())), indent=4) + "\n\n")
    opened_and_verified(d)


def nested(path, value):
    """A change setting ``manifest[path[0]][path[1]]... = value``."""
    def change(m):
        for key in path[:-1]:
            m = m[key]
        m[path[-1]] = value
    return change


@pytest.mark.parametrize("path, value, message", [
    (("splits", "train", "count"), None, "splits.train.count must be an integer >= 1, got None"),
    (("splits", "train", "count"), "1000", "splits.train.count must be an integer >= 1, got '1000'"),
    (("splits", "train", "shards", 0, "bytes"), None, r"splits.train.shards\[0\].bytes must be"),
    (("splits", "train", "shards", 0, "file"), "../../x.h5", r"splits.train.shards\[0\].file must be"),
    (("splits", "train", "sample_shape"), None, "splits.train.sample_shape must be"),
    (("splits", "test", "sample_shape"), [8, 8, 1], r"splits.test.sample_shape must be .*\[6, 6, 1\]"),
    (("splits", "train", "x_dtype"), "<f4", "splits.train.x_dtype must be"),
    (("splits", "train", "y_dtype"), None, "splits.train.y_dtype must be"),
    (("splits", "train", "chunk_rows"), 0, "splits.train.chunk_rows must be"),
    (("classes",), "0123456789", "classes must be"),
    (("classes",), [], "classes must be"),
    (("mean",), [0.1, 0.1, 0.1], "mean must be .*1 channel"),
    (("std",), [0.0], "std must be"),
    (("std",), [-0.25], "std must be"),
    (("mean",), [33.3], "mean must be"),
    (("kind",), "video", "kind must be"),
])
def test_a_wrong_manifest_field_names_the_field(tmp_path, path, value, message):
    """A manifest whose checksum agrees but whose fields are wrong (written by another
    tool, or edited and re-sealed) is refused field by field, never a raw traceback."""
    d = image(tmp_path)
    edit_manifest(d, nested(path, value), reseal=True)
    with pytest.raises(DataError, match=rf"manifest\.json: {message}"):
        open_dataset(d)


@pytest.mark.parametrize("path, value", [
    (("splits", "train", "count"), None),
    (("splits", "train", "shards", 1, "count"), "10"),
    (("splits",), []),
    (("splits", "train", "shards"), None),
])
def test_nulls_and_strings_in_a_damaged_manifest_are_one_error(tmp_path, path, value):
    d = image(tmp_path)
    edit_manifest(d, nested(path, value))
    with pytest.raises(DataError, match=r"manifest\.json"):
        opened_and_verified(d)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "2.5e999"])
def test_numbers_beyond_a_float_in_a_manifest_are_refused(tmp_path, number):
    """2.5e999 is what the wide mutation run made of a flipped byte in 0.25: Python reads
    infinity, and the checksum's canonical JSON then raised a raw ValueError."""
    d = image(tmp_path)
    (d / MANIFEST).write_text((d / MANIFEST).read_text().replace('"std": [\n  0.25\n ]', f'"std": [{number}]'))
    with pytest.raises(DataError, match=rf"manifest\.json: not a valid manifest.*{number}"):
        open_dataset(d)


# ------------------------------------------------------------------ older format versions
def downgrade(d):
    """Make ``d`` look as format version 1 wrote it: no checksums."""
    manifest = json.loads((d / MANIFEST).read_text())
    manifest.pop("manifest_sha256", None)
    manifest["version"] = 1
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            shard.pop("metadata_sha256", None)
            shard.pop("data_ranges", None)
    (d / MANIFEST).write_text(json.dumps(manifest, indent=1))


def test_a_version_1_dataset_is_refused_with_the_command_that_rebuilds_it(tmp_path):
    d = image(tmp_path)
    downgrade(d)
    with pytest.raises(DataError, match=rf"manifest\.json: format version 1 .*mpitrain data build .* --out {d}"):
        open_dataset(d)


def test_building_into_a_version_1_directory_replaces_it(tmp_path):
    from mpitrain_datasets import build

    src = tmp_path / "a.txt"
    src.write_text("to be or not to be\n" * 20)
    out = tmp_path / "out"
    build("text", src, out)
    downgrade(out)
    writer = build("text", src, out)
    assert not writer.up_to_date
    opened_and_verified(out)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing left beside it


def test_rebuilding_repairs_damaged_shards_rather_than_calling_them_up_to_date(tmp_path):
    from mpitrain_datasets import build

    src = tmp_path / "a.txt"
    src.write_text("to be or not to be\n" * 20)
    out = tmp_path / "out"
    build("text", src, out)
    shard = out / "train-00000.h5"
    with h5py.File(shard, "r") as f:
        offset = f["x"].id.get_chunk_info(0).byte_offset
    flip(shard, offset + 3, 0x01)
    with pytest.raises(DataError, match="train-00000.h5: damaged"):
        opened_and_verified(out)
    assert not build("text", src, out).up_to_date
    opened_and_verified(out)
    assert build("text", src, out).up_to_date


def test_the_embedded_cache_of_an_older_version_is_rebuilt_by_itself(tmp_path, monkeypatch):
    from mpitrain_datasets import embedded, text as recipes

    def tiny(src, out, **options):
        return recipes.write_text(out, "shakespeare", "to be or not to be\n" * 20, 0.1, {"from": "test"})

    monkeypatch.setenv("MPITRAIN_DATA", str(tmp_path / "cache"))
    monkeypatch.setitem(embedded.DEFAULTS, "shakespeare", tiny)
    logged = []
    path = embedded.ensure("shakespeare", log=logged.append)
    downgrade(path)
    assert embedded.ensure("shakespeare", log=logged.append) == path
    assert len(logged) == 2 and "format version 1" in logged[1]
    opened_and_verified(path)
    assert embedded.ensure("shakespeare", log=logged.append) == path and len(logged) == 2  # current: kept


# ------------------------------------------------------------------ damaged HDF5 metadata
def flip(path, offset, mask=0xFF):
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def header_address(shard, region):
    with h5py.File(shard, "r") as f:
        obj = {"root group": f, "x header": f.get("x"), "y header": f.get("y")}.get(region)
        return 0 if obj is None else h5py.h5o.get_info(obj.id).addr


@pytest.mark.parametrize("region, offset", [("superblock", 17), ("superblock", 19), ("root group", 16),
                                            ("root group", 40), ("x header", 0), ("x header", 16),
                                            ("x header", 33), ("y header", 8)])
def test_damaged_hdf5_metadata_is_one_error_naming_the_shard(tmp_path, region, offset):
    """Single bytes that made h5py raise KeyError, RuntimeError or AttributeError."""
    d = image(tmp_path)
    shard = d / "train-00002.h5"
    flip(shard, header_address(shard, region) + offset)
    with pytest.raises(DataError) as raised:
        opened_and_verified(d)
    assert str(shard) in str(raised.value)


def test_a_damaged_attribute_type_never_reaches_hdf5(tmp_path):
    """This byte (the class of the datatype of the 'dataset' attribute) made HDF5 2.0
    crash the process with a segmentation fault while the attributes were read: a
    subprocess, so that a crash fails this test rather than ending the test run."""
    d = image(tmp_path)
    shard = d / "train-00002.h5"
    flip(shard, shard.read_bytes().index(b"dataset\x00") + 9)
    code = ("import sys\n"
            "from mpitrain.data import DataError, open_dataset\n"
            "try:\n"
            "    open_dataset(sys.argv[1]).verify()\n"
            "except DataError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.startswith(f"{shard}: damaged")


def test_swapped_shard_files_are_found_at_open(tmp_path):
    d = image(tmp_path)
    a, b = d / "train-00001.h5", d / "train-00002.h5"
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    with pytest.raises(DataError, match="train-0000[12].h5"):
        open_dataset(d)


# ------------------------------------------------------------------ values: the writer
def images(n=20, dtype=np.uint8, high=256):
    return np.random.default_rng(0).integers(0, high, (n, 4, 4, 1)).astype(dtype)


def write_image_split(tmp_path, x, y, **meta):
    meta = {"classes": list("0123456789"), "mean": [0.5], "std": [0.25], **meta}
    with DatasetWriter(tmp_path / "out", "toy", "image", **meta) as w:
        w.write_split("train", x, y)


def nothing_left(tmp_path):
    return [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize("label", [10, 255, -1, -100])
def test_the_writer_refuses_labels_outside_the_classes(tmp_path, label):
    y = (np.arange(20) % 10).astype(np.int16)
    y[7] = label
    with pytest.raises(DataError, match=rf"out: split 'train': label {label} at index 7 is outside 0\.\.9"):
        write_image_split(tmp_path, images(), y)
    assert nothing_left(tmp_path)


@pytest.mark.parametrize("x, message", [
    (images(dtype=np.float32, high=2) / 1.0, "float32"),  # already scaled to [0, 1]
    (images(dtype=np.float64), "float64"),
    (images(dtype=np.int16), "int16"),
    (images()[..., 0], r"uint8 \(20, 4, 4\)"),
], ids=["float scaled", "float 0-255", "int16", "no channel axis"])
def test_the_writer_refuses_images_that_are_not_uint8_pixels(tmp_path, x, message):
    with pytest.raises(DataError, match=rf"images must be uint8 .*0-255.*got {message}"):
        write_image_split(tmp_path, x, np.arange(20) % 10)
    assert nothing_left(tmp_path)


@pytest.mark.parametrize("mean, std", [([float("nan")], [0.3]), ([0.1], [float("nan")]), ([0.1], [float("inf")]),
                                       ([0.1], [0.0]), ([0.1], [-0.2]), ([33.3], [78.6]), ([0.5, 0.5], [0.2, 0.2]),
                                       ([], [])])
def test_the_writer_refuses_statistics_that_would_not_normalise(tmp_path, mean, std):
    with pytest.raises(DataError, match=r"out: (mean|std) must be"):
        write_image_split(tmp_path, images(), np.arange(20) % 10, mean=mean, std=std)
    assert nothing_left(tmp_path)


def test_the_writer_refuses_tokens_outside_the_vocabulary(tmp_path):
    ids = np.arange(100) % 5
    ids[42] = 5
    with pytest.raises(DataError, match=r"out: split 'train': token 5 at index 42 is outside 0\.\.4"):
        with DatasetWriter(tmp_path / "out", "toy", "text", vocab="abcde") as w:
            w.write_split("train", ids)
    assert nothing_left(tmp_path)


def test_the_writer_refuses_splits_of_other_sample_shapes(tmp_path):
    with pytest.raises(DataError, match=r"split 'test' has samples of shape \(5, 5, 1\), split 'train' \(4, 4, 1\)"):
        with DatasetWriter(tmp_path / "out", "toy", "image", classes=list("01"), mean=[0.5], std=[0.25]) as w:
            w.write_split("train", images(), np.zeros(20, np.uint8))
            w.write_split("test", np.zeros((3, 5, 5, 1), np.uint8), np.zeros(3, np.uint8))
    assert nothing_left(tmp_path)


# ------------------------------------------------------------------ values: the reader and the trainer
@pytest.fixture
def unchecked(monkeypatch):
    """A writer that does not check values (an older or another tool): the reader's checks
    are what stands between such data and the model."""
    monkeypatch.setattr(DatasetWriter, "_checked", lambda self, split, x, y: (x, y))


def bad_labels(d, split, index, label, n_classes=10):
    x, y = image_set(d)
    y = y.astype(np.int32 if n_classes > 256 else np.uint8)
    with DatasetWriter(d.parent / "bad", "toy", "image", shard_mb=0.01, chunk_kb=4,
                       classes=[str(c) for c in range(n_classes)], mean=[0.5], std=[0.25]) as w:
        for name, (xs, ys) in {"train": (x, y.copy()), "test": (x[:100], y[:100].copy())}.items():
            if name == split:
                ys[index] = label
            w.write_split(name, xs, ys)
    return d.parent / "bad"


@pytest.mark.parametrize("label, n_classes", [(10, 10), (255, 10), (-100, 300)])
def test_the_reader_refuses_labels_outside_the_classes(tmp_path, unchecked, label, n_classes):
    d = bad_labels(tmp_path / "d", "train", 400, label, n_classes)
    with open_dataset(d) as ds:
        split = ds.split("train")
        reader = ShardReader(split, rank=0, size=1, global_batch=64, seed=0, drop_last=False)
        with pytest.raises(DataError, match=rf"train-00001\.h5: split 'train': label {label} at index 400 is outside"):
            list(reader.epoch(0))
        problems = ds.verify()
        assert len(problems) == 1 and "label" in problems[0] and "train-00001.h5" in problems[0]


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("split, index, file", [("test", 42, "test-00000.h5"), ("train", 400, "train-00001.h5")])
def test_a_bad_label_is_found_before_step_0(tmp_path, unchecked, verify, split, index, file):
    """Not at the final evaluation, after the whole run; with data.verify = false too."""
    d = bad_labels(tmp_path / "d", split, index, 10)
    cfg = config.from_dict({"data": {"path": str(d), "verify": verify}, "train": {"epochs": 1}})
    with pytest.raises(DataError, match=rf"{file}: split '{split}': label 10 at index {index} is outside 0\.\.9"):
        build.open_data(cfg, SingleComm(), log=lambda *a: None)


@pytest.mark.parametrize("verify", [True, False])
def test_tokens_beyond_the_vocabulary_are_found_before_step_0(tmp_path, unchecked, verify):
    ids = (np.arange(5000) * 7 % 31).astype(np.uint8)
    ids[4700] = 31
    with DatasetWriter(tmp_path / "d", "toytext", "text", shard_mb=0.002, vocab="abcdefghijklmnopqrstuvwxyz01234") as w:
        w.write_split("train", ids[:4500])
        w.write_split("val", ids[4500:])
    cfg = config.from_dict({"model": {"name": "gpt", "block_size": 8}, "data": {"path": str(tmp_path / "d"),
                            "verify": verify}, "train": {"steps": 2}})
    with pytest.raises(DataError, match=r"val-00000\.h5: split 'val': token 31 at index 200 is outside 0\.\.30"):
        build.open_data(cfg, SingleComm(), log=lambda *a: None)
    with open_dataset(tmp_path / "d") as ds:
        windows = ShardReader(ds.split("val"), rank=0, size=1, global_batch=4, seed=0, window=8, drop_last=False)
        with pytest.raises(DataError, match="token 31 at index 200"):
            list(windows.epoch(0))


def test_cli_train_on_bad_labels_is_one_line_before_step_0(tmp_path, unchecked, capsys):
    from mpitrain import cli

    d = bad_labels(tmp_path / "d", "test", 42, 10)
    jobs = Path(__file__).resolve().parent.parent / "jobs"
    code = cli.main(["train", str(jobs / "mnist_lenet.toml"), "--set", f"data.path={d}", "--set", "train.epochs=0",
                     "--set", "train.steps=2",
                     "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr()
    assert code == 2 and "step" not in out.out
    assert out.err.strip().splitlines() == [f"mpitrain: error: {d}/test-00000.h5: split 'test': label 10 at index 42 "
                                            "is outside 0..9 (10 classes)"]


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (pip install mpich)")
def test_a_bad_token_met_by_one_rank_mid_run_ends_every_rank_with_its_message(tmp_path, unchecked):
    """With data.verify = false the training tokens are checked as they are read: a
    damaged one is found by the one rank that reads its window, while the other goes on
    into the step's allreduce. That rank names itself and ends the job (no waiting for
    the stall watchdog)."""
    ids = (np.arange(5000) * 7 % 31).astype(np.uint8)
    ids[2004] = 31  # inside one window of 8 (2000..2008) only: one rank reads it
    with DatasetWriter(tmp_path / "d", "toytext", "text", shard_mb=0.002, vocab="abcdefghijklmnopqrstuvwxyz01234") as w:
        w.write_split("train", ids[:4500])
        w.write_split("val", ids[4500:])
    jobs = Path(__file__).resolve().parent.parent / "jobs"
    cmd = [shutil.which("mpiexec"), "-n", "2", sys.executable, "-m", "mpitrain", "train", str(jobs / "tinyshakespeare_gpt.toml"),
           "--set", f"data.path={tmp_path / 'd'}", "--set", "data.verify=false", "--set", "data.sampling=stride",
           "--set", "model.n_layer=1",
           "--set", "model.n_embd=16", "--set", "model.n_head=2", "--set", "model.block_size=8",
           "--set", "train.global_batch_size=8", "--set", "train.steps=80", "--set", "train.eval_batches=1",
           "--set", "train.sample_tokens=0", "--set", "train.threads=1", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    said = [line for line in done.stderr.splitlines() if "mpitrain: error:" in line]
    assert len(said) == 1 and said[0].startswith("[rank ") and "token 31 at index 2004 is outside 0..30" in said[0]
    assert "Traceback" not in done.stderr, done.stderr
