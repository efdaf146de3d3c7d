"""Mixed precision: half-precision weights and gradients, float32 master weights, a loss scale.

Micikevicius et al., "Mixed Precision Training" (ICLR 2018); the bytes are the ZeRO
paper's (Rajbhandari et al., SC 2020). With Adam, per parameter: the model holds a
half-precision **working copy** (``bf16`` or ``fp16``, 2 B) and its half ``.grad`` (2 B);
the optimizer keeps the float32 **master** weight and Adam's two moments (4 + 8 B). That
is 16 bytes, as in float32 training with Adam (4 + 4 + 8); what halves is what moves
and what a layer reads: the weights, the gradients and their exchange.

**Products in float32.** Every op reads a half-precision tensor upcast to float32
(:meth:`mpitrain.tensor.Function.apply`): NumPy's half-precision arithmetic is slow or
silently float32 (``mpitrain/bench/README.md``), so half precision is a storage and wire
format, as on hardware whose half products accumulate in float32. An upcast copy lives
while the op's backward needs it, like an activation: up to 4 B more per parameter.

**Gradients.** Each op's float32 gradient is rounded once as it is added into the half
``.grad`` (once per micro-batch with gradient accumulation). Data parallelism's buckets
are then half-precision arrays: the ring sends 16-bit words and adds in float32 at each
hop (:mod:`mpitrain.comm.ring`); MPI cannot add bfloat16, so ``parallel.allreduce = "mpi"``
sums each bucket as a float32 copy rounded back: the same arithmetic, twice the bytes.

**The loss scale** (fp16). float16's smallest normal number is 6.1e-5 and its smallest
subnormal 6e-8: most of a small model's gradients would round to zero. The loss is
multiplied by ``S`` before backward (:class:`LossScaler`), so every gradient is ``S``
times larger; the update divides by ``S`` in float32, never in half precision, where the
small gradients would vanish again. A gradient that overflows (inf or NaN anywhere, on
any rank) skips the step on every rank, agreed in the training loop's allreduce of the
step's loss, and halves ``S``; after ``growth_interval`` clean steps ``S`` doubles.
bfloat16 has float32's range: no scale (``S = 1``); a non-finite gradient still skips.

**The update** (:meth:`MixedPrecision.step`): each parameter's unscaled float32 gradient
``fp32(g) x c/S`` in one reused work array (``c``: the clipping factor, from the unscaled
gradients' norm), the optimizer's update of the master, the master rounded (to nearest
even) into the working copy. **Checkpoints** hold the float32 masters and the loss scale
(:meth:`MixedPrecision.masters_in_model`): a run resumes exactly, in any precision.
"""

from __future__ import annotations

import contextlib
import copy
import math

import numpy as np

from mpitrain.dtypes import dtype_of
from mpitrain.optim import sum_of_squares
from mpitrain.tensor import Tensor


