"""The number formats of parameters, gradients and messages: ``fp32``, ``bf16``, ``fp16``.

Arrays only (no tensors, no MPI), so the base layers and ``comm`` share one table:
mixed precision (:mod:`mpitrain.precision`) stores weights and gradients in a half
format, and the ring (:mod:`mpitrain.comm.ring`) sends them in one. ``bf16`` is
``ml_dtypes``' bfloat16 (the JAX team's package), NumPy has none of its own.
"""

from __future__ import annotations

import numpy as np

FORMATS = ("fp32", "bf16", "fp16")


def dtype_of(name: str):
    """The dtype of a format's name; None for fp32 (float32 as it is)."""
    if name not in FORMATS:
        raise ValueError(f"a number format must be one of {FORMATS}, got {name!r}")
    if name == "bf16":
        import ml_dtypes  # imported on first use: a float32 run never needs it
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16) if name == "fp16" else None


def is_half(dtype) -> bool:
    """Whether ``dtype`` is a 16-bit float: float16, or bfloat16."""
    dtype = np.dtype(dtype)
    return dtype.itemsize == 2 and (dtype.kind == "f" or dtype.name == "bfloat16")


def upcast(x: np.ndarray) -> np.ndarray:
    """A half-precision array as float32 (NumPy's half products are slow or silently
    float32, and a dot product in bfloat16 sums in bfloat16); any other as it is."""
    return x.astype(np.float32) if is_half(x.dtype) else x
