"""Tier 1, the textbook planner: what one rank of a GPT's (or a CNN's) layout holds,
computes, sends and takes, from the published formulas alone (:mod:`mpitrain.cost`) and
the sizes of the part of the model the rank holds. Read this first; tier 2
(:mod:`mpitrain.plan.predict`, :mod:`~mpitrain.plan.peak`) is the same answer made exact
for this machine's NumPy.

Memory (:func:`gpt_memory`), per rank:

* model state, ZeRO's formula (Rajbhandari et al. 2020): of the ``N`` parameters its
  part holds, weights ``w``, gradients ``g`` and optimizer state ``s`` bytes a parameter,
  each whole or ``1/dp`` of it (:func:`mpitrain.cost.state_shares`): 16 bytes with Adam,
  and under ZeRO-1 in mixed precision ``2 + 2 + 12/dp``;
* activations, Korthikanti et al. 2022: ``s b h (34 + 5 a s/h)`` bytes a block in 16-bit
  numbers, sliced over ``t`` ranks ``s b h (10 + 24/t + 5 a s/(h t))``, all of it over
  ``t`` with sequence parallelism, and the block's input alone, ``sbh`` 16-bit numbers,
  when its forward runs again in backward; float32 numbers twice these; times the
  micro-batches the schedule keeps (:func:`mpitrain.cost.micro_batches_held`); and the
  logits' probabilities, ``s b V / t`` numbers, on the last stage.

FLOPs (:func:`gpt_flops`): the products of forward (Narayanan et al. 2021), twice that in
backward, once more for each recomputed block. Bytes (:func:`gpt_bytes`): what each
communicator carries. Time (:func:`step_seconds`): the products at the device's rate,
Hockney's sums, each sync's overlap and the bubble. The trainer's cut of the layers into
stages and of each layer into slices says how many blocks and parameters a rank holds
(:func:`of_layout`: one source for the layout, :class:`mpitrain.plan.layout.Layout`). A
CNN's part (:func:`of_cnn`) holds the same model state and keeps each layer's input.
"""

from __future__ import annotations

import math

from numpy import maximum, minimum

from mpitrain import cost

