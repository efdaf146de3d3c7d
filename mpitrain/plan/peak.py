"""What a rank holds above rest during a step, predicted from shapes alone: the activations
at the schedule's peak, walked layer by layer through forward and backward (what each layer
keeps, its scratch, a convolution's columns, the gradients backward makes, ZeRO's gradients
and buckets in flight, a pipeline's messages), and what the ops cache between steps.
:mod:`mpitrain.plan.predict` puts it into each rank's plan; ``--validate`` holds it against
``tracemalloc`` (:mod:`mpitrain.plan.validate`).
"""

from __future__ import annotations

import functools
import math

from mpitrain import cost, schedules
from mpitrain.ops._util import BLOCK_ELEMENTS
from mpitrain.ops.conv import COLUMN_GRAD_BYTES
from mpitrain.plan.layout import buckets as buckets_of


def split_backward(lay, s: int) -> bool:
    """Whether pipeline rank ``s`` splits backward in two passes (a zero-bubble schedule),
    which runs its layers on the plain path (:class:`mpitrain.parallel.pipeline.PipelineStage`)."""
    return lay.pp > 1 and _splits(lay.par.schedule, lay.pp, lay.m, s, lay.v)


@functools.lru_cache(maxsize=4096)
def _splits(name: str, p: int, m: int, s: int, v: int) -> bool:
    """Whether rank ``s``'s schedule has a backward of the input alone (each stage's ranks
    ask it: a large job's thousands, of a few stages)."""
    return any(isinstance(x, schedules.BackwardInput) for x in schedules.schedule(name, p, m, s, v))


def replays(lay, layer) -> bool:
    """Whether ``layer`` runs forward again in backward: activation checkpointing's blocks,
    and under ZeRO-3 every layer with parameters that train (it frees its gathered weights);
    not one that records no graph (fine-tuning's frozen layers before the first that trains)."""
    return layer.graph and (layer.recompute or (lay.par.sync == "zero3"
                                                and any(n in lay.trained for n, _ in layer.params)))


def fused(lay, layer, fast: bool) -> bool:
    """Whether ``layer`` runs as one fused op when the run's paths are ``fast``: not sliced
    over tensor-parallel ranks, nor a block with LoRA's adapters, whose layers the fused ops
    would skip (:meth:`mpitrain.nn.models.Block._fusable`): those run op by op, each op on
    its fast path."""
    from mpitrain.nn.lora import is_adapter

    return fast and lay.tp == 1 and not any(is_adapter(n) for n, _ in layer.params)


def weight_grads(lay, layer) -> int:
    """Numbers of the weight gradients ``layer``'s backward makes at once: its largest part's
    (``part``, or all of it), at most those of its parameters that train."""
    mine = sum(math.prod(shape) for n, shape in layer.params if n in lay.trained)
    return min(layer.part or layer.size, mine)


def takes_data(lay, layer) -> bool:
    """Whether ``layer`` is the model's first, whose input (the data) has no gradient."""
    return layer.name == lay.models[0].layers[0].name


def recomputed(lay, layer, split: bool) -> int:
    """FLOPs per sample ``layer`` runs again in backward: a replayed layer's forward; and in
    a backward split in two passes (``split``) a replayed layer's node (a checkpointed
    block's, a ZeRO-3 unit's), which replays its private graph in each pass, makes all of
    its gradients in both (:func:`mpitrain.autograd.backward_split`): its forward and
    backward once more (none for the data's layer, whose input pass has nothing to do)."""
    if not replays(lay, layer):
        return 0
    twice = split and (layer.recompute or not takes_data(lay, layer))
    return layer.forward + (layer.forward + layer.backward if twice else 0)


# tier 2's named corrections to tier 1's activations (plan/README.md, "Two tiers"): what each adds, and why
# NumPy and the runtime hold it (:func:`corrections`)
ACTIVATION_CORRECTIONS = {
    "layers' own count": "what mpitrain's layers keep for backward, counted in the textbook's words, less the "
                         "published count: the norms' inverse deviations, dropout masks as floats, the embedding's "
                         "rows",
    "16-bit words": "mixed precision's activations in float32 (NumPy computes in float32), the textbook's in 16 bits",
    "ZeRO-3's replays": "ZeRO-3 frees each layer's gathered weights after its forward and runs it again in backward: "
                        "its input kept, not its activations (less)",
    "float32 weights": "mixed precision's float32 copies of the weights each product reads (dtypes.upcast)",
    "received": "the inputs a pipeline stage received, kept until their backward",
    "freed or rebuilt": "at the peak moment in backward: the later layers' arrays already freed (less), a replayed "
                        "layer's set made again (more)",
    "scratch": "a layer's work arrays while it runs: a block's input and half, GELU's blocks, the logits, "
               "a convolution's columns",
    "gradients": "the gradients backward holds at its peak: of the output and the input, the weights' of a part",
    "zero": "ZeRO-2's buckets in flight and ZeRO-3's gathered weights and gradients",
    "images": "the first stage's batch of images as the loop hands it over",
    "sends": "a pipeline stage's last sends, kept until a test sees them done",
}


