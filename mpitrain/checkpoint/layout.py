"""Where each array of a checkpoint comes from and goes to: the whole model's arrays and
the flat optimizer state (:class:`Layout`), the pieces each rank holds of them, and
gathering them to rank 0 as buffers (:mod:`mpitrain.checkpoint`, "the flat layout")."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

import h5py
import numpy as np

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
    optimizer holding this rank's state, its pieces as (local index, parameter index, lo,
    hi, within), whether this rank writes them: of replicas, one does), as the gradient
    sync's ``state_pieces`` says (None: no state here, as on parameter-server workers).
    The sync is asked in the coordinates of what this rank holds (:func:`part_offsets`);
    a piece is then ``[lo, hi)`` of the whole flat layout, or, of a sliced parameter, its
    whole range with ``within``: the piece's ``[lo, hi)`` in the slice's flat order (None:
    the whole slice)."""
    sizes = ([p.size for group in optimizer.param_groups for p in group["params"]] if layout is None
             else [size for _, size in layout.params])
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # (n_params + 1,)
    slices = layout.slices() if layout is not None else {}
    held = part_offsets(sizes, slices)
    split = sync.state_pieces(held)
    if split is None:
        return offsets, optimizer, [], False
    local, pieces, writes = split
    out = []
    for k, (i, lo, hi) in enumerate(pieces):
        lo, hi = int(lo - held[i]), int(hi - held[i])  # in the part of parameter i this rank holds
        if i not in slices:
            out.append((k, i, int(offsets[i]) + lo, int(offsets[i]) + hi, None))
        else:
            whole = (lo, hi) == (0, int(held[i + 1] - held[i]))
            out.append((k, i, int(offsets[i]), int(offsets[i + 1]), None if whole else (lo, hi)))
    return offsets, local, out, writes


def part_offsets(sizes, slices: dict) -> np.ndarray:
    """The flat offsets of the parameters as this rank holds them: a sliced one
    (``slices``: :meth:`Layout.slices`) takes its slice's size."""
    held = [_slice_size(*slices[i]) if i in slices else size for i, size in enumerate(sizes)]
    return np.concatenate([[0], np.cumsum(held, dtype=np.int64)])


def _slice_size(where, shape) -> int:
    return int(np.broadcast_to(np.int8(0), tuple(shape))[where].size)


def _kinds(local) -> dict:
    """{key: ("array" | "scalar", dtype)} of the optimizer state this rank holds."""
    return {key: ("scalar" if np.ndim(value) == 0 else "array", np.asarray(value).dtype.str)
            for state in local.state.values() for key, value in state.items()}


def _optimizer_meta(local) -> str:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in local.param_groups]
    meta = {"step_count": local.step_count, "groups": groups}
    if getattr(local, "scaler", None) is not None:  # mixed precision: the loss scale, for an exact resume
        meta["loss_scale"] = {"precision": local.precision, **local.scaler.state_dict()}
    return json.dumps(meta)


def _load_scaler(local, meta: dict) -> None:
    """A mixed-precision optimizer's loss scale from a checkpoint of the same precision
    (another precision's scale, or none, leaves it as it starts)."""
    saved = meta.get("loss_scale")
    if getattr(local, "scaler", None) is not None and saved and saved["precision"] == local.precision:
        local.scaler.load_state_dict(saved)


def _contribution(local, pieces, slices: dict, arrays: dict, parts: dict) -> list:
    """What this rank writes: ``(header, array)`` pairs, the header saying where the
    array goes (:func:`_apply`): its model arrays (``arrays``; a sliced one, ``parts``,
    into its slice of the whole array) and the optimizer state of its ``pieces`` (a
    sliced parameter's into its slice of the parameter's flat range, ``slices``:
    :meth:`Layout.slices`, or into a piece of that slice)."""
    out = [((f"model/{name}", None, None, parts.get(name), None), np.ascontiguousarray(a))
           for name, a in arrays.items()]
    for k, i, lo, hi, within in pieces:
        state = local.state.get(k)
        if not state:
            continue
        out.append((("optim/has_state", (i, i + 1), None, None, None), np.ones(1, dtype=bool)))
        for key, value in state.items():
            value = np.asarray(value)
            if value.ndim == 0:
                out.append(((f"optim/scalar/{key}", (i, i + 1), None, None, None), value.reshape(1)))
            elif i in slices:
                where, shape = slices[i]
                out.append(((f"optim/state/{key}", (lo, hi), tuple(shape), where, within),
                            np.ascontiguousarray(value)))
            else:
                out.append(((f"optim/state/{key}", (lo, hi), None, None, None), np.ascontiguousarray(value).reshape(-1)))
    return out


