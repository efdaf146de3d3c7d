"""``mpitrain data download``: files fetched from a local HTTP server on 127.0.0.1 are
verified, cached, resumed after a dropped connection, refused (leaving nothing) when the
hash is wrong, and built into shards by the same recipes as ``mpitrain data build``.

Never touches any address but 127.0.0.1: every download goes to a mirror given as the
local server, and proxies are bypassed. The real-data case serves ../shared/datasets
and skips where that folder is absent (a user's machine)."""

import dataclasses
import gzip
import hashlib
import http.client
import io
import json
import pickle
import re
import socket
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from mpitrain_datasets import download
from mpitrain_datasets.download import DOWNLOADS, Remote, fetch

from mpitrain import cli
from mpitrain.data import DataError, open_dataset

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is absent")
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 300  # 18,900 bytes


class Server:
    """An HTTP server on 127.0.0.1 (a free port) in a thread. GET /a/b answers ``files["a/b"]``,
    else the file ``root/a/b``; ``Range: bytes=N-`` gets 206 and the rest (unless
    ``ignore_range``; from ``range_back`` bytes before N if set). ``drop_after=N``: the
    next answer stops after N body bytes while promising them all (a dropped
    connection). ``requests`` records (path, Range header)."""

    def __init__(self, root: Path | None = None):
        self.root, self.files, self.requests = root, {}, []
        self.ignore_range, self.drop_after, self.range_back = False, None, 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def body(self, path: str) -> bytes | None:
        key = path.lstrip("/")
        if key in self.files:
            return self.files[key]
        if self.root is not None and ".." not in key and (self.root / key).is_file():
            return (self.root / key).read_bytes()
        return None

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                asked = self.headers.get("Range")
                server.requests.append((self.path, asked))
                body = server.body(self.path)
                if body is None:
                    return self.send_error(404)
                m = re.fullmatch(r"bytes=(\d+)-", asked or "")
                start = max(0, int(m.group(1)) - server.range_back) if m and not server.ignore_range else 0
                if start >= len(body) > 0:
                    return self.send_error(416)
                self.send_response(206 if m and not server.ignore_range else 200)
                if start or (m and not server.ignore_range):
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                payload = body[start:]
                if server.drop_after is not None:
                    payload, server.drop_after = payload[: server.drop_after], None
                self.wfile.write(payload)  # HTTP/1.0: the connection closes after each answer

            def log_message(self, *args):
                pass

        return Handler

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture(autouse=True)
def local_only(monkeypatch):
    """No proxy may carry a test's request off this machine, and no mirror from the environment."""
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(var, "*")
    monkeypatch.delenv(download.MIRROR_ENV, raising=False)


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def with_hashes(monkeypatch, name: str, **contents: bytes) -> None:
    """Make the registry expect ``contents`` ({file: bytes}) for ``name``."""
    files = tuple(Remote(f, hashlib.sha256(b).hexdigest(), md5=hashlib.md5(b).hexdigest())
                  for f, b in contents.items())
    monkeypatch.setitem(DOWNLOADS, name, dataclasses.replace(DOWNLOADS[name], files=files))


def run_cli(*args) -> int:
    return cli.main(["data", "download", *map(str, args)])


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


# ------------------------------------------------------------------ real files
@needs_shared
def test_tinyshakespeare_and_mnist_download_verify_and_build(tmp_path, capsys):
    s = Server(root=SHARED)
    try:
        for name, kind, count in (("tinyshakespeare", "text", None), ("mnist", "image", 60_000)):
            out = tmp_path / "out" / name
            assert run_cli(name, "--mirror", s.url, "--cache", tmp_path / "cache", "--out", out) == 0
            with open_dataset(out) as ds:
                assert ds.kind == kind
                if count:
                    assert ds.split("train").count == count and ds.split("test").count == 10_000
                else:
                    text = (SHARED / "tinyshakespeare" / "input.txt").read_text()
                    ids = np.concatenate([ds.split(n).read_all("x") for n in ("train", "val")])
                    assert ds.decode(ids) == text
            for f in DOWNLOADS[name].files:
                assert (tmp_path / "cache" / name / f.file).read_bytes() == (SHARED / name / f.file).read_bytes()
        assert not list((tmp_path / "cache").rglob("*.part"))
        assert len(s.requests) == 5 and all(r is None for _, r in s.requests)

        # a second call: from the cache, no request, the shards already up to date
        assert run_cli("mnist", "--mirror", s.url, "--cache", tmp_path / "cache", "--out",
                       tmp_path / "out" / "mnist") == 0
        assert len(s.requests) == 5
        assert "already up to date" in capsys.readouterr().out
    finally:
        s.close()