def held(lay, s: int, r: int = 0, in_flight: str = "last") -> dict:
    """Bytes of activations pipeline rank ``s``'s slice ``r`` holds at its peak, by part:
    ``held`` micro-batches (the schedule's, :func:`mpitrain.cost.micro_batches_held`) of
    what its layers ``kept`` (ZeRO-3's replayed layers as if they were not, and the
    difference as "ZeRO-3's replays"; in mixed precision their ``float32 weights``) and of the
    inputs it ``received`` (the pipeline keeps each until its backward); the last of them
    at the moment of its forward or backward that holds most (:func:`_moments`: the parts
    "freed or rebuilt", "scratch", "gradients", "zero"; ``in_flight``: ZeRO-2's buckets and
    ZeRO-3's reduce-scatters still in flight then); and beside the layers all step the
    first stage's ``images`` (augmented and normalised, a copy in ``train.dtype``; later
    stages get none, ``Role.takes_input``) and as a rule its last ``sends``
    (:func:`sends_in_flight`; none when ``in_flight`` is "none")."""
    layers, model = lay.layers(s, r), lay.models[r].layers
    k = lay.bounds[s]  # the stage's first layer in the whole list
    first = math.prod(model[k - 1].out) if k else math.prod(lay.models[r].sample)
    split = split_backward(lay, s)
    n = cost.micro_batches_held(lay.par.schedule, lay.pp, lay.m, s, lay.v) if lay.pp > 1 else 1
    received = sum(math.prod(model[lay.bounds[c * lay.pp + s] - 1].out) for c in range(lay.v)  # inputs sent to it
                   if c * lay.pp + s and not replays(lay, model[lay.bounds[c * lay.pp + s]]))  # (a replay keeps it)
    kept, most = _moments(lay, layers, first, split, in_flight)
    a, b = lay.dtype_bytes, lay.micro_batch
    fast = lay.cfg.train.fast_paths and not split
    inputs = [first] + [math.prod(x.out) for x in layers[:-1]]
    replayed = sum(x.kept_on(fast) - i for x, i in zip(layers, inputs) if replays(lay, x) and not x.recompute)
    return {"kept": n * (kept["kept"] + replayed * b * a), "ZeRO-3's replays": -n * replayed * b * a,
            "float32 weights": n * kept["float32 weights"],
            "received": n * received * b * a,
            "freed or rebuilt": most["kept"] + most["float32 weights"] - kept["kept"] - kept["float32 weights"],
            "scratch": most["scratch"], "gradients": most["gradients"], "zero": most["zero"],
            "images": first * lay.micro_batch * lay.m * a if lay.data.kind == "image" and k == 0 else 0,
            "sends": sends_in_flight(lay, s) if in_flight != "none" else 0}


def corrections(lay, s: int, r: int, textbook: float) -> dict:
    """Tier 2's activations of pipeline rank ``s``'s slice ``r`` (:func:`held`) as tier
    1's ``textbook`` figure (:func:`mpitrain.plan.estimate.of_layout`) plus each of
    :data:`ACTIVATION_CORRECTIONS`: their sum is tier 2's figure."""
    parts = held(lay, s, r)
    word = cost.word_bytes(lay.mixed, lay.dtype_bytes)  # the textbook's: 16 bits in mixed precision
    ours = parts.pop("kept")
    return {"layers' own count": ours * word / lay.dtype_bytes - textbook,
            "16-bit words": ours * (lay.dtype_bytes - word) / lay.dtype_bytes, **parts}