def gpt_memory(N: int, blocks: int, T: int, C: int, H: int, V: int, *, b: int, held: float, sync: str = "ddp",
               dp: int = 1, tp: int = 1, precision: str = "fp32", itemsize: int = 4, moments: int = 2,
               sequence: bool = False, recompute: bool = False, last: bool = True, ffn: int = 0, kv: int = 0,
               gated: bool = False, selective: bool = False, frozen: int = 0) -> dict[str, float]:
    """Bytes one rank holds at its peak, by category: its part holds ``N`` parameters that
    train and ``frozen`` ones (fine-tuning: held whole, no gradients nor optimizer state), and
    ``blocks`` of a GPT's blocks (context ``T``, width ``C``, ``H`` heads, vocabulary ``V``),
    ``held`` micro-batches of ``b`` samples at once; ``sync`` over ``dp`` replicas, sliced
    over ``tp`` ranks (``sequence`` parallel), in ``precision`` (``fp32``: numbers of
    ``itemsize`` bytes; ``bf16``, ``fp16``), ``moments`` optimizer arrays (Adam 2),
    ``recompute``: each block's forward again in backward; ``last``: the stage with the head;
    ``ffn``, ``kv``, ``gated``: an MLP that wide, that many key and value heads, gated (0,
    0, False: mpitrain's 4C MLP, a key and a value per head); ``selective``: attention's
    scores and softmax run again in backward, not kept."""
    mixed = precision != "fp32"
    number = cost.word_bytes(mixed, itemsize)
    state = _state(N, frozen, sync, dp, moments, number, mixed)
    block = cost.transformer_block_activation_bytes(T, b, C, H, tp, sequence, recompute, number, ffn,
                                                    kv * C // H, gated, selective)
    logits = last * cost.logits_activation_bytes(T, b, V, tp, number)
    return {**state, "activations": held * (blocks * block + logits)}


def _state(N, frozen, sync: str, dp, moments: int, number: int, mixed: bool) -> dict[str, float]:
    """ZeRO's model state (:func:`mpitrain.cost.state_shares`) of ``N`` parameters that
    train, and ``frozen`` weights held whole beside them."""
    w, g, s = cost.state_shares(sync, dp)
    return cost.model_state_bytes(w * N + frozen, g * N, s * N, moments, number, mixed)


def gpt_flops(blocks: int, T: int, C: int, V: int, *, samples: int, tp: int = 1, recompute: bool = False,
              last: bool = True, ffn: int = 0, kvw: int = 0, gated: bool = False,
              selective: bool = False) -> dict[str, float]:
    """FLOPs of a step of one rank of ``tp``: forward, backward and recomputed, over
    ``samples`` samples (its micro-batches together) of its ``blocks`` blocks (and the
    head's product on the ``last`` stage); ``ffn``, ``kvw``, ``gated``:
    :func:`mpitrain.cost.gpt_block_flops`'s; ``selective``: attention's two products once
    more (Korthikanti et al. 2022)."""
    block = cost.gpt_block_flops(1, T, C, ffn, kvw, gated) / tp
    forward = samples * (blocks * block + last * cost.matmul_flops(T, C, V) / tp)
    again = block if recompute else cost.attention_flops(1, T, C) / tp if selective else 0
    return {"forward": forward, "backward": 2 * forward, "recompute": samples * blocks * again}


def gpt_bytes(N: int, blocks: int, T: int, C: int, V: int, *, b: int, m: int, sync: str = "ddp", dp: int = 1,
              pp: int = 1, tp: int = 1, v: int = 1, precision: str = "fp32", itemsize: int = 4,
              recompute: bool = False, sequence: bool = False, first: bool = True,
              last: bool = True, tied: bool = True) -> dict[str, float]:
    """Bytes one rank sends in a step, by communicator, its part holding ``N`` parameters
    and ``blocks`` blocks (``first`` and ``last``: the pipeline rank with the embedding,
    with the head), ``m`` micro-batches of ``b`` samples, numbers of ``itemsize`` bytes
    (2 in mixed precision): ``tp``, each block's four sums of a micro-batch's activations
    (Shoeybi et al. 2019: two forward, two backward; six with recomputation; the same
    bytes as a reduce-scatter and an allgather with sequence parallelism), the embedding's
    and the head's input's (:func:`mpitrain.cost.tensor_parallel_bytes`); ``pp``, each
    micro-batch's activations to the next stage and their gradients to the one before,
    for each of the ``v`` chunks but at the model's two ends (with ``sequence``
    parallelism a slice's ``1/tp`` of the sequence), and the ``tied`` embedding's
    gradient summed by the first and last stage; ``dp``, the gradients' allreduce, or
    ZeRO's reduce-scatters and gathers (:func:`mpitrain.cost.zero_bytes`). Scalars or
    arrays alike."""
    number = cost.word_bytes(precision != "fp32", itemsize)
    act = b * T * C * number
    ends = 1 * first + 1 * last  # (numbers, not truth values: NumPy adds two booleans as "or")
    tp_bytes = m * (blocks * (1.5 if recompute else 1) * cost.tensor_parallel_bytes(b, T, C, number, tp)
                    + ends * cost.collective_bytes("allreduce", act, tp))
    sends = m * act / (tp if sequence else 1) * (2 * v - ends)
    tied = (ends > 0) * tied * cost.collective_bytes("allreduce", V * C / tp * number, 2)  # (untied: none)
    return {"dp": sync_bytes(N * number, sync, dp, m), "pp": (pp > 1) * (sends + tied), "tp": tp_bytes}


def sync_bytes(grads, sync: str, dp, m):
    """Bytes one of ``dp`` replicas sends in a step to sync gradients of ``grads`` bytes:
    ddp's allreduce, or ZeRO's reduce-scatters and gathers over ``m`` micro-batches (none
    with ``local``)."""
    if sync == "local":  # one replica: nothing to sync
        return 0
    if sync == "ddp":
        return cost.collective_bytes("allreduce", grads, dp)
    return cost.zero_bytes(int(sync[-1]), grads, dp, m)


def cnn_memory(N: int, kept: float, *, b: int, held: float, sync: str = "ddp", dp: int = 1, precision: str = "fp32",
               itemsize: int = 4, moments: int = 2, frozen: int = 0) -> dict[str, float]:
    """Bytes one rank of a CNN holds at its peak, by category: the model state of its
    part's ``N`` parameters (and ``frozen`` ones) as :func:`gpt_memory`'s, and ``held`` micro-batches of ``b``
    samples of what backward reads, each layer's input (``kept`` numbers a sample: the
    textbook's count, whatever the ops keep)."""
    mixed = precision != "fp32"
    state = _state(N, frozen, sync, dp, moments, itemsize, mixed)
    return {**state, "activations": held * b * kept * cost.word_bytes(mixed, itemsize)}


def of_cnn(lay, s: int) -> tuple[dict, dict, dict]:
    """(:func:`cnn_memory`, FLOPs, bytes by communicator) of pipeline rank ``s`` of a
    :class:`~mpitrain.plan.layout.Layout` of a CNN: its layers as the trainer cuts them;
    each layer's products and their backward (the first layer's, whose input is data, the
    weight gradient's alone); each micro-batch's activations to the next stage and their
    gradients to the one before, and the sync's exchange."""
    model, t = lay.models[0], lay.cfg.train
    where = {layer.name: k for k, layer in enumerate(model.layers)}
    inputs = [math.prod(model.layers[k - 1].out) if k else math.prod(model.sample) for k in range(len(model.layers))]
    layers = lay.layers(s)
    N = sum(math.prod(shape) for shape in lay.parameters(s).values())
    held = cost.micro_batches_held(lay.par.schedule, lay.pp, lay.m, s, lay.v) if lay.pp > 1 else 1
    number = lay.itemsize  # the textbook's words: 16 bits in mixed precision
    memory = cnn_memory(N, sum(inputs[where[x.name]] for x in layers), b=lay.micro_batch, held=held, sync=lay.par.sync,
                        dp=lay.dp, precision=t.precision, itemsize=lay.dtype_bytes, moments=lay.moments,
                        frozen=lay.frozen(s))
    samples = lay.micro_batch * lay.m
    flops = {"forward": samples * sum(x.forward for x in layers), "backward": samples * sum(x.backward for x in layers),
             "recompute": 0}
    sends = 0
    for c, chunk in enumerate(lay.chunks(s)):
        k, end = where[chunk[0].name], where[chunk[-1].name]
        sends += (end + 1 < len(model.layers)) * math.prod(chunk[-1].out) + (k > 0) * inputs[k]
    return memory, flops, {"dp": sync_bytes(N * number, lay.par.sync, lay.dp, lay.m),
                           "pp": lay.m * lay.micro_batch * sends * number, "tp": 0}


def step_seconds(compute, tp, dp, send, after, *, sync: str, schedule: str, p, m, v=1, forward_share=1 / 3,
                 hides: float = 1.0, waited=0.0, once=0.0, last=0.0) -> dict:
    """The step of a layout's slowest stage, by part, in seconds: ``compute``, its products
    at the device's rate, and ``tp``, its blocking tensor-parallel sums, for all ``m``
    micro-batches; the pipeline's idle time (:func:`mpitrain.cost.pipeline_idle` of ``p``
    stages, ``v`` chunks, a micro-batch's forward its ``forward_share``, the input's and the
    weights' gradients halves of the rest) with its fill and drain, ``2 (p - 1)`` messages of
    ``send`` seconds; data parallelism's ``dp`` seconds, of which ddp hides what the last
    micro-batch's backward runs beside (its buckets start as that backward passes their
    parameters, the others only accumulate), and ZeRO-2 what every backward runs beside of
    its ``m`` reduce-scatters but not the gather after the update, both but ``last``, the
    share of their sums in the last bucket, ready when backward ends; ZeRO-3 what the whole
    compute does (each layer's gathers beside the layer before), each at most the link's
    ``hides`` share of it, and ZeRO-1 nothing (its reduce-scatter follows backward);
    ``after``, the pipeline's collectives after the schedule (a tied weight's gradient);
    ``waited``, what a stage waits on its sends in the schedule (a GPU framework's,
    :func:`mpitrain.plan.gpu.sends_waited`; 0: none waited on); ``once``, compute once a step
    after the schedule (a GPU's update), in ``compute`` but in no micro-batch;
    ``communication``, every call's time, hidden or not (a stage sends each micro-batch's
    activations and their gradients). Scalars or arrays of layouts alike."""
    one = (compute + tp) / m
    F = one * forward_share
    bubble = cost.pipeline_idle(schedule, p, m, v, F, (one - F) / 2, (one - F) / 2) + 2 * (p - 1) * send
    backward = compute * (1 - forward_share)  # of all m micro-batches
    beside = {"zero1": 0 * compute, "zero3": compute, "zero2": backward}.get(sync, backward / m)
    hideable = dp * (m / (m + 1) if sync == "zero2" else 1) * (1 - last)
    exposed = dp - minimum(beside, hides * hideable) + tp + after + waited
    compute = compute + once
    return {"compute": compute, "exposed": exposed, "bubble": bubble, "step": compute + exposed + bubble,
            "communication": dp + tp + after + maximum(waited, 2 * m * send * (p > 1))}


def of_layout(lay, s: int, r: int = 0) -> tuple[dict, dict, dict]:
    """(:func:`gpt_memory`, :func:`gpt_flops`, :func:`gpt_bytes`) of pipeline rank ``s``'s
    slice ``r`` of a :class:`~mpitrain.plan.layout.Layout` of a GPT: its parameters and
    blocks as the trainer cuts them; a CNN's, :func:`of_cnn`."""
    if lay.cfg.model.name != "gpt":
        return of_cnn(lay, s)
    m, par, t = lay.cfg.model, lay.par, lay.cfg.train
    layers = lay.layers(s, r)
    blocks = sum(layer.name.startswith("block") for layer in layers)
    first = any(layer.name == "embed" for layer in layers)
    last = any(layer.name == "head" for layer in layers)
    N = sum(math.prod(shape) for shape in lay.parameters(s, r).values())
    held = cost.micro_batches_held(par.schedule, lay.pp, lay.m, s, lay.v) if lay.pp > 1 else 1
    V, kv = m.vocab_size or lay.data.ids, m.n_kv_head or m.n_head
    memory = gpt_memory(N, blocks, lay.T, m.n_embd, m.n_head, V, b=lay.micro_batch, held=held,
                        sync=par.sync, dp=lay.dp, tp=lay.tp, precision=t.precision, itemsize=lay.dtype_bytes,
                        moments=lay.moments, sequence=lay.tp > 1 and par.sequence_parallel,
                        recompute=m.checkpoint_activations, last=last, ffn=m.ffn_hidden, kv=kv, gated=m.gated_mlp,
                        selective=m.selective_recompute or m.flash_attention,  # (FlashAttention keeps no scores)
                        frozen=lay.frozen(s, r))
    flops = gpt_flops(blocks, lay.T, m.n_embd, V, samples=lay.micro_batch * lay.m, tp=lay.tp,
                      recompute=m.checkpoint_activations, last=last, ffn=m.ffn_hidden, kvw=kv * m.n_embd // m.n_head,
                      gated=m.gated_mlp, selective=m.selective_recompute)
    sent = gpt_bytes(N, blocks, lay.T, m.n_embd, V, b=lay.micro_batch, m=lay.m, sync=par.sync, dp=lay.dp,
                     pp=lay.pp, tp=lay.tp, v=lay.v, precision=t.precision, itemsize=lay.dtype_bytes,
                     recompute=m.checkpoint_activations, sequence=lay.tp > 1 and par.sequence_parallel,
                     first=first, last=last, tied=m.tie_embeddings)
    return memory, flops, sent
