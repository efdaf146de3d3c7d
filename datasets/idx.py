"""MNIST and Fashion-MNIST from the four standard IDX files (LeCun et al.; Xiao et al. 2017).

The IDX format: a big-endian header (two zero bytes, a type code, the number of
dimensions, then one 32-bit size per dimension) followed by the values. Images are
type 0x08 (unsigned byte) with 3 dimensions (count, rows, columns): magic 0x00000803;
labels are 0x08 with 1 dimension: magic 0x00000801. Files may be gzipped (``.gz``) or raw.

The published files are checked by the SHA-256 of their *decompressed* content (gzip
headers carry a timestamp, so archives from different mirrors differ), so a
re-compressed copy such as Debian's ``dataset-fashion-mnist`` passes too.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
from mpitrain_datasets.common import sha256, write_images

from mpitrain.data.shards import DataError

FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
COUNTS = {"train": 60_000, "test": 10_000}
IMAGE_MAGIC, LABEL_MAGIC = 0x00000803, 0x00000801

MNIST_SHA256 = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
FASHION_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                   "Bag", "Ankle boot")
DEBIAN_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


def find(src: Path, stem: str) -> Path:
    """``stem`` or ``stem.gz`` in ``src`` (also the common ``stem.idx3-ubyte`` spelling)."""
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx") + ".gz", stem.replace("-idx", ".idx")):
        if (src / name).is_file():
            return src / name
    raise DataError(f"{src}: no {stem} or {stem}.gz")


def read_idx(path: Path, magic: int, count: int | None, expect_sha256: str | None):
    """(array, SHA-256 of the decompressed file) of an IDX file, after checking its magic
    number, its sizes and (if given) the hash."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
        raise DataError(f"{path}: cannot be read ({e})") from None
    if len(data) < 4 or int.from_bytes(data[:4], "big") != magic:
        got = f"0x{int.from_bytes(data[:4], 'big'):08x}" if len(data) >= 4 else "too short"
        raise DataError(f"{path}: wrong magic number {got}, expected 0x{magic:08x} "
                        f"({'images' if magic == IMAGE_MAGIC else 'labels'}); not this kind of IDX file")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(data) != header + int(np.prod(shape)):
        raise DataError(f"{path}: {len(data) - header} bytes of values, the header's shape {shape} "
                        f"needs {int(np.prod(shape))} (truncated?)")
    if count is not None and shape[0] != count:
        raise DataError(f"{path}: holds {shape[0]} items, expected {count}; use --unverified-source "
                        "to build from other IDX files")
    digest = sha256(data)
    if expect_sha256 is not None and digest != expect_sha256:
        raise DataError(f"{path}: SHA-256 of the decompressed content is {digest}, not the "
                        f"published {expect_sha256}; use --unverified-source to build from other IDX files")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape), digest


def build_idx(src, out, name: str, classes, hashes: dict | None, **options):
    """Shards from a directory with the four IDX files; ``hashes`` None skips the check."""
    src = Path(src)
    if not src.is_dir():
        raise DataError(f"{src}: no such directory (expected the four IDX files in it)")
    splits, source = {}, {}
    for split, (images, labels) in FILES.items():
        count = COUNTS[split] if hashes else None
        paths = find(src, images), find(src, labels)
        x, source[images] = read_idx(paths[0], IMAGE_MAGIC, count, hashes and hashes[images])
        y, source[labels] = read_idx(paths[1], LABEL_MAGIC, len(x), hashes and hashes[labels])
        if x.ndim != 3:
            raise DataError(f"{paths[0]}: images must have 3 dimensions, found {x.ndim}")
        if y.max(initial=0) >= len(classes):
            raise DataError(f"{paths[1]}: label {int(y.max())} is not below {len(classes)} classes")
        splits[split] = (x[..., None], y)  # (N, 28, 28, 1): channels last
    return write_images(out, name, splits, classes, {"from": str(src.resolve()), "sha256": source}, **options)


def mnist(src, out, unverified_source: bool = False, **options):
    return build_idx(src, out, "mnist", [str(d) for d in range(10)],
                     None if unverified_source else MNIST_SHA256, **options)


def fashion_mnist(src, out, unverified_source: bool = False, **options):
    return build_idx(src, out, "fashion-mnist", FASHION_CLASSES,
                     None if unverified_source else FASHION_SHA256, **options)


def fashion_mnist_debian(src, out, **options):
    """Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (``apt-get install
    dataset-fashion-mnist``), which installs the four files under /usr/share/datasets."""
    src = Path(src) if src else DEBIAN_FASHION_DIR
    if not src.is_dir():
        raise DataError(f"{src}: not found; install Debian's package: apt-get install dataset-fashion-mnist")
    return fashion_mnist(src, out, **options)