def _moments(lay, layers: list, first_input: int, split: bool, in_flight: str = "last") -> tuple[dict, dict]:
    """(bytes one micro-batch keeps, the moment that holds most), each by part: ``kept`` (the
    layers' arrays) and ``float32 weights``, and for the moment also ``scratch``,
    ``gradients`` and ``zero`` (ZeRO's arrays beyond its shard). A layer keeps its kept
    numbers, and in mixed precision the float32 copies of the weights its products read
    (:func:`mpitrain.dtypes.upcast`); one that runs again in backward keeps its input
    only, its forward having run without a graph (``first_input``: the stage's input's
    numbers per sample). While a layer runs forward it also holds its scratch
    (:func:`scratch_numbers`; ``split``: a zero-bubble schedule's plain path) and its
    convolution's columns (:func:`conv_work`), under ZeRO-3 its and the next layer's
    gathered weights, and under ZeRO-2 from the second micro-batch on what the previous
    one's backward left (:func:`_zero2_held`: its buckets in flight, each freed once a
    test during backward has seen it done, so how many depends on the messages' timing,
    ``in_flight``; or the whole gradient, accumulated in full). While it runs backward,
    what the layers before it keep, its whole set, the gradients of its output and of
    its input (none for data), its convolution's columns and their gradient, and its
    largest part's weight gradients; a layer that ran again keeps its input beside its
    set, holds the gradient of its output twice (the outer engine keeps the one it
    passed while the private graph makes its own), and its weight gradients come from
    its private graph, a second copy until the engine has added them (so under ZeRO-2,
    whose parameters have no ``.grad`` to add into; in mixed precision they are float32,
    and its replay holds float32 copies of its weights); the end of its replay is a
    moment of its own (its whole set made, its forward's scratch, the output's
    gradient); under ZeRO-3 also its and the previous layer's gathered weights and the
    whole gradient of the layer after it with its shard (its reduce-scatter in flight:
    :meth:`mpitrain.parallel.zero3.Zero3._progress` frees each once a test sees its sum
    in, which depends on the MPI library: MPICH's reduce-scatter, on shared memory, was
    as a rule still in flight; Open MPI's was done, and freed: ``in_flight`` "none";
    16-bit gradients go as a float32 copy, :func:`mpitrain.comm.ring.ireduce_scatter`),
    under ZeRO-2 the later layers' gradients it holds, and at most the previous
    micro-batch's buckets not yet started again (:func:`_zero2_held`). Fused backward
    passes write their gradients over the arrays they read last, which is why a layer's
    backward adds no more than this."""
    b, a, s = lay.micro_batch, lay.dtype_bytes, lay.itemsize
    fast = lay.cfg.train.fast_paths and not split
    buckets = _zero2_held(lay, layers, 0, in_flight) if lay.m > 1 else 0
    # ZeRO-2 frees each .grad once packed: a gradient is a new array (but accumulated in full, a sum)
    fresh = lay.par.sync == "zero2" and not (lay.m > 1 and lay.par.accumulate == "full")
    moments = []  # (kept, float32 weights, scratch, gradients, zero) of each moment
    kept, up, inp, before, inputs = 0, 0, first_input, [], []  # before: (kept, float32 weights) of the layers before
    for i, layer in enumerate(layers):
        inputs.append(0 if takes_data(lay, layer) or not layer.grad_in else inp)
        mine = (inp if replays(lay, layer) else layer.kept_on(fast)) * b * a * layer.graph  # no graph: nothing kept
        copy = 4 * layer.size if lay.mixed and layer.forward and layer.graph and not replays(lay, layer) else 0
        work = scratch_numbers(lay, layer, fast) + conv_work(lay, layer, fast)[0]
        moments.append((kept + mine, up + copy, work * a, 0, _zero3_held(lay, layers, i, in_flight, False) + buckets))
        before.append((kept, up))
        kept, up, inp = kept + mine, up + copy, math.prod(layer.out)
    before.append((kept, up))
    for i, layer in enumerate(layers):
        if not layer.graph:  # (fine-tuning's frozen layers before the first that trains: no backward)
            continue
        again = replays(lay, layer)  # its graph is private: its weight gradients are returned, then added
        whole = (layer.full or layer.kept_on(fast)) * b * a + (before[i + 1][0] - before[i][0] if again else 0)
        copy = 4 * layer.size if again and lay.mixed and layer.forward else 0  # its replay's upcast weights
        copies = 2 if again or fresh else 1
        grads = (b * (math.prod(layer.out) * (1 + again) + inputs[i]) + conv_work(lay, layer, fast)[1]) * a
        grads += copies * weight_grads(lay, layer) * (4 if again and lay.mixed else s)  # float32 from a replay
        sharded = _zero3_held(lay, layers, i, in_flight, True)
        zero2 = _zero2_held(lay, layers, i + 1, in_flight, lay.m > 1)
        moments.append((before[i][0] + whole, before[i][1] + copy, 0, grads, sharded + zero2))
        if again:  # the end of its replay: its whole set made, its forward's scratch, the output's gradient
            work = scratch_numbers(lay, layer, fast) + conv_work(lay, layer, fast)[0]
            moments.append((before[i][0] + whole, before[i][1] + copy, work * a, b * math.prod(layer.out) * a, sharded))
    moments.append((kept, up, 0, 0, 0))  # between them, all kept
    most = max(moments, key=sum)  # the first of equal ones
    return ({"kept": kept, "float32 weights": up},
            dict(zip(("kept", "float32 weights", "scratch", "gradients", "zero"), most)))


