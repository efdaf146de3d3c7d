"""A config on ``P`` ranks as the planner sees it: the grid, the sync, the schedule, the
sizes, and which layers and parameters each rank holds.

Everything here is derived the way the trainer derives it, from the same functions: the
grid from :func:`mpitrain.config.check_ranks` (so a layout the trainer refuses, the planner
refuses with the same message), a pipeline's cut from :func:`mpitrain.schedules.balance`
of the whole layers' parameter counts, a rank's tensor-parallel slices from
:func:`mpitrain.plan.shapes.gpt` (the cuts of :mod:`mpitrain.parallel.tensor_parallel`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from mpitrain import cost, flat, optim, parallel
from mpitrain.comm.ring import chunk_length
from mpitrain.config import Config, check_ranks, cut_refused, trained_names, validate
from mpitrain.config.checks import planning
from mpitrain.parallel import zero3
from mpitrain.plan import shapes
from mpitrain.schedules import balance

PRECISION_BYTES = {"fp32": None, "bf16": 2, "fp16": 2}  # None: train.dtype's


@dataclass(frozen=True)
class Layout:
    cfg: Config
    P: int  # ranks in the job (with parameter servers: servers + workers)
    dp: int
    pp: int
    tp: int
    data: object  # :class:`mpitrain.plan.data.DataShape`
    threads: int = 1  # BLAS threads per rank, which size a convolution's tiles (:func:`mpitrain.ops.conv.tile_images`)
    # the device computes as GPU frameworks do (a published device, not this machine's NumPy): mixed
    # precision's activations and the messages between stages and slices in 16 bits, no work arrays
    native: bool = False

    @classmethod
    def of(cls, cfg: Config, P: int, data, threads: int = 1, native: bool = False) -> "Layout":
        """The layout of ``cfg`` on ``P`` ranks, each with ``threads`` BLAS threads, on a
        ``native`` device or NumPy; a ConfigError (naming the field) if the trainer would
        refuse it."""
        with planning() if native else contextlib.nullcontext():  # a GPU: what only mpitrain refuses is planned
            validate(cfg, data_needed=False)
        dp, pp, tp = check_ranks(cfg, P)
        lay = cls(cfg, P, dp, pp, tp, data, threads, native)
        try:
            lay.bounds  # noqa: B018 (a pipeline the layers cannot be cut into: refused as the trainer refuses it)
        except ValueError as e:
            raise cut_refused(cfg, e) from None
        return lay

    # ------------------------------------------------------------ what the config says
    @property
    def par(self):
        return self.cfg.parallel

    @property
    def servers(self) -> int:
        return self.par.servers if self.par.sync == "ps" else 0

    @property
    def m(self) -> int:
        return self.cfg.train.micro_batches

    @property
    def v(self) -> int:
        return model_chunks(self.par, self.pp)

    @property
    def micro_batch(self) -> int:
        """Samples of one micro-batch of one rank."""
        return self.cfg.train.global_batch_size // (self.dp * self.m)

    @property
    def mixed(self) -> bool:
        return self.cfg.train.precision != "fp32"

    @property
    def itemsize(self) -> int:
        """Bytes of a number of the model's weights, gradients and activations."""
        return PRECISION_BYTES[self.cfg.train.precision] or np.dtype(self.cfg.train.dtype).itemsize

    @property
    def dtype_bytes(self) -> int:
        """Bytes of a number of the activations: ``train.dtype``'s (NumPy computes mixed
        precision in float32), the training's 16 bits on a ``native`` device."""
        return self.itemsize if self.native else np.dtype(self.cfg.train.dtype).itemsize

    def sum_bytes(self, wire: int | None = None, algorithm: str = "mpi") -> int:
        """Bytes a number of a sum of gradients sends (:func:`mpitrain.cost.wire_bytes`): on a
        ``native`` device, which adds 16-bit numbers itself, the gradients' own."""
        return cost.wire_bytes(self.itemsize, wire, "native" if self.native else algorithm)

    @property
    def moments(self) -> int:
        return moments_of(self.cfg.optim)

    @property
    def work_arrays(self) -> int:
        """Arrays as large as the largest piece an update holds between steps: Adam's work
        array (:meth:`mpitrain.optim.Optimizer._scratch`; SGD's update keeps none) and mixed
        precision's unscaled gradient (:class:`mpitrain.precision.MixedPrecision`); none on a
        ``native`` device (its frameworks' updates are fused)."""
        return 0 if self.native else (self.cfg.optim.name in ("adam", "adamw")) + self.mixed

    @property
    def textbook(self) -> bool:
        """Whether tier 1 is the answer for this layout's memory and time: a ``native``
        device, a sync tier 1 knows (:mod:`mpitrain.plan.space`); tier 2 then walks only its
        calls."""
        return self.native and self.par.sync in ("ddp", "zero1", "zero2", "zero3")

    @property
    def T(self) -> int:
        return self.cfg.model.block_size if self.data.kind == "text" else 0

    # ------------------------------------------------------------ who holds what
    @cached_property
    def models(self) -> list:
        """Each tensor-parallel rank's :class:`~mpitrain.plan.shapes.ModelShape`; a fine-tuning
        config's as it trains (:meth:`~mpitrain.plan.shapes.ModelShape.tuned`: the backward of
        what trains, the layers that record no graph), a pipeline stage's input needing a
        gradient (:class:`mpitrain.parallel.pipeline.PipelineStage`'s anchor)."""
        models = [shapes.from_config(self.cfg, self.data, self.tp, r) for r in range(self.tp)]
        names = list(models[0].parameters())
        trained = frozenset(trained_names(self.cfg, names))
        if len(trained) == len(names):
            return models
        starts = frozenset(cut(models[0], self.pp * self.v)[1:-1])  # (the cut balances parameters: the same)
        return [m.tuned(trained, starts) for m in models]

    @cached_property
    def bounds(self) -> list[int]:
        """The pipeline's cut of the layer list into ``pp x chunks`` stages."""
        return cut(self.models[0], self.pp * self.v)

    def chunks(self, s: int, r: int = 0) -> list[list]:
        """Pipeline rank ``s``'s chunks of the layers of tensor-parallel rank ``r``."""
        return chunks_of(self.models[r].layers, self.bounds, self.pp, self.v, s)

    def layers(self, s: int, r: int = 0) -> list:
        return [layer for chunk in self.chunks(s, r) for layer in chunk]

    def parameters(self, s: int, r: int = 0) -> dict:
        """{name: shape} of the parameters pipeline rank ``s``, slice ``r`` holds and trains:
        what has gradients, optimizer state and is exchanged (a fine-tuning config's frozen
        ones are :meth:`frozen`)."""
        if (s, r) not in self.cache:  # asked for every rank: a 1,024-rank plan asks often
            held = self.models[r].parameters(self.layers(s, r))
            self.cache[s, r] = {n: shape for n, shape in held.items() if n in self.trained}
            self.cache["frozen", s, r] = sum(math.prod(shape) for n, shape in held.items() if n not in self.trained)
        return self.cache[s, r]

    def frozen(self, s: int, r: int = 0) -> int:
        """Numbers of the frozen parameters pipeline rank ``s``, slice ``r`` holds: whole on
        every data-parallel rank, no gradient, no optimizer state, never exchanged."""
        self.parameters(s, r)
        return self.cache["frozen", s, r]

    @cached_property
    def trained(self) -> frozenset:
        """The names of the parameters that train (:func:`mpitrain.config.trained_names`)."""
        return frozenset(trained_names(self.cfg, list(self.models[0].parameters())))

    def tuning(self) -> str:
        """The plan's line on what trains: '' when everything does."""
        whole = shapes.from_config(self.cfg, self.data).parameters()
        n = sum(math.prod(shape) for name, shape in whole.items() if name in self.trained)
        total = sum(math.prod(shape) for shape in whole.values())
        if n == total:
            return ""
        return (f"fine-tuning: {n:,} of {total:,} parameters train ({100 * n / total:.2f}%); the frozen "
                f"{total - n:,} are held whole on every rank, with no gradients, no optimizer state and no exchange")

    @cached_property
    def cache(self) -> dict:
        """What the planner derives once per part and asks for per rank."""
        return {}

    @cached_property
    def replicated(self) -> frozenset:
        """The names of the parameters every tensor slice holds whole (the rest are cut)."""
        if self.tp == 1:
            return frozenset()
        whole = shapes.from_config(self.cfg, self.data).parameters()
        return frozenset(n for n, shape in self.models[0].parameters().items() if tuple(shape) == tuple(whole[n]))

    @cached_property
    def kind(self):
        """The trainer's :func:`mpitrain.parallel.kinds` of a stand-in parameter: the
        tied weights when stages share them, the replicated ones under sequence parallelism."""
        tied = self.models[0].tied if self.pp > 1 else frozenset()
        replicated = self.replicated if self.par.sequence_parallel else frozenset()
        return parallel.kinds(tied, replicated, key=lambda q: q.name)

    @cached_property
    def whole(self) -> int:
        """The whole model's parameters (a tied weight once)."""
        return self.models[0].count() if self.tp == 1 else shapes.from_config(self.cfg, self.data).count()

    def rank_of(self, s: int, d: int, r: int) -> int:
        """The world rank of (pipeline, data-parallel, tensor-parallel) coordinates
        (:class:`mpitrain.comm.grid.GridShape`), after the servers."""
        return self.servers + (s * self.dp + d) * self.tp + r

    def describe(self) -> str:
        par = self.par
        parts = [f"{self.P} rank(s)"]
        if self.servers:
            parts.append(f"{self.servers} server(s) + {self.dp} worker(s)")
        parts.append(f"dp {self.dp} x pp {self.pp} x tp {self.tp}")
        parts.append(par.sync)
        if self.pp > 1:
            parts.append(f"{par.schedule}{f' x {self.v} chunks' if self.v > 1 else ''}")
        if self.tp > 1 and par.sequence_parallel:
            parts.append("sequence parallel")
        parts.append(f"{self.m} micro-batch(es) of {self.micro_batch}")
        parts.append(self.cfg.train.precision if self.mixed else self.cfg.train.dtype)
        if self.cfg.model.name == "gpt" and self.cfg.model.checkpoint_activations:
            parts.append("activation checkpointing")
        return ", ".join(parts)


