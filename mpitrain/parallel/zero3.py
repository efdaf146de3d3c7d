"""ZeRO stage 3: the parameters themselves sharded over the data-parallel ranks, each
layer's gathered only while it runs (Rajbhandari et al., SC 2020, stage P_os+g+p; what
PyTorch's FSDP does).

**What is split.** The global batch, as in data parallelism, and every part of the model
state: each rank of ``dp_comm`` keeps ``1/P`` of the parameters, of their gradients and
of the optimizer state, ``16/P`` bytes per float32 parameter with Adam (against data
parallelism's 16). At rest a parameter's ``.data`` is a placeholder of its shape that
holds no memory (a broadcast NaN, so that any use outside its layer is loud).

**Units and groups.** The model's layers (``model.named_layers()``: the GPT's embedding,
blocks and head; a CNN's layers) are the units. The parameters a unit alone uses form
its group; a parameter several units use (the GPT's token embedding, tied to its head)
forms a group of its own, so that it is gathered, freed and reduced once like any
other. Each group is one flat array cut into ``P`` chunks; rank ``r`` keeps chunk ``r``.

**The calls and when.** Each unit's call goes through :meth:`Zero3._call` (installed with
``Module.call_through``, so the model's code knows nothing of it), which runs it as one
autograd node:

* forward: wait for the unit's groups (``Iallgatherv`` of the chunks into a whole flat
  array that the parameters' ``.data`` become views of), start gathering the next unit's
  (prefetch), run the unit without recording a graph, free every group this was the last
  forward use of;
* backward: gather the unit's groups again (the next unit back prefetched), replay its
  forward recording a private graph (:func:`mpitrain.nn.checkpoint.replay`, the random
  streams rewound), take the gradients of its input and its parameters, free the groups
  whose first forward use this was and start an ``Ireduce_scatter`` of their gradients:
  each rank adds the sum of its chunk into its gradient shard as soon as it has arrived
  (tested after each unit's backward), freeing the whole gradient, and waits for those
  started before, so that one unit's gradients are in flight at most;
* :meth:`Zero3.finish` waits for those and divides the shard by ``P``; :meth:`Zero3.step`
  clips by the global norm (one 8-byte allreduce) and updates the shard. Nothing else:
  the next forward gathers the updated chunks.

Why replay: a NumPy op keeps the arrays it read until its backward (a product keeps its
weight), so a layer's gathered weights can be freed after its forward only if its
activations go too. Each unit is therefore recomputed in backward, one more forward of
compute (FSDP with activation checkpointing, Chen et al. 2016), and the activations kept
between forward and backward are the units' inputs only.

**Bytes per rank per step**: the parameters gathered twice and the gradients
reduce-scattered once: ``3 (P-1)/P x N x s`` (:func:`mpitrain.cost.zero_bytes`;
micro-batches gather and reduce again each).

**Micro-batches and pipelines: when to gather** (``gather``). With ``m`` micro-batches
(a pipeline stage runs ``m`` per step, in its schedule's order) ``"layer"``, the default
(FSDP's), gathers each unit for every forward and every backward and reduce-scatters
every backward: ``3m (P-1)/P x N x s``, the least memory (one unit's weights at a time);
zero bubble's backward is two passes, each gathering and replaying: ``4m`` (the data's
layer ``3m``: its input pass has nothing to do). ``"step"`` keeps every
unit's weights from their first gather to the step's last backward and sums the
micro-batches' whole gradients, reduce-scattered once: ``2 (P-1)/P x N x s`` as data
parallelism's allreduce, at the memory of the whole part's weights and gradients
(DeepSpeed's and FSDP's "no reshard" choice, for a stage that fits).

**On a part of the model.** Over the replicas of a tensor slice (FSDP x TP, torchtitan's)
or of a pipeline stage, the units are the part's layers; the sums the whole model still
owes come after :meth:`Zero3.finish`, on the pieces :meth:`Zero3.held` gives
(:class:`mpitrain.train.parts.PartSync`). ``kind`` keeps the weights those sums meet in
groups of their own (:func:`groups`), so every stage or slice holds the same piece.

**Mixed precision.** The chunks are of 16-bit working copies (gathered in 16 bits); each
rank keeps the float32 masters and Adam's moments of its chunk only, ``(2 + 2 + 12)/P``
bytes per parameter; the 16-bit gradients are reduce-scattered as float32 copies
(:func:`mpitrain.comm.ring.ireduce_scatter`). ``whole_model(masters=True)`` gathers
the float32 masters for a checkpoint. Each replayed unit's float32 gradients are rounded
once, as they are added into the 16-bit sum (as backward does into ``.grad``): with
``"step"`` the arithmetic is data parallelism's, bit for bit, but for a weight two units
use (the GPT's tied embedding), whose two gradients are added in the order the units'
backwards run, not the order one backward meets them. ``"layer"`` with micro-batches sums
each micro-batch over the replicas before adding the micro-batches: another order.

**Frozen parameters** (fine-tuning: ``requires_grad`` false) are none of this: each rank
holds them whole, as the model was built or loaded, and they are neither gathered nor
reduced; ``N`` above counts the parameters that train.

Checkpoints (in every strategy's format: a ZeRO-3 run resumes on data parallelism or
one process and back), evaluation and the text sample run inside :meth:`Zero3.whole_model`,
the whole model gathered once (ranks may score different numbers of batches).

**Launch**: ``mpiexec -n 2 mpitrain train jobs/tinyshakespeare_gpt.toml --set parallel.sync=zero3``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from mpitrain.autograd import grad
from mpitrain.comm import replicas
from mpitrain.comm.ring import Ring, chunk_bounds, ireduce_scatter
from mpitrain.flat import offsets
from mpitrain.nn.checkpoint import replay
from mpitrain.parallel import GradSync, mean, runs, sharded_update, trained
from mpitrain.rng import snapshot
from mpitrain.tensor import Function, Tensor, as_tensor, is_grad_enabled, no_grad


GATHER = ("layer", "step")  # when a unit's gathered parameters are freed: after each use, or after the step


@dataclass
class _Group:
    """Parameters gathered and reduced together: one unit's own, or one shared parameter."""

    params: list
    first: int  # the first and last unit (in forward order) that use them
    last: int
    offsets: np.ndarray  # (len(params) + 1,) in the group's flat array
    bounds: np.ndarray  # (P + 1,) the chunks
    data: np.ndarray  # (chunk,) my chunk of the parameters: what the optimizer updates
    grad: np.ndarray  # (chunk,) my chunk of the gradient
    comm: object  # a Dup of dp_comm for this group's gathers
    rs_comm: object  # and one for its reduce-scatters (one ring in flight on each at most)
    whole: np.ndarray | None = None  # (n,) gathered, or being gathered
    gathering: object = None  # the request of a gather in flight
    grads: np.ndarray | None = None  # (n,) this step's gradient, summed over the units using it
    reducing: list = field(default_factory=list)  # [(request, send, recv)] in flight


