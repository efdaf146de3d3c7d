"""Models as shapes: what a model of a config is, layer by layer, without one array.

A :class:`ModelShape` lists a model's layers in the order a pipeline cuts them
(``model.named_layers()``), each with the shapes of its parameters as one tensor-parallel
rank holds them, its products' FLOPs per sample forward, the numbers it keeps for backward
per sample, and its output per sample (what a pipeline stage sends). mpitrain's own models
come from their configs (:func:`gpt`, :func:`lenet`, :func:`convnet`, :func:`resnet`,
exact to the parameter: ``tests/test_plan.py`` builds them for real and compares); the
reference models people plan for come from ``models.toml`` (:mod:`mpitrain.plan.models`).
The FLOPs are those :mod:`mpitrain.observe.flops` counts (products only), through the same
formulas of :mod:`mpitrain.cost`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mpitrain.cost import attention_flops, backward_flops, conv2d_flops, gpt_block_activation_bytes, matmul_flops
from mpitrain.ops.conv import tile_images
from mpitrain.parallel.tensor_parallel import gpt_slices, shard, sliced_shape


@dataclass(frozen=True)
class Layer:
    """One layer of the list a pipeline cuts, as one tensor-parallel rank holds it."""

    name: str
    params: tuple  # ((name, shape), ...): this rank's parameters (a tied one under each layer that uses it)
    forward: int  # FLOPs of its products per sample
    backward: int  # ... of their backward per sample (twice forward, once where the input is data)
    kept: int  # numbers kept from forward for backward per sample (activations)
    out: tuple  # its output per sample (a pipeline boundary's shape)
    recompute: bool = False  # checkpointed: keeps its input only and runs forward again in backward
    whole: int = 0  # parameters of the whole layer (all tensor-parallel slices): what a pipeline cut balances
    gemm: tuple = ()  # its typical product (rows per sample, inner, columns): the shape whose speed times it
    full: int = 0  # numbers kept per sample without checkpointing (0: ``kept``): what its elementwise work walks
    scratch: int = 0  # numbers per sample its forward holds for a moment beyond ``kept`` (a block's input and half)
    gelu: int = 0  # numbers per sample of its GELU, whose work arrays the forward holds too (plan.peak.scratch_numbers)
    part: int = 0  # parameters of its largest part (a block's MLP), whose gradients backward makes at once; 0: all
    cache: int = 0  # numbers its ops keep cached between steps, once in a process (attention's causal mask)
    ones: int = 0  # rows per sample its batch norms sum over (Ho Wo): each length's vector of ones is cached
    tiled: bool = False  # its ``gemm`` a convolution's (rows per image, k k C_in, C_out): multiplied in tiles of images
    convs: tuple = ()  # per convolution, numbers per sample of (its padded input, kept in ``kept``; its columns)
    steps: tuple = ()  # its products and parameters in order, for what backward runs when some are frozen (chain)
    grad_in: bool = True  # its input needs a gradient (fine-tuning: not where nothing before it trains; tuned)
    graph: bool = True  # its ops record a graph (fine-tuning: not where neither its input nor its parameters train)

    def kept_on(self, fast: bool) -> int:
        """Numbers per sample it keeps for backward on the fast paths (``kept``: each
        convolution its padded input) or the plain ones, where each convolution keeps its
        columns instead (:class:`mpitrain.ops.conv.Conv2d`)."""
        if fast:
            return self.kept
        return self.kept + sum(columns - padded for padded, columns in self.convs)

    def product_rows(self, batch: int, itemsize: int, threads: int = 1, fast: bool = True) -> int:
        """Rows of its typical product as mpitrain runs it on ``batch`` samples: the whole
        batch's, or a convolution's on the fast path a tile's (as many whole images as
        :func:`mpitrain.ops.conv.tile_images` puts in one for ``threads`` BLAS threads)."""
        per_sample = self.gemm[0] if self.gemm else 1
        if self.tiled and fast:  # an image's columns: (Ho Wo, k k C_in)
            batch = min(batch, tile_images(per_sample * self.gemm[1] * itemsize, threads))
        return max(1, per_sample * batch)

    @property
    def size(self) -> int:
        return sum(math.prod(s) for _, s in self.params)

    @property
    def traffic(self) -> int:
        """Numbers per sample its elementwise work walks over: what it keeps for backward (all
        of it, checkpointed or not), and each convolution's columns, ``Ho Wo k k C_in`` (written in forward, rebuilt and
        their gradient summed back in backward; a layer's convolutions all produce its
        output's ``Ho x Wo``)."""
        kept = self.full or self.kept
        return kept + sum(self.out[0] * self.out[1] * math.prod(s[:3]) for _, s in self.params if len(s) == 4)


