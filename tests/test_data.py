"""The shard format's checks and the per-rank reader (no MPI: ranks are simulated)."""

import json

import h5py
import numpy as np
import pytest

from mpitrain.data import DataError, DatasetWriter, ShardReader, open_dataset
from mpitrain.data.loader import flips, normalize, random_flip, random_shift, shifts
from mpitrain.data.reader import EpochPlan


def image_set(path, n=1000, test=100, shard_mb=0.01, compression=None, seed=0, shape=(6, 6, 1)):
    """A small image dataset of ``shape`` (H, W, C): sample i of 'train' has label i % 10 and pixels derived from i."""
    r = np.random.default_rng(seed)
    x = r.integers(0, 256, (n, *shape), dtype=np.uint8)
    x[:, 0, 0, 0] = np.arange(n) % 256
    y = (np.arange(n) % 10).astype(np.uint8)
    with DatasetWriter(path, "toy", "image", shard_mb=shard_mb, chunk_kb=4, compression=compression,
                       classes=list("0123456789"), mean=[0.5] * shape[-1], std=[0.25] * shape[-1]) as w:
        w.write_split("train", x, y)
        w.write_split("test", x[:test], y[:test])
    return x, y


def text_set(path, n=5000, shard_mb=0.002):
    ids = (np.arange(n) * 7 % 31).astype(np.uint8)
    with DatasetWriter(path, "toytext", "text", shard_mb=shard_mb, vocab="abcdefghijklmnopqrstuvwxyz01234") as w:
        w.write_split("train", ids[: n - 500])
        w.write_split("val", ids[n - 500 :])
    return ids


def collect(split, size, B, seed=3, epoch=0, **kw):
    """The global batches of one epoch, assembled from ``size`` simulated ranks."""
    per_rank = []
    for rank in range(size):
        reader = ShardReader(split, rank=rank, size=size, global_batch=B, seed=seed, buffer_mb=0.01, **kw)
        per_rank.append(list(reader.epoch(epoch)))
    steps = len(per_rank[0])
    assert all(len(p) == steps for p in per_rank), "every rank gets the same number of batches"
    return [(np.concatenate([p[s].index for p in per_rank]), np.concatenate([p[s].x for p in per_rank]),
             np.concatenate([p[s].y for p in per_rank])) for s in range(steps)]


# ------------------------------------------------------------------- reader
@pytest.mark.parametrize("compression", [None, "gzip"])
def test_epoch_visits_every_sample_once_and_batches_match_the_data(tmp_path, compression):
    x, y = image_set(tmp_path / "d", compression=compression)
    split = open_dataset(tmp_path / "d").split("train")
    assert len(split.shards) > 3  # reads cross shard boundaries
    batches = collect(split, 1, 64, drop_last=False)
    index = np.concatenate([b[0] for b in batches])
    assert sorted(index.tolist()) == list(range(1000))
    for idx, xb, yb in batches:
        np.testing.assert_array_equal(xb, x[idx])
        np.testing.assert_array_equal(yb, y[idx])
    dropped = np.concatenate([b[0] for b in collect(split, 1, 64)])
    assert len(dropped) == 1000 // 64 * 64 and len(set(dropped.tolist())) == len(dropped)


@pytest.mark.parametrize("drop_last", [True, False])
def test_global_batches_do_not_depend_on_the_rank_count(tmp_path, drop_last):
    image_set(tmp_path / "d")
    split = open_dataset(tmp_path / "d").split("train")
    one = collect(split, 1, 48, drop_last=drop_last)
    for size in (2, 4):
        other = collect(split, size, 48, drop_last=drop_last)
        assert len(other) == len(one)
        for (i1, x1, y1), (i2, x2, y2) in zip(one, other):
            np.testing.assert_array_equal(i1, i2)
            np.testing.assert_array_equal(x1, x2)
            np.testing.assert_array_equal(y1, y2)


