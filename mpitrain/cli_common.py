"""What every part of the ``mpitrain`` command line shares (:mod:`mpitrain.cli` and the
commands it registers: :mod:`mpitrain.cli_train`, :mod:`mpitrain.cli_bench`,
:mod:`mpitrain.cli_data`, :mod:`mpitrain.plan.cli`): the errors a command raises, the
line printed once, the exit status after Ctrl-C, and the checks of numeric arguments.
Below them all, so that none imports the others to reach these."""

from __future__ import annotations

import argparse
import sys

INTERRUPTED = 130  # the exit status after Ctrl-C (128 + SIGINT), as shells report it
# mpitrain plan's exit status where a rank outgrows its memory (--search: in every layout; --largest: at the least size)
DOES_NOT_FIT = 3


def _note(message: str) -> None:
    """A line about the command or its error, printed once: by rank 0 (:func:`_prints_errors`)."""
    if _prints_errors():
        print(message, file=sys.stderr, flush=True)


class _usage(ValueError):
    """A command-line mistake found after parsing."""


class _failure(ValueError):
    """A problem with the input a command was given: one line, exit status 2."""


def _prints_errors() -> bool:
    """Whether this process prints the errors that every rank raises alike: rank 0 of
    the MPI world, or, before MPI has started (the config and the command line are read
    first), rank 0 by its launcher's environment, so that ``mpiexec -n 2`` prints one line."""
    from mpitrain.comm import launcher_rank, started_world

    world = started_world()
    return (launcher_rank() if world is None else world.rank) in (None, 0)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value
