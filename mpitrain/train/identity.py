"""A run's identity: which run a directory holds, and whose each checkpoint is.

A run gets an identity when it starts: a random ``id``, when it ``started``, the SHA-256
of its config (``config_sha256``, the run directory left out), the dataset's name and
manifest digest (``data``), and for a run started from another run's weights
(``--from``) where they came from (``from``). Rank 0 writes it to ``RUN_DIR/run.json``
(with the SHA-256 of its content) before the first step, and every checkpoint's header
carries it. So ``--resume`` takes only the run's own checkpoints: one of another run,
copied into ``checkpoints/``, is reported (which run, how it differs) and left where it
is, never loaded and never pruned (:mod:`mpitrain.train.resume`).

A run directory without ``run.json`` (its checkpoints copied into a new directory, or a
run started by an mpitrain before identities) is the run that all its checkpoints name;
checkpoints of several runs and no ``run.json`` to choose are refused. When ``run.json``
names a run that no checkpoint is of, and every checkpoint names one other run, the
start records of ``metrics.jsonl`` decide: written by the checkpoints' run, the
``run.json`` was copied in from elsewhere, and the resume moves it aside to
``run.json.<its id>``, saying so; written by the run ``run.json`` names, that run has no
checkpoint yet and the others' were copied in; neither, the resume is refused, naming
both. A checkpoint with no identity, written before identities, is taken as the run's own.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import time
from pathlib import Path

from mpitrain import checkpoint
from mpitrain.checkpoint import CheckpointError, CheckpointWriteError
from mpitrain.config import changes as config_changes
from mpitrain.observe.metrics import read as read_metrics
from mpitrain.output import write_whole

FILE = "run.json"


def new(cfg, data: dict, origin: dict | None = None) -> dict:
    """A new run's identity (the random id differs on each rank: rank 0's is kept)."""
    ident = {"id": secrets.token_hex(8), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "config_sha256": config_digest(cfg.to_dict()), "data": data}
    return {**ident, "from": origin} if origin else ident


def config_digest(config: dict) -> str:
    """SHA-256 of a config (as ``Config.to_dict``), where the run directory is not part of it."""
    plain = {section: {k: v for k, v in table.items() if (section, k) != ("run", "dir")}
             for section, table in config.items()}
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


def of(fields: dict) -> dict | None:
    """The identity a checkpoint's header fields carry; None for one written before identities."""
    return fields.get("run") or None


def read(run_dir) -> dict | None:
    """``RUN_DIR/run.json``'s identity, verified; None when there is none."""
    path = Path(run_dir) / FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})") from None
    try:
        record = json.loads(text)
        ident = record["run"]
        good = record["sha256"] == _digest(ident) and isinstance(ident["id"], str)
    except (ValueError, TypeError, KeyError):
        good = False
    if not good:
        raise CheckpointError(f"{path}: damaged (it does not match its SHA-256); it says which run the directory "
                              "holds: put back a good copy, or move it away to take the run its checkpoints name")
    return ident


def write(run_dir, ident: dict) -> None:
    """``RUN_DIR/run.json`` (atomically), unless it holds ``ident`` already; raises
    CheckpointWriteError, leaving no temporary file, when the disk refuses it."""
    path = Path(run_dir) / FILE
    with_digest = json.dumps({"run": ident, "sha256": _digest(ident)}, indent=1, sort_keys=True) + "\n"
    if path.is_file() and path.read_text() == with_digest:
        return
    try:
        write_whole(path, with_digest)
    except OSError as e:  # the disk's fault (full, read-only): nothing half-written stays
        fix = ("make room, then run the same command again" if e.errno in (errno.ENOSPC, errno.EDQUOT) else
               "run the same command again once it can be written")
        raise CheckpointWriteError(f"{path}: could not be written ({e.strerror or e}); the run starts by writing "
                                   f"it, so nothing was trained: {fix}") from None