@dataclass(frozen=True)
class ModelShape:
    """A model as a list of layers; ``tied`` names the parameters several layers share."""

    name: str
    layers: tuple
    sample: tuple  # one input sample's shape (tokens (T,), or an image (H, W, C))
    tied: frozenset = field(default=frozenset())

    def parameters(self, layers=None) -> dict:
        """{name: shape} of the parameters of ``layers`` (default all), a tied one once."""
        out = {}
        for layer in self.layers if layers is None else layers:
            out.update(layer.params)
        return out

    def count(self, layers=None) -> int:
        return sum(math.prod(s) for s in self.parameters(layers).values())

    def tuned(self, trained, starts=()) -> ModelShape:
        """The model as a fine-tuning run trains it, only the parameters named in ``trained``
        having gradients: each layer's ``backward`` the products autograd runs (:func:`chain`),
        whether its input needs a gradient (``grad_in``; the data's does not, nor an output
        of layers whose inputs and parameters are all frozen) and whether it records a graph at
        all (``graph``: it keeps nothing for backward then). ``starts``: the layers that
        receive their input from another pipeline stage, which always needs a gradient."""
        g, layers = False, []
        for i, layer in enumerate(self.layers):
            g = g or i in starts
            backward, out = chain(layer.steps, trained, g)
            layers.append(Layer(**{**layer.__dict__, "backward": backward, "grad_in": g, "graph": out}))
            g = out
        return ModelShape(self.name, tuple(layers), self.sample, self.tied)


def chain(steps, trained, g: bool) -> tuple[int, bool]:
    """(backward FLOPs per sample, whether the output needs a gradient) of a layer's
    ``steps`` when its input needs one (``g``) and the parameters named in ``trained`` train,
    as mpitrain's autograd runs them (:meth:`mpitrain.tensor.Function.apply` records an op
    only when an input needs a gradient, and its backward computes only the gradients its
    inputs need): each product one of its size per operand that needs a gradient
    (:func:`mpitrain.cost.backward_flops`). A path needs a gradient from where its input does
    or a parameter joins that trains, and on (a residual carries the block's input along).
    Steps, each ``(kind, flops, names)``: ``join`` (parameters without a product: a norm's,
    a bias), ``product`` (the path times the weight ``names[0]``), ``pair`` (two products of
    the path with itself: attention's, both of whose operands need the gradient),
    ``beside`` (a product on the last one's input: SwiGLU's gate), ``branch`` (a product on the
    layer's input: a shortcut), ``adapters`` (LoRA's ``x A``
    and ``(x A) B``, flops a pair, beside the last product on its input)."""
    g_in, read, total = g, g, 0
    for kind, flops, names in steps:
        t = [n in trained for n in names]
        if kind == "join":
            g = g or any(t)
        elif kind == "pair":
            total += backward_flops(flops, 2 * g)
        elif kind in ("product", "beside", "branch"):
            read = {"product": g, "beside": read, "branch": g_in}[kind]
            total += backward_flops(flops, read + t[0])
            g = g or t[0]
        else:  # adapters: x A, then (x A) B, on the last product's input
            total += backward_flops(flops[0], read + t[0]) + backward_flops(flops[1], (read or t[0]) + t[1])
            g = g or any(t)
    return total, g


