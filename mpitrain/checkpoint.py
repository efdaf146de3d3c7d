"""HDF5 checkpoints: everything a run needs to continue exactly, written atomically.

One file per checkpoint, ``RUN_DIR/checkpoints/step-00001234.h5``:

* attributes: ``format`` (``mpitrain-checkpoint``), ``format_version``,
  ``mpitrain_version``, ``step`` (optimizer steps done), ``epoch`` and ``epoch_step``
  (the data position: the reader's batches are a function of the step, given the
  seed, global batch, ``data.buffer_mb`` and the data; a resume that changes one of
  those is warned about, see ``DATA_ORDER``),
  ``ranks`` and ``strategy`` at save time (the gradient sync and the grid: the name
  older checkpoints gave the strategy), ``config`` (the resolved config as JSON),
  ``rng`` (the dropout and initialisation stream, :mod:`mpitrain.rng`), ``optimizer``
  (its step count and group hyperparameters, JSON), ``created``;
* ``model/<name>``: every parameter and buffer, by its dotted name;
* ``optim/state/<key>`` ``(N,)``: each array state of the optimizer (Adam's
  ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum``) *flat*: the ``N`` parameter
  elements end to end in the optimizer's parameter order;
* ``optim/scalar/<key>`` ``(n_params,)``: each per-parameter scalar (Adam's ``step``),
  and ``optim/has_state`` ``(n_params,)``.

The flat layout makes the file independent of how the state was split: with ZeRO-1
each rank writes the ``[lo, hi)`` range of its own shard, each parameter server the
ranges of its parameters, with data parallelism rank 0 writes it all (the gradient
sync says which, ``state_pieces``); and a run resumes on any number of ranks with any
sync (local, ddp, zero1), each rank reading the ranges it owns then.

**Atomic.** Rank 0 creates ``step-XXXXXXXX.h5.tmp`` (metadata, model, empty optimizer
datasets, its own state); the other ranks that own state write theirs one after the
other; rank 0 flushes it to disk (``fsync``) and renames it, so a checkpoint either
exists whole or not at all; then it deletes all but the newest ``keep``. A leftover
``.tmp`` from a killed run is ignored and replaced.

**Integrity.** Every array is stored in chunks with HDF5's Fletcher-32 checksum, and
:func:`latest` reads every byte of a candidate before choosing it: a truncated file, a
damaged header or a flipped bit makes it skip that checkpoint with a warning and take
the one before.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import h5py
import numpy as np

from mpitrain import __version__, rng

FORMAT, FORMAT_VERSION = "mpitrain-checkpoint", 1
_NAME = re.compile(r"^step-(\d{8,})\.h5$")
_CHUNK = 1 << 20  # elements per HDF5 chunk of the flat arrays


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file."""