def _zero3_held(lay, layers: list, i: int, in_flight: str, backward: bool) -> int:
    """Bytes ZeRO-3 holds beyond its shard while layer ``i`` runs forward or ``backward``.
    With ``gather = "step"`` every weight, gathered for the step, and from the second
    micro-batch on (in backward, always) every whole gradient; in backward of the last pass
    in mixed precision also the later layer's reduce-scatter, a float32 copy (its weights
    freed). With ``"layer"``: forward this and the next layer's weights; backward this and
    the previous layer's, and the later layer's whole gradient with its shard in flight
    (16-bit: as a float32 copy), unless a test saw it done (``in_flight`` "none")."""
    if lay.par.sync != "zero3":
        return 0
    s, flying = lay.itemsize, in_flight != "none"
    if lay.par.gather == "step":
        whole = lay.models[0].count(layers) * s
        if not backward:
            return whole * (2 if lay.m > 1 else 1)
        later = layers[i + 1 : i + 2] if lay.mixed else []
        return 2 * whole + sum(x.size * (4 - s) + -(-x.size // lay.dp) * (4 + s) for x in later) * flying
    if not backward:
        return sum(x.size for x in layers[i : i + 2]) * s
    wide = s + (4 if lay.mixed else 0)
    return (sum(x.size for x in layers[max(0, i - 1) : i + 1]) * s
            + sum(x.size + -(-x.size // lay.dp) for x in layers[i + 1 : i + 2]) * wide * flying)


def _zero2_held(lay, layers: list, after: int, in_flight: str, later: bool = False) -> int:
    """Bytes of gradients ZeRO-2 holds beyond its shard once backward has passed the layers
    from ``after`` on (0: a whole backward, the previous micro-batch's): accumulated in full,
    the whole gradient; else the gradients of a bucket not yet full, and the buckets started
    with their received shards while in flight: each is freed when a hook sees it done, so
    "all" of them at most, "none" at least, and as a rule the "last" one started (a
    reduce-scatter ends while the next layer's backward runs). In a ``later`` micro-batch's
    backward, "all" also counts the previous micro-batch's buckets that this one has not
    started again: a rank ahead of the others tests them in vain until its own bucket's
    start waits for them (:meth:`mpitrain.parallel.zero.Zero2._start`)."""
    if lay.par.sync != "zero2":
        return 0
    model, s = lay.models[0], lay.itemsize
    if lay.m > 1 and lay.par.accumulate == "full":
        return model.count(layers) * s
    key = ("zero2 buckets", tuple(layer.name for layer in layers))  # asked once for every layer of a walk
    if key not in lay.cache:
        params = model.parameters(layers)
        lay.cache[key] = params, buckets_of(lay, params)
    params, groups = lay.cache[key]
    ready = set(model.parameters(layers[after:]))
    started = [all(name in ready for name in group) for group in groups]
    last = max((k for k, done in enumerate(started) if done), default=-1)
    held = 0
    for k, group in enumerate(groups):
        n = sum(math.prod(params[name]) for name in group if name in ready)
        if n and (not started[k] or in_flight == "all" or (in_flight == "last" and k == last)):
            held += n + (-(-n // lay.dp) if started[k] else 0)
        if later and in_flight == "all" and not started[k]:
            whole = sum(math.prod(params[name]) for name in group)
            held += whole + -(-whole // lay.dp)
    return held * s


def scratch_numbers(lay, layer, fast: bool) -> int:
    """Numbers a layer's forward holds for a moment beyond what it keeps, for one
    micro-batch: its ``scratch`` (a block's input and its first half's output, the
    head's logits), and a GELU's work: on the fast paths two arrays of one block of
    elements (:func:`mpitrain.ops.elementwise.gelu_blocks`), else three of the whole
    (``gelu_plain``: ``x^2``, ``h``, and the temporaries of its expressions, one at a
    time beyond its outputs); op by op (:func:`fused`: tensor slicing, LoRA's blocks, a
    zero-bubble schedule) its input too, which the fused block's GELU overwrites. An adapted
    ``Linear`` (:class:`mpitrain.nn.lora.LoRALinear`) holds the two products it sums, its
    own and the adapters' ``(x A) B``, beside their sum: the widest's (the MLP's first, GELU's
    input) a moment before GELU's work."""
    b = lay.micro_batch
    if not layer.gelu:
        return layer.scratch * b
    work = 2 * min(layer.gelu * b, BLOCK_ELEMENTS) if fast else 3 * layer.gelu * b
    summed = max((shape[1] for n, shape in layer.params if n.endswith(".lora_B")), default=0)
    work = max(work, 2 * layer.gemm[0] * summed * b)
    return layer.scratch * b + work + (0 if fused(lay, layer, fast) else layer.gelu * b)


def sends_in_flight(lay, s: int) -> int:
    """Bytes of the messages pipeline stage ``s`` has sent and not yet seen done
    (:meth:`mpitrain.parallel.pipeline.PipelineStage._progress` lets each go once a test
    finds it complete, which waits for the neighbour's receive): as a rule the last
    activation it sent on, while it runs its next micro-batch, and the last input gradient
    it sent back (its first chunk's boundaries); none where a test saw them done before the
    peak, which depends on the messages' timing (the plan's bounds)."""
    if lay.pp == 1:
        return 0
    model, first, last = lay.models[0].layers, lay.bounds[s], lay.bounds[s + 1]
    onward = math.prod(model[last - 1].out) if last < len(model) else 0  # to the next stage
    back = math.prod(model[first - 1].out) if first else 0  # to the previous one
    return (onward + back) * lay.micro_batch * lay.dtype_bytes


def cached(lay, layers: list) -> int:
    """Bytes the layers' ops keep cached between steps, once in a process: attention's causal
    mask, one for all blocks, and for batch norm's column sums a vector of ones for each
    length of rows it sums (:func:`mpitrain.ops._util.cached_full`): ``ones`` per sample of a
    micro-batch (an evaluation at another batch adds its own)."""
    mask = max((layer.cache for layer in layers), default=0)
    ones = {layer.ones for layer in layers if layer.ones}
    return (mask + sum(ones) * lay.micro_batch) * lay.dtype_bytes


def conv_work(lay, layer, fast: bool) -> tuple[int, int]:
    """Numbers a layer's convolutions hold for a moment in (forward, backward), for one
    micro-batch. On the fast path its largest (its ``gemm``) one tile's column matrix
    (:class:`mpitrain.ops.conv.TiledConv2d` reuses one work array for every tile), which
    backward builds again for the weight gradient, beside a sub-tile of the column gradient
    (``COLUMN_GRAD_BYTES``; none where the input is data, whose gradient nobody needs). On
    the plain path (:class:`~mpitrain.ops.conv.Conv2d`, whose columns are kept:
    :meth:`~mpitrain.plan.shapes.Layer.kept_on`) the widest padded copy of an input, which
    forward pads before it builds the columns, and in backward the whole column gradient
    with the padded input gradient it is summed into."""
    if not layer.tiled:
        return 0, 0
    b = lay.micro_batch
    needs_input = layer.grad_in and not takes_data(lay, layer)  # its backward has the input gradient's product too
    if not fast:
        padded = max(p for p, _ in layer.convs) * b
        return padded, needs_input * (max(c for _, c in layer.convs) * b + padded)
    per_image = layer.gemm[0] * layer.gemm[1]  # (Ho Wo) x (k k C_in)
    columns = layer.product_rows(b, lay.dtype_bytes, lay.threads, fast) * layer.gemm[1]
    sub = max(1, min(columns // per_image, COLUMN_GRAD_BYTES // (per_image * lay.dtype_bytes)))
    return columns, columns + needs_input * sub * per_image