# ----------------------------------------------------------------------------- GPT
def _block_steps(p: str, held: dict, T: int, C: int, w: int, kvw: int, hid: int, gated: bool) -> list:
    """A block's forward in order, as :func:`chain` reads it (what backward runs when some
    parameters are frozen): the norms' joins, each ``Linear``'s product (and LoRA's two
    adapters' products beside it, where ``held`` has them, and its bias), attention's pair
    of products; the block ``p``'s parameters ``held`` by name, ``w`` and ``kvw`` its
    heads' query and key widths, ``hid`` its hidden units."""
    steps = []

    def linear(name: str, flops: int, kind: str = "product"):  # a Linear: its product, adapters, bias
        steps.append((kind, flops, (f"{name}.weight",)))
        if f"{name}.lora_A" in held:
            (n_in, r), n_out = held[f"{name}.lora_A"], held[f"{name}.lora_B"][1]
            steps.append(("adapters", (matmul_flops(T, n_in, r), matmul_flops(T, r, n_out)),
                          (f"{name}.lora_A", f"{name}.lora_B")))
        steps.append(("join", 0, tuple(n for n in (f"{name}.bias",) if n in held)))

    steps.append(("join", 0, tuple(n for n in held if n.startswith(f"{p}.ln_1."))))
    linear(f"{p}.attn.c_attn", matmul_flops(T, C, w + 2 * kvw))
    steps.append(("pair", attention_flops(1, T, w), ()))
    linear(f"{p}.attn.c_proj", matmul_flops(T, w, C))
    steps.append(("join", 0, tuple(n for n in held if n.startswith(f"{p}.ln_2."))))
    linear(f"{p}.mlp.c_fc", matmul_flops(T, C, hid))
    if gated:  # SwiGLU's gate: a product on the same input
        linear(f"{p}.mlp.c_gate", matmul_flops(T, C, hid), "beside")
    linear(f"{p}.mlp.c_proj", matmul_flops(T, hid, C))
    return steps


