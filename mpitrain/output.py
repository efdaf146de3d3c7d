"""Where a command writes what it makes (a file, or a folder of them), checked before any
work starts, and written whole or not at all.

A place that cannot be written (a read-only file system, a folder without permission, a
file where a folder is wanted or the other way round) is one line naming it when the
command starts (:func:`unwritable`; as an option's type, :func:`file_option` and
:func:`folder_option`), not a traceback after the work. A write that fails anyway (the
disk fills meanwhile) leaves no half-written file (:func:`write_whole`: ``run.json``,
``metrics.jsonl`` and the timeline are written so too) and raises :class:`OutputError`
naming the file (:func:`write_text`). Checkpoints and datasets have their own, stronger rules
(:mod:`mpitrain.checkpoint`, :mod:`mpitrain.data.writer`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path


class OutputError(ValueError):
    """An output that could not be written (a full disk, say); the message names it."""


def unwritable(path, folder: bool = False, whole: bool = False) -> str | None:
    """Why ``path`` cannot be written as a file (``folder``: as a folder to write into,
    made with the folders above it if missing; ``whole``: a folder made beside it and
    renamed over it, as a dataset is), or None if it can. Nothing is made or written."""
    path = Path(path)
    if path.exists():
        if (folder or whole) and not path.is_dir():
            return f"{path}: is a file, not a folder"
        if not (folder or whole) and path.is_dir():
            return f"{path}: is a folder; name a file"
    place = path if folder and path.is_dir() else path.parent
    for link in (path, *path.parents):  # a dangling link is neither there nor makeable
        if link.is_symlink() and not link.exists():
            return f"{link}: is a link to {os.readlink(link)}, which does not exist"
        if link == place:
            break
    while not place.exists():
        place = place.parent
    if not place.is_dir():
        return f"{place}: is a file, not a folder"
    if not os.access(place, os.W_OK | os.X_OK):  # a file there is replaced whole: its own mode does not matter
        return f"{path}: cannot write there ({_why(place)})"
    return None


def _why(place: Path) -> str:
    with contextlib.suppress(OSError, AttributeError):  # no statvfs (Windows)
        if os.statvfs(place).f_flag & os.ST_RDONLY:
            return "a read-only file system"
    return f"no permission to write in {place}"


def _option(folder: bool = False, whole: bool = False):
    def check(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected a {'folder' if folder or whole else 'file'}'s name, got none")
        if (why := unwritable(text, folder, whole)) is not None:
            raise argparse.ArgumentTypeError(why)
        return text
    check.__name__ = "file" if not (folder or whole) else "folder"  # argparse names the type in its message
    return check


file_option = _option()  # an option naming a file to write: type=file_option
folder_option = _option(folder=True)  # an option naming a folder to write into
whole_folder_option = _option(whole=True)  # an option naming a folder made whole and renamed into place


def write_whole(path, text: str) -> Path:
    """``text`` into ``path`` whole: a temporary file beside it, synced, renamed over it (a
    link's target, not the link), the folders above it made. Nothing is left beside it,
    whatever stops the write (Ctrl-C too); the OSError of a disk that refuses passes on,
    for the caller to say what it means (:func:`write_text`: an :class:`OutputError`)."""
    real = Path(os.path.realpath(path))
    tmp = real.with_name(f".{real.name}.tmp-{os.getpid()}")
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    return Path(path)


def write_text(path, text: str) -> Path:
    """``text`` into ``path`` whole (:func:`write_whole`); OutputError naming it if the disk refuses."""
    try:
        return write_whole(path, text)
    except OSError as e:
        raise OutputError(f"{path}: could not be written ({e.strerror or e})") from None
