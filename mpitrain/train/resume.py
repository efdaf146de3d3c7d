"""Resuming a run: which run directory (:func:`find_run`), which config
(:func:`saved_config`, :func:`check_config`), which checkpoint (:func:`choose`); never a
guess, and nothing deleted that could not be read (what the user sees: ``jobs/README.md``,
"Checkpoints, resume and signals").

A resumed run trains with the config saved in its checkpoint, not the CONFIG file's; a
change to ``model.*`` or ``optim.name`` is refused, since the saved state would not fit
it. An unusable checkpoint is *moved* aside, never deleted: the resumed run would write
over it when it reaches its step. A file of a newer format version stops the resume:
taking an older checkpoint past it would drop the newer run's steps on a guess.
"""

from __future__ import annotations

import re
from pathlib import Path

from mpitrain import checkpoint, config
from mpitrain.checkpoint import UNUSABLE, CheckpointError, CheckpointNewer
from mpitrain.config import ConfigError
from mpitrain.train import identity

# the settings the order of the batches follows (with the step); changing one on resume
# trains on other batches than the saved run would have
DATA_ORDER = ("train.seed", "train.global_batch_size", "data.buffer_mb", "data.shift", "data.flip", "data.sampling",
              "data.path", "data.name")


def runs_of(stem: str, root: Path = Path("runs")) -> list[Path]:
    """The run directories of the config named ``stem`` that exist: ``root/stem`` and
    every ``root/stem-<n>``, by ``n`` (all of them, also past a gap a deleted run left)."""
    numbered = re.compile(re.escape(stem) + r"-([1-9][0-9]*)")
    found = [(0, root / stem)] if (root / stem).is_dir() else []
    if root.is_dir():
        found += [(int(m.group(1)), p) for p in root.iterdir() if (m := numbered.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def find_run(stem: str, root: Path = Path("runs")) -> tuple[Path, str]:
    """(the run directory ``CONFIG --resume`` continues, a line saying which); raises
    ConfigError listing the runs when there are several."""
    runs = runs_of(stem, root)
    if not runs:
        return root / stem, f"resume: no run of {stem} in {root}/ yet: starting {root / stem}"
    if len(runs) == 1:
        return runs[0], f"resume: {runs[0]} (the only run of {stem})"
    described = "; ".join(f"{p} ({_newest(p)})" for p in runs)
    raise ConfigError(f"--resume: {len(runs)} runs of {stem}: {described}; say which to resume: "
                      f"mpitrain train --resume {runs[-1]}")


def _newest(run_dir: Path) -> str:
    saved = checkpoint.listed(run_dir)
    return f"newest checkpoint step {checkpoint.step_of(saved[-1])}" if saved else "no checkpoint"


def _newest_usable(run_dir, full: bool, start_over: bool, ours: dict | None):
    """(the newest checkpoint of the run ``ours`` in ``run_dir`` that verifies, its
    attributes (``full``: :func:`checkpoint.check`, every byte) or its metadata
    (:func:`checkpoint.read_meta`), the newer ones that do not verify with why, the
    checkpoints of other runs with their header's fields); no checkpoint (None, None):
    when there is none of the run, or none is usable and ``start_over``. Raises
    CheckpointError when none is usable otherwise; CheckpointNewer (a newer format
    version) passes through."""
    unusable, others, chosen = [], [], None
    for path in reversed(checkpoint.listed(run_dir)):
        try:
            fields = checkpoint.header(path)
            if identity.foreign(fields, ours):
                others.append((path, fields))
            elif chosen is None:
                chosen = path, checkpoint.check(path) if full else checkpoint.read_meta(path)
        except CheckpointNewer:
            if chosen is None:
                raise
        except CheckpointError as e:
            if chosen is None:
                unusable.append((path, str(e)))
    if chosen is None and unusable and not start_over:
        raise CheckpointError(f"{checkpoint.directory(run_dir)}: no checkpoint can be used: "
                              f"{'; '.join(why for _, why in unusable)}. Nothing was changed; to start this run again "
                              f"at step 0 (the files are kept in {checkpoint.directory(run_dir) / UNUSABLE}), "
                              "add --start-over")
    return (*(chosen or (None, None)), unusable, others)


def saved_config(run_dir, start_over: bool = False) -> tuple[Path, dict] | None:
    """(checkpoint, the config saved in it, as ``Config.to_dict``) of the run's newest
    checkpoint whose header verifies (the arrays are not read: every rank calls this
    before MPI starts), or None (:func:`_newest_usable`)."""
    path, meta, _, _ = _newest_usable(run_dir, False, start_over, identity.owner(run_dir))
    return None if path is None else (path, meta["json"]["config"])


def newest(run_dir) -> tuple[Path, dict, list[str]]:
    """(the run's newest checkpoint whose every byte verifies, its attributes, why each
    newer one was passed over), moving nothing (for reading a run, not resuming it);
    raises CheckpointError when there is none."""
    path, attrs, unusable, others = _newest_usable(run_dir, True, True, identity.owner(run_dir))
    if path is None:
        why = f": {'; '.join(w for _, w in unusable)}" if unusable else ""
        raise CheckpointError(f"{checkpoint.directory(run_dir)}: no checkpoint of the run can be used{why}")
    newer = [f"{other}: a checkpoint of another run ({(identity.of(fields) or {}).get('id', '?')})"
             for other, fields in others if checkpoint.step_of(other) > checkpoint.step_of(path)]
    return path, attrs, [why for _, why in unusable] + newer


def choose(run_dir, comm, warn, start_over: bool = False, now: dict | None = None, data: dict | None = None):
    """(the checkpoint to resume and its verified attributes, or None to start at step
    0; the run's identity, None if nothing says it), chosen by rank 0 and told to every
    rank (:func:`_newest_usable`): the newer checkpoints that do not verify are moved to
    ``checkpoints/unusable/``, and each checkpoint of another run is named, with how it
    differs from this run (``now``: its config as ``Config.to_dict``, ``data`` its
    dataset's identity), and left in place. Collective; raises the same CheckpointError
    on every rank."""

    def pick():
        ours = identity.owner(run_dir)
        if (stray := identity.stray(run_dir, ours)) is not None:
            kept = _set_aside_record(run_dir, stray)
            warn(f"resume: {Path(run_dir) / identity.FILE} named run {stray['id']} (started "
                 f"{stray.get('started', '?')}), which none of the checkpoints here is; every one is run "
                 f"{ours['id']}'s (started {ours.get('started', '?')}): resuming that run; the other record was "
                 f"moved to {kept}")
        path, attrs, unusable, others = _newest_usable(run_dir, True, start_over, ours)
        _set_aside(unusable, warn)
        for other, fields in others:
            warn(f"resume: {other} is a checkpoint of another {identity.differences(fields, now or {}, data)}; "
                 "left in place, not loaded")
        return None if path is None else (str(path), attrs), ours

    chosen, ours = comm.bcast(comm.agree(lambda: pick() if comm.rank == 0 else None))
    return None if chosen is None else (Path(chosen[0]), chosen[1]), ours


def _set_aside_record(run_dir, stray: dict) -> Path:
    """Move another run's ``run.json``, copied in, to ``run.json.<its id>``: kept, not deleted."""
    try:
        return identity.set_aside(run_dir, stray)
    except OSError as e:
        raise CheckpointError(f"{Path(run_dir) / identity.FILE} names another run than its checkpoints, and cannot be "
                              f"moved aside ({e.strerror or e}); move it away yourself to resume") from None


def _set_aside(unusable: list[tuple[Path, str]], warn) -> None:
    """Move each unusable checkpoint to ``checkpoints/unusable/``, saying so."""
    for path, why in unusable:
        try:
            target = checkpoint.set_aside(path, UNUSABLE)
        except OSError as e:
            raise CheckpointError(f"cannot resume from {why}, nor move it to {path.parent / UNUSABLE} "
                                  f"({e.strerror or e})") from None
        warn(f"warning: cannot resume from {why}; moved to {target}")


def check_config(path: Path, saved: dict, cfg, warn) -> None:
    """Compare the config saved in ``path`` with the run's: a change to the model or the
    optimizer's kind is refused (raises CheckpointError); every other change is listed
    through ``warn`` as one the user asked for, with what it means for the batches."""
    changes = config.changes(saved, cfg.to_dict())
    if model := [f"{k} = {new!r} (saved: {old!r})" for k, old, new in changes if k.startswith("model.")]:
        raise CheckpointError(f"{path}: the checkpoint's model differs: {', '.join(model)}; a resumed run trains "
                              "the saved model (start a new run to change it)")
    for key, old, new in changes:
        if key in ("optim.name", "train.trainable"):
            raise CheckpointError(f"{path}: saved with {key} = {old!r}, this run has {new!r}; the optimizer "
                                  "state cannot carry over")
    if changes:
        warn("resume: changes to the saved config: "
             + ", ".join(f"{k} = {new!r} (saved: {old!r})" for k, old, new in changes))
    if order := [k for k, _, _ in changes if k in DATA_ORDER]:
        warn(f"warning: {path}: resuming with another {', '.join(order)}: the batches differ from the ones the "
             "saved run would have trained on")


def check_data(path: Path, saved: dict | None, now: dict, warn) -> None:
    """Warn when the run reads other data than the checkpoint was trained on (another
    dataset, or the same one built from other files): not refused, since going on with
    new data can be meant, but never silent. (Data that does not fit the model, another
    number of classes or characters, is refused when the model's arrays are loaded.)"""
    if saved and saved.get("manifest_sha256") and saved != now:
        warn(f"warning: {path} was trained on {saved['name']} (manifest SHA-256 {saved['manifest_sha256'][:12]}); "
             f"this run reads {now['name']} ({now['manifest_sha256'][:12]}): other data")