def model_chunks(par, pp: int) -> int:
    """The model chunks each of ``pp`` pipeline ranks holds: ``parallel.chunks`` under the
    interleaved schedule, else one."""
    return par.chunks if pp > 1 and par.schedule == "interleaved" else 1


def moments_of(optim) -> int:
    """Arrays the optimizer of config section ``optim`` keeps per parameter: Adam's two
    moments, SGD's momentum (or none)."""
    return 2 if optim.name in ("adam", "adamw") else int(optim.momentum > 0)


# ------------------------------------------------------------ how a pipeline cuts the model
def cut(shape, parts: int) -> list[int]:
    """The bounds of ``parts`` consecutive stages of the layers of ``shape`` (a
    :class:`~mpitrain.plan.shapes.ModelShape`), balanced by each whole layer's parameters
    as the trainer cuts them (:func:`mpitrain.schedules.balance`)."""
    return list(_balanced(tuple(layer.whole for layer in shape.layers), parts))


@lru_cache(maxsize=256)
def _balanced(sizes: tuple, parts: int) -> tuple[int, ...]:
    return tuple(balance(list(sizes), parts))


def chunks_of(layers, bounds: list[int], pp: int, v: int, s: int) -> list[list]:
    """Pipeline rank ``s``'s ``v`` chunks of ``layers`` cut at ``bounds``: chunk ``c`` is
    stage ``c pp + s`` (the interleaved schedule's round-robin)."""
    return [list(layers[bounds[c * pp + s]: bounds[c * pp + s + 1]]) for c in range(v)]