def test_shuffle_depends_on_seed_and_epoch_only(tmp_path):
    image_set(tmp_path / "d")
    split = open_dataset(tmp_path / "d").split("train")
    first = lambda **kw: collect(split, 1, 32, **kw)[0][0]  # noqa: E731
    np.testing.assert_array_equal(first(seed=1, epoch=2), first(seed=1, epoch=2))
    assert not np.array_equal(first(seed=1, epoch=2), first(seed=1, epoch=3))
    assert not np.array_equal(first(seed=1, epoch=2), first(seed=2, epoch=2))
    # a well mixed epoch: consecutive batches are not runs of neighbouring samples
    assert np.abs(np.diff(np.sort(first(seed=1, epoch=0)))).mean() > 5


def test_each_rank_reads_only_its_share(tmp_path):
    image_set(tmp_path / "d", n=4000, shard_mb=0.02)
    split = open_dataset(tmp_path / "d").split("train")
    sample = split.sample_bytes
    for size in (1, 2, 4):
        for rank in range(size):
            reader = ShardReader(split, rank=rank, size=size, global_batch=64, seed=0, buffer_mb=0.1)
            for _ in reader.epoch(0):
                pass
            s = reader.stats[0]
            assert s.bytes_read == 4000 // 64 * (64 // size) * sample  # its samples, each read once
            assert s.samples == 4000 // 64 * (64 // size) and s.batches == 4000 // 64


def test_plan_rounds_cover_the_lanes():
    for n, B, K in [(1000, 64, 5), (1000, 64, 100), (64, 64, 3), (10, 4, 1), (30, 64, 4)]:
        plan = EpochPlan(n, B, seed=0, epoch=1, block=K, shuffle=True)
        rounds = list(plan.rounds(drop_last=False))
        assert sum(length for _, _, length in rounds) == plan.L + (plan.R > 0)
        seen = set()
        for round_id, first, length in rounds:
            for g in range(B):
                if first >= plan.L and g >= plan.R:
                    continue
                for k in range(length):
                    seen.add(int(plan.starts(np.array([g]), first)[0] + k) % n)
        assert seen == set(range(n))


def test_text_windows_are_inputs_and_next_token_targets(tmp_path):
    ids = text_set(tmp_path / "t")
    data = open_dataset(tmp_path / "t")
    split = data.split("train")
    T = 16
    batches = collect(split, 1, 8, window=T)
    train = ids[:4500]
    windows = (4500 - T) // T
    assert len(batches) == windows // 8
    for index, x, y in batches:
        assert x.shape == (8, T) and x.dtype == np.int64
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
        for row, target in zip(x, y):
            start = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(train, T) == row, axis=1))[0])
            np.testing.assert_array_equal(target, train[start + 1 : start + T + 1])
    for size in (2, 4):
        other = collect(split, size, 8, window=T)
        for (i1, x1, _), (i2, x2, _) in zip(batches, other):
            np.testing.assert_array_equal(x1, x2)
    unshuffled = collect(split, 1, 8, window=T, shuffle=False, drop_last=False)
    index = np.concatenate([b[0] for b in unshuffled])
    assert sorted(index.tolist()) == list(range(windows))


