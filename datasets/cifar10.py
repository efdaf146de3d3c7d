"""CIFAR-10 (Krizhevsky 2009) from the python pickle batches or from an image folder.

* ``cifar-10-batches-py``: ``data_batch_1`` ... ``data_batch_5``, ``test_batch`` and
  ``batches.meta``, each a pickled dict; ``data`` is (10000, 3072) uint8 holding the red,
  green and blue planes of each 32x32 image, ``labels`` a list of ints. Given as the
  directory or as the ``cifar-10-python.tar.gz`` archive. The pickles are loaded with an
  unpickler that accepts only NumPy arrays and plain Python values, never arbitrary code.
* an image folder ``train/<class>/*.jpg`` and ``test/<class>/*.jpg`` (also ``.png``), as
  a directory or a ``.tar``/``.tar.gz`` of one; classes are the sorted folder names.
  Decoding needs Pillow (``pip install pillow``). The folder order is class-sorted, so
  each split is shuffled once with a fixed seed, recorded in the manifest.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import tarfile
import zlib
from pathlib import Path

import numpy as np
from mpitrain_datasets.common import SHUFFLE_SEED, sha256, shuffled, write_images

from mpitrain.data.shards import DataError

BATCHES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


class _ArraysOnly(pickle.Unpickler):
    """Unpickle NumPy arrays and builtin containers; refuse every other global."""

    ALLOWED = frozenset({("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                         ("numpy", "ndarray"), ("numpy", "dtype"),
                         ("_codecs", "encode"),  # how Python 3 stores bytes at protocol 2
                         ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")})

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _load_pickle(data: bytes, where: str) -> dict:
    try:
        value = _ArraysOnly(io.BytesIO(data), encoding="bytes").load()
    except Exception as e:  # a damaged or foreign pickle: say which file
        raise DataError(f"{where}: not a CIFAR-10 python batch ({e})") from None
    if not isinstance(value, dict):
        raise DataError(f"{where}: not a CIFAR-10 python batch (a {type(value).__name__}, not a dict)")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in value.items()}


@contextlib.contextmanager
def _damaged_archive(src: Path):
    """A truncated or corrupted archive (its gzip stream or its tar blocks) as one
    DataError naming it."""
    try:
        yield
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DataError(f"{src}: damaged archive ({e or type(e).__name__})") from None


def _to_the_end(tar: tarfile.TarFile) -> None:
    """Read the archive's stream to its end: tarfile stops at the archive's end marker,
    before a gzip trailer's CRC-32, and only reading past it checks that (a corrupted
    stream can otherwise inflate to other bytes without a word)."""
    while tar.fileobj.read(1 << 20):
        pass


def _pickle_members(src: Path) -> dict[str, bytes]:
    """{file name: bytes} of the batch files, from a directory or a tar archive."""
    wanted = set(BATCHES["train"] + BATCHES["test"] + ["batches.meta"])
    if src.is_dir():
        return {p.name: p.read_bytes() for p in src.iterdir() if p.name in wanted}
    if src.is_file() and tarfile.is_tarfile(src):
        found = {}
        with _damaged_archive(src), tarfile.open(src) as tar:
            for m in tar:
                name = m.name.rsplit("/", 1)[-1]
                if m.isfile() and name in wanted:
                    found[name] = tar.extractfile(m).read()
            _to_the_end(tar)
        return found
    raise DataError(f"{src}: neither a directory nor a tar archive")


def cifar10(src, out, **options):
    """From ``cifar-10-batches-py`` (directory) or ``cifar-10-python.tar.gz``."""
    src = Path(src)
    files = _pickle_members(src)
    splits, source = {}, {}
    for split, names in BATCHES.items():
        xs, ys = [], []
        for name in names:
            if name not in files:
                raise DataError(f"{src}: no {name} (expected the cifar-10-batches-py files)")
            batch = _load_pickle(files[name], f"{src}/{name}")
            data, labels = np.asarray(batch.get("data")), np.asarray(batch.get("labels"))
            if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
                raise DataError(f"{src}/{name}: expected uint8 data (N, 3072) and N labels, got "
                                f"{data.dtype} {data.shape} and {labels.shape}")
            xs.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))  # planes -> (N, 32, 32, 3)
            ys.append(labels)
            source[name] = sha256(files[name])
        splits[split] = (np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys))
    classes = CLASSES
    if "batches.meta" in files:
        names = _load_pickle(files["batches.meta"], f"{src}/batches.meta").get("label_names")
        if names:
            classes = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
    for split, (_, y) in splits.items():
        if y.min() < 0 or y.max() >= len(classes):
            raise DataError(f"{src}: {split} labels outside 0..{len(classes) - 1}")
    return write_images(out, "cifar10", splits, classes, {"from": str(src.resolve()), "sha256": source},
                        **options)


_LAYOUT = re.compile(r"(?:^|/)(train|test)/([^/]+)/([^/]+)$")


def _folder_members(src: Path):
    """(split, class, name, bytes) for every image under train/ and test/."""
    if src.is_dir():
        for p in sorted(src.rglob("*")):
            m = _LAYOUT.search(p.relative_to(src).as_posix())
            if m and p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES:
                yield m.group(1), m.group(2), p.as_posix(), p.read_bytes()
    elif src.is_file() and tarfile.is_tarfile(src):
        with _damaged_archive(src), tarfile.open(src) as tar:
            for member in tar:
                m = _LAYOUT.search(member.name)
                if m and member.isfile() and Path(member.name).suffix.lower() in IMAGE_SUFFIXES:
                    yield m.group(1), m.group(2), f"{src}:{member.name}", tar.extractfile(member).read()
            _to_the_end(tar)
    else:
        raise DataError(f"{src}: neither a directory nor a tar archive")


def image_folder(src, out, name: str = "cifar10-images", **options):
    """From ``train/<class>/*.jpg`` and ``test/<class>/*.jpg`` (directory or tar archive)."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError("decoding JPEG/PNG images needs Pillow: pip install pillow") from None
    src = Path(src)
    found: dict[str, list] = {"train": [], "test": []}
    shape = None
    for split, cls, where, data in _folder_members(src):
        try:
            with Image.open(io.BytesIO(data)) as im:
                pixels = np.asarray(im.convert("RGB"))  # (H, W, 3) uint8
        except Exception as e:  # Pillow raises many kinds for a damaged image
            raise DataError(f"{where}: not a readable image ({e})") from None
        if shape is None:
            shape = pixels.shape
        elif pixels.shape != shape:
            raise DataError(f"{where}: {pixels.shape[1]}x{pixels.shape[0]} pixels, the others are "
                            f"{shape[1]}x{shape[0]}; all images must have one size")
        found[split].append((cls, where, pixels))
    if not found["train"]:
        raise DataError(f"{src}: no images in train/<class>/ (expected train/<class>/*.jpg and test/...)")
    classes = sorted({cls for cls, _, _ in found["train"]})
    extra = sorted({cls for cls, _, _ in found["test"]} - set(classes))
    if extra:
        raise DataError(f"{src}: test classes {extra} have no training images")
    index = {c: i for i, c in enumerate(classes)}
    splits = {}
    for split, items in found.items():
        if not items:
            continue
        items.sort(key=lambda t: t[1])  # by path: the same order from a directory or an archive
        x = np.stack([p for _, _, p in items])  # (N, H, W, 3)
        y = np.array([index[c] for c, _, _ in items])
        splits[split] = shuffled(x, y)
    source = {"from": str(src.resolve()), "layout": "split/class/image", "shuffle_seed": SHUFFLE_SEED}
    return write_images(out, name, splits, classes, source, **options)
