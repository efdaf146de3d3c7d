"""Layers: thin modules that own parameters and call one fused op each.

Initialisation follows PyTorch's defaults unless a model overrides it: weights and biases
of ``Linear`` and ``Conv2d`` uniform in ``+-1/sqrt(fan_in)``, normalisation scales one
and shifts zero, embeddings standard normal; a seed fixes them all (:mod:`mpitrain.rng`).
"""

from __future__ import annotations

import math

import numpy as np

from mpitrain import ops, rng
from mpitrain.nn.module import Module
from mpitrain.tensor import Parameter, get_default_dtype


def uniform(shape, bound: float) -> Parameter:
    return Parameter(rng.generator().uniform(-bound, bound, shape).astype(get_default_dtype()))


def normal(shape, std: float) -> Parameter:
    return Parameter((rng.generator().standard_normal(shape) * std).astype(get_default_dtype()))


def full(shape, value: float) -> Parameter:
    return Parameter(np.full(shape, value, dtype=get_default_dtype()))


class Linear(Module):
    """``y = x @ weight + bias`` with ``weight`` of shape (in_features, out_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        bound = 1.0 / math.sqrt(in_features)
        self.weight = uniform((in_features, out_features), bound)
        self.bias = uniform((out_features,), bound) if bias else None

    @classmethod
    def of(cls, weight: np.ndarray, bias: np.ndarray | None = None) -> "Linear":
        """A ``Linear`` holding ``weight`` (in, out) and ``bias`` (no random numbers drawn)."""
        layer = cls.__new__(cls)
        Module.__init__(layer)
        layer.in_features, layer.out_features = weight.shape
        layer.weight, layer.bias = Parameter(weight), None if bias is None else Parameter(bias)
        return layer

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Conv2d(Module):
    """Channels-last convolution: input (B, H, W, C_in), weight (kh, kw, C_in, C_out).
    ``relu=True`` fuses a following ReLU into the same op (one array less per layer)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 bias: bool = True, relu: bool = False):
        super().__init__()
        kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
        self.in_channels, self.out_channels = in_channels, out_channels
        self.stride, self.padding, self.relu = stride, padding, relu
        bound = 1.0 / math.sqrt(in_channels * kh * kw)
        self.weight = uniform((kh, kw, in_channels, out_channels), bound)
        self.bias = uniform((out_channels,), bound) if bias else None

    def forward(self, x):
        return ops.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.relu)

    def extra_repr(self) -> str:
        kh, kw = self.weight.shape[:2]
        return (f"{self.in_channels}, {self.out_channels}, kernel=({kh}, {kw}), "
                f"stride={self.stride}, padding={self.padding}" + (", relu" if self.relu else ""))


class BatchNorm2d(Module):
    """Batch normalisation over (B, H, W) per channel of channels-last input (also
    accepts (B, C)). Running statistics are buffers, updated in training mode."""

    def __init__(self, num_features: int, momentum: float = 0.1, eps: float = 1e-5):
        super().__init__()
        self.num_features, self.momentum, self.eps = num_features, momentum, eps
        self.weight = full((num_features,), 1.0)
        self.bias = full((num_features,), 0.0)
        self.register_buffer("running_mean", np.zeros(num_features, dtype=get_default_dtype()))
        self.register_buffer("running_var", np.ones(num_features, dtype=get_default_dtype()))

    def forward(self, x):
        return ops.batch_norm(x, self.weight, self.bias, self.running_mean, self.running_var,
                              self.training, self.momentum, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, momentum={self.momentum}, eps={self.eps}"


class LayerNorm(Module):
    def __init__(self, num_features: int, bias: bool = True, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = full((num_features,), 1.0)
        self.bias = full((num_features,), 0.0) if bias else None

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, bias={self.bias is not None}"


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = normal((num_embeddings, embedding_dim), 1.0)

    def forward(self, ids):
        return ops.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


class Dropout(Module):
    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x):
        return ops.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class _Pool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def extra_repr(self) -> str:
        return f"kernel={self.kernel_size}, stride={self.stride or self.kernel_size}, padding={self.padding}"


class MaxPool2d(_Pool2d):
    """``relu=True`` fuses a ReLU, equal to one before the pool (they commute) at a quarter of the cost."""

    def __init__(self, kernel_size, stride=None, padding=0, relu: bool = False):
        super().__init__(kernel_size, stride, padding)
        self.relu = relu

    def forward(self, x):
        return ops.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.relu)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", relu" if self.relu else "")


class AvgPool2d(_Pool2d):
    def forward(self, x):
        return ops.avg_pool2d(x, self.kernel_size, self.stride, self.padding)


class GlobalAvgPool(Module):
    """(B, H, W, C) -> (B, C): the mean over all pixels."""

    def forward(self, x):
        return ops.mean(x, axis=(1, 2))


class ReLU(Module):
    def forward(self, x):
        return ops.relu(x)


class GELU(Module):
    def __init__(self, form: str = "tanh"):
        super().__init__()
        self.form = form  # "tanh" or "erf" (see ops.gelu)

    def forward(self, x):
        return ops.gelu(x, self.form)


class Flatten(Module):
    """(B, ...) -> (B, prod(...))."""

    def forward(self, x):
        return ops.reshape(x, (x.shape[0], -1))
