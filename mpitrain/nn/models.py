"""Models: LeNet-style and ResNet-style CNNs for channels-last images, and a GPT decoder.

The GPT is an explicit list of parts, ``model.layers() == [embed, *blocks, head]``,
so a pipeline can cut it between any two of them and tensor slicing can replace the
``Linear`` layers inside a block, without changing this file: a block whose layers were
swapped runs nanoGPT's plain two lines, not the fused fast path (see :class:`Block`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpitrain import ops, rng
from mpitrain.nn.checkpoint import checkpointed
from mpitrain.nn.layers import (BatchNorm2d, Conv2d, Dropout, Embedding, Flatten, GlobalAvgPool, LayerNorm, Linear,
                                 MaxPool2d, ReLU)
from mpitrain.nn.module import Module, ModuleList, Sequential
from mpitrain.tensor import Parameter, no_grad


# ---------------------------------------------------------------------------- CNNs
def run_layers(model: Module, x):
    """``x`` through ``model.named_layers()`` in order, each layer inside its own dropout streams
    (:func:`mpitrain.rng.layer`), so that a pipeline stage running some of them draws the masks they draw here."""
    for i, (_, layer) in enumerate(model.named_layers()):
        with rng.layer(i):
            x = layer(x)
    return x


class LeNet(Sequential):
    """LeNet-5's shape (LeCun et al. 1998) with ReLU and max-pooling:
    [conv5x5 + ReLU -> maxpool2] x 2 -> linear -> ReLU -> dropout -> linear.
    Each ReLU before a pool runs after it, inside the pool op (the same function)."""

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10,
                 channels: tuple = (16, 32), hidden: int = 128, dropout: float = 0.0):
        c1, c2 = channels
        side = image_size // 4
        super().__init__(
            Conv2d(in_channels, c1, 5, padding=2), MaxPool2d(2, relu=True),
            Conv2d(c1, c2, 5, padding=2), MaxPool2d(2, relu=True),
            Flatten(), Linear(c2 * side * side, hidden), ReLU(), Dropout(dropout),
            Linear(hidden, num_classes),
        )

    def forward(self, x):
        return run_layers(self, x)


class ConvNet(Sequential):
    """Plain CNN: 3x3 same-padded convolutions with ReLU, one 2x2 max-pool, a linear
    classifier. ``channels=(16, 32)`` is the benchmark model of ``mpitrain bench step``.
    The last convolution's ReLU runs after the pool, inside the pool op (the same function)."""

    def __init__(self, in_channels: int = 3, image_size: int = 32, num_classes: int = 10, channels: tuple = (16, 32)):
        ins = (in_channels, *channels[:-1])
        convs = [Conv2d(c, width, 3, padding=1, relu=n < len(channels))
                 for n, (c, width) in enumerate(zip(ins, channels), 1)]
        side = image_size // 2
        super().__init__(*convs, MaxPool2d(2, relu=True), Flatten(), Linear(channels[-1] * side * side, num_classes))

    def forward(self, x):
        return run_layers(self, x)