def test_random_windows_start_anywhere_and_do_not_depend_on_the_rank_count_or_a_resume(tmp_path):
    """sampling="random" (nanoGPT's draws): window k of an epoch starts at a token drawn
    from (seed, epoch, k); an epoch is as many windows as a pass in stride mode; the
    global batches are the same on 1, 2 or 4 ranks and from a resumed step; every
    alignment in the window shows up."""
    from mpitrain.data.samples import random_starts

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 31, 5000).astype(np.uint8)  # windows of 17 are unique: each one's start can be checked
    with DatasetWriter(tmp_path / "t", "toytext", "text", shard_mb=0.002, vocab="abcdefghijklmnopqrstuvwxyz01234") as w:
        w.write_split("train", ids[:4500])
        w.write_split("val", ids[4500:])
    train, T = ids[:4500], 16
    split = open_dataset(tmp_path / "t").split("train")
    one = collect(split, 1, 8, window=T, sampling="random")
    assert len(one) == (4500 - T) // T // 8
    starts = []
    for index, x, y in one:
        s = random_starts(3, 0, index, 4500 - T)  # collect's seed, epoch 0
        for row, target, start in zip(x, y, s):
            np.testing.assert_array_equal(row, train[start : start + T])
            np.testing.assert_array_equal(target, train[start + 1 : start + T + 1])
        starts += s.tolist()
    assert len({s % T for s in starts}) == T and min(starts) < 100 and max(starts) > 4500 - T - 100
    for size in (2, 4):
        for (i1, x1, y1), (i2, x2, y2) in zip(one, collect(split, size, 8, window=T, sampling="random")):
            np.testing.assert_array_equal(i1, i2)
            np.testing.assert_array_equal(x1, x2)
            np.testing.assert_array_equal(y1, y2)
    reader = ShardReader(split, rank=0, size=1, global_batch=8, seed=3, window=T, sampling="random", buffer_mb=0.01)
    resumed = list(reader.batches(0, 1, first_step=5))
    assert len(resumed) == len(one) - 5
    for b, (_, x, _) in zip(resumed, one[5:]):
        np.testing.assert_array_equal(b.x, x)
    later = collect(split, 1, 8, window=T, sampling="random", epoch=1)
    other_seed = collect(split, 1, 8, seed=4, window=T, sampling="random")
    assert not np.array_equal(one[0][1], later[0][1]) and not np.array_equal(one[0][1], other_seed[0][1])
    assert reader.sample_bytes == (T + 1) * 1  # a random window is read whole: T + 1 one-byte tokens
    image_set(tmp_path / "i")
    with pytest.raises(ValueError, match="places text windows"):
        ShardReader(open_dataset(tmp_path / "i").split("train"), rank=0, size=1, global_batch=8, seed=0,
                    sampling="random")
    with pytest.raises(ValueError, match="sampling must be one of"):
        ShardReader(split, rank=0, size=1, global_batch=8, seed=0, window=T, sampling="shuffled")


def test_reader_errors_reach_the_training_loop(tmp_path):
    image_set(tmp_path / "d")
    split = open_dataset(tmp_path / "d").split("train")
    reader = ShardReader(split, rank=0, size=1, global_batch=64, seed=0)
    split.shards[1].path.unlink()  # vanishes after opening
    with pytest.raises(DataError, match="train-00001.h5"):
        list(reader.epoch(0))
    with pytest.raises(ValueError, match="divisible"):
        ShardReader(split, rank=0, size=3, global_batch=64, seed=0)
    with pytest.raises(DataError, match="fewer than one global batch"):
        ShardReader(split, rank=0, size=1, global_batch=4096, seed=0)


def test_stopping_early_ends_the_prefetch_thread(tmp_path):
    import threading

    image_set(tmp_path / "d")
    split = open_dataset(tmp_path / "d").split("train")
    reader = ShardReader(split, rank=0, size=1, global_batch=16, seed=0, buffer_mb=0.001)
    batches = reader.batches()
    next(batches)
    batches.close()
    assert not any(t.name.startswith("shard-reader") for t in threading.enumerate())


# -------------------------------------------------------------- bad shards
def damaged(tmp_path, how):
    """A dataset with one kind of damage (or inconsistency: the manifest is re-sealed
    after an edit, as a tool that wrote it so would have)."""
    from mpitrain.data.integrity import file_checksums
    from mpitrain.data.manifest import write_manifest

    image_set(tmp_path / "d")
    d = tmp_path / "d"
    shard = d / "train-00002.h5"
    manifest = json.loads((d / "manifest.json").read_text())
    if how == "flipped byte":
        data = bytearray(shard.read_bytes())
        with h5py.File(shard) as f:
            offset = f["x"].id.get_chunk_info(0).byte_offset
        data[offset + 100] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "object header":
        data = bytearray(shard.read_bytes())
        with h5py.File(shard) as f:
            offset = h5py.h5o.get_info(f["x"].id).addr
        data[offset] ^= 0xFF  # its version: h5py raised KeyError
        shard.write_bytes(bytes(data))
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-1000])
    elif how == "missing":
        shard.unlink()
    elif how == "manifest version":
        manifest["version"] = 99
    elif how == "shard version":
        with h5py.File(shard, "a") as f:
            f.attrs["format_version"] = 99
        manifest["splits"]["train"]["shards"][2].update(file_checksums(shard, ("x", "y")))
    elif how == "count mismatch":
        manifest["splits"]["train"]["shards"][2]["count"] += 1
        manifest["splits"]["train"]["count"] += 1
    write_manifest(d, manifest)
    return d, shard


