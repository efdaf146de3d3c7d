"""Differentiable operations on :class:`~mpitrain.tensor.Tensor`.

Every operation is a :class:`~mpitrain.tensor.Function` with a hand-written, vectorised
backward pass, grouped by kind:

* ``elementwise``: add, sub, mul, div, neg, pow, exp, log, tanh, sigmoid, relu, gelu
* ``reduce``: sum, mean, max over axes
* ``shape``: reshape, transpose, getitem, concat, split
* ``linalg``: matmul (batched), linear (fused x @ W + b)
* ``conv``: conv2d, max_pool2d, avg_pool2d on channels-last images
* ``norm``: batch_norm, layer_norm
* ``loss``: softmax, log_softmax, cross_entropy (fused, with ignore_index)
* ``attention``: causal_self_attention (fused multi-head attention)
* ``embedding``: embedding lookup, dropout
* ``transformer``: attention_sublayer, mlp_sublayer (a pre-norm transformer block's two
  halves, each one node)

Some ideas have a plain version, the text to learn from, and a fast one beside it,
tested equal to it; ``fast_paths`` / ``set_fast_paths`` choose between them for the
whole process (the fast ones by default, see ``_util.set_fast_paths``).
"""

from mpitrain.ops._util import fast_paths, fast_paths_enabled, set_fast_paths
from mpitrain.ops.attention import causal_self_attention
from mpitrain.ops.conv import avg_pool2d, conv2d, max_pool2d
from mpitrain.ops.elementwise import add, div, exp, gelu, log, mul, neg, pow, relu, sigmoid, sub, tanh
from mpitrain.ops.embedding import dropout, embedding
from mpitrain.ops.linalg import linear, matmul
from mpitrain.ops.loss import cross_entropy, log_softmax, softmax
from mpitrain.ops.norm import batch_norm, layer_norm
from mpitrain.ops.reduce import max, mean, sum
from mpitrain.ops.shape import concat, getitem, reshape, split, transpose
from mpitrain.ops.transformer import attention_sublayer, mlp_sublayer

__all__ = [
    "add", "attention_sublayer", "avg_pool2d", "batch_norm", "causal_self_attention", "concat",
    "conv2d", "cross_entropy", "div", "dropout", "embedding", "exp", "fast_paths",
    "fast_paths_enabled", "gelu", "getitem", "layer_norm", "linear", "log", "log_softmax",
    "matmul", "max", "max_pool2d", "mean", "mlp_sublayer", "mul", "neg", "pow", "relu",
    "reshape", "set_fast_paths", "sigmoid", "softmax", "split", "sub", "sum", "tanh", "transpose",
]
