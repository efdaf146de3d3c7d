"""The checkpoint file's format: its name, the errors, and the header that proves every
byte before HDF5 reads any (the format itself: :mod:`mpitrain.checkpoint`, "Integrity").

The file begins with HDF5's *userblock* holding the plain-text header
(:func:`header_bytes`): the line ``mpitrain-checkpoint``, one line of JSON
(:data:`HEADER_TYPES`, the SHA-256 of every byte after the userblock among them), and
``sha256 <hex>`` of that line. :func:`read_header` checks the header alone;
:func:`verified_header` every byte after it too.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from mpitrain import __version__

FORMAT, FORMAT_VERSION = "mpitrain-checkpoint", 2
NAME = re.compile(r"^step-(\d{8,})\.h5$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file."""


class CheckpointNewer(CheckpointError):
    """A checkpoint written by a newer format version than this mpitrain reads."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (no space left, permissions, I/O error);
    the message names the file, and the previous checkpoint is intact."""


MAGIC = b"mpitrain-checkpoint\n"  # then one line of JSON (the header), then "sha256 <hex of that line>"
HASH_LINE = b"sha256 "
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"  # a format-1 file begins with HDF5's own signature
MAX_HEADER = 1 << 20


def header_bytes(fields: dict) -> bytes:
    body = json.dumps(fields, sort_keys=True).encode()
    return MAGIC + body + b"\n" + HASH_LINE + hashlib.sha256(body).hexdigest().encode() + b"\n"


def userblock_size(fields: dict) -> int:
    """The smallest userblock HDF5 allows (512 bytes times a power of two) that holds
    the header of ``fields`` once the file's size and digest are added."""
    longest = header_bytes({**fields, "userblock": 1 << 40, "file_bytes": 1 << 60, "file_sha256": "0" * 64})
    return max(512, 1 << (len(longest) - 1).bit_length())  # the smallest power of two that holds it


def read_header(path: Path) -> dict | None:
    """The header of a checkpoint, read and verified without HDF5 (which a damaged file
    can make loop forever: the module's docstring); None for a format-1 file, which has none."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(MAX_HEADER)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror or e})") from None
    if head.startswith(HDF5_SIGNATURE):
        return None
    if not head.startswith(MAGIC):
        raise CheckpointError(f"{path}: not an mpitrain checkpoint (no {MAGIC.strip().decode()!r} header)")
    body, _, rest = head[len(MAGIC):].partition(b"\n")
    if rest[: len(HASH_LINE) + 64] != HASH_LINE + hashlib.sha256(body).hexdigest().encode():
        raise CheckpointError(f"{path}: damaged: its header does not match its SHA-256")
    fields = _header_fields(path, body)
    if (named := NAME.match(path.name)) and int(named.group(1)) != fields["step"]:  # copied or renamed over another
        raise CheckpointError(f"{path}: holds step {fields['step']}, not the step its name says")
    return fields


# what a header must hold, and of which type, before anything uses it
HEADER_TYPES = {"format_version": int, "step": int, "epoch": int, "epoch_step": int, "userblock": int,
                 "file_bytes": int, "file_sha256": str, "config": dict, "data": dict}


def _header_fields(path: Path, body: bytes) -> dict:
    """The header's JSON, checked for the fields and types the loaders use: a header
    whose SHA-256 matches was written by mpitrain, or edited and sealed again by hand,
    and the second must be one message too, not a traceback."""
    try:
        fields = json.loads(body)
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{path}: damaged: its header is not JSON ({e})") from None
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path}: damaged: its header is not a JSON object")
    _check_types(path, fields, ("format_version",))
    if fields["format_version"] > FORMAT_VERSION:  # checked first: a newer format may hold other fields
        raise CheckpointNewer(f"{path}: written in checkpoint format version {fields['format_version']} (by "
                              f"mpitrain {fields.get('mpitrain_version', '?')}); this mpitrain {__version__} reads "
                              f"versions up to {FORMAT_VERSION}: upgrade mpitrain to resume it")
    _check_types(path, fields, HEADER_TYPES)
    if len(fields["file_sha256"]) != 64:
        raise CheckpointError(f"{path}: damaged: its header's 'file_sha256' is not a SHA-256")
    if "run" in fields and not (isinstance(fields["run"], dict) and isinstance(fields["run"].get("id"), str)):
        raise CheckpointError(f"{path}: damaged: its header's 'run' is {fields['run']!r}, not a run's identity")
    return fields


def _check_types(path: Path, fields: dict, keys) -> None:
    for key in keys:
        kind, value = HEADER_TYPES[key], fields.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):  # bool is an int
            raise CheckpointError(f"{path}: damaged: its header's {key!r} is {value!r}, not a "
                                  f"{'non-negative integer' if kind is int else kind.__name__}")


def verified_header(path: Path) -> dict | None:
    """The header (:func:`read_header`), with every byte after it checked against its
    SHA-256 (read in 4 MiB pieces); None for a format-1 file."""
    fields = read_header(path)
    if fields is None:
        return None
    size = path.stat().st_size
    if size != fields["file_bytes"]:
        raise CheckpointError(f"{path}: damaged: {size} bytes, its header says {fields['file_bytes']} "
                              f"({'truncated' if size < fields['file_bytes'] else 'grown'})")
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(fields["userblock"])
        while piece := fh.read(1 << 22):
            digest.update(piece)
    if digest.hexdigest() != fields["file_sha256"]:
        raise CheckpointError(f"{path}: damaged: its bytes do not match the SHA-256 in its header")
    return fields