def groups(params, units, kind=None, key=id) -> list[tuple[list, int, int]]:
    """ZeRO-3's groups, each ``(its parameters, the first and the last unit that use
    them)``, in the order the forward reaches them: a unit's own parameters (``params``
    in order; ``units``: each unit's parameters), cut where their ``kind`` changes
    (:func:`mpitrain.parallel.kinds`: a tied weight or one every slice holds whole is
    chunked on its own, so that the stages or slices that sum it hold the same piece),
    and each parameter several units use on its own. ``key``: what identifies a
    parameter (the planner's are names). The planner cuts by this function too."""
    uses: dict = {}
    for k, unit in enumerate(units):
        for p in unit:
            uses.setdefault(key(p), []).append(k)
    by_unit: dict[int, list] = {}
    specs = []
    for p in params:
        k = uses[key(p)]
        (specs.append(([p], min(k), max(k))) if len(k) > 1 else by_unit.setdefault(k[0], []).append(p))
    specs += [(run, k, k) for k, ps in sorted(by_unit.items()) for run in runs(ps, kind)]
    specs.sort(key=lambda spec: (spec[1], spec[2]))
    return specs


def _trained(unit) -> list:
    """The parameters of ``unit`` that train: a frozen one is held whole, never sharded."""
    return [q for q in unit.parameters() if q.requires_grad]