def directory(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def path_for(run_dir, step: int) -> Path:
    return directory(run_dir) / f"step-{step:08d}.h5"


def _step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def listed(run_dir) -> list[Path]:
    """The finished checkpoints of a run, oldest first."""
    d = directory(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


# --------------------------------------------------------------- layout
@dataclass(frozen=True)
class Layout:
    """The whole model as one process holds it: every array's name, shape and dtype, and
    the optimizer's parameters (name, size) in its order. A checkpoint is written in
    this layout whatever part of it each rank holds (a pipeline stage holds a slice)."""

    arrays: dict  # name -> (shape, dtype string), the model's state_dict
    params: tuple  # ((name, size), ...) in the optimizer's parameter order
    # name -> the index of this rank's slice in the whole array, for arrays sliced over ranks (tensor parallel)
    parts: dict = field(default_factory=dict)

    @classmethod
    def of(cls, model, optimizer) -> "Layout":
        names = {id(q): n for n, q in model.named_parameters()}
        arrays = {n: (a.shape, a.dtype.str) for n, a in model.state_dict().items()}
        return cls(arrays, tuple((names[id(q)], q.size) for g in optimizer.param_groups for q in g["params"]))

    def with_parts(self, parts: dict) -> "Layout":
        """This layout, of which this rank holds the slices ``parts`` (name -> index)."""
        return replace(self, parts=dict(parts))

    def slices(self) -> dict:
        """Parameter index (optimizer order) -> (the index of this rank's slice, the whole
        shape), for the sliced ones."""
        return {i: (self.parts[name], self.arrays[name][0]) for i, (name, _) in enumerate(self.params)
                if name in self.parts}


def _layout(optimizer, sync, layout: Layout | None):
    """(flat offsets of every parameter of ``layout`` (None: the optimizer's own), the
    optimizer holding this rank's state, its pieces as (local index, parameter index,
    lo, hi), whether this rank writes state).

    The gradient sync says which part of the state this rank holds with
    ``state_pieces(offsets)`` -> (its optimizer, [(parameter index, lo, hi)] in that
    optimizer's order, whether this rank writes them: of replicas, one does), or None on
    ranks that hold none (parameter-server workers)."""
    if layout is None:
        sizes = [p.size for group in optimizer.param_groups for p in group["params"]]
    else:
        sizes = [size for _, size in layout.params]
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # (n_params + 1,)
    split = sync.state_pieces(offsets)
    if split is None:
        return offsets, optimizer, [], False
    local, pieces, writes = split
    return offsets, local, [(k, i, lo, hi) for k, (i, lo, hi) in enumerate(pieces)], writes


def _kinds(local) -> dict:
    """{key: ("array" | "scalar", dtype)} of the optimizer state this rank holds."""
    kinds = {}
    for state in local.state.values():
        for key, value in state.items():
            value = np.asarray(value)
            kinds[key] = ("scalar" if value.ndim == 0 else "array", value.dtype.str)
    return kinds


def _optimizer_meta(local) -> str:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in local.param_groups]
    return json.dumps({"step_count": local.step_count, "groups": groups})


def _write_state(f: h5py.File, local, pieces, slices: dict) -> None:
    """This rank's optimizer state into the flat arrays; a sliced parameter's into its
    slice of the whole parameter's range (``slices``: :meth:`Layout.slices`)."""
    has = f["optim/has_state"]
    for k, i, lo, hi in pieces:
        state = local.state.get(k)
        if not state:
            continue
        has[i] = True
        for key, value in state.items():
            value = np.asarray(value)
            if value.ndim == 0:
                f[f"optim/scalar/{key}"][i] = value
            elif i in slices:
                where, shape = slices[i]
                whole = f[f"optim/state/{key}"][lo:hi].reshape(shape)
                whole[where] = value
                f[f"optim/state/{key}"][lo:hi] = whole.reshape(-1)
            else:
                f[f"optim/state/{key}"][lo:hi] = value.reshape(-1)


def _write_arrays(f: h5py.File, mine: dict, parts: dict) -> None:
    """This rank's model arrays; a sliced one into its slice of the whole array."""
    for name, array in mine.items():
        if name in parts:
            whole = f[f"model/{name}"][()]
            whole[parts[name]] = array
            array = whole
        f[f"model/{name}"][...] = array


# ----------------------------------------------------------------- save
def save(run_dir, step: int, *, model, optimizer, sync, cfg, comm, keep: int, epoch: int = 0,
         epoch_step: int = 0, strategy: str = "", layout: Layout | None = None) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank of ``comm`` calls it);
    ``strategy`` says how the run was laid out (the attribute), ``layout`` is the whole
    model's when ``model`` is a part of it (None: ``model`` is whole). Of a part, each
    rank that writes state writes its arrays too."""
    offsets, local, pieces, writes = _layout(optimizer, sync, layout)
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    parts = layout.parts if layout is not None else {}
    slices = layout.slices() if layout is not None else {}
    partial = layout is not None and (names != set(layout.arrays) or bool(parts))
    mine = model.state_dict() if comm.rank == 0 or (partial and writes) else {}  # copies: only where written
    shapes = layout.arrays if layout is not None else {n: (a.shape, a.dtype.str) for n, a in mine.items()}
    kinds = {}
    for k in comm.allgather(_kinds(local) if writes else {}):
        kinds.update(k)
    final = path_for(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "mpitrain_version": __version__,
            "step": step, "epoch": epoch, "epoch_step": epoch_step, "ranks": comm.size,
            "strategy": strategy, "config": json.dumps(cfg.to_dict()),
            "rng": json.dumps(rng.get_state()), "optimizer": _optimizer_meta(local),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def create():
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(tmp, "w") as f:
            f.attrs.update(meta)
            for name, (shape, dtype) in shapes.items():
                if name in mine and name not in parts:
                    _dataset(f, f"model/{name}", data=mine[name])
                else:  # held, or partly held, by other ranks, which write it next
                    _dataset(f, f"model/{name}", shape=shape, dtype=np.dtype(dtype))
            _write_arrays(f, {n: a for n, a in mine.items() if n in parts}, parts)
            n, n_params = int(offsets[-1]), len(offsets) - 1
            f.create_dataset("optim/has_state", data=np.zeros(n_params, dtype=bool))
            for key, (kind, dtype) in sorted(kinds.items()):
                length = n if kind == "array" else n_params
                _dataset(f, f"optim/{'state' if kind == 'array' else 'scalar'}/{key}", shape=(length,),
                         dtype=np.dtype(dtype))
            if writes:
                _write_state(f, local, pieces, slices)

    comm.agree(lambda: create() if comm.rank == 0 else None)
    def add_mine(writer: int) -> None:
        if comm.rank == writer:
            with h5py.File(tmp, "r+") as f:
                _write_state(f, local, pieces, slices)
                _write_arrays(f, mine if partial else {}, parts)

    writers = [r for r, w in enumerate(comm.allgather(writes)) if w and r > 0]
    for writer in writers:  # one rank at a time: an HDF5 file has one writer
        comm.agree(add_mine, writer)

    def commit():
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        # checkpoints of later steps belong to the run this one replaced (it resumed from an
        # earlier one, past a damaged file): they go, then all but the newest `keep`
        saved = listed(run_dir)
        later = [p for p in saved if _step_of(p) > step]
        for old in later + [p for p in saved if _step_of(p) <= step][:-keep]:
            old.unlink()

    comm.agree(lambda: commit() if comm.rank == 0 else None)
    return final


def _dataset(f: h5py.File, name: str, **kwargs) -> None:
    shape = np.shape(kwargs["data"]) if "data" in kwargs else kwargs["shape"]
    if len(shape) and int(np.prod(shape)) > 0:  # chunked, so that Fletcher-32 can guard it
        chunks = (min(shape[0], _CHUNK),) + tuple(shape[1:]) if len(shape) == 1 else True
        kwargs.update(chunks=chunks, fletcher32=True)
    f.create_dataset(name, **kwargs)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform without directory file descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------- load
def check(path: Path) -> dict:
    """Read every byte of a checkpoint (checksums verified); its attributes, or raise
    :class:`CheckpointError` saying what is wrong."""
    try:
        with h5py.File(path, "r") as f:
            attrs = dict(f.attrs)
            if attrs.get("format") != FORMAT:
                raise CheckpointError(f"{path}: not an mpitrain checkpoint (format {attrs.get('format')!r})")
            if int(attrs.get("format_version", -1)) > FORMAT_VERSION:
                raise CheckpointError(f"{path}: format version {attrs['format_version']} is newer than this "
                                      f"mpitrain's ({FORMAT_VERSION})")
            for group in ("model", "optim"):
                if group not in f:
                    raise CheckpointError(f"{path}: no {group!r} group")

            def read(name, obj):
                if isinstance(obj, h5py.Dataset):
                    obj[()]

            f.visititems(read)
            return attrs
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError, TypeError) as e:  # how h5py reports damage
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def latest(run_dir, comm, warn) -> Path | None:
    """The newest checkpoint of the run that reads back whole (chosen by rank 0, which
    ``warn``s about each damaged one it skips), on every rank; None if there is none."""

    def choose():
        for path in reversed(listed(run_dir)):
            try:
                check(path)
                return str(path)
            except CheckpointError as e:
                warn(f"warning: skipping damaged checkpoint: {e}")
        return None

    chosen = comm.bcast(comm.agree(lambda: choose() if comm.rank == 0 else None))
    return Path(chosen) if chosen else None


# the settings the order of the batches follows (with the step); changing one on resume
# trains on other batches than the saved run would have
DATA_ORDER = (("train", "seed"), ("train", "global_batch_size"), ("data", "buffer_mb"), ("data", "shift"),
              ("data", "path"), ("data", "name"), ("model", "block_size"))


def restore(path: Path, *, cfg, model, optimizer, sync, comm, warn=None, layout: Layout | None = None) -> dict:
    """Load ``path`` into the model (a part of the whole one of ``layout``, or the whole
    one), the optimizer state this rank owns and the random stream (collective); returns
    the checkpoint's attributes. ``warn`` hears of settings that change the batch order
    from the saved run's."""
    offsets, local, pieces, _ = _layout(optimizer, sync, layout)

    def load():
        with h5py.File(path, "r") as f:
            attrs = dict(f.attrs)
            saved_cfg, now = json.loads(attrs["config"]), cfg.to_dict()
            changed = [f"{a}.{b} = {now[a][b]!r} (saved: {saved_cfg[a][b]!r})" for a, b in DATA_ORDER
                       if saved_cfg.get(a, {}).get(b) != now[a][b]]
            if changed and warn is not None:
                warn(f"warning: {path}: resuming with {', '.join(changed)}: the batches differ from the ones "
                     "the saved run would have trained on")
            was = saved_cfg["optim"]["name"]
            if was != cfg.optim.name:
                raise CheckpointError(f"{path}: saved with optim.name = {was!r}, this run has {cfg.optim.name!r}; "
                                      "the optimizer state cannot carry over")
            saved = {name: f[f"model/{name}"] for name in _names(f["model"])}
            wanted = model.state_dict()
            whole = set(layout.arrays) if layout is not None else set(wanted)
            missing, unexpected = sorted(whole - set(saved)), sorted(set(saved) - whole)
            if missing or unexpected:
                raise CheckpointError(f"{path}: the model differs from the checkpoint's: missing {missing}, "
                                      f"unexpected {unexpected} (is model.* the same as when it was saved?)")
            parts = layout.parts if layout is not None else {}
            slices = layout.slices() if layout is not None else {}

            def mine(name):  # this rank's part of a saved array
                return saved[name][()][parts[name]] if name in parts else saved[name][()]

            for name, array in wanted.items():
                whole_shape = tuple(layout.arrays[name][0]) if name in parts else array.shape
                if saved[name].shape != whole_shape:  # a slice's whole array, not the slice, against the file
                    raise CheckpointError(f"{path}: {name} has shape {saved[name].shape} in the checkpoint, "
                                          f"{whole_shape} in this model (is model.* the same?)")
            model.load_state_dict({name: mine(name) for name in wanted})
            has = f["optim/has_state"][()]
            arrays = {k: f[f"optim/state/{k}"] for k in f["optim/state"]} if "optim/state" in f else {}
            scalars = {k: f[f"optim/scalar/{k}"] for k in f["optim/scalar"]} if "optim/scalar" in f else {}
            if len(has) != len(offsets) - 1 or any(ds.shape[0] != offsets[-1] for ds in arrays.values()):
                raise CheckpointError(f"{path}: the optimizer state of {len(has)} parameters does not fit this "
                                      f"optimizer's {len(offsets) - 1} (is optim.* the same?)")
            shapes = [p.shape for group in local.param_groups for p in group["params"]]
            local.state = {}
            for k, i, lo, hi in pieces:
                if has[i]:
                    state = {key: (ds[lo:hi].reshape(slices[i][1])[slices[i][0]] if i in slices else ds[lo:hi])
                             .reshape(shapes[k]) for key, ds in arrays.items()}
                    state.update({key: np.array(ds[i]) for key, ds in scalars.items()})
                    local.state[k] = state
            opt_meta = json.loads(attrs["optimizer"])
            local.step_count = int(opt_meta["step_count"])
            rng.set_state(json.loads(attrs["rng"]))
            return attrs

    return comm.agree(load)


def _names(group: h5py.Group) -> list[str]:
    names = []
    group.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names