@pytest.mark.parametrize("how,message", [
    ("truncated", "train-00002.h5: truncated"),
    ("missing", "train-00002.h5: missing"),
    ("manifest version", "manifest.json: format version 99 is not supported"),
    ("object header", "train-00002.h5: damaged: the SHA-256 of its HDF5 metadata"),
    ("shard version", "train-00002.h5: shard format version 99 is not supported"),
    ("count mismatch", r"train-00002.h5: x has shape \(\d+, 6, 6, 1\), the manifest says"),
])
def test_opening_a_bad_dataset_names_the_file(tmp_path, how, message):
    d, _ = damaged(tmp_path, how)
    with pytest.raises(DataError, match=message):
        open_dataset(d)


def test_a_flipped_byte_is_found_by_verify(tmp_path):
    d, shard = damaged(tmp_path, "flipped byte")
    data = open_dataset(d)  # the structure is intact
    problems = data.verify()
    assert len(problems) == 1 and str(shard) in problems[0] and "SHA-256" in problems[0]
    # split over ranks, exactly one rank sees it
    found = [data.verify(rank, 3) for rank in range(3)]
    assert sum(len(p) for p in found) == 1


def test_not_a_dataset(tmp_path):
    with pytest.raises(DataError, match="no such dataset directory"):
        open_dataset(tmp_path / "absent")
    (tmp_path / "e").mkdir()
    with pytest.raises(DataError, match="manifest.json: not found"):
        open_dataset(tmp_path / "e")
    (tmp_path / "e" / "manifest.json").write_text("{")
    with pytest.raises(DataError, match="not a valid manifest"):
        open_dataset(tmp_path / "e")


# ------------------------------------------------------------ preparation
def test_normalize():
    x = np.array([0, 255], dtype=np.uint8).reshape(2, 1, 1, 1)
    np.testing.assert_allclose(normalize(x, (0.5,), (0.25,), np.float64).reshape(-1), [-2.0, 2.0])


def test_random_shift_matches_a_per_image_loop():
    x = np.random.default_rng(0).integers(1, 255, (5, 7, 7, 2), dtype=np.uint8)
    dy, dx = np.array([0, 1, 2, 3, 4]), np.array([4, 2, 0, 1, 3])
    out = random_shift(x, dy, dx, 2)
    for i in range(5):
        padded = np.pad(x[i], ((2, 2), (2, 2), (0, 0)))
        np.testing.assert_array_equal(out[i], padded[dy[i] : dy[i] + 7, dx[i] : dx[i] + 7])


def test_augmentation_draws_are_rank_count_independent():
    full = shifts(7, 1, 5, 8, 2, np.arange(8))
    halves = [shifts(7, 1, 5, 8, 2, np.arange(r * 4, r * 4 + 4)) for r in range(2)]
    np.testing.assert_array_equal(full[0], np.concatenate([h[0] for h in halves]))
    np.testing.assert_array_equal(full[1], np.concatenate([h[1] for h in halves]))


def test_flips_mirror_left_to_right_half_the_images_the_same_at_any_rank_count():
    x = np.random.default_rng(0).integers(1, 255, (6, 5, 7, 3), dtype=np.uint8)
    mirrored = np.array([True, False, True, True, False, False])
    out = random_flip(x, mirrored)
    for i in range(6):
        np.testing.assert_array_equal(out[i], x[i, :, ::-1] if mirrored[i] else x[i])
    full = flips(7, 1, 5, 4096, np.arange(4096))
    assert 0.45 < full.mean() < 0.55
    halves = [flips(7, 1, 5, 4096, np.arange(r * 2048, (r + 1) * 2048)) for r in range(2)]
    np.testing.assert_array_equal(full, np.concatenate(halves))
    assert not np.array_equal(full, flips(7, 1, 6, 4096, np.arange(4096)))  # another step, other draws


