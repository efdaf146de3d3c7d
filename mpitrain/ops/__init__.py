"""Differentiable operations on :class:`~mpitrain.tensor.Tensor`, one module per kind
(the imports below name each one's), every one a :class:`~mpitrain.tensor.Function`
with a hand-written, vectorised backward pass.

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

__all__ = ["add", "attention_sublayer", "avg_pool2d", "batch_norm", "causal_self_attention", "concat", "conv2d",
           "cross_entropy", "div", "dropout", "embedding", "exp", "fast_paths", "fast_paths_enabled", "gelu", "getitem",
           "layer_norm", "linear", "log", "log_softmax", "matmul", "max", "max_pool2d", "mean", "mlp_sublayer", "mul",
           "neg", "pow", "relu", "reshape", "set_fast_paths", "sigmoid", "softmax", "split", "sub", "sum", "tanh",
           "transpose"]