class LossScaler:
    """The loss scale ``S`` (module docstring): ``update(overflow)`` after each step halves or
    doubles it, with PyTorch's ``GradScaler`` defaults; not ``dynamic``, it stays (bf16: 1)."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000, dynamic: bool = True):
        if not scale > 0 or growth_interval < 1:
            raise ValueError(f"need scale > 0 and growth_interval >= 1, got {scale} and {growth_interval}")
        self.scale, self.growth_interval, self.dynamic = float(scale), growth_interval, dynamic
        self.clean = 0  # steps since the last overflow or growth
        self.skipped = 0  # steps skipped for an overflow

    def update(self, overflow: bool) -> None:
        self.skipped += 1 if overflow else 0
        self.clean = 0 if overflow else self.clean + 1
        if self.dynamic and overflow:
            self.scale /= 2
        elif self.dynamic and self.clean == self.growth_interval:
            self.scale *= 2
            self.clean = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean": self.clean, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean, self.skipped = float(state["scale"]), int(state["clean"]), int(state["skipped"])


def scaler_for(precision: str) -> LossScaler:
    """fp16: a dynamic scale from 2^16; bf16 and fp32: a fixed scale of 1."""
    return LossScaler() if precision == "fp16" else LossScaler(1.0, dynamic=False)


class MixedPrecision:
    """``optimizer``'s parameters turned into half-precision working copies, and the
    optimizer itself over float32 master copies of them (see the module's docstring).

    Use (the trainer does this for ``train.precision``)::

        opt = MixedPrecision(AdamW(model.parameters(), ...), "bf16")   # the model is now half
        loss = loss_fn(model, x, y) * opt.scaler.scale
        loss.backward()
        overflow = opt.check()      # any rank's True skips every rank's step (agree on it)
        if not overflow:
            opt.step(grad_clip)
        opt.scaler.update(overflow); opt.zero_grad()

    It answers what syncs and checkpoints ask of an optimizer (``set_lr``, ``zero_grad``,
    ``state``, ``param_groups``, ``step_count``, ``memory``): its state is the masters'
    optimizer's, parameter for parameter as the float32 optimizer's would be."""

    unscales = True  # optim.update hands it the clipping: the norm is the unscaled gradients'

    def __init__(self, optimizer, precision: str, scaler: LossScaler | None = None):
        self.dtype = dtype_of(precision)
        if self.dtype is None:
            raise ValueError("MixedPrecision needs bf16 or fp16; float32 training needs no wrapper")
        self.precision, self.scaler = precision, scaler or scaler_for(precision)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        if any(p.dtype != np.float32 for p in self.params):
            raise ValueError(f"mixed precision starts from float32 parameters, got "
                             f"{sorted({str(p.dtype) for p in self.params})}")
        self._masters = {id(p): np.ascontiguousarray(p.data) for p in self.params}
        self.inner = optimizer.over(lambda p: (self._masters[id(p)], None))
        for p in self.params:
            p.data = p.data.astype(self.dtype)  # the working copy, rounded to nearest even
            p.grad = None if p.grad is None else p.grad.astype(self.dtype)
        self._work = None  # one float32 array, as large as the largest parameter: its unscaled gradient
        self.norm = None  # the unscaled gradients' norm, from check()
        self.handed = False  # the masters went to a shard's optimizer (over)

    def describe(self) -> str:
        scale = (f"loss scale 2^{math.log2(self.scaler.scale):g}, dynamic" if self.scaler.dynamic
                 else "no loss scale")
        return (f"mixed precision {self.precision}: {self.precision} weights and gradients, float32 master weights "
                f"and optimizer state, products in float32; {scale}")

    @property
    def masters(self) -> list[np.ndarray]:
        """The float32 master weights, in the parameters' order (none once handed to shards)."""
        return [] if self.handed else [self._masters[id(p)] for p in self.params]

    # -------------------------------------------------------------- a step
    def check(self) -> bool:
        """After the gradients of a step are complete: whether any of this rank's is not
        finite (an overflow); keeps the unscaled norm for clipping."""
        self.norm = math.sqrt(sum_of_squares(p.grad for p in self.params if p.grad is not None)) / self.scaler.scale
        return not math.isfinite(self.norm)

    def step(self, grad_clip: float = 0.0, norm: float | None = None) -> None:
        """Update the masters with the unscaled gradients, clipped to global norm
        ``grad_clip`` (0: not clipped), and round them into the working copies. ``norm``:
        the whole gradient's norm as the ranks hold it (scaled), when a sync summed it over
        more than this optimizer's parameters (ZeRO's shards, a model's parts); None:
        these parameters' own, from :meth:`check`."""
        if norm is not None:
            self.norm = norm / self.scaler.scale
        elif self.norm is None:
            self.check()
        norm, self.norm = self.norm, None
        if not math.isfinite(norm):
            raise FloatingPointError(f"gradient norm is {norm}: skip the step (check() said so) instead")
        factor = 1.0 / self.scaler.scale
        if grad_clip > 0 and norm > grad_clip:
            factor *= grad_clip / (norm + 1e-6)  # as optim.scale_to does for float32 gradients

        def unscaled(i, master):
            g = self.params[i].grad
            if g is None:
                return None
            if self._work is None or self._work.size < g.size:
                self._work = np.empty(max(q.size for q in self.params), np.float32)
            out = self._work[: g.size].reshape(g.shape)
            np.copyto(out, g)
            out *= factor
            return out
        self.inner.step_with(unscaled)
        for p in self.params:
            np.copyto(p.data, self._masters[id(p)], casting="same_kind")

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    # --------------------------------------------------- as an optimizer: the masters' optimizer's
    state = property(lambda self: self.inner.state, lambda self, value: setattr(self.inner, "state", value))
    param_groups = property(lambda self: self.inner.param_groups)
    step_count = property(lambda self: self.inner.step_count,
                          lambda self, value: setattr(self.inner, "step_count", value))

    def over(self, views):
        """This mixed precision over pieces of the parameters (a ZeRO shard, as
        :meth:`mpitrain.optim.Optimizer.over`): ``views(p)`` gives ``(data, grad, at)``,
        the working copy's and the gradient's piece (16-bit views into a strategy's flat
        buffers) and where it starts in ``p``, or None. Each piece's float32 master is
        copied from this optimizer's, whose whole masters are then dropped: the shards
        hold them (the sync's ``whole_model(masters=True)`` gathers them for a checkpoint). The two
        share the loss scale."""
        other = copy.copy(self)
        other.params, other._masters, other._work, other.norm, other.handed = [], {}, None, None, False
        trained = iter(self.params)  # the inner optimizer's parameters are these ones' masters, in order

        def master_piece(_master):
            p = next(trained)
            arrays = views(p)
            if arrays is None:
                return None
            data, grad, at = arrays
            piece = Tensor(data, requires_grad=True)  # wraps the 16-bit view itself
            piece.grad = grad
            other.params.append(piece)
            other._masters[id(piece)] = self._masters[id(p)].reshape(-1)[at : at + data.size].copy()  # (n,)
            return other._masters[id(piece)], None

        other.inner = self.inner.over(master_piece)
        working = iter(self.params)  # this one's groups now list the working copies: no float32 array is kept
        self.inner.param_groups = [{**g, "params": [next(working) for _ in g["params"]]} for g in self.inner.param_groups]
        self._masters, self.handed = {}, True
        return other

    def memory(self) -> dict:
        """Bytes of optimizer state, the masters included, and of the work arrays."""
        inner = self.inner.memory()
        return {"optim_bytes": inner["optim_bytes"] + sum(m.nbytes for m in self._masters.values()),
                "work_bytes": inner["work_bytes"] + (0 if self._work is None else self._work.nbytes)}

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.scaler.load_state_dict(state.pop("scaler"))
        self.inner.load_state_dict(state)

    @contextlib.contextmanager
    def masters_in_model(self):
        """The float32 masters in the parameters' ``.data`` (checkpoints save and load
        them there); on the way out the working copies are rounded from them."""
        if self.handed:
            raise RuntimeError("these masters are a sharded optimizer's: the sync's whole_model(masters=True) "
                               "gathers them")
        halves = [p.data for p in self.params]
        for p in self.params:
            p.data = self._masters[id(p)]
        try:
            yield
        finally:
            for p, half in zip(self.params, halves):
                np.copyto(half, p.data, casting="same_kind")
                p.data = half