def test_leaving_an_epoch_early_does_not_hang(tmp_path):
    image_set(tmp_path / "d")
    split = open_dataset(tmp_path / "d").split("train")
    reader = ShardReader(split, rank=0, size=1, global_batch=16, seed=0, buffer_mb=0.001, prefetch=1,
                         shuffle=False, drop_last=False)
    for batch in reader.epoch(0):
        if batch.step == 3:
            break  # the producer may be waiting to queue the end of the epoch


def test_random_windows_read_in_stretches_are_the_windows_read_one_by_one(tmp_path, monkeypatch):
    """Random windows are read as stretches across small gaps, cut at STRETCH bytes and at
    shard ends; every window is the one a read of its own gives, in the order drawn."""
    from mpitrain.data import samples as module

    rng = np.random.default_rng(1)
    with DatasetWriter(tmp_path / "t", "toytext", "text", shard_mb=0.002, vocab="abcdefghijklmnopqrstuvwxyz01234") as w:
        w.write_split("train", rng.integers(0, 31, 9000).astype(np.uint8))
        w.write_split("val", rng.integers(0, 31, 500).astype(np.uint8))
    split, T = open_dataset(tmp_path / "t").split("train"), 16
    windows = module.Windows(split, T, "random")
    for gap, stretch in ((8, 64), (64, 200), (4096, 1 << 20)):
        monkeypatch.setattr(module, "GAP", gap)
        monkeypatch.setattr(module, "STRETCH", stretch)
        starts = np.concatenate([rng.integers(0, 9000 - T, 300), [0, 0, 9000 - T - 1, 5]])  # repeats, both ends
        got = np.empty((len(starts), T + 1), np.uint8)
        nbytes = windows._scattered(starts, got)
        for row, start in zip(got, starts):
            np.testing.assert_array_equal(row, split.read_all("x")[start : start + T + 1])
        assert nbytes <= (len(starts) * (T + 1) if gap == 8 else split.count)  # overlaps read once; gaps at most


def test_a_settled_reader_holds_its_queue_full(tmp_path):
    """settle(): returns once the thread has ``prefetch`` rounds queued and the next one
    read, waiting to queue it (what cost.reader_bytes counts); at the epoch's end, at once."""
    image_set(tmp_path / "d")
    split = open_dataset(tmp_path / "d").split("train")
    reader = ShardReader(split, rank=0, size=1, global_batch=16, seed=0, buffer_mb=0.001, prefetch=2)
    reads = []
    reader.on_read = lambda start, end, nbytes: reads.append(nbytes)
    batches = reader.batches(0, 1)
    next(batches)
    assert reader.settle(30)
    assert len(reads) == 1 + 2 + 1  # in use, queued, and the one waiting
    list(batches)
    assert reader.settle(1)


def test_a_held_reader_begins_no_round_until_released_or_the_loop_runs_dry(tmp_path):
    """hold(): the thread reads no new round (a traced step's peak is the step's own) while
    batches are queued; released, it reads on; a loop that empties the queue while it is
    held gets its batches all the same (no hang)."""
    import time

    image_set(tmp_path / "d")
    split = open_dataset(tmp_path / "d").split("train")
    reader = ShardReader(split, rank=0, size=1, global_batch=16, seed=0, buffer_mb=0.001, prefetch=4)
    assert reader.block == 1  # a round is one step
    reads = []
    reader.on_read = lambda start, end, nbytes: reads.append(nbytes)
    batches = reader.batches(0, 1)
    steps = [next(batches).step]
    time.sleep(0.3)  # the queue fills: 4 rounds ahead
    reader.hold()
    steps += [next(batches).step for _ in range(2)]  # from the queue: room for 2 more rounds
    held = len(reads)
    time.sleep(0.3)
    assert len(reads) == held
    reader.release()
    time.sleep(0.3)
    assert len(reads) > held
    reader.hold()
    steps += [b.step for b in batches]  # the queue runs dry: the loop opens it
    assert steps == list(range(reader.steps_per_epoch))