def stage_layers(shape, pp: int, v: int, s: int) -> list:
    """The layers pipeline rank ``s`` of ``pp`` holds, its ``v`` chunks together."""
    return [x for chunk in chunks_of(shape.layers, cut(shape, pp * v), pp, v, s) for x in chunk]


# ------------------------------------------------------------ how the strategies lay parameters out
class _Stand:
    """A parameter as the trainer's layout functions see one: its shape, bytes and dtype."""

    def __init__(self, name: str, shape: tuple, itemsize: int):
        self.name, self.ndim, self.dtype = name, len(shape), itemsize
        self.size = math.prod(shape)
        self.data = self
        self.nbytes = self.size * itemsize


def optimizer_order(params: dict) -> list[str]:
    """The names in the optimizer's order (:func:`mpitrain.optim.decay_groups`'s groups)."""
    stands = [(n, _Stand(n, s, 4)) for n, s in params.items()]
    return [q.name for group in optim.decay_groups(stands, 0.0) for q in group["params"]]


def buckets(lay, params: dict) -> list[list[str]]:
    """The names in each gradient bucket, as backward completes them (:func:`mpitrain.flat.buckets`
    of the parameters in reverse; ZeRO-2's of one :attr:`Layout.kind` each)."""
    stands = [_Stand(n, s, lay.itemsize) for n, s in params.items()]
    kind = lay.kind if lay.par.sync == "zero2" else None
    return [[q.name for q in group] for group in flat.buckets(reversed(stands), int(lay.par.bucket_mb * 2**20), kind)]