def _place(stored: np.ndarray, header, array: np.ndarray) -> None:
    """Put ``array``, a slice, into ``stored``, the rows ``header = (dataset, rows, whole
    shape, where, within)`` names: at ``where`` in the whole array of ``shape`` those rows
    hold (None: the rows' own shape), at ``within`` that slice's flat order (None: all of
    it)."""
    _, _, shape, where, within = header
    whole = stored.reshape(shape) if shape is not None else stored  # a view: writing it writes stored
    if within is None:
        whole[where] = array.reshape(whole[where].shape)  # a shard's piece may be the whole slice, flat
    else:
        part = np.ascontiguousarray(whole[where])  # the slice in C order (reshape(-1) then a view), its piece replaced
        part.reshape(-1)[within[0] : within[1]] = array.reshape(-1)
        whole[where] = part


def _runs(contribution: list) -> list:
    """``contribution``'s pairs by dataset, each run of consecutive rows of a flat
    dataset joined into one pair (a rank's shard of the optimizer state spans many
    parameters: one write, not one a parameter)."""
    by_name: dict = {}
    for header, array in contribution:
        by_name.setdefault(header[0], []).append((header, array))
    out = []
    for pairs in by_name.values():
        runs = [[pairs[0]]]
        for header, array in pairs[1:]:
            before = runs[-1][-1][0]
            flat = header[1] is not None and header[2:] == before[2:] == (None, None, None)
            if flat and before[1] is not None and before[1][1] == header[1][0]:
                runs[-1].append((header, array))
            else:
                runs.append([(header, array)])
        out += [_joined(run) for run in runs]
    return out


def _joined(run: list):
    if len(run) == 1:
        return run[0]
    first, last = run[0][0], run[-1][0]
    return (first[0], (first[1][0], last[1][1]), None, None, None), np.concatenate([a.reshape(-1) for _, a in run])


class _Writer:
    """Rank 0's writes into the checkpoint it builds, few and large: each dataset looked
    up once; consecutive rows written at once (:func:`_runs`); and what several writes
    would fill in parts, the per-parameter rows (``optim/has_state``, ``optim/scalar/*``)
    and the rows of a sliced parameter (its slices come from the ranks of a tensor-parallel
    group), put together in memory and written once, at :meth:`close`."""

    def __init__(self, f: h5py.File):
        self.f, self.datasets, self.parts = f, {}, {}

    def dataset(self, name: str) -> h5py.Dataset:
        if name not in self.datasets:
            self.datasets[name] = self.f[name]
        return self.datasets[name]

    def write(self, contribution: list) -> None:
        for header, array in _runs(contribution):
            name, rows, where = header[0], header[1], header[3]
            if name == "optim/has_state" or name.startswith("optim/scalar/"):
                if name not in self.parts:
                    self.parts[name] = (Ellipsis, self.dataset(name)[()])
                self.parts[name][1][slice(*rows)] = array
            elif where is not None:
                key = (name, rows)
                if key not in self.parts:
                    at = slice(*rows) if rows is not None else Ellipsis
                    self.parts[key] = (at, self.dataset(name)[at])
                _place(self.parts[key][1], header, array)
            else:
                self.dataset(name)[slice(*rows) if rows is not None else Ellipsis] = array

    def close(self) -> None:
        for key, (at, values) in self.parts.items():
            self.dataset(key if isinstance(key, str) else key[0])[at] = values


_ALIGN = 8  # each array of a packed message starts on a multiple of 8 bytes, so that its view is aligned


def _packed(sizes) -> np.ndarray:
    """The offsets of arrays of ``sizes`` bytes in one packed message, and its end."""
    padded = [-(-n // _ALIGN) * _ALIGN for n in sizes]
    return np.concatenate([[0], np.cumsum(padded, dtype=np.int64)])


def _collect(f: h5py.File, own: list, comm) -> None:
    """Write this rank's (rank 0's) contribution, then every other rank's, received one
    rank after the other as one buffer each, its arrays end to end (their headers, small,
    come by ``gather``)."""
    from mpitrain.comm import Tag

    headers = comm.gather([h for h, _ in own])
    writer = _Writer(f)
    writer.write(own)
    for source in range(1, comm.size):
        meta = headers[source]
        dtypes = [np.dtype(h[6]) for h in meta]
        offsets = _packed([math.prod(h[5]) * d.itemsize for h, d in zip(meta, dtypes)])
        buf = np.empty(int(offsets[-1]), dtype=np.uint8)
        comm.recv(buf, source, Tag.CHECKPOINT)
        arrays = [buf[int(o) : int(o) + math.prod(h[5]) * d.itemsize].view(d).reshape(h[5])
                  for h, d, o in zip(meta, dtypes, offsets)]
        writer.write([(h[:5], a) for h, a in zip(meta, arrays)])
    writer.close()


def _send(own: list, comm) -> None:
    """A rank other than 0 sends its contribution to rank 0, as one buffer."""
    from mpitrain.comm import Tag

    comm.gather([(*h, a.shape, a.dtype.str) for h, a in own])
    offsets = _packed([a.nbytes for _, a in own])
    buf = np.zeros(int(offsets[-1]), dtype=np.uint8)
    for (_, a), o in zip(own, offsets):
        buf[int(o) : int(o) + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    comm.waitall([comm.isend(buf, 0, Tag.CHECKPOINT)])
