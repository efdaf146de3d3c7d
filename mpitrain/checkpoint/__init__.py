"""HDF5 checkpoints: everything a run needs to continue exactly, written atomically and
checksummed (what a user sees of them: ``jobs/README.md``, "Checkpoints, resume and signals").

One file per checkpoint, ``RUN_DIR/checkpoints/step-00001234.h5``: a header, then an
HDF5 file holding

* attributes: ``format``, ``format_version``, ``mpitrain_version``, ``step`` (optimizer
  steps done), ``epoch`` and ``epoch_step`` (the data position: the reader's batches are a
  function of the step, given the seed, global batch, ``data.buffer_mb``,
  ``data.sampling`` and the data), ``ranks`` and ``strategy`` (the sync and the grid, under
  the name older checkpoints gave them) at save time, as JSON ``config`` (resolved),
  ``rng`` (:mod:`mpitrain.rng`) and ``optimizer`` (its step count and group
  hyperparameters), ``created``;
* ``model/<name>``: every parameter and buffer, by its dotted name;
* ``optim/state/<key>`` ``(N,)``: each array state of the optimizer (Adam's
  ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum``) *flat*: the ``N`` parameter
  elements end to end in the optimizer's parameter order;
* ``optim/scalar/<key>`` ``(n_params,)``: each per-parameter scalar (Adam's ``step``),
  and ``optim/has_state`` ``(n_params,)``.

The flat layout makes the file independent of how the state was split (the gradient
sync says which ``[lo, hi)`` ranges a rank holds, ``state_pieces``), so a run resumes on
any number of ranks with any sync, each rank reading the ranges it owns then.

**Integrity: every byte, checked before HDF5 reads any.** The file begins with HDF5's
*userblock* (512 bytes times a power of two, left to its user) holding the plain-text
header (:func:`~.format.header_bytes`): the line ``mpitrain-checkpoint``, one line of JSON
(:data:`~.format.HEADER_TYPES`, the SHA-256 of every byte after the userblock among them), and
``sha256 <hex>`` of that line. HDF5 parses a file only once both digests match, since a
damaged file can make it loop forever (one flipped byte in its heap of strings did); only
the zeros padding the userblock are covered by nothing, and read by nothing. The header's
layout stays in every later version, so a newer file is refused, naming both versions. The
arrays also carry HDF5's Fletcher-32: it names a damaged chunk to HDF5's own tools, and
checks files of format version 1 (no header) as they load, with a note.

**Atomic, and safe when the disk is full.** Rank 0 builds the file in memory (the other
ranks send their parts as buffers, one rank after the other), writes it with plain file
I/O to ``step-XXXXXXXX.h5.tmp``, syncs it (``fsync``) and renames it. HDF5 never writes to
disk: a write failing inside it (no space left, a quota, an I/O error) left its library in
a state that crashed the process, while a failed plain write is one ``OSError``
(:class:`CheckpointWriteError`: the ``.tmp`` removed, the previous checkpoint intact). The
cost: one copy of the checkpoint in rank 0's memory while it writes, and of a
tensor-sliced model a second of its sliced arrays, put together from their slices before
each is written once (HDF5 writes a small array in about the time it writes a large one).
After the rename rank 0 deletes all but the newest ``keep`` of the run's own checkpoints
(never one of a later step, of another run, or whose header does not verify) and any
``.tmp`` a killed write left (a resume ignores it).

**Whose.** The header holds the run's identity (``run``: :mod:`mpitrain.train.identity`),
so that a resume takes only the run's own files. A file of another run (or an unreadable
one) where this step's checkpoint goes is moved to ``checkpoints/other-runs/``, never
written over. Which checkpoint a resume takes, and what becomes
of those it cannot use: :mod:`mpitrain.train.resume`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import time
from pathlib import Path

import h5py
import numpy as np

from mpitrain import __version__, rng
from mpitrain.checkpoint.format import (FORMAT, FORMAT_VERSION, NAME, CheckpointError, CheckpointNewer,
                                        CheckpointWriteError, header_bytes, read_header, userblock_size,
                                        verified_header)
from mpitrain.checkpoint.layout import (Layout, _collect, _contribution, _kinds, _layout, _load_scaler,
                                        _optimizer_meta, _send)

__all__ = ["FORMAT", "FORMAT_VERSION", "CheckpointError", "CheckpointNewer", "CheckpointWriteError", "Layout",
           "check", "directory", "header", "listed", "path_for", "read_meta", "restore", "run_holding", "save",
           "set_aside", "step_of"]

_CHUNK = 1 << 20  # elements per HDF5 chunk of the flat arrays
_JSON_ATTRS = ("config", "rng", "optimizer")


def directory(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def run_holding(folder) -> Path | None:
    """The run directory whose checkpoints folder ``folder`` is (``RUN/checkpoints``,
    given where ``RUN`` was meant), or None when it is not one."""
    folder = Path(folder)
    if folder.name in ("", ".", ".."):  # --resume . inside it
        folder = folder.resolve()
    if folder.name != directory("").name or not folder.is_dir() or listed(folder):  # a run of its own inside?
        return None
    holds = listed(folder.parent) or (folder.parent / "run.json").is_file()
    return folder.parent if holds else None


def path_for(run_dir, step: int) -> Path:
    return directory(run_dir) / f"step-{step:08d}.h5"


def step_of(path: Path) -> int:
    return int(NAME.match(path.name).group(1))


def listed(run_dir) -> list[Path]:
    """The finished checkpoints of a run, oldest first."""
    d = directory(run_dir)
    if not d.is_dir():
        return []
    try:
        found = [(int(m.group(1)), p) for p in d.iterdir() if (m := NAME.match(p.name))]
    except OSError as e:  # permissions, a file system gone away
        raise CheckpointError(f"{d}: cannot list the checkpoints ({e.strerror or e})") from None
    return [p for _, p in sorted(found)]


# ----------------------------------------------------------------- save
def save(run_dir, step: int, *, model, optimizer, sync, cfg, comm, keep: int, epoch: int = 0,
         epoch_step: int = 0, strategy: str = "", layout: Layout | None = None, data: dict | None = None,
         run: dict | None = None, warn=None) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank of ``comm`` calls it);
    ``strategy`` says how the run was laid out (the attribute), ``layout`` is the whole
    model's when ``model`` is a part of it (None: ``model`` is whole). Of a part, each
    rank that writes state sends its arrays too. ``data`` says what the run trains on
    (the header keeps it: a resume on other data is told so); ``run`` is the run's
    identity (:mod:`mpitrain.train.identity`): only its own checkpoints are pruned, and
    a file of another run (or one unreadable) at this step's name is moved aside, said
    through ``warn``. Raises :class:`CheckpointWriteError` on every rank if the file
    cannot be written."""
    offsets, local, pieces, writes = _layout(optimizer, sync, layout)
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    parts = layout.parts if layout is not None else {}
    slices = layout.slices() if layout is not None else {}
    partial = layout is not None and (names != set(layout.arrays) or bool(parts))
    mine = model.state_dict() if comm.rank == 0 or (partial and writes) else {}  # copies: only where written
    shapes = layout.arrays if layout is not None else {n: (a.shape, a.dtype.str) for n, a in mine.items()}
    kinds = {key: kind for held in comm.allgather(_kinds(local) if writes else {}) for key, kind in held.items()}
    own = _contribution(local, pieces if writes else [], slices, mine, parts)
    head = {"format": FORMAT, "format_version": FORMAT_VERSION, "mpitrain_version": __version__, "step": step,
            "epoch": epoch, "epoch_step": epoch_step}  # the attributes the header holds too
    meta = {**head, "ranks": comm.size, "strategy": strategy, "config": json.dumps(cfg.to_dict()),
            "rng": json.dumps(rng.get_state()), "optimizer": _optimizer_meta(local),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    final = path_for(run_dir, step)
    if comm.rank != 0:
        _send(own, comm)
        comm.agree(lambda: None)  # rank 0's write, and its error if it fails
        return final
    n, n_params = int(offsets[-1]), len(offsets) - 1
    fields = {**head, "config": cfg.to_dict(), "data": data or {}, **({"run": run} if run else {})}
    size = userblock_size(fields)
    buffer = io.BytesIO()
    with h5py.File(buffer, "w", userblock_size=size) as f:  # in memory: see the module's docstring
        f.attrs.update(meta)
        for name, (shape, dtype) in shapes.items():
            _dataset(f, f"model/{name}", shape, dtype)
        _dataset(f, "optim/has_state", (n_params,), bool)
        for key, (kind, dtype) in sorted(kinds.items()):
            group, length = ("state", n) if kind == "array" else ("scalar", n_params)
            _dataset(f, f"optim/{group}/{key}", (length,), dtype)
        _collect(f, own, comm)
    image = buffer.getbuffer()
    body = image[size:]  # the HDF5 file proper, after the userblock HDF5 leaves to us
    fields.update(userblock=size, file_bytes=len(image), file_sha256=hashlib.sha256(body).hexdigest())
    comm.agree(_write, final, (header_bytes(fields).ljust(size, b"\0"), body), run_dir, step, keep,
               run and run["id"], warn or (lambda line: None))
    return final


def _write(final: Path, pieces, run_dir, step: int, keep: int, owner: str | None, warn) -> None:
    """``pieces`` (bytes) to ``final`` atomically, then all but the newest ``keep`` of the
    run ``owner``'s checkpoints go (None: of every checkpoint)."""
    tmp = final.with_name(final.name + ".tmp")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if owner is not None and final.exists() and not _owned(final, owner):  # never written over
            warn(f"warning: {final} is not this run's checkpoint: moved to {set_aside(final, OTHERS)}")
        with open(tmp, "wb") as fh:
            fh.writelines(pieces)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException as e:  # a write error, or an abort (a second Ctrl-C) while writing
        with contextlib.suppress(OSError):  # a file system gone read-only or away: report the write's error
            tmp.unlink(missing_ok=True)
        if not isinstance(e, OSError):
            raise
        before = [p for p in listed(run_dir) if step_of(p) < step]
        intact = f"the previous checkpoint, {before[-1]}, is intact" if before else "no earlier checkpoint"
        raise CheckpointWriteError(f"{final}: could not be written ({e.strerror or e}); {intact}") from None
    _fsync_dir(final.parent)
    upto = [p for p in listed(run_dir) if step_of(p) <= step]  # a later one is never this run's to delete
    if owner is not None:  # another run's, or one whose header does not verify: not this run's to delete
        upto = [p for p in upto if _owned(p, owner)]
    for old in upto[:-keep] + list(final.parent.glob("step-*.h5.tmp")):  # and halves of killed writes
        with contextlib.suppress(OSError):  # kept: one more file is no harm, and this checkpoint is written
            old.unlink(missing_ok=True)


OTHERS, UNUSABLE = "other-runs", "unusable"  # folders of checkpoints/: files a run set aside, never deleted


def _owned(path: Path, owner: str) -> bool:
    """Whether ``path``'s header verifies and names the run ``owner``."""
    try:
        fields = read_header(path)
    except CheckpointError:
        return False
    return fields is not None and (fields.get("run") or {}).get("id") == owner


def set_aside(path: Path, folder: str) -> Path:
    """Move ``path`` into ``folder`` beside it (under a new name if one is there
    already); where it went. Raises OSError."""
    aside = path.parent / folder
    target, n = aside / path.name, 1
    while target.exists():
        target, n = aside / f"{path.name}.{n}", n + 1
    aside.mkdir(exist_ok=True)
    path.rename(target)
    return target


def _dataset(f: h5py.File, name: str, shape, dtype) -> None:
    guard = {}
    if len(shape) and int(np.prod(shape)) > 0:  # chunked, so that Fletcher-32 can guard it
        guard = {"chunks": (min(shape[0], _CHUNK),) + tuple(shape[1:]) if len(shape) == 1 else True, "fletcher32": True}
    f.create_dataset(name, shape=shape, dtype=np.dtype(dtype), **guard)


def _fsync_dir(path: Path) -> None:
    # a platform without directory file descriptors, or a file system that cannot sync one: the rename stands
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------- load
def _attributes(path: Path, f: h5py.File, legacy: bool) -> dict:
    """The attributes of an open checkpoint, JSON ones parsed into ``attrs["json"]``. A
    format-1 file (``legacy``, no header) is checked as it was then: its format, and
    its arrays' Fletcher-32 checksums, read whole."""
    attrs = {k: v.item() if isinstance(v, np.generic) else v for k, v in f.attrs.items()}
    if attrs.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an mpitrain checkpoint (format {attrs.get('format')!r})")
    if legacy:
        if attrs.get("format_version") != 1:
            raise CheckpointError(f"{path}: damaged: format version {attrs.get('format_version')!r} without a header")
        for name in _names(f):  # each read whole (visititems would stop at the first value returned)
            f[name][()]
    try:
        attrs["json"] = {k: json.loads(attrs[k]) for k in _JSON_ATTRS}
        for k in ("step", "epoch", "epoch_step"):
            if not isinstance(attrs[k], int) or attrs[k] < 0:
                raise ValueError(f"{k} is {attrs[k]!r}")
        for group in ("model", "optim"):
            f[group]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: damaged metadata ({type(e).__name__}: {e})") from None
    return attrs


def _open(path: Path, use):
    """``use(open file)``, every error of reading turned into a CheckpointError naming ``path``."""
    try:
        with h5py.File(path, "r") as f:
            return use(f)
    except (CheckpointError, MemoryError):  # a file too large for this node is not a damaged one
        raise
    except Exception as e:  # h5py reports damage as OSError, KeyError, ValueError, RuntimeError, ...
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def check(path: Path) -> dict:
    """Verify every byte of a checkpoint before HDF5 reads any; its attributes (JSON ones
    parsed, under ``"json"``; the header's fields under ``"header"``), or raise
    :class:`CheckpointError` saying what is wrong (:class:`CheckpointNewer`: a newer format)."""
    path = Path(path)
    fields = verified_header(path)
    return {**_open(path, lambda f: _attributes(path, f, legacy=fields is None)), "header": fields or {}}


def header(path: Path) -> dict:
    """A checkpoint's header fields, verified, without reading the rest of the file nor
    opening it with HDF5 ({} for a format-1 file, which has no header)."""
    return read_header(Path(path)) or {}


def read_meta(path: Path) -> dict:
    """What the header of a checkpoint says (its ``step``, ``format_version``, ...,
    and the saved config as ``["json"]["config"]``), verified but without reading the
    rest: cheap enough for every rank before MPI starts. A format-1 file's attributes."""
    path = Path(path)
    fields = read_header(path)
    if fields is None:
        return _open(path, lambda f: _attributes(path, f, legacy=True))
    return {**fields, "json": {"config": fields["config"]}}


def restore(path: Path, *, model, optimizer, sync, comm, check_config=None, layout: Layout | None = None,
            weights_only: bool = False) -> dict:
    """Load ``path`` into the model (a part of the whole one of ``layout``, or the whole
    one), the optimizer state this rank owns and the random stream (collective); returns
    the checkpoint's attributes. Every rank verifies the file's bytes (as :func:`check`)
    before it reads any. ``check_config(saved config as a dict)`` may refuse the file
    (raising CheckpointError) before anything is loaded. ``weights_only``: the model's
    arrays alone (a new run from another's weights); the optimizer and the random stream
    stay as they are."""
    offsets, local, pieces, _ = _layout(optimizer, sync, layout)

    def load(f, legacy: bool):
        attrs = _attributes(path, f, legacy)
        if check_config is not None:
            check_config(attrs["json"]["config"])
        saved = {name: f[f"model/{name}"] for name in _names(f["model"])}
        wanted = model.state_dict()
        whole = set(layout.arrays) if layout is not None else set(wanted)
        if weights_only:  # a new run from another's weights: LoRA adapters may come and go
            saved, fresh = _adapters(saved, whole, attrs["json"]["config"])
            whole -= fresh
            wanted = {name: array for name, array in wanted.items() if name not in fresh}
        missing, unexpected = sorted(whole - set(saved)), sorted(set(saved) - whole)
        if missing or unexpected:
            raise CheckpointError(f"{path}: the model differs from the checkpoint's: missing {missing}, "
                                  f"unexpected {unexpected} (is model.* the same as when it was saved?)")
        parts = layout.parts if layout is not None else {}
        for name, array in wanted.items():
            whole_shape = tuple(layout.arrays[name][0]) if name in parts else array.shape
            if saved[name].shape != whole_shape:  # a slice's whole array, not the slice, against the file
                raise CheckpointError(f"{path}: {name} has shape {saved[name].shape} in the checkpoint, "
                                      f"{whole_shape} in this model (is model.* the same?)")
        model.load_state_dict({name: saved[name][()][parts[name]] if name in parts else saved[name][()]
                               for name in wanted}, strict=not weights_only)
        if weights_only:
            return attrs
        _load_state(path, f, local, pieces, offsets, layout.slices() if layout is not None else {})
        local.step_count = int(attrs["json"]["optimizer"]["step_count"])
        _load_scaler(local, attrs["json"]["optimizer"])
        rng.set_state(attrs["json"]["rng"])
        return attrs

    def verify_then_load():
        legacy = verified_header(path) is None  # on every rank: each reads the file itself
        return _open(path, lambda f: load(f, legacy))

    return comm.agree(verify_then_load)


def _adapters(saved: dict, whole: set, config: dict) -> tuple[dict, set]:
    """(the checkpoint's arrays as a model of the arrays ``whole`` takes them; the adapters
    that model has and the checkpoint lacks, which keep their fresh values): a checkpoint's
    LoRA adapters that the model lacks are merged into their layers' weights, with the
    scale of the checkpoint's ``config`` (:func:`mpitrain.nn.lora.merge_state`)."""
    from mpitrain.nn import lora  # here: the base's ops are not a checkpoint's to import up front

    fresh = {n for n in whole - set(saved) if lora.is_adapter(n)}
    extra = [n for n in saved if lora.is_adapter(n) and n not in whole]
    if not extra:
        return saved, fresh
    m = config.get("model", {})
    layers = {n.rsplit(".", 1)[0] for n in extra}
    arrays = {n: saved[n][()] for n in saved if n.rsplit(".", 1)[0] in layers}
    merged = lora.merge_state(arrays, lora.scale(m.get("lora_rank", 1), m.get("lora_alpha", 0)))
    return {**{n: a for n, a in saved.items() if n not in arrays}, **{n: _Read(a) for n, a in merged.items()}}, fresh


class _Read:
    """An array read already, answering ``[()]`` and ``shape`` as an HDF5 dataset does."""

    def __init__(self, array):
        self.array, self.shape = array, array.shape

    def __getitem__(self, index):
        return self.array[index]


def _load_state(path: Path, f: h5py.File, local, pieces, offsets, slices: dict) -> None:
    """This rank's ``pieces`` of the flat optimizer state into ``local``."""
    has = f["optim/has_state"][()]
    arrays = {k: f[f"optim/state/{k}"] for k in f["optim/state"]} if "optim/state" in f else {}
    scalars = {k: f[f"optim/scalar/{k}"] for k in f["optim/scalar"]} if "optim/scalar" in f else {}
    if len(has) != len(offsets) - 1 or any(ds.shape[0] != offsets[-1] for ds in arrays.values()):
        raise CheckpointError(f"{path}: the optimizer state of {len(has)} parameters does not fit this "
                              f"optimizer's {len(offsets) - 1} (is optim.* the same?)")
    shapes = [p.shape for group in local.param_groups for p in group["params"]]
    local.state = {}
    for k, i, lo, hi, within in pieces:
        if has[i]:
            state = {key: _piece(ds, lo, hi, slices.get(i), within).reshape(shapes[k]) for key, ds in arrays.items()}
            state.update({key: np.array(ds[i]) for key, ds in scalars.items()})
            local.state[k] = state


def _piece(ds, lo: int, hi: int, sliced, within) -> np.ndarray:
    """Rows ``[lo, hi)`` of a flat dataset; of a ``sliced`` parameter (``(where, whole
    shape)``), its slice of them, or the piece ``within`` that slice's flat order."""
    if sliced is None:
        return ds[lo:hi]
    where, shape = sliced
    part = ds[lo:hi].reshape(shape)[where]
    return part if within is None else part.reshape(-1)[within[0] : within[1]]


def _names(group: h5py.Group) -> list[str]:
    names = []
    group.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names
