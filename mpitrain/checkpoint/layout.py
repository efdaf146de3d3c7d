"""Where each array of a checkpoint comes from and goes to: the whole model's arrays and
the flat optimizer state (:class:`Layout`), the pieces each rank holds of them, and
gathering them to rank 0 as buffers (:mod:`mpitrain.checkpoint`, "the flat layout")."""

from __future__ import annotations

import json
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


def _apply(f: h5py.File, header, array: np.ndarray) -> None:
    """Write ``array`` where ``header = (dataset, rows, whole shape, where, within)``
    says: rows ``[lo, hi)`` of a flat dataset (None: all of it), and for a slice, its
    ``where`` in the whole array of ``shape`` that those rows hold (None: the rows' own
    shape), and ``within`` that slice's flat order (None: all of it)."""
    name, rows, shape, where, within = header
    ds = f[name]
    rows = slice(*rows) if rows is not None else Ellipsis
    if where is None:
        ds[rows] = array
        return
    stored = ds[rows]
    whole = stored.reshape(shape) if shape is not None else stored  # a view: writing it writes stored
    if within is None:
        whole[where] = array.reshape(whole[where].shape)  # a shard's piece may be the whole slice, flat
    else:
        part = np.ascontiguousarray(whole[where])  # the slice in C order (reshape(-1) then a view), its piece replaced
        part.reshape(-1)[within[0] : within[1]] = array.reshape(-1)
        whole[where] = part
    ds[rows] = stored


def _collect(f: h5py.File, own: list, comm) -> None:
    """Write this rank's (rank 0's) contribution, then every other rank's, received as
    buffers one rank after the other (their headers, small, come by ``gather``)."""
    from mpitrain.comm import Tag

    headers = comm.gather([h for h, _ in own])
    for header, array in own:
        _apply(f, header, array)
    for source in range(1, comm.size):
        for header in headers[source]:
            buf = np.empty(header[5], dtype=np.dtype(header[6]))
            comm.recv(buf, source, Tag.CHECKPOINT)
            _apply(f, header[:5], buf)


def _send(own: list, comm) -> None:
    """A rank other than 0 sends its contribution to rank 0."""
    from mpitrain.comm import Tag

    comm.gather([(*h, a.shape, a.dtype.str) for h, a in own])
    comm.waitall([comm.isend(a, 0, Tag.CHECKPOINT) for _, a in own])
