"""The one error of the data layer, and turning any failure to read a data file into it.

A damaged HDF5 file makes h5py raise nearly any exception type, mostly with a message
that does not name the file (``datasets/README.md``, "Why these choices"). Every read of
a shard goes through :func:`reading`, so that what reaches the user (on every rank,
through ``Comm.agree``) is one :class:`DataError` naming the file, never a traceback.
"""

from __future__ import annotations

from contextlib import contextmanager


class DataError(RuntimeError):
    """Missing, damaged or inconsistent data; the message names the file and the problem."""


@contextmanager
def reading(path, what: str = "cannot be read"):
    """Within the block, any exception but a DataError becomes ``DataError("{path}: {what} (...)")``."""
    try:
        yield
    except DataError:
        raise
    except Exception as e:  # h5py and the OS raise many kinds for one damaged file: see the module's docstring
        detail = " ".join(f"{type(e).__name__}: {e}".split())  # one line
        raise DataError(f"{path}: {what} ({detail})") from None