# ------------------------------------------------------------------ synthetic files
def test_synthetic_text_is_built_from_the_mirror_given_by_the_environment(server, tmp_path, monkeypatch):
    server.files["tinyshakespeare/input.txt"] = TEXT.encode()
    with_hashes(monkeypatch, "tinyshakespeare", **{"input.txt": TEXT.encode()})
    monkeypatch.setenv(download.MIRROR_ENV, server.url + "/")
    assert run_cli("tinyshakespeare", "--cache", tmp_path / "cache", "--out", tmp_path / "out") == 0
    assert server.requests == [("/tinyshakespeare/input.txt", None)]
    with open_dataset(tmp_path / "out") as ds:
        ids = np.concatenate([ds.split(n).read_all("x") for n in ("train", "val")])
        assert ds.decode(ids) == TEXT


def test_wrong_hash_is_refused_and_leaves_nothing(server, tmp_path, capsys):
    server.files["tinyshakespeare/input.txt"] = TEXT.encode()  # not the real input.txt
    assert run_cli("tinyshakespeare", "--mirror", server.url, "--cache", tmp_path / "cache",
                   "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SHA-256" in err and "86c4e6aa" in err
    assert f"{server.url}/tinyshakespeare/input.txt" in err
    assert leftovers(tmp_path / "cache") == [] and not (tmp_path / "out").exists()


def test_gzip_whose_content_differs_is_refused(server, tmp_path):
    """IDX files are checked after decompression: a valid gzip of other bytes fails."""
    for f in DOWNLOADS["mnist"].files:
        server.files[f"mnist/{f.file}"] = gzip.compress(b"\0\0\x08\x03 not MNIST")
    with pytest.raises(DataError, match="SHA-256 of the decompressed content is .* not the expected ba891046"):
        fetch("mnist", cache=tmp_path / "cache", mirror=server.url, log=lambda _: None)
    assert leftovers(tmp_path / "cache") == []


def test_gzip_archives_differing_only_in_the_timestamp_both_pass(server, tmp_path, monkeypatch):
    """As two mirrors' copies of MNIST do: the hash is of the content, not of the archive."""
    payload = b"\0\0\x08\x01\0\0\0\x03\x01\x02\x03"
    remote = Remote("t10k-labels-idx1-ubyte.gz", hashlib.sha256(payload).hexdigest(), gunzip=True)
    monkeypatch.setitem(DOWNLOADS, "mnist", dataclasses.replace(DOWNLOADS["mnist"], files=(remote,)))
    archives = [gzip.compress(payload, mtime=t) for t in (1, 2)]
    assert archives[0] != archives[1]
    for t, archive in enumerate(archives):
        server.files[f"{t}/mnist/{remote.file}"] = archive
        fetch("mnist", cache=tmp_path / str(t), mirror=f"{server.url}/{t}", log=lambda _: None)
        assert (tmp_path / str(t) / "mnist" / remote.file).read_bytes() == archive


def test_server_down_prints_one_line_naming_the_url_and_the_way_by_hand(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on: bound, then freed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "out"
    assert run_cli("mnist", "--mirror", url, "--cache", tmp_path / "cache", "--out", out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mpitrain: error: cannot download")
    assert f"{url}/mnist/train-images-idx3-ubyte.gz" in err and "offline" in err
    assert f"mpitrain data build mnist --src {tmp_path / 'cache' / 'mnist'} --out {out}" in err
    assert leftovers(tmp_path / "cache") == [] and not out.exists()


def test_missing_file_on_the_server_names_the_http_status(server, tmp_path):
    with pytest.raises(DataError, match=r"tinyshakespeare/input.txt \(HTTP 404"):
        fetch("tinyshakespeare", cache=tmp_path, mirror=server.url, log=lambda _: None)


def test_interrupted_download_resumes_with_a_range_request(server, tmp_path, monkeypatch):
    data = TEXT.encode()
    server.files["tinyshakespeare/input.txt"] = data
    with_hashes(monkeypatch, "tinyshakespeare", **{"input.txt": data})
    server.drop_after = 5000
    part = tmp_path / "tinyshakespeare" / "input.txt.part"
    with pytest.raises(DataError, match=f"interrupted after 5,000 of {len(data):,} bytes; run the command again"):
        fetch("tinyshakespeare", cache=tmp_path, mirror=server.url, log=lambda _: None)
    assert part.read_bytes() == data[:5000] and not (tmp_path / "tinyshakespeare" / "input.txt").exists()

    fetch("tinyshakespeare", cache=tmp_path, mirror=server.url, log=lambda _: None)
    assert server.requests[-1] == ("/tinyshakespeare/input.txt", "bytes=5000-")
    assert (tmp_path / "tinyshakespeare" / "input.txt").read_bytes() == data and not part.exists()


def planted(cache: Path, server, content: bytes, url: str | None = None) -> Path:
    """A ``.part`` of tiny shakespeare's input.txt as an interrupted download from ``url``
    (the server's) left it."""
    part = cache / "tinyshakespeare" / "input.txt.part"
    part.parent.mkdir(exist_ok=True)
    part.write_bytes(content)
    url = url or f"{server.url}/tinyshakespeare/input.txt"
    part.with_name("input.txt.part.from").write_text(json.dumps({"url": url, "validator": ""}))
    return part


def test_a_part_from_another_url_is_not_continued(server, tmp_path, monkeypatch):
    """Mirrors' copies may differ (gzip timestamps): bytes of two are never spliced."""
    data = TEXT.encode()
    server.files["tinyshakespeare/input.txt"] = data
    with_hashes(monkeypatch, "tinyshakespeare", **{"input.txt": data})
    part = planted(tmp_path, server, b"y" * 999, url="http://127.0.0.1:9/elsewhere/input.txt")
    fetch("tinyshakespeare", cache=tmp_path, mirror=server.url, log=lambda _: None)
    assert server.requests == [("/tinyshakespeare/input.txt", None)]
    assert (tmp_path / "tinyshakespeare" / "input.txt").read_bytes() == data
    assert leftovers(tmp_path) == ["input.txt"] and not part.exists()


def test_a_part_without_its_origin_starts_again(server, tmp_path, monkeypatch):
    data = TEXT.encode()
    server.files["tinyshakespeare/input.txt"] = data
    with_hashes(monkeypatch, "tinyshakespeare", **{"input.txt": data})
    part = planted(tmp_path, server, data[:100])
    part.with_name("input.txt.part.from").unlink()
    fetch("tinyshakespeare", cache=tmp_path, mirror=server.url, log=lambda _: None)
    assert server.requests == [("/tinyshakespeare/input.txt", None)]


def test_a_range_answered_from_another_byte_fetches_the_whole_file(server, tmp_path, monkeypatch):
    """A 206 whose Content-Range does not start where the .part ends is not appended."""
    data = TEXT.encode()
    server.files["tinyshakespeare/input.txt"] = data
    with_hashes(monkeypatch, "tinyshakespeare", **{"input.txt": data})
    planted(tmp_path, server, data[:5000])
    server.range_back = 1000  # answers bytes=5000- from byte 4000
    fetch("tinyshakespeare", cache=tmp_path, mirror=server.url, log=lambda _: None)
    assert [r for _, r in server.requests] == ["bytes=5000-", None]
    assert (tmp_path / "tinyshakespeare" / "input.txt").read_bytes() == data


def test_a_mirror_whose_copy_fails_the_hash_is_skipped_for_the_next(server, tmp_path, monkeypatch):
    data = TEXT.encode()
    server.files["bad/input.txt"], server.files["good/input.txt"] = b"damaged copy", data
    with_hashes(monkeypatch, "tinyshakespeare", **{"input.txt": data})
    source = dataclasses.replace(DOWNLOADS["tinyshakespeare"], urls=(f"{server.url}/bad/", f"{server.url}/good/"))
    monkeypatch.setitem(DOWNLOADS, "tinyshakespeare", source)
    fetch("tinyshakespeare", cache=tmp_path, log=lambda _: None)
    assert [p for p, _ in server.requests] == ["/bad/input.txt", "/good/input.txt"]
    assert leftovers(tmp_path) == ["input.txt"]
    server.files["good/input.txt"] = b"another damaged copy"
    (tmp_path / "tinyshakespeare" / "input.txt").unlink()
    with pytest.raises(DataError, match=r"bad/input.txt: SHA-256 .*; .*good/input.txt: SHA-256 .*; the download "
                                        r"was deleted"):
        fetch("tinyshakespeare", cache=tmp_path, log=lambda _: None)
    assert leftovers(tmp_path) == []


def test_a_connection_dropped_without_a_length_keeps_the_part(tmp_path):
    """A chunked answer cut short raises on read: the .part is kept for a resume, not
    hashed and deleted."""
    class Cut(io.BytesIO):
        status, headers = 200, {}

        def read(self, n=-1):
            block = super().read(min(n, 100))
            if not block:
                raise http.client.IncompleteRead(b"")
            return block

    part = tmp_path / "f.part"
    assert download._copy(Cut(b"x" * 250), part, 0, None) is False and part.read_bytes() == b"x" * 250
    assert download._copy(io.BytesIO(b"y" * 10), part, 250, None) is True and part.stat().st_size == 260


def test_a_server_ignoring_range_restarts_the_file_cleanly(server, tmp_path, monkeypatch):
    data = TEXT.encode()
    server.files["tinyshakespeare/input.txt"] = data
    server.ignore_range = True
    with_hashes(monkeypatch, "tinyshakespeare", **{"input.txt": data})
    part = planted(tmp_path, server, b"x" * 1234)  # not even a prefix: appending to it would fail the hash
    fetch("tinyshakespeare", cache=tmp_path, mirror=server.url, log=lambda _: None)
    assert server.requests == [("/tinyshakespeare/input.txt", "bytes=1234-")]
    assert (tmp_path / "tinyshakespeare" / "input.txt").read_bytes() == data and not part.exists()


def test_a_part_longer_than_the_file_is_downloaded_again(server, tmp_path, monkeypatch):
    data = TEXT.encode()
    server.files["tinyshakespeare/input.txt"] = data
    with_hashes(monkeypatch, "tinyshakespeare", **{"input.txt": data})
    planted(tmp_path, server, data + b"extra")
    fetch("tinyshakespeare", cache=tmp_path, mirror=server.url, log=lambda _: None)
    assert [r for _, r in server.requests] == [f"bytes={len(data) + 5}-", None]  # 416, then all
    assert (tmp_path / "tinyshakespeare" / "input.txt").read_bytes() == data


def test_a_damaged_cached_file_is_reported_not_used(server, tmp_path):
    cached = tmp_path / "tinyshakespeare" / "input.txt"
    cached.parent.mkdir()
    cached.write_text("damaged")
    with pytest.raises(DataError, match=f"{cached}: cached file SHA-256 .*; delete it to download it again"):
        fetch("tinyshakespeare", cache=tmp_path, mirror=server.url, log=lambda _: None)
    assert server.requests == [] and cached.read_text() == "damaged"


# ------------------------------------------------------------------ CIFAR-10
def cifar_tarball(per_batch: int = 2) -> tuple[bytes, dict]:
    """cifar-10-python.tar.gz in the real layout (cifar-10-batches-py/ with five pickled
    training batches, test_batch and batches.meta), a few random images per batch."""
    r = np.random.default_rng(3)
    buf, data = io.BytesIO(), {}
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        def add(name: str, obj) -> None:
            raw = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))

        for split, names in (("train", [f"data_batch_{i}" for i in range(1, 6)]), ("test", ["test_batch"])):
            xs, ys = [], []
            for name in names:
                x = r.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
                y = [int(v) for v in r.integers(0, 10, per_batch)]
                add(name, {b"batch_label": name.encode(), b"labels": y, b"data": x})
                xs.append(x)
                ys += y
            data[split] = np.concatenate(xs).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), np.array(ys)
        add("batches.meta", {b"label_names": [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog",
                                               b"frog", b"horse", b"ship", b"truck"]})
    return buf.getvalue(), data