class BasicBlock(Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = BatchNorm2d(c_out)
        self.conv2 = Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = BatchNorm2d(c_out)
        self.shortcut = (Sequential(Conv2d(c_in, c_out, 1, stride=stride, bias=False), BatchNorm2d(c_out))
                         if stride != 1 or c_in != c_out else None)

    def forward(self, x):
        h = ops.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return ops.relu(h + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(Module):
    """CIFAR-style ResNet (He et al. 2016): a 3x3 stem, stages of ``blocks`` basic blocks
    at widths ``widths`` (stride 2 between stages), global average pool, linear.
    ``blocks=1`` is ResNet-8, ``blocks=3`` ResNet-20."""

    def __init__(self, in_channels: int = 3, image_size: int = 32, num_classes: int = 10,
                 widths: tuple = (16, 32, 64), blocks: int = 1):
        super().__init__()
        del image_size  # global pooling makes the network independent of image size
        self.stem = Sequential(Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
                               BatchNorm2d(widths[0]), ReLU())
        stages, c = [], widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks):
                stages.append(BasicBlock(c, width, 2 if (i > 0 and j == 0) else 1))
                c = width
        self.stages = Sequential(*stages)
        self.pool = GlobalAvgPool()
        self.fc = Linear(c, num_classes)

    def named_layers(self) -> list[tuple[str, Module]]:
        """stem, each basic block, pool, fc: the sequence a pipeline cuts."""
        return [("stem", self.stem), *((f"block {i}", b) for i, b in enumerate(self.stages)), ("pool", self.pool),
                ("fc", self.fc)]

    def forward(self, x):
        return run_layers(self, x)  # fc(pool(stages(stem(x))))


# ----------------------------------------------------------------------------- GPT
@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    checkpoint_activations: bool = False
    gelu: str = "tanh"  # the MLP's GELU: "tanh" (GPT-2's approximation) or "erf" (exact; nanoGPT today)


class CausalSelfAttention(Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = Dropout(cfg.dropout)

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T, 3C)
        p = self.dropout if self.training else 0.0
        y = ops.causal_self_attention(qkv, self.n_head, dropout_p=p)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def residual(self, x, ln: LayerNorm):
        """``x + self(ln(x))`` as one op (``ops.attention_sublayer``): ``Block``'s fast path."""
        p = self.dropout if self.training else 0.0
        return ops.attention_sublayer(x, ln.weight, ln.bias, self.c_attn.weight, self.c_attn.bias,
                                      self.c_proj.weight, self.c_proj.bias, self.n_head, ln.eps, p)


class MLP(Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = Dropout(cfg.dropout)
        self.gelu = cfg.gelu

    def forward(self, x):
        return self.dropout(self.c_proj(ops.gelu(self.c_fc(x), self.gelu)))

    def residual(self, x, ln: LayerNorm):
        """``x + self(ln(x))`` as one op (``ops.mlp_sublayer``): ``Block``'s fast path."""
        p = self.dropout.p if self.training else 0.0
        return ops.mlp_sublayer(x, ln.weight, ln.bias, self.c_fc.weight, self.c_fc.bias,
                                self.c_proj.weight, self.c_proj.bias, ln.eps, p, gelu=self.gelu)


class Block(Module):
    """Pre-norm transformer block, nanoGPT's: x + attn(ln_1(x)), then x + mlp(ln_2(x)).

    Those two lines, the end of ``forward``, are the plain path, through the ``LayerNorm``
    and ``Linear`` modules, so a layer swapped in (tensor slicing's column- and row-parallel
    ``c_attn``, ``c_fc`` and ``c_proj``) is what computes. With the fast paths on (the
    default) each half runs instead as one fused op (``ops.transformer``), equal bit for
    bit, but only when every layer is the plain one (:meth:`_fusable`): the fused op does
    the layers' arithmetic itself and would silently ignore a swapped layer's ``forward``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        if ops.fast_paths_enabled() and self._fusable():
            x = self.attn.residual(x, self.ln_1)  # x + attn(ln_1(x)), one op
            return self.mlp.residual(x, self.ln_2)  # x + mlp(ln_2(x)), one op
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def _fusable(self) -> bool:
        """True when every layer is the plain one whose arithmetic the fused ops do."""
        attn, mlp = self.attn, self.mlp
        return (type(attn) is CausalSelfAttention and type(mlp) is MLP
                and all(type(m) is Linear for m in (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj))
                and type(self.ln_1) is LayerNorm and type(self.ln_2) is LayerNorm)


class GPTEmbedding(Module):
    """Token plus learned position embeddings: ids (B, T) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd)
        self.drop = Dropout(cfg.dropout)

    def forward(self, ids):
        T = ids.shape[-1]
        if T > self.block_size:
            raise ValueError(f"sequence of length {T} exceeds block_size {self.block_size}")
        pos = self.wpe.weight[:T]  # (T, C)
        return self.drop(self.wte(ids) + pos)  # (B, T, C)


class GPTHead(Module):
    """Final layer norm and the tied output projection, ``ln_f(x) @ wte^T`` (Press & Wolf 2017)."""

    def __init__(self, cfg: GPTConfig, wte: Parameter):
        super().__init__()
        self.ln_f = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.wte = wte  # registered here too; named_parameters lists it once

    def forward(self, x):
        return ops.linear(self.ln_f(x), ops.transpose(self.wte))  # (B, T, V)

    def loss(self, logits, targets, label_smoothing: float = 0.0):
        """The mean cross-entropy of the logits against ``targets`` smoothed by ``label_smoothing``
        (a head whose logits are sliced over ranks computes it on its slices: ``parallel/tensor_parallel.py``)."""
        return ops.cross_entropy(logits, targets, label_smoothing=label_smoothing)


class GPT(Module):
    """Decoder-only transformer (Radford et al. 2019), as in nanoGPT (Karpathy)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.embed = GPTEmbedding(cfg)
        self.blocks = ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        if cfg.checkpoint_activations:  # each block's activations recomputed in backward, wherever it runs
            for block in self.blocks:
                checkpointed(block)
        self.head = GPTHead(cfg, self.embed.wte.weight)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2: matrices N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 * n_layer)), biases 0
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        gen = rng.generator()
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = residual_std if name.endswith("c_proj.weight") else 0.02
                p.data[...] = gen.standard_normal(p.shape) * std
            elif name.endswith("bias"):
                p.data[...] = 0

    def layers(self) -> list[Module]:
        """The model as a sequence, for pipeline stages: [embed, *blocks, head]."""
        return [self.embed, *self.blocks, self.head]

    def named_layers(self) -> list[tuple[str, Module]]:
        return [("embed", self.embed), *((f"block {i}", b) for i, b in enumerate(self.blocks)), ("head", self.head)]

    def forward(self, ids, targets=None, label_smoothing: float = 0.0):
        """Logits (B, T, V), and the mean cross-entropy if ``targets`` (B, T) is given (against
        targets smoothed by ``label_smoothing``); the layers run through :func:`run_layers`
        (blocks checkpointed with ``checkpoint_activations``)."""
        logits = run_layers(self, ids)
        if targets is None:
            return logits, None
        return logits, self.head.loss(logits, targets, label_smoothing)

    def generate(self, ids: np.ndarray, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: np.random.Generator | None = None) -> np.ndarray:
        """Sample ``max_new_tokens`` tokens after ``ids`` (B, T) one at a time."""
        gen = generator if generator is not None else rng.generator()
        ids = np.asarray(ids)
        was_training = self.training
        self.eval()
        try:
            with no_grad():
                for _ in range(max_new_tokens):
                    logits, _ = self(ids[:, -self.config.block_size:])
                    z = logits.data[:, -1, :].astype(np.float64) / max(temperature, 1e-8)  # (B, V)
                    if top_k is not None:
                        kth = np.sort(z, axis=-1)[:, -min(top_k, z.shape[-1])][:, None]
                        z = np.where(z < kth, -np.inf, z)
                    p = np.exp(z - z.max(axis=-1, keepdims=True))
                    p /= p.sum(axis=-1, keepdims=True)
                    u = gen.random((p.shape[0], 1))
                    nxt = np.minimum((p.cumsum(axis=-1) < u).sum(axis=-1), p.shape[-1] - 1)  # (B,)
                    ids = np.concatenate([ids, nxt[:, None].astype(ids.dtype)], axis=1)
            return ids
        finally:
            self.train(was_training)

