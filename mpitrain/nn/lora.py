"""Low-rank adapters (LoRA: Hu et al., "LoRA: Low-Rank Adaptation of Large Language
Models", ICLR 2022), and choosing parameters by name.

A :class:`LoRALinear` is a ``Linear`` whose weight ``W`` (in, out) stays frozen while two
small matrices learn a correction of rank ``r``::

    y = x W + b + ((x A) B) * alpha / r        A: (in, r), B: (r, out)

``A`` starts random (uniform in ``+-1/sqrt(in)``, the reference implementation's
``kaiming_uniform(a=sqrt(5))``, drawn from :func:`mpitrain.rng.generator`) and ``B`` zero,
so an adapted model starts equal to the model it adapts. The layer keeps the ``Linear``'s
parameter names (``weight``, ``bias``) and adds ``lora_A`` and ``lora_B``: a checkpoint of
the plain model loads into the adapted one, the adapters missing (they start fresh).

For inference the adapters are folded into the weight, ``W' = W + A B alpha / r``
(:func:`merged`): one product per layer again, and the plain layers the fused fast paths
run (:meth:`mpitrain.nn.models.Block._fusable`). :func:`merge_state` does the same to a
checkpoint's arrays, for a model without adapters.

The names a pattern chooses (:func:`matching`) are ``fnmatch`` globs on dotted names:
``blocks.*.attn.c_attn`` matches that layer of every block (``*`` crosses dots).
"""

from __future__ import annotations

import contextlib
import math
from fnmatch import fnmatchcase

import numpy as np

from mpitrain import ops
from mpitrain.dtypes import upcast
from mpitrain.nn.layers import Linear, uniform
from mpitrain.nn.module import Module
from mpitrain.tensor import Parameter, get_default_dtype

ADAPTERS = ("lora_A", "lora_B")  # the adapter parameters' names within their layer


def matching(names, patterns) -> tuple[list[str], list[str]]:
    """(the ``names`` some pattern matches, in their order; the ``patterns`` that match none)."""
    names, patterns = list(names), list(patterns)
    hit = [n for n in names if any(fnmatchcase(n, p) for p in patterns)]
    return hit, [p for p in patterns if not any(fnmatchcase(n, p) for n in names)]


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` is a LoRA adapter."""
    return name.rsplit(".", 1)[-1] in ADAPTERS


def scale(rank: int, alpha: float) -> float:
    """The adapters' scale ``alpha / r`` (``alpha`` 0: ``r``, a scale of one, as the paper's
    advice to set alpha to the first rank tried and leave it)."""
    return (alpha or rank) / rank


class LoRALinear(Linear):
    """``linear`` (its own ``weight`` and ``bias`` parameters, kept) with adapters of rank
    ``rank`` scaled by ``alpha / rank``."""

    def __init__(self, linear: Linear, rank: int, alpha: float = 0.0):
        Module.__init__(self)
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.rank, self.scale = rank, scale(rank, alpha)
        self.lora_A = uniform((self.in_features, rank), 1.0 / math.sqrt(self.in_features))  # (in, r)
        self.lora_B = Parameter(np.zeros((rank, self.out_features), dtype=get_default_dtype()))  # (r, out)

    def forward(self, x):
        y = ops.linear(x, self.weight, self.bias)  # (..., out)
        h = ops.linear(x, self.lora_A) * self.scale  # (..., r): the scale on the narrow side
        return y + ops.linear(h, self.lora_B)

    def merged_weight(self) -> np.ndarray:
        """``W + A B scale``, computed in float32 (at least) and rounded to ``W``'s dtype."""
        return merge(self.weight.data, self.lora_A.data, self.lora_B.data, self.scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora rank={self.rank}, scale={self.scale:g}"


def merge(w: np.ndarray, a: np.ndarray, b: np.ndarray, s: float) -> np.ndarray:
    """``w + a b s`` in ``w``'s dtype (a 16-bit ``w`` summed in float32, rounded once)."""
    w32 = upcast(w)
    out = w32 + (upcast(a) @ upcast(b)) * np.asarray(s, dtype=w32.dtype)  # (in, out)
    return out.astype(w.dtype)


def adapt(model: Module, patterns, rank: int, alpha: float = 0.0) -> list[str]:
    """Replace each ``Linear`` of ``model`` whose module name a pattern matches by a
    :class:`LoRALinear`, in place; returns the adapted layers' names. Raises ValueError
    naming a pattern that matches no ``Linear`` (and the ``Linear`` layers there are)."""
    linears = {n: where for n, where in _children(model) if type(where[0]._modules[where[1]]) is Linear}
    chosen, unmatched = matching(linears, patterns)
    if unmatched:
        raise ValueError(f"{unmatched[0]!r} matches no Linear layer; the model's are {_brief(list(linears))}")
    for name in chosen:
        parent, attr = linears[name]
        setattr(parent, attr, LoRALinear(getattr(parent, attr), rank, alpha))
    return chosen


def _children(model: Module, prefix: str = ""):
    """(dotted name, (parent, attribute)) of every module below ``model``, depth first (a
    module registered under a dotted key, as a pipeline stage registers its layers, too)."""
    for attr, child in model._modules.items():
        name = f"{prefix}.{attr}" if prefix else attr
        yield name, (model, attr)
        yield from _children(child, name)


def _brief(names: list[str], shown: int = 6) -> str:
    """A few of ``names``, and how many there are."""
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


@contextlib.contextmanager
def merged(model: Module):
    """Inside, every :class:`LoRALinear` of ``model`` is a plain ``Linear`` whose weight is
    ``W + A B scale`` (a new array: ``W`` and the adapters are untouched); on the way out
    the adapted layers are back. For evaluation and sampling, which train nothing."""
    swapped = []
    for _, (parent, attr) in list(_children(model)):
        m = parent._modules[attr]
        if isinstance(m, LoRALinear):
            plain = Linear.of(m.merged_weight(), None if m.bias is None else m.bias.data)
            plain.train(m.training)
            setattr(parent, attr, plain)
            swapped.append((parent, attr, m))
    try:
        yield model
    finally:
        for parent, attr, m in swapped:
            setattr(parent, attr, m)


def merge_state(arrays: dict, s: float) -> dict:
    """A state dict's adapters folded into their layers' weights (``X.weight + X.lora_A
    X.lora_B s``) and dropped: the arrays of the same model without adapters."""
    out = {n: a for n, a in arrays.items() if not is_adapter(n)}
    for name in arrays:
        if name.endswith(".lora_A"):
            layer = name[: -len(".lora_A")]
            out[f"{layer}.weight"] = merge(np.asarray(arrays[f"{layer}.weight"]), np.asarray(arrays[name]),
                                           np.asarray(arrays[f"{layer}.lora_B"]), s)
    return out