def test_cifar10_download_checks_both_hashes_and_builds_the_batches(server, tmp_path, monkeypatch):
    tarball, data = cifar_tarball()
    server.files["cifar10/cifar-10-python.tar.gz"] = tarball
    with_hashes(monkeypatch, "cifar10", **{"cifar-10-python.tar.gz": tarball})
    assert run_cli("cifar10", "--mirror", server.url, "--cache", tmp_path / "cache", "--out", tmp_path / "out") == 0
    with open_dataset(tmp_path / "out") as ds:
        assert ds.name == "cifar10" and ds.classes[0] == "airplane"
        for split, (x, y) in data.items():
            np.testing.assert_array_equal(ds.split(split).read_all("x"), x)
            np.testing.assert_array_equal(ds.split(split).read_all("y"), y)

    # the published MD5 is checked too: right SHA-256, wrong MD5 is refused
    remote = DOWNLOADS["cifar10"].files[0]
    monkeypatch.setitem(DOWNLOADS, "cifar10", dataclasses.replace(
        DOWNLOADS["cifar10"], files=(dataclasses.replace(remote, md5="0" * 32),)))
    with pytest.raises(DataError, match="MD5 is .*, not the published 0000"):
        fetch("cifar10", cache=tmp_path / "cache2", mirror=server.url, log=lambda _: None)
    assert leftovers(tmp_path / "cache2") == []


def test_the_registry_pins_the_published_hashes():
    cifar = DOWNLOADS["cifar10"].files[0]
    assert (cifar.md5, cifar.sha256[:8]) == ("c58f30108f718f92721af3b95e74349a", "6d958be0")
    assert {f.file for f in DOWNLOADS["mnist"].files} == {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                                                           "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}
    assert all(f.gunzip for n in ("mnist", "fashion-mnist") for f in DOWNLOADS[n].files)
    for name, source in DOWNLOADS.items():
        assert source.urls and all(u.endswith("/") for u in source.urls), name


def test_help_lists_every_dataset(capsys):
    with pytest.raises(SystemExit):
        cli.main(["data", "download", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in DOWNLOADS) and "--mirror" in out and "dataset-fashion-mnist" in out