class _Unit(Function):
    """One unit as one autograd node: its parameters are inputs (so the node is recorded
    even over integer input) whose gradients go to the shards, not to ``.grad``."""

    def forward(self, x, *placeholders, unit, k, zero):
        self.unit, self.k, self.zero, self.x = unit, k, zero, x
        zero._gather(k, ahead=k + 1)
        self.rng_state = snapshot()
        with no_grad():
            out = unit.forward(Tensor(x)).data
        zero._release(k, forward=True, keep=True)
        return out

    def backward(self, g):
        """The input's gradient, the parameters' (to the shards), or, when zero bubble
        splits the backward in two (:func:`mpitrain.autograd.backward_split`), the one
        its pass asks for: each pass gathers and replays the unit."""
        zero, params = self.zero, _trained(self.unit)
        want_x, want_w = self.needs_input_grad[0], any(self.needs_input_grad[1:])
        zero._gather(self.k, ahead=self.k - 1)
        x, out = replay(self.unit, self.x, want_x, self.rng_state)
        wrt = ([x] if want_x else []) + (params if want_w else [])
        grads = grad([out], wrt, [g])
        gx = grads[0] if want_x else None
        if want_w:
            zero._reduce(self.k, dict(zip(map(id, params), grads[len(wrt) - len(params):])))
        else:
            zero._release(self.k, forward=False, keep=zero.deferring)
        return (gx,) + (None,) * len(params)


