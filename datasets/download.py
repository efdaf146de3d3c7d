"""``mpitrain data download NAME``: fetch a dataset's canonical files, verify them, build shards.

Sources (:data:`DOWNLOADS`; base URLs are tried in order, the file name appended):

* ``mnist``: the four IDX files from the mirror torchvision uses
  (https://ossci-datasets.s3.amazonaws.com/mnist/), then Google's CVDF mirror, then the
  original http://yann.lecun.com/exdb/mnist/ (which now refuses most scripted downloads).
* ``fashion-mnist``: Zalando's release (http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/),
  then the same files in Zalando's GitHub repository (``data/fashion/``).
* ``cifar10``: ``cifar-10-python.tar.gz`` from https://www.cs.toronto.edu/~kriz/cifar.html.
* ``tinyshakespeare``: ``input.txt`` of Karpathy's char-rnn (``data/tinyshakespeare/``).

**What is verified.** MNIST and Fashion-MNIST: the SHA-256 of each *decompressed* file
(the hashes :mod:`mpitrain_datasets.idx` holds), because a gzip header carries a
timestamp, so two mirrors' archives of the same content differ. CIFAR-10: the Toronto
page publishes only an MD5 (``c58f30108f718f92721af3b95e74349a``); the archive is
checked against it and against the SHA-256 that Keras pins for the same URL
(``keras.datasets.cifar10``). tiny shakespeare: the SHA-256 of ``input.txt``.

**Cache.** Files are kept as ``CACHE/NAME/FILE``; CACHE defaults to ``downloads/`` in
the data cache directory (``$MPITRAIN_DATA``, else ``$XDG_CACHE_HOME/mpitrain``, else
``~/.cache/mpitrain``). A file already there is re-verified (it is cheap) and not
downloaded again.

**Resume.** A download writes ``FILE.part`` beside the final file, and ``FILE.part.from``
(the URL, and the server's ETag or Last-Modified). A later call finding a ``.part`` from
the same URL asks for the rest with ``Range: bytes=N-`` (and ``If-Range``): an answer 206
whose Content-Range starts at N is appended; a whole file (200: the server ignores
ranges, or the file changed) replaces the ``.part`` from its first byte, as does any
answer from another URL (mirrors' copies differ). A read that ends early (fewer bytes
than Content-Length, or a dropped connection) keeps the ``.part`` and says to run the
command again.

**Atomic.** Only a complete, verified ``.part`` is renamed to FILE (``os.replace``, atomic
within a directory); one that fails verification is deleted, and the next base URL
tried. So the cache holds only verified files, and the shards (built by the same
recipe as ``mpitrain data build``, itself atomic) are only ever built from them.

**Mirror.** ``--mirror URL`` or ``$MPITRAIN_MIRROR`` replaces the base URLs: files are
then fetched from ``URL/NAME/FILE`` only (the cache's own layout, so a served copy of
a cache directory is a mirror). Proxies: urllib honours ``https_proxy``/``http_proxy``.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import json
import os
import re
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

from mpitrain_datasets import embedded, idx
from mpitrain_datasets.recipes import RECIPES
from tqdm import tqdm

from mpitrain import __version__
from mpitrain.data.shards import DataError

MIRROR_ENV = "MPITRAIN_MIRROR"
TIMEOUT_S = 30  # for connecting and for each read: a stalled server ends the call
BLOCK = 1 << 20


@dataclass(frozen=True)
class Remote:
    """One file to fetch and what verifies it."""

    file: str
    sha256: str
    gunzip: bool = False  # the hashes are of the decompressed content
    md5: str | None = None  # also checked, where the publisher gives only an MD5


@dataclass(frozen=True)
class Source:
    """A downloadable dataset: where its files are and which recipe builds them."""

    urls: tuple[str, ...]  # base URLs, tried in order
    files: tuple[Remote, ...]
    recipe: str  # the RECIPES entry that turns the files into shards
    about: str  # what is fetched from where, and what is checked (for --help)
    src: str = ""  # the recipe's --src inside CACHE/NAME ("": that folder itself)


def _idx_files(hashes: dict) -> tuple[Remote, ...]:
    return tuple(Remote(f"{stem}.gz", digest, gunzip=True) for stem, digest in hashes.items())


DOWNLOADS = {
    "mnist": Source(
        urls=("https://ossci-datasets.s3.amazonaws.com/mnist/",  # torchvision's mirror
              "https://storage.googleapis.com/cvdf-datasets/mnist/",  # Google's (TensorFlow's)
              "http://yann.lecun.com/exdb/mnist/"),  # the original, which refuses most scripts now
        files=_idx_files(idx.MNIST_SHA256), recipe="mnist",
        about="4 IDX files: torchvision's mirror, Google's, LeCun's; SHA-256 after gunzip"),
    "fashion-mnist": Source(
        urls=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",  # Zalando's release
              "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"),
        files=_idx_files(idx.FASHION_SHA256), recipe="fashion-mnist",
        about="4 IDX files: Zalando's release, then its GitHub copy; SHA-256 after gunzip"),
    "cifar10": Source(
        urls=("https://www.cs.toronto.edu/~kriz/",),
        files=(Remote("cifar-10-python.tar.gz",
                      sha256="6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",  # Keras pins it
                      md5="c58f30108f718f92721af3b95e74349a"),),  # the one the Toronto page publishes
        recipe="cifar10", src="cifar-10-python.tar.gz",
        about="cifar-10-python.tar.gz from U. Toronto; published MD5, Keras' SHA-256"),
    "tinyshakespeare": Source(
        urls=("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/",),
        files=(Remote("input.txt", sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"),),
        recipe="text", src="input.txt",  # as `mpitrain data build text --src input.txt`: the same dataset
        about="input.txt of karpathy/char-rnn; SHA-256"),
}


class _Unreachable(Exception):
    """No answer with the file from this URL (offline, refused, HTTP error): try the next."""


class _WrongContent(Exception):
    """The file from this URL fails its hash (deleted): try the next."""


def default_cache() -> Path:
    return embedded.cache_dir() / "downloads"


def default_out(name: str) -> Path:
    return Path("runs") / "data" / name  # where the configs in jobs/ look


def fetch(name: str, cache=None, mirror: str | None = None, out=None, log=print) -> Path:
    """Download (or find in the cache) and verify every file of ``name``; returns what the
    recipe reads as ``--src``. ``out`` only completes the advice printed on failure."""
    if name not in DOWNLOADS:
        raise DataError(f"no download named {name!r} (there are {', '.join(DOWNLOADS)})")
    source = DOWNLOADS[name]
    folder = Path(cache if cache is not None else default_cache()) / name
    mirror = mirror or os.environ.get(MIRROR_ENV)
    bases = (f"{mirror.rstrip('/')}/{name}/",) if mirror else source.urls
    src = folder / source.src if source.src else folder
    files = ", ".join(r.file for r in source.files)
    by_hand = (f"put {files} into {folder} and run: mpitrain data build {source.recipe} --src {src} "
               f"--out {out or default_out(name)}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{folder}: cannot create the download folder ({e.strerror})") from None
    for remote in source.files:
        _fetch_one(bases, folder / remote.file, remote, by_hand, log)
    return src


def build(name: str, src, out=None):
    """Shards from the fetched files, by the recipe ``mpitrain data build`` runs; returns
    the :class:`~mpitrain.data.writer.DatasetWriter`."""
    return RECIPES[DOWNLOADS[name].recipe].build(src, out or default_out(name))


def _fetch_one(bases, dest: Path, remote: Remote, by_hand: str, log) -> None:
    """``dest`` verified: from the cache, else from the first base URL that answers
    with the right content (a mirror whose copy fails the hash is skipped, said)."""
    if dest.exists():
        problem = _mismatch(dest, remote)
        if problem:
            raise DataError(f"{dest}: cached file {problem}; delete it to download it again")
        log(f"{dest}: cached, verified")
        return
    unreachable, wrong = [], []
    for base in bases:
        url = base + remote.file
        try:
            _download(url, dest, remote, log)
            return
        except _Unreachable as e:
            unreachable.append(f"{url} ({e})")
        except _WrongContent as e:
            wrong.append(f"{url}: {e}")
    if wrong:
        raise DataError(f"{'; '.join(wrong)}; the download was deleted (a damaged mirror, or a changed file?)"
                        + (f"; also unreachable: {'; '.join(unreachable)}" if unreachable else ""))
    raise DataError(f"cannot download {remote.file} from {'; '.join(unreachable)}: offline, or the server is "
                    f"down? To do it by hand, {by_hand}")


def _download(url: str, dest: Path, remote: Remote, log) -> None:
    """``url`` into ``dest`` through ``dest.part``, verified, renamed. A ``.part`` is
    continued only from the URL its bytes came from (``.part.from`` says which, with the
    server's ETag or Last-Modified, sent back as If-Range): mirrors' copies of a file
    may differ (MNIST's gzip timestamps), and bytes of two copies spliced fail the hash."""
    part = dest.with_name(dest.name + ".part")
    origin = dest.with_name(dest.name + ".part.from")
    have = part.stat().st_size if part.exists() else 0
    validator = _origin(origin, url) if have else None
    if validator is None:
        have = 0  # nothing yet, or another URL's bytes: from the first byte
    response = _open(url, have, validator) if have else None
    if response is None:  # the .part cannot be continued (416, another range): the whole file
        have, response = 0, _open(url, 0, None)
    with response:
        if response.status != 206:
            have = 0  # the whole file (the server ignored the range, or the file changed): it replaces the .part
        if not have:
            origin.write_text(json.dumps({"url": url, "validator": response.headers.get("ETag")
                                          or response.headers.get("Last-Modified") or ""}))
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        log(f"{'resuming' if have else 'downloading'} {url}" + (f" at byte {have:,}" if have else ""))
        try:
            whole = _copy(response, part, have, total)
        except OSError as e:  # the disk, not the network (read errors end _copy quietly)
            raise DataError(f"{part}: cannot write ({e.strerror or e})") from None
    size = part.stat().st_size
    if not whole or (total is not None and size < total):
        of = f" of {total:,}" if total is not None else ""
        raise DataError(f"{url}: download interrupted after {size:,}{of} bytes; run the command again to "
                        f"continue from {part}")
    problem = _mismatch(part, remote)
    if problem:
        part.unlink()
        origin.unlink(missing_ok=True)
        raise _WrongContent(problem)
    os.replace(part, dest)
    origin.unlink(missing_ok=True)


def _origin(origin: Path, url: str) -> str | None:
    """The validator (ETag or Last-Modified, "" if the server sent neither) of the
    ``.part`` whose origin file is ``origin`` if its bytes came from ``url``, else None."""
    try:
        saved = json.loads(origin.read_text())
        return saved["validator"] if saved["url"] == url and isinstance(saved["validator"], str) else None
    except (OSError, ValueError, KeyError, TypeError):  # none (an older .part), or damaged: start again
        return None


def _copy(response, part: Path, have: int, total: int | None) -> bool:
    """Append the body of ``response`` to ``part`` (truncated first if ``have`` is 0), with
    a progress bar; whether it read to the end (False: the connection dropped)."""
    bar = tqdm(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024,
               desc=part.name.removesuffix(".part"), disable=None)  # None: no bar unless stderr is a terminal
    whole = True
    with open(part, "ab" if have else "wb") as f, bar:
        while True:
            try:
                block = response.read(BLOCK)
            except (OSError, http.client.HTTPException):
                whole = False
                break
            if not block:
                break
            f.write(block)
            bar.update(len(block))
        f.flush()
        os.fsync(f.fileno())
    return whole


def _open(url: str, have: int, validator: str | None):
    """The response to GET ``url`` (from byte ``have`` on, if > 0, and only if the file
    is still ``validator``); None where a range was asked and cannot be given (416, or a
    206 from another byte); :class:`_Unreachable` for anything else that is no answer."""
    request = urllib.request.Request(url, headers={"User-Agent": f"mpitrain/{__version__}"})
    if have:
        request.add_header("Range", f"bytes={have}-")
        if validator:
            request.add_header("If-Range", validator)
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 416 and have:
            return None
        raise _Unreachable(f"HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise _Unreachable(str(e.reason)) from None
    except (OSError, http.client.HTTPException, ValueError) as e:  # timeouts, resets, a bad URL
        raise _Unreachable(str(e) or type(e).__name__) from None
    match = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
    if response.status == 206 and (match is None or int(match.group(1)) != have):
        response.close()
        return None
    return response


def _mismatch(path: Path, remote: Remote) -> str | None:
    """None if ``path`` has the expected hashes, else what is wrong."""
    sha256, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    try:
        with (gzip.open if remote.gunzip else open)(path, "rb") as f:
            while block := f.read(BLOCK):
                sha256.update(block)
                if remote.md5:
                    md5.update(block)
    except (OSError, EOFError, zlib.error) as e:  # not gzip, a truncated or a corrupted gzip stream
        return f"cannot be read ({e})"
    content = "of the decompressed content " if remote.gunzip else ""
    if sha256.hexdigest() != remote.sha256:
        return f"SHA-256 {content}is {sha256.hexdigest()}, not the expected {remote.sha256}"
    if remote.md5 and md5.hexdigest() != remote.md5:
        return f"MD5 {content}is {md5.hexdigest()}, not the published {remote.md5}"
    return None