def zero_groups(lay, s: int, r: int) -> list[list[str]]:
    """The names in each range of the flat layout a ZeRO stage cuts into ``dp`` chunks on
    pipeline rank ``s``'s slice ``r``: stage 1 each run of one kind in the optimizer's
    order (:func:`mpitrain.parallel.zero.segments`), stage 2 each bucket in flat order,
    stage 3 each layer's group."""
    key = ("zero groups", s, r)
    if key not in lay.cache:
        params = lay.parameters(s, r)
        if lay.par.sync == "zero1":
            order = [_Stand(n, params[n], lay.itemsize) for n in optimizer_order(params)]
            lay.cache[key] = [[q.name for q in run] for run in parallel.runs(order, lay.kind)]
        elif lay.par.sync == "zero2":
            lay.cache[key] = [list(reversed(g)) for g in buckets(lay, params)]
        else:
            lay.cache[key] = zero3_groups(lay, params, lay.layers(s, r))
    return lay.cache[key]


def held(lay, s: int, r: int, d: int, names) -> int:
    """How many numbers of the gradients of ``names`` data-parallel rank ``d`` holds after
    the replicas' exchange: all of them, or with ZeRO its chunk of each range made of
    them alone (what :attr:`Layout.kind` keeps apart), on pipeline rank ``s``'s slice ``r``."""
    params, names = lay.parameters(s, r), set(names)
    if lay.par.sync not in ("zero1", "zero2", "zero3"):
        return sum(math.prod(params[n]) for n in names)
    total = 0
    for group in zero_groups(lay, s, r):
        if names.issuperset(group):
            total += chunk_length(sum(math.prod(params[n]) for n in group), lay.dp, d)
    return total


def zero3_groups(lay, params: dict, layers: list, units: bool = False) -> list:
    """ZeRO-3's groups of ``params`` (name -> shape) over ``layers``, by the trainer's rule
    (:func:`mpitrain.parallel.zero3.groups`), as names (``units``: each with the first and
    the last of ``layers`` that use it)."""
    stands = {n: _Stand(n, shape, lay.itemsize) for n, shape in params.items()}
    units_params = [[stands[n] for n, _ in layer.params if n in stands] for layer in layers]  # (frozen: none)
    specs = zero3.groups(list(stands.values()), units_params, lay.kind, key=lambda q: q.name)
    return [([q.name for q in names], first, last) if units else [q.name for q in names] for names, first, last in specs]