class Zero3(GradSync):
    """Shard ``model``'s parameters, gradients and optimizer state over ``dp_comm``. Use::

        zero = Zero3(model, opt, dp_comm)
        loss.backward()            # units gathered, replayed, their gradients reduce-scattered
        zero.finish()              # wait, average my shard
        zero.step(lr, grad_clip)   # update my shard
        zero.zero_grad()
    """

    waits = {"finish": "gradient reduce-scatter"}
    sharded = True

    def __init__(self, model, optimizer, dp_comm, algorithm: str = "mpi", prefetch: bool = True, kind=None,
                 gather: str = "layer"):
        if algorithm not in ("mpi", "ring"):
            raise ValueError(f"ZeRO-3's algorithm must be 'mpi' or 'ring', got {algorithm!r}")
        if gather not in GATHER:
            raise ValueError(f"ZeRO-3's gather must be one of {GATHER}, got {gather!r}")
        super().__init__(model, optimizer, dp_comm)
        self.algorithm, self.prefetch, self.keep, self.deferring = algorithm, prefetch, gather == "step", False
        opt_params = trained(optimizer)  # mixed precision: the 16-bit working copies
        if {id(p) for p in opt_params} != {id(p) for p in self.params}:
            raise ValueError("ZeRO-3 needs an optimizer over exactly the model's trainable parameters")
        replicas.broadcast(dp_comm, [p.data for p in self.params] + [b for _, b in model.named_buffers()]
                           + list(getattr(optimizer, "masters", [])))  # mixed precision's float32 masters
        self.units = [m for _, m in model.named_layers()]
        self.groups = self._groups(kind)
        self.unit_groups = [[g for g in self.groups if g.first <= k <= g.last and
                             any(id(p) in {id(q) for q in u.parameters()} for p in g.params)]
                            for k, u in enumerate(self.units)]
        for k, unit in enumerate(self.units):
            if unit._call_through is not None:
                raise ValueError(f"ZeRO-3: layer {k}'s calls are routed already (activation checkpointing?); "
                                 "ZeRO-3 replays every layer in backward itself")
            if self.unit_groups[k]:
                unit.call_through(self._call)
        self._unit_index = {id(u): k for k, u in enumerate(self.units)}
        self.optimizer = self._shard_optimizer(optimizer, opt_params)
        for g in self.groups:
            self._free(g)
        self._whole = False

    def _groups(self, kind) -> list:
        """The groups of :func:`groups`, each with my chunk of its parameters."""
        try:
            specs = groups(self.params, [u.parameters() for u in self.units], kind)
        except KeyError:
            raise ValueError("ZeRO-3 gathers parameters layer by layer: some parameter belongs to no layer of "
                             "model.named_layers()") from None
        P, r = self.comm.size, self.comm.rank
        out = []
        for params, first, last in specs:
            offs = offsets(params)
            bounds = chunk_bounds(int(offs[-1]), P)
            whole = np.concatenate([p.data.reshape(-1) for p in params])
            data = whole[bounds[r] : bounds[r + 1]].copy()
            out.append(_Group(params, first, last, offs, bounds, data, np.zeros_like(data), self.comm.dup(),
                              self.comm.dup()))
        return out

    def _shard_optimizer(self, full, opt_params):
        """The optimizer over my chunks; ``self.pieces`` places them in the flat layout of
        the optimizer's order (checkpoints' coordinates)."""
        group_of = {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}
        opt_offsets = offsets(opt_params)
        opt_index = {id(p): i for i, p in enumerate(opt_params)}
        r = self.comm.rank
        self.pieces, self.spans, self._held = [], [], {}  # spans: (group, lo, hi) in its chunk, the masters' order

        def views(p):
            g, i = group_of[id(p)]
            lo, hi = max(int(g.bounds[r]), int(g.offsets[i])), min(int(g.bounds[r + 1]), int(g.offsets[i + 1]))
            if lo >= hi:
                return None
            base = int(opt_offsets[opt_index[id(p)]]) - int(g.offsets[i])
            self.pieces.append((opt_index[id(p)], lo + base, hi + base))
            at = lo - int(g.bounds[r])
            self.spans.append((g, at, at + hi - lo))
            self._held[id(p)] = g.grad[at : at + hi - lo]
            return g.data[at : at + hi - lo], g.grad[at : at + hi - lo], lo - int(g.offsets[i])

        return full.over(views)

    # --------------------------------------------------------- gather, free
    def _start_gather(self, g: _Group) -> None:
        if g.whole is not None:
            return
        r = self.comm.rank
        g.whole = np.empty(int(g.offsets[-1]), dtype=g.data.dtype)  # (n,)
        g.whole[g.bounds[r] : g.bounds[r + 1]] = g.data
        if self.algorithm == "ring":
            g.gathering = Ring(g.comm, g.whole, ("allgather",))
        else:
            g.gathering = g.comm.iallgather_array(g.whole, np.diff(g.bounds))

    def _gather(self, k: int, ahead: int) -> None:
        """Unit ``k``'s groups whole (waiting for them), and unit ``ahead``'s on their way."""
        for g in self.unit_groups[k]:
            self._start_gather(g)
        if self.prefetch and 0 <= ahead < len(self.units):
            for g in self.unit_groups[ahead]:
                self._start_gather(g)
        for g in self.unit_groups[k]:
            if g.gathering is not None:
                g.gathering.wait()
                g.gathering = None
                for p, lo, hi in zip(g.params, g.offsets[:-1], g.offsets[1:]):
                    p.data = g.whole[lo:hi].reshape(p.shape)

    def _free(self, g: _Group) -> None:
        for p in g.params:
            p.data = np.broadcast_to(np.array(np.nan, dtype=g.data.dtype), p.shape)  # no memory
        g.whole = None

    def _release(self, k: int, forward: bool, keep: bool = False) -> None:
        """After unit ``k``: free the groups no later unit needs in this pass; with
        ``gather = "step"`` not those a training pass may ``keep`` (the step's last
        backward frees them)."""
        if self.keep and keep:
            return
        for g in self.unit_groups[k]:
            if (g.last if forward else g.first) == k:
                self._free(g)

    def _call(self, unit, x, *args, **kwargs):
        """A unit's call: one recorded node while training; gathered and freed around a
        plain call in evaluation."""
        k = self._unit_index[id(unit)]
        if self._whole:  # inside whole_model(): every parameter is there
            return unit.forward(x, *args, **kwargs)
        if not is_grad_enabled():
            self._gather(k, ahead=k + 1)
            out = unit.forward(x, *args, **kwargs)
            self._release(k, forward=True)
            return out
        if args or kwargs:
            raise TypeError(f"ZeRO-3 runs each layer on one input; layer {k} ({type(unit).__name__}) got more")
        return _Unit.apply(as_tensor(x), *_trained(unit), unit=unit, k=k, zero=self)

    # ------------------------------------------------------------- gradients
    def _reduce(self, k: int, grads: dict) -> None:
        """Add unit ``k``'s gradients into its groups' whole gradients; reduce-scatter
        those whose first unit this is (the last backward use) and free them; then wait for
        the reduce-scatters started before these, so that the next unit's backward runs
        beside this unit's alone: one whole gradient in flight at most, whatever the link's
        speed (a slow link would otherwise keep several, and a step's peak would depend on
        the messages' timing; FSDP limits its gathers in flight for the same reason)."""
        started = []
        for g in self.unit_groups[k]:
            if g.grads is None:
                g.grads = np.zeros(int(g.offsets[-1]), dtype=g.data.dtype)  # (n,)
            for p, lo, hi in zip(g.params, g.offsets[:-1], g.offsets[1:]):
                d = grads.get(id(p))
                if d is not None:
                    g.grads[lo:hi] += d.reshape(-1)
            if g.first == k and not self.deferring:
                if self.algorithm == "ring":
                    self._drain(g)  # a ring's messages must not meet the previous micro-batch's
                    g.reducing.append((Ring(g.rs_comm, g.grads, ("reduce_scatter",)), g.grads, None))
                else:
                    recv = np.empty_like(g.grad)
                    g.reducing.append((ireduce_scatter(g.rs_comm, g.grads, recv, np.diff(g.bounds)), g.grads, recv))
                g.grads = None
                started.append(g)
        self._release(k, forward=False, keep=self.deferring)
        if started:
            for g in self.groups:
                self._drain(g, keep=1 if g in started else 0)
        self._progress()

    def _progress(self) -> None:
        """Add every reduce-scatter already done into its shard, in each group's order, and
        free its buffers: a whole gradient lives until its sum has arrived, not until the
        step's end (else every layer's would be alive at once near the end of backward)."""
        for g in self.groups:
            while g.reducing and g.reducing[0][0].test():
                self._add(g, *g.reducing.pop(0)[1:])

    def _drain(self, g: _Group, keep: int = 0) -> None:
        """Wait for the group's reduce-scatters in flight but its last ``keep``; add my chunk
        of each into the shard, in order."""
        while len(g.reducing) > keep:
            request, send, recv = g.reducing.pop(0)
            request.wait()
            self._add(g, send, recv)

    def _add(self, g: _Group, send: np.ndarray, recv: np.ndarray | None) -> None:
        r = self.comm.rank
        g.grad += send[g.bounds[r] : g.bounds[r + 1]] if recv is None else recv

    @contextlib.contextmanager
    def no_sync(self):
        """The step's backward passes but its last. ``gather = "layer"`` holds nothing
        back (every backward reduce-scatters; the parameters are gathered again for each
        anyway); ``"step"`` keeps the gathered parameters and their whole gradients, summed
        over the passes, until the last."""
        self.deferring = self.keep
        try:
            yield
        finally:
            self.deferring = False

    def finish(self) -> None:
        """Reduce-scatter what is still held back (``gather = "step"`` under a schedule
        whose last pass made no weight gradients: zero bubble's weight pass), wait for
        the reduce-scatters, average my shard."""
        for g in self.groups:
            self._drain(g)
            if g.grads is not None:
                recv = np.empty_like(g.grad)
                ireduce_scatter(g.rs_comm, g.grads, recv, np.diff(g.bounds)).wait()
                self._add(g, g.grads, recv)
                g.grads = None
            if self.keep and g.whole is not None:
                self._free(g)
            mean(g.grad, self.comm.size)

    def held(self) -> dict:
        """My shard's piece of each parameter's gradient (after :meth:`finish`)."""
        return self._held

    def step(self, lr: float | None = None, grad_clip: float = 0.0, norm: float | None = None) -> float:
        """Clip by the global norm (``norm``: the whole model's, when this is a part of
        it), update my shard; returns the norm (nan: no clipping)."""
        return sharded_update(self.comm, self.optimizer, [g.grad for g in self.groups], lr, grad_clip, norm)

    def zero_grad(self) -> None:
        for g in self.groups:
            g.grad.fill(0)

    # ------------------------------------------------------------ the rest
    def check_replicas(self) -> str:
        """The replicas' check, on the whole parameters (gathered: a collective)."""
        with self.whole_model():
            return super().check_replicas()

    @contextlib.contextmanager
    def whole_model(self, masters: bool = False):
        """Inside, every parameter whole in ``.data`` (gathered; a collective); on the way
        out my chunk of what they then hold becomes my shard, and they are freed. A
        checkpoint is saved and loaded inside. ``masters``: in mixed precision the float32
        masters are gathered instead of the 16-bit working copies (``4N`` bytes), and on
        the way out my chunk of them goes back to my masters and is rounded into my
        working copies (float32 training has no masters: the same as without)."""
        halves = {}
        if masters and hasattr(self.optimizer, "masters"):
            for g in self.groups:
                halves[id(g)], g.data = g.data, g.data.astype(np.float32)  # (chunk,) my float32 masters
            for (g, lo, hi), m in zip(self.spans, self.optimizer.masters):
                g.data[lo:hi] = m
        for g in self.groups:
            self._start_gather(g)
        for k in range(len(self.units)):
            self._gather(k, ahead=-1)
        self._whole = True
        try:
            yield
        finally:
            self._whole = False
            r = self.comm.rank
            for g in self.groups:
                np.copyto(g.data, g.whole[g.bounds[r] : g.bounds[r + 1]])
            for (g, lo, hi), m in zip(self.spans, self.optimizer.masters if halves else ()):
                m[...] = g.data[lo:hi]
            for g in self.groups:
                if halves:
                    np.copyto(halves[id(g)], g.data, casting="same_kind")
                    g.data = halves[id(g)]
                self._free(g)

    def close(self) -> None:
        for g in self.groups:
            g.comm.free()
            g.rs_comm.free()
        for unit in self.units:
            unit.call_through(None)