def _digest(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def owner(run_dir) -> dict | None:
    """The identity of the run ``run_dir`` holds: its ``run.json``'s, or else the one its
    checkpoints carry; None when neither says (no checkpoint, or only ones written before
    identities). A ``run.json`` that no checkpoint names, where every checkpoint names one
    other run, is weighed by ``metrics.jsonl``, whose start records name the run that
    wrote them (:func:`_by_the_record`). Raises CheckpointError for checkpoints of
    several runs and no ``run.json``."""
    ident = read(run_dir)
    named = _named(run_dir)
    if ident is not None and (ident["id"] in named or len(named) != 1):
        return ident
    if len(named) > 1:
        runs = "; ".join(f"run {i} (started {t.get('started', '?')}): steps {', '.join(map(str, s))}"
                         for i, (t, s) in named.items())
        raise CheckpointError(f"{checkpoint.directory(run_dir)}: checkpoints of {len(named)} runs, and no "
                              f"{Path(run_dir) / FILE} to say which run this is: {runs}; move the other run's "
                              "files out (or start a new run from one: mpitrain train CONFIG --from CHECKPOINT)")
    if not named:
        return None
    theirs = next(iter(named.values()))[0]
    return theirs if ident is None else _by_the_record(run_dir, ident, theirs)


def _by_the_record(run_dir, ident: dict, theirs: dict) -> dict:
    """Which run ``run_dir`` holds when its ``run.json`` names ``ident`` and every
    checkpoint is of the other run ``theirs``: the one ``metrics.jsonl`` was written by.
    ``theirs``: the run.json was copied in from elsewhere (:func:`stray`). ``ident``: its
    own run had saved no checkpoint yet, and the other's were copied in (left in place,
    never loaded). Neither, or both: refused, naming both."""
    try:
        started = {(r.get("run") or {}).get("id") for r in read_metrics(Path(run_dir) / "metrics.jsonl")
                   if r.get("kind") == "start"}
    except OSError:
        started = set()
    if (theirs["id"] in started) != (ident["id"] in started):
        return theirs if theirs["id"] in started else ident
    raise CheckpointError(f"{Path(run_dir) / FILE} names run {ident['id']} (started {ident.get('started', '?')}), "
                          f"but every checkpoint in {checkpoint.directory(run_dir)} is run {theirs['id']}'s (started "
                          f"{theirs.get('started', '?')}), and its metrics.jsonl does not say which run this is: move "
                          f"{FILE} away to resume run {theirs['id']}, or move the checkpoints out to go on with run "
                          f"{ident['id']}")


def _named(run_dir) -> dict[str, tuple[dict, list[int]]]:
    """Each run the checkpoints of ``run_dir`` name: id -> (its identity, the steps)."""
    named = {}
    for path in checkpoint.listed(run_dir):
        try:
            theirs = of(checkpoint.header(path))
        except CheckpointError:  # a damaged file says nothing; the resume sets it aside
            continue
        if theirs is not None:
            named.setdefault(theirs["id"], (theirs, []))[1].append(checkpoint.step_of(path))
    return named


def stray(run_dir, ours: dict | None) -> dict | None:
    """The identity in ``run_dir``'s ``run.json`` when it is not the run's (``ours``, as
    :func:`owner` decided): another run's record, copied in; None otherwise."""
    ident = read(run_dir)
    return ident if ident is not None and ours is not None and ident["id"] != ours["id"] else None


def set_aside(run_dir, ident: dict) -> Path:
    """Move a stray ``run.json`` (of the run ``ident``) to ``run.json.<its id>``, kept."""
    path = Path(run_dir) / FILE
    target = path.with_name(f"{FILE}.{ident['id']}")
    os.replace(path, target)
    return target


def foreign(fields: dict, ours: dict | None) -> bool:
    """Whether a checkpoint (its header ``fields``) is of another run than ``ours``."""
    theirs = of(fields)
    return ours is not None and theirs is not None and theirs["id"] != ours["id"]


def differences(fields: dict, config: dict, data: dict | None) -> str:
    """How a checkpoint of another run (its header ``fields``) differs from this run
    (``config`` as ``Config.to_dict``, ``data`` its identity): a clause for a message."""
    theirs = of(fields) or {}
    changes = [f"{k} = {old!r} (this run: {new!r})" for k, old, new in config_changes(fields["config"], config)]
    if data and fields.get("data") and fields["data"] != data:
        changes.append(f"data {fields['data'].get('name')} ({fields['data'].get('manifest_sha256', '')[:12]}) "
                       f"(this run: {data.get('name')} ({data.get('manifest_sha256', '')[:12]}))")
    shown = ", ".join(changes[:4]) + (f" and {len(changes) - 4} more" if len(changes) > 4 else "")
    return (f"run {theirs.get('id', '?')} (started {theirs.get('started', '?')}), "
            + (f"differs: {shown}" if changes else f"the same config{' and data' if data else ''}: another run of it"))