def gpt(V: int, T: int, L: int, H: int, C: int, bias: bool = False, checkpointed: bool = False,
        t: int = 1, rank: int = 0, name: str = "gpt", sequence: bool = False, ffn: int = 0, kv: int = 0,
        gated: bool = False, tied: bool = True, positions: bool = True, lora: tuple = (0, ())) -> ModelShape:
    """mpitrain's GPT (:class:`mpitrain.nn.GPT`: vocabulary ``V``, context ``T``, ``L``
    blocks of width ``C`` with ``H`` heads) as rank ``rank`` of ``t`` tensor-parallel ranks
    holds it: its heads' q, k, v columns and projection rows, its part of the 4C hidden
    units, its part of the vocabulary (:mod:`mpitrain.parallel.tensor_parallel`). The
    shapes only a plan takes (:func:`mpitrain.config.checks.planned_only`): an MLP ``ffn``
    wide (0: ``4C``), ``gated`` (SwiGLU's gate beside it, ``mlp.c_gate``), ``kv`` key and
    value heads (0: ``H``; grouped-query attention), a head of its own (not ``tied``), no
    learned ``positions`` (rotary, ALiBi); these are cut over the slices as Megatron-LM
    cuts them (query, key and value heads, the MLP's columns, the vocabulary's rows). ``lora``:
    (rank, patterns of the ``Linear`` layers adapted; :mod:`mpitrain.nn.lora`), each
    adapted layer's ``lora_A`` (in, rank) and ``lora_B`` (rank, out) after its own."""
    if C % H or H % t:
        raise ValueError(f"width {C} over {H} heads over {t} tensor-parallel ranks does not divide")
    f, k = ffn or 4 * C, kv or H
    plain = f == 4 * C and k == H and not gated and tied and positions  # mpitrain's own: the trainer's cut
    if k % t:
        raise ValueError(f"{k} key and value heads over {t} tensor-parallel ranks does not divide")
    cut = gpt_slices(C, H, V, L, bias, t, rank) if t > 1 and plain else {}  # the trainer's cut: one table

    def mine(name: str, shape: tuple | None, needed: bool = True, sliced: int = -1):  # (name, this rank's shape)
        if not needed:
            return name, None
        if name in cut:
            return name, sliced_shape(shape, cut[name])
        if plain or t == 1 or sliced < 0:
            return name, shape
        lo, hi = shard(shape[sliced], t, rank)  # another shape: its axis ``sliced`` cut as Megatron-LM does
        return name, tuple(hi - lo if i == sliced else n for i, n in enumerate(shape))

    hd = C // H  # a head's width
    qkv = C + 2 * k * hd
    w = mine("blocks.0.attn.c_proj.weight", (C, C), sliced=0)[1][0]  # this rank's heads' width
    kvw = k * hd // t  # its key and value heads' width
    hid = mine("blocks.0.mlp.c_fc.weight", (C, f), sliced=1)[1][1]  # its hidden units
    v = mine("embed.wte.weight", (V, C), sliced=0)[1][0]  # its rows of the vocabulary
    ln = lambda p: [(f"{p}.weight", (C,)), mine(f"{p}.bias", (C,), bias)]  # noqa: E731
    seq = (T // t, C) if sequence else (T, C)  # what the embedding and a block hand on: a slice of the sequence

    def block(i: int) -> Layer:
        p = f"blocks.{i}"
        params = [*ln(f"{p}.ln_1"), mine(f"{p}.attn.c_attn.weight", (C, qkv), sliced=1),
                  mine(f"{p}.attn.c_attn.bias", (qkv,), bias, sliced=0), mine(f"{p}.attn.c_proj.weight", (C, C),
                                                                             sliced=0),
                  mine(f"{p}.attn.c_proj.bias", (C,), bias), *ln(f"{p}.ln_2"),
                  mine(f"{p}.mlp.c_fc.weight", (C, f), sliced=1), mine(f"{p}.mlp.c_fc.bias", (f,), bias, sliced=0),
                  mine(f"{p}.mlp.c_gate.weight", (C, f), gated, sliced=1),
                  mine(f"{p}.mlp.c_gate.bias", (f,), gated and bias, sliced=0),
                  mine(f"{p}.mlp.c_proj.weight", (f, C), sliced=0), mine(f"{p}.mlp.c_proj.bias", (C,), bias)]
        params = adapters(params, *lora)
        extra = sum(math.prod(shape) for n, shape in params if n.endswith((".lora_A", ".lora_B")))  # (untouched by tp)
        held = {n: shape for n, shape in params if shape is not None}
        steps = _block_steps(p, held, T, C, w, kvw, hid, gated)
        fwd = sum(sum(f) if kind == "adapters" else f for kind, f, _ in steps)
        full = gpt_block_activation_bytes(1, T, C, H, 1, t=t, sequence=sequence)
        kept = gpt_block_activation_bytes(1, T, C, H, 1, checkpointed, t, sequence)
        # the whole block's parameters, every slice's together (12 C^2 + 13 C with biases for mpitrain's own)
        whole = (C * qkv + C * C + (2 + gated) * C * f + 2 * C * (1 + bias)
                 + ((qkv + C + (1 + gated) * f + C) if bias else 0) + extra)
        return Layer(f"block {i}", _present(params), fwd, 2 * fwd, kept, seq,
                     checkpointed, whole, (T, C, hid), full,
                     (3 if sequence else 2) * T * C // (t if sequence else 1), T * hid,  # sequence: the norm's
                     (2 + gated) * C * hid + ((1 + gated) * hid + C if bias else 0),  # output slice lives too
                     T * T, steps=tuple(steps))  # the causal mask (ops.attention: one in a process)

    wte = mine("embed.wte.weight", (V, C), sliced=0)
    # sliced, the embedding keeps its rows looked up (the product that zeroes the others' ids keeps them)
    embed = Layer("embed", _present([wte, ("embed.wpe.weight", (T, C) if positions else None)]), 0, 0,
                  T * C if t > 1 else 0, seq, whole=(V + T * positions) * C,
                  steps=(("join", 0, (wte[0], "embed.wpe.weight")),))
    # the head's own weight before its norm's, as Module.named_parameters lists them (ZeRO cuts in that order)
    weight = wte if tied else mine("head.weight", (V, C), sliced=0)
    head = Layer("head", _present([weight, *ln("head.ln_f")]), matmul_flops(T, C, v), 2 * matmul_flops(T, C, v),
                 2 * T * C + T + T * v, (T, V), whole=V * C + (2 * C if bias else C), gemm=(T, C, v), scratch=T * v,
                 steps=(("join", 0, ("head.ln_f.weight", "head.ln_f.bias")), ("product", matmul_flops(T, C, v),
                                                                                 (weight[0],))))
    return ModelShape(name, (embed, *(block(i) for i in range(L)), head), (T,),
                      frozenset({wte[0]}) if tied else frozenset())


def adapters(params: list, rank: int, patterns) -> list:
    """``params`` ((name, shape), ...) with LoRA's adapters of ``rank`` after each ``Linear``
    weight (and bias) whose layer a pattern names (:func:`mpitrain.nn.lora.matching`)."""
    if not rank:
        return params
    from mpitrain.nn.lora import matching

    layers = [n[: -len(".weight")] for n, shape in params if n.endswith(".weight") and shape and len(shape) == 2]
    chosen = set(matching(layers, patterns)[0])
    out = []
    for n, shape in params:
        out.append((n, shape))
        layer = n.rsplit(".", 1)[0]
        last = n.endswith(".bias") or not any(m == f"{layer}.bias" and sh for m, sh in params)
        if layer in chosen and last and shape is not None:
            w = dict(params)[f"{layer}.weight"]
            out += [(f"{layer}.lora_A", (w[0], rank)), (f"{layer}.lora_B", (rank, w[1]))]
    return out


def _present(params) -> tuple:
    return tuple((n, s) for n, s in params if s is not None)


# ----------------------------------------------------------------------------- CNNs
class _Walk:
    """A CNN's layers from an image of ``(H, W, C)``: each call adds one layer and moves
    the running shape on. The first product sees data, whose gradient nobody needs: its
    backward is the weight gradient's product alone."""

    def __init__(self, sample: tuple):
        self.shape, self.data, self.product = tuple(sample), True, {}  # product: the last one's Layer fields
        self.padded = 0  # numbers per sample of the last convolution's padded input, which it keeps for backward
        self.convs = []  # (padded, columns) of each convolution since the last layer: Layer.convs
        self.steps = []  # the products and parameters since the last layer: Layer.steps (:func:`chain`)

    def conv(self, name, cout, k, stride=1, pad=0, bias=True, bn=False, relu=False, kind="product"):
        H, W, cin = self.shape
        Ho, Wo = (H + 2 * pad - k) // stride + 1, (W + 2 * pad - k) // stride + 1
        self.padded = (H + 2 * pad) * (W + 2 * pad) * cin if pad else 0  # unpadded: its input itself, kept already
        self.convs.append((self.padded, Ho * Wo * k * k * cin))
        params = [(f"{name}.weight", (k, k, cin, cout))] + ([(f"{name}.bias", (cout,))] if bias else [])
        self.product = {"gemm": (Ho * Wo, k * k * cin, cout), "tiled": True}
        return self._product(params, conv2d_flops(1, Ho, Wo, k, k, cin, cout), (Ho, Wo, cout), kind)

    def taken(self) -> dict:
        """The last product's Layer fields, with the convolutions since the last call."""
        convs, self.convs = tuple(self.convs), []
        return {**self.product, "convs": convs} if convs else dict(self.product)

    def linear(self, name, n_out, bias=True):
        n_in = math.prod(self.shape)
        params = [(f"{name}.weight", (n_in, n_out))] + ([(f"{name}.bias", (n_out,))] if bias else [])
        self.product = {"gemm": (1, n_in, n_out)}
        return self._product(params, matmul_flops(1, n_in, n_out), (n_out,))

    def _product(self, params, fwd, out, kind="product"):
        grads = 1 if self.data else 2
        self.data = False
        self.shape = out
        self.steps += [(kind, fwd, (params[0][0],)), ("join", 0, tuple(n for n, _ in params[1:]))]
        return list(params), fwd, fwd * grads

    def join(self, params) -> list:
        """``params`` (a norm's), joining the path after the last product: as they are."""
        self.steps.append(("join", 0, tuple(n for n, _ in params)))
        return params

    def flush(self) -> tuple:
        """The steps since the last layer (:attr:`Layer.steps`), taken."""
        steps, self.steps = tuple(self.steps), []
        return steps


# What each layer keeps for backward, numbers per sample, as mpitrain's ops keep it: a
# convolution its padded input (the weight gradient's columns are built from it again;
# on the plain path its columns instead, Layer.kept_on) and,
# with a fused ReLU, its output; a max-pool its input and its output (ops.conv.MaxPool2d);
# batch norm its normalised input; a ReLU its output; a linear layer its input (after a
# pool, the pool's output viewed flat: kept already); the loss its softmax.
def lenet(sample: tuple, classes: int, channels=(16, 32), hidden: int = 128, dropout: float = 0.0) -> ModelShape:
    """:class:`mpitrain.nn.LeNet`: each of its nine layers."""
    walk, layers = _Walk(sample), []
    c1, c2 = channels
    for i, c in ((0, c1), (2, c2)):
        p, f, b = walk.conv(str(i), c, 5, pad=2)
        layers.append(Layer(str(i), tuple(p), f, b, walk.padded, walk.shape, steps=walk.flush(), **walk.taken()))
        out, walk.shape = math.prod(walk.shape), (walk.shape[0] // 2, walk.shape[1] // 2, c)
        layers.append(Layer(str(i + 1), (), 0, 0, out + math.prod(walk.shape), walk.shape))
    walk.shape = (math.prod(walk.shape),)
    layers.append(Layer("4", (), 0, 0, 0, walk.shape))
    p, f, b = walk.linear("5", hidden)
    layers += [Layer("5", tuple(p), f, b, 0, (hidden,), steps=walk.flush(), **walk.product),
               Layer("6", (), 0, 0, hidden, (hidden,)),
               Layer("7", (), 0, 0, hidden if dropout else 0, (hidden,))]  # dropout's mask (none at p = 0)
    p, f, b = walk.linear("8", classes)
    layers.append(Layer("8", tuple(p), f, b, hidden + classes, (classes,), steps=walk.flush(), **walk.product))
    return ModelShape("lenet", _whole(layers), tuple(sample))


def convnet(sample: tuple, classes: int, channels=(16, 32)) -> ModelShape:
    """:class:`mpitrain.nn.ConvNet`: 3x3 convolutions (a ReLU fused into each but the last,
    whose ReLU the pool takes), a 2x2 pool, flatten, a linear layer."""
    walk, layers = _Walk(sample), []
    for i, c in enumerate(channels):
        p, f, b = walk.conv(str(i), c, 3, pad=1)
        relu = math.prod(walk.shape) if i + 1 < len(channels) else 0
        layers.append(Layer(str(i), tuple(p), f, b, walk.padded + relu, walk.shape, steps=walk.flush(),
                            **walk.taken()))
    n, out = len(channels), math.prod(walk.shape)
    walk.shape = (walk.shape[0] // 2, walk.shape[1] // 2, walk.shape[2])
    layers.append(Layer(str(n), (), 0, 0, out + math.prod(walk.shape), walk.shape))
    walk.shape = (math.prod(walk.shape),)
    layers.append(Layer(str(n + 1), (), 0, 0, 0, walk.shape))
    p, f, b = walk.linear(str(n + 2), classes)
    layers.append(Layer(str(n + 2), tuple(p), f, b, classes, (classes,), steps=walk.flush(), **walk.product))
    return ModelShape("convnet", _whole(layers), tuple(sample))


def resnet(sample: tuple, classes: int, widths=(16, 32, 64), blocks: int = 1) -> ModelShape:
    """:class:`mpitrain.nn.ResNet`: a stem, basic blocks, a global pool and a linear layer."""
    walk = _Walk(sample)
    bn = lambda p, c: walk.join([(f"{p}.weight", (c,)), (f"{p}.bias", (c,))])  # noqa: E731
    p, f, b = walk.conv("stem.0", widths[0], 3, pad=1, bias=False)
    stem = math.prod(walk.shape)  # the norm's normalised input, the ReLU's output
    params = p + bn("stem.1", widths[0])
    layers = [Layer("stem", tuple(params), f, b, walk.padded + 2 * stem, walk.shape,
                    ones=stem // widths[0], steps=walk.flush(), **walk.taken())]
    c, k = widths[0], 0
    for i, width in enumerate(widths):
        for j in range(blocks):
            stride, inp, name = 2 if (i > 0 and j == 0) else 1, walk.shape, f"stages.{k}"
            p1, f1, b1 = walk.conv(f"{name}.conv1", width, 3, stride, 1, bias=False)
            p1 += bn(f"{name}.bn1", width)
            kept = walk.padded
            p2, f2, b2 = walk.conv(f"{name}.conv2", width, 3, 1, 1, bias=False)
            kept += walk.padded + 4 * math.prod(walk.shape)  # the two norms' normalised inputs, the two ReLUs'
            params, fwd, bwd = p1 + p2 + bn(f"{name}.bn2", width), f1 + f2, b1 + b2
            if stride != 1 or c != width:  # the block's product stays conv2's, its largest (a 1x1 has 1/9 of it)
                out, main, walk.shape = walk.shape, walk.product, inp
                ps, fs, bs = walk.conv(f"{name}.shortcut.0", width, 1, stride, bias=False,  # keeps the block's input
                                       kind="branch")
                params, fwd, bwd, walk.shape = params + ps + bn(f"{name}.shortcut.1", width), fwd + fs, bwd + bs, out
                walk.product, kept = main, kept + math.prod(out)  # and its norm's normalised input
            layers.append(Layer(f"block {k}", tuple(params), fwd, bwd, kept, walk.shape, ones=math.prod(walk.shape[:2]),
                                steps=walk.flush(), **walk.taken()))
            c, k = width, k + 1
    layers.append(Layer("pool", (), 0, 0, 0, (c,)))
    walk.shape = (c,)
    p, f, b = walk.linear("fc", classes)
    layers.append(Layer("fc", tuple(p), f, b, c + classes, (classes,), steps=walk.flush(), **walk.product))
    return ModelShape("resnet", _whole(layers), tuple(sample))


def _whole(layers) -> tuple:
    """Layers of a model that tensor slicing does not cut: each whole on every rank."""
    return tuple(Layer(**{**layer.__dict__, "whole": layer.size}) for layer in layers)


def from_config(cfg, data, t: int = 1, rank: int = 0) -> ModelShape:
    """The model of ``cfg.model`` on data of :class:`~mpitrain.plan.data.DataShape`
    ``data``, as tensor-parallel rank ``rank`` of ``t`` holds it."""
    m = cfg.model
    if m.name == "gpt":
        return gpt(m.vocab_size or data.ids, m.block_size, m.n_layer, m.n_head, m.n_embd, m.bias,
                   m.checkpoint_activations, t, rank, sequence=t > 1 and cfg.parallel.sequence_parallel,
                   ffn=m.ffn_hidden, kv=m.n_kv_head, gated=m.gated_mlp, tied=m.tie_embeddings,
                   positions=m.position_embedding, lora=(m.lora_rank, m.lora_targets))
    sample, classes = data.sample, data.ids
    if m.name == "lenet":
        return lenet(sample, classes, m.channels, m.hidden, m.dropout)
    if m.name == "convnet":
        return convnet(sample, classes, m.channels)
    return resnet(sample, classes, m.widths, m.blocks)
