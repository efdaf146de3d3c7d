"""A shard set built from the real MNIST IDX files holds exactly their images and labels."""

import gzip
from pathlib import Path

import numpy as np
import pytest

from mpitrain.data import DataError, open_dataset
from mpitrain_datasets import idx

MNIST = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mnist"


def decode(path: Path, header: int) -> np.ndarray:
    return np.frombuffer(gzip.decompress(path.read_bytes()), dtype=np.uint8, offset=header)


@pytest.mark.skipif(not MNIST.is_dir(), reason="needs ../shared/datasets/mnist")
def test_mnist_shards_match_the_idx_files(tmp_path):
    idx.mnist(MNIST, tmp_path / "m")
    data = open_dataset(tmp_path / "m")
    assert data.verify() == []
    for split, stem in (("train", "train"), ("test", "t10k")):
        images = decode(MNIST / f"{stem}-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
        labels = decode(MNIST / f"{stem}-labels-idx1-ubyte.gz", 8)
        s = data.split(split)
        np.testing.assert_array_equal(s.read_all("x")[..., 0], images)
        np.testing.assert_array_equal(s.read_all("y"), labels)
    assert data.mean == pytest.approx((0.1307,), abs=1e-4) and data.std == pytest.approx((0.3081,), abs=1e-4)


def test_wrong_magic_number_names_the_file(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    header = (0x00000801).to_bytes(4, "big") + (3).to_bytes(4, "big")  # a labels magic on an images file
    (src / "train-images-idx3-ubyte").write_bytes(header + b"\0\0\0")
    (src / "train-labels-idx1-ubyte").write_bytes(header + b"\0\0\0")
    with pytest.raises(DataError, match="train-images-idx3-ubyte: wrong magic number 0x00000801"):
        idx.mnist(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
