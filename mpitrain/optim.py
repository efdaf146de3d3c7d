"""Optimizers, learning-rate schedules and gradient clipping.

Each optimizer updates parameters in place from their ``.grad``, every step in in-place
NumPy operations (no temporaries the size of the model). Its state is plain arrays keyed
by the parameter's position in the list it was given (``state_dict``, ``load_state_dict``),
so a checkpoint can store them and ZeRO can give each rank a slice of them.

Semantics follow PyTorch: ``SGD`` (momentum with dampening, Nesterov, L2 weight decay
added to the gradient), ``Adam`` (Kingma & Ba 2015; L2 weight decay added to the
gradient) and ``AdamW`` (Loshchilov & Hutter 2019; decoupled decay ``p -= lr * wd * p``).
"""

from __future__ import annotations

import copy
import math

import numpy as np

from mpitrain.dtypes import upcast
from mpitrain.tensor import Tensor


class Optimizer:
    """Base class: parameter groups with their own hyperparameters, and per-parameter state.
    ``params`` is a list of parameters or of groups ``{"params": [...], "lr": ...}``, whose
    keys override the optimizer's defaults."""

    def __init__(self, params, defaults: dict):
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[int, dict[str, np.ndarray]] = {}
        self.step_count = 0

    def _indexed(self):
        """(index, parameter, group) for every parameter; the index keys its state."""
        pairs = ((p, group) for group in self.param_groups for p in group["params"])
        return ((i, p, group) for i, (p, group) in enumerate(pairs))

    def zero_grad(self) -> None:
        for _, p, _ in self._indexed():
            p.zero_grad()

    def set_lr(self, lr: float) -> None:
        """Set every group's learning rate (schedules call this once per step)."""
        for group in self.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.step_with(lambda i, p: p.grad)

    def step_with(self, grad_of) -> None:
        """One step in which ``grad_of(i, p)`` gives parameter ``i``'s (``p``'s) gradient (None:
        leave it as it is) just before its update, so one array may serve them all
        (:class:`mpitrain.precision.MixedPrecision` unscales into one float32 work array)."""
        self.step_count += 1
        for i, p, group in self._indexed():
            g = grad_of(i, p)
            if g is not None:
                self._update(p.data, g, self.state.setdefault(i, {}), group)

    def _update(self, p: np.ndarray, g: np.ndarray, state: dict, group: dict) -> None:  # pragma: no cover
        raise NotImplementedError

    def over(self, views) -> Optimizer:
        """This optimizer (its class and hyperparameters) over other arrays, with fresh state:
        ``views(p)`` gives, for each parameter ``p`` in order, the ``(data, grad)`` arrays to
        update in its place (views into a strategy's flat buffers, never copies), or None to
        leave ``p`` out; a third element, where the piece starts in ``p``, is for mixed
        precision (:meth:`mpitrain.precision.MixedPrecision.over`, which copies its master's
        piece from there). ZeRO and the parameter servers update their shards this way."""
        other = copy.copy(self)
        other.state, other.param_groups = {}, []
        other.__dict__.pop("_buffer", None)  # the work array is sized for these parameters
        for group in self.param_groups:
            params = []
            for p in group["params"]:
                arrays = views(p)
                if arrays is not None:
                    piece = Tensor(arrays[0], requires_grad=True)  # wraps the view itself
                    piece.grad = arrays[1]
                    params.append(piece)
            other.param_groups.append({**group, "params": params})
        return other

    def _scratch(self, like: np.ndarray) -> np.ndarray:
        """A reusable work array shaped like ``like``: one buffer for all parameters, so an update allocates nothing."""
        buf = getattr(self, "_buffer", None)
        if buf is None or buf.size < like.size or buf.dtype != like.dtype:
            buf = self._buffer = np.empty(max(like.size, 0 if buf is None else buf.size), like.dtype)
        return buf[: like.size].reshape(like.shape)

    def memory(self) -> dict:
        """Bytes of optimizer state (``optim_bytes``) and of the reusable work array
        (``work_bytes``): the optimizer's part of :func:`mpitrain.observe.memory.model_state`."""
        state = sum(v.nbytes for s in self.state.values() for v in s.values() if isinstance(v, np.ndarray))
        work = getattr(self, "_buffer", None)
        return {"optim_bytes": state, "work_bytes": 0 if work is None else work.nbytes}

    def state_dict(self) -> dict:
        return {
            "step": self.step_count,
            "state": {i: {k: v.copy() for k, v in s.items()} for i, s in self.state.items()},
            "groups": [{**{k: v for k, v in g.items() if k != "params"}, "size": len(g["params"])}
                       for g in self.param_groups],
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["groups"]) != len(self.param_groups):
            raise ValueError(f"state has {len(state['groups'])} parameter groups, optimizer has "
                             f"{len(self.param_groups)}")
        for n, (saved, group) in enumerate(zip(state["groups"], self.param_groups)):
            if "size" in saved and saved["size"] != len(group["params"]):
                raise ValueError(f"parameter group {n}: state has {saved['size']} parameters, "
                                 f"optimizer has {len(group['params'])}")
        shapes = {i: p.shape for i, p, _ in self._indexed()}
        for i, s in state["state"].items():
            i = int(i)
            if i not in shapes:
                raise ValueError(f"optimizer state for parameter {i}, but there are {len(shapes)}")
            for k, v in s.items():
                if k != "step" and np.shape(v) != shapes[i]:
                    raise ValueError(f"optimizer state {i}.{k}: shape {np.shape(v)}, parameter {shapes[i]}")
        self.step_count = int(state["step"])
        self.state = {int(i): {k: np.array(v, copy=True) for k, v in s.items()} for i, s in state["state"].items()}
        for group, saved in zip(self.param_groups, state["groups"]):
            group.update({k: v for k, v in saved.items() if k != "size"})


class SGD(Optimizer):
    def __init__(self, params, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening = 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      nesterov=nesterov, weight_decay=weight_decay))

    def _update(self, p, g, state, group):
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        if wd:
            g = g + wd * p
        if mu:
            buf = state.get("momentum")
            if buf is None:
                buf = state["momentum"] = np.array(g, copy=True)
            else:
                buf *= mu
                buf += (1 - group["dampening"]) * g
            g = g + mu * buf if group["nesterov"] else buf
        p -= lr * g


class Adam(Optimizer):
    decoupled = False

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _update(self, p, g, state, group):
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if not state:
            state.update(exp_avg=np.zeros_like(p), exp_avg_sq=np.zeros_like(p), step=np.zeros((), dtype=np.int64))
        state["step"] += 1
        t = int(state["step"])
        if wd and self.decoupled:
            p *= 1 - lr * wd
        elif wd:
            g = g + wd * p
        m, v = state["exp_avg"], state["exp_avg_sq"]
        tmp = self._scratch(p)
        np.multiply(g, 1 - b1, out=tmp)
        m *= b1
        m += tmp  # first moment
        np.multiply(g, g, out=tmp)
        tmp *= 1 - b2
        v *= b2
        v += tmp  # second moment
        # p -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)
        np.sqrt(v, out=tmp)
        tmp *= 1 / math.sqrt(1 - b2**t)
        tmp += eps
        np.divide(m, tmp, out=tmp)
        tmp *= lr / (1 - b1**t)
        p -= tmp


class AdamW(Adam):
    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(params, lr, betas, eps, weight_decay)


def decay_groups(named_params, weight_decay: float) -> list[dict]:
    """Two groups, the split nanoGPT and most transformer recipes use: matrices (weights,
    embeddings) decay, vectors (biases, norm scales) don't."""
    decay, no_decay = [], []
    for _, p in named_params:
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def clip_grad_norm(params, max_norm: float) -> float:
    """Scale all gradients together so their global L2 norm (:func:`sum_of_squares`) is at
    most ``max_norm``; returns the norm before clipping. A non-finite norm (an overflowed
    or NaN gradient) is returned and the gradients are left as they are, for the caller."""
    grads = [p.grad for p in params if p.grad is not None]
    total = math.sqrt(sum_of_squares(grads))
    scale_to(grads, total, max_norm)
    return total


def sum_of_squares(grads) -> float:
    """The sum of the squares of the arrays' elements, each array's a BLAS dot product, added in float64 in
    order (a strategy holding part of the model sums its part, then adds the parts over ranks)."""
    return sum(float(np.dot(v, v)) for v in (upcast(g).reshape(-1) for g in grads))


def scale_to(grads, norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place from their global norm ``norm`` to ``max_norm`` if larger (and finite)."""
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g *= scale


def update(optimizer: Optimizer, params, lr: float | None, grad_clip: float = 0.0, norm: float | None = None) -> None:
    """One optimizer step after backward: the gradients of ``params`` clipped together to
    global norm ``grad_clip`` (0: no clipping; the norm sums in ``params``' order, unless
    ``norm`` gives it: a whole model's, of which ``params`` are a part), the learning rate
    set to ``lr`` (None: as it is), then the update. A mixed-precision optimizer clips
    itself: the norm to clip is that of its unscaled gradients."""
    if lr is not None:
        optimizer.set_lr(lr)
    if getattr(optimizer, "unscales", False):
        optimizer.step(grad_clip, norm)
        return
    if grad_clip > 0:
        if norm is None:
            clip_grad_norm(params, grad_clip)
        else:
            scale_to([p.grad for p in params if p.grad is not None], norm, grad_clip)
    optimizer.step()


class WarmupCosine:
    """Learning rate at a step (the schedule of GPT-3 and nanoGPT): linear warmup to ``lr``
    from lr / (warmup + 1), never 0, so step 0 already moves the weights; cosine decay to
    ``min_lr`` at ``decay_steps``, then ``min_lr``."""

    def __init__(self, lr: float, warmup_steps: int, decay_steps: int, min_lr: float = 0.0):
        if warmup_steps < 0 or decay_steps < warmup_steps:
            raise ValueError(f"need 0 <= warmup_steps ({warmup_steps}) <= decay_steps ({decay_steps})")
        self.lr, self.warmup, self.decay, self.min_lr = lr, warmup_steps, decay_steps, min_lr

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / (self.warmup + 1)
        if step >= self.decay:
            return self.min_lr
        progress = (step - self.warmup) / max(1, self.decay - self.warmup)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)


class Constant(WarmupCosine):
    """A constant learning rate, with optional linear warmup: no decay, ``min_lr = lr``."""

    def __init__(self, lr: float, warmup_steps: int = 0):
        super().__init__(lr, warmup_steps, warmup_steps, min_lr=lr)


__all__ = ["SGD", "Adam", "AdamW", "Constant", "Optimizer", "WarmupCosine", "clip_grad_norm", "decay_groups",
           "scale_to", "sum_of_squares", "update"]
