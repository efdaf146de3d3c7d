"""What training costs, once: every formula the code, tests, benchmarks and end-of-run
tables use, and those a run is planned by (6 N D, PFLOP/s-days, storage bandwidth, ...),
as pure functions of shapes and sizes (no MPI, no arrays of their own; a size may be a
NumPy array of sizes, as the planner's search gives every layout at once).

A formula written twice drifts; here each is written once, with its source: the
communicators count MPI's collectives by :func:`collective_bytes`, the start of a run
states each strategy's bytes per step, the end of a run sets the model state it counted
beside :func:`bytes_per_parameter`, and the benchmarks and tests hold what they measure
against these functions (a test keeps formulas out of every other module).

Sizes: ``n`` numbers of ``itemsize`` bytes, ``P`` ranks; "bytes" are what one rank
sends (each rank sends as much in these algorithms); ``B`` samples of ``T`` tokens,
width ``C``, ``H`` heads, ``L`` layers, vocabulary ``V``.
"""

from __future__ import annotations

from numpy import maximum, minimum

PFLOP_S_DAY = 1e15 * 86_400  # FLOPs in a day at one PFLOP/s


# ----------------------------------------------------------------------------- memory
def word_bytes(mixed: bool, itemsize: int) -> int:
    """Bytes of a weight, a gradient or an activation as the textbook trains: 2 in mixed
    precision (bf16, fp16), else the dtype's ``itemsize``."""
    return 2 if mixed else itemsize


def model_state_bytes(params: float, grads: float, owned: float, moments: int = 2, itemsize: int = 4,
                      mixed: bool = False) -> dict[str, float]:
    """Bytes of model state by category of a rank holding ``params`` weights and ``grads``
    gradients and updating ``owned`` parameters (its shard of the optimizer): weights and
    gradients of ``itemsize`` bytes (2 in ``mixed`` precision), ``moments`` optimizer arrays
    (Adam 2, SGD with momentum 1) of ``itemsize`` (float32 in mixed precision), and in mixed
    precision a float32 master of each owned parameter."""
    w = word_bytes(mixed, itemsize)
    return {"parameters": params * w, "gradients": grads * w,
            "optimizer state": moments * owned * (4 if mixed else itemsize), "masters": 4 * owned if mixed else 0}


def state_shares(sync: str, P: int) -> tuple[float, float, float] | None:
    """Of the weights, gradients and optimizer state of the parameters a part of the model
    holds, the share each of ``P`` data-parallel ranks keeps: all of each with ``ddp``
    (and ``local``), ZeRO-1 ``1/P`` of the optimizer state, ZeRO-2 of the gradients too,
    ZeRO-3 of the weights too; None for parameter servers (they keep the state)."""
    return {"ddp": (1, 1, 1), "local": (1, 1, 1), "zero1": (1, 1, 1 / P), "zero2": (1, 1 / P, 1 / P),
            "zero3": (1 / P, 1 / P, 1 / P)}.get(sync)


def bytes_per_parameter(sync: str, P: int, moments: int = 2, itemsize: int = 4, mixed: bool = False) -> float | None:
    """Model state one of ``P`` data-parallel ranks holds per parameter (Rajbhandari et
    al., "ZeRO", SC 2020), :func:`model_state_bytes` of its :func:`state_shares`:
    ``ddp``/``local`` 16 bytes with Adam, float32 or mixed; ``zero1`` 8 + 8/P (mixed 2 +
    2 + 12/P), ``zero2`` 4 + 12/P, ``zero3`` 16/P; None for a layout without a formula
    here (parameter servers)."""
    shares = state_shares(sync, P)
    return None if shares is None else sum(model_state_bytes(*shares, moments, itemsize, mixed).values())


# ------------------------------------------------------------------ communication
def collective_bytes(kind: str, nbytes: float, P: int, root: bool = False) -> float:
    """Bytes one rank sends in a bandwidth-optimal collective on an array of ``nbytes``
    (Patarasuk & Yuan 2009): ``allreduce`` ``2 (P-1)/P x n``; ``reduce_scatter`` and
    ``allgather`` ``(P-1)/P x n``; ``broadcast`` ``n`` from the ``root``, 0 elsewhere.
    mpitrain's ring sends exactly this when ``P`` divides ``n``; MPI's own collectives
    are counted by it."""
    if kind == "broadcast":
        return float(nbytes) if root else 0.0
    times = {"allreduce": 2, "reduce_scatter": 1, "allgather": 1}[kind]
    return times * (P - 1) * nbytes / P


def ring_elements(n: int, P: int, rank: int) -> int:
    """Numbers rank ``rank`` sends in a ring allreduce of ``n`` in ``P`` chunks (chunk
    ``i`` is ``[n i / P, n (i+1) / P)``): every chunk but its own in the reduce-scatter,
    every chunk but its right neighbour's in the allgather, ``2n - c_r - c_{r+1}``;
    summed over the ranks, exactly ``2 (P-1) n``."""
    chunk = [n * (i + 1) // P - n * i // P for i in range(P)]
    return 2 * n - chunk[rank] - chunk[(rank + 1) % P]


def node_aware_bytes(nbytes: float, nodes: int, per_node: int) -> dict[str, float]:
    """Bytes one rank sends in the node-aware allreduce (:mod:`mpitrain.comm.hierarchical`)
    on ``nodes`` nodes of ``per_node`` ranks: ``2 (L-1)/L x n`` over shared memory, and
    over the network its slice's allreduce, ``2 (N-1)/N x n/L``."""
    return {"intra-node": collective_bytes("allreduce", nbytes, per_node),
            "inter-node": collective_bytes("allreduce", nbytes / per_node, nodes)}


def messages(kind: str, P: int) -> int:
    """Messages one rank sends, one after another, in a ring collective on ``P`` ranks:
    ``2 (P-1)`` in an ``allreduce``, ``P-1`` in a ``reduce_scatter`` or an ``allgather``;
    one ``send``."""
    return {"allreduce": 2 * (P - 1), "reduce_scatter": P - 1, "allgather": P - 1}.get(kind, 1)


def alpha_beta_seconds(kind: str, P: int, sent: float, alpha: float, bandwidth: float, calls: int = 1) -> float:
    """Hockney's time (Parallel Computing 20, 1994) of ``calls`` collectives of ``kind``
    on ``P`` ranks in which a rank sends ``sent`` bytes in all: a latency ``alpha`` per
    message (:func:`messages`) and the bytes at ``bandwidth``."""
    return calls * alpha * messages(kind, P) + sent / bandwidth


def port_share(per_node: int, P: int, k: int) -> float:
    """Of a node's one network port, how many ranks' traffic it carries at once when each
    of its ``per_node`` ranks calls a collective of ``P`` ranks, ``k`` of them on the node:
    each sends the share ``(P - k) / (P - 1)`` of its bytes off the node, so the port carries
    ``per_node (P - k) / (P - 1)`` ranks' worth (at least one)."""
    return maximum(1.0, per_node * (P - k) / maximum(1, P - 1))


def wire_bytes(itemsize: int, wire: int | None = None, algorithm: str = "mpi") -> int:
    """Bytes of a number a sum of gradients of ``itemsize`` sends: ``wire``'s (mpitrain's
    ring sends 16-bit numbers of float32 gradients), or 4 for half-precision gradients
    through MPI, which sums a float32 copy (MPI cannot add bfloat16), or the gradients' own
    (mpitrain's ring; a GPU's collectives, ``"native"``, which add 16-bit numbers)."""
    return wire or (4 if itemsize == 2 and algorithm == "mpi" else itemsize)


def data_parallel_bytes(n: int, P: int, itemsize: int, wire: int | None = None, algorithm: str = "mpi") -> float:
    """Bytes one rank sends per step with data parallelism (Li et al., VLDB 2020): one
    allreduce of the ``n`` gradients, ``2 (P-1)/P x n x s``, ``s`` the bytes of a number on
    the wire (:func:`wire_bytes`)."""
    return collective_bytes("allreduce", n * wire_bytes(itemsize, wire, algorithm), P)


def zero_bytes(stage: int, nbytes: float, P: int, micro_batches: int = 1, sharded: bool = True,
               gather: str = "layer", split: bool = False) -> float:
    """Bytes one rank sends per step with ZeRO ``stage`` on parameters of ``nbytes``:
    stage 1 a reduce-scatter and an allgather, ``2 (P-1)/P x n``, data parallelism's
    allreduce in two halves; stage 2 a reduce-scatter per micro-batch (``sharded``
    accumulation) or per step, and the allgather, ``(m + 1) (P-1)/P x n``; stage 3 the
    parameters gathered and the gradients reduce-scattered as :func:`zero3_passes` says,
    ``3 m (P-1)/P x n`` by default."""
    half = collective_bytes("allgather", nbytes, P)
    if stage == 1:
        return 2 * half
    if stage == 2:
        return (micro_batches + 1 if sharded else 2) * half
    return sum(zero3_passes(micro_batches, gather, split)) * half


def zero3_passes(micro_batches: int, gather: str = "layer", split: bool = False) -> tuple[int, int]:
    """(gathers, reduce-scatters) of each ZeRO-3 group per step: with ``gather = "layer"``
    per micro-batch in forward and again in backward (``split``: a zero-bubble backward's
    two passes, each gathering), and reduced once; with ``"step"`` once each."""
    if gather == "step":
        return 1, 1
    return (3 if split else 2) * micro_batches, micro_batches


def parameter_server_bytes(nbytes: float, servers: int) -> tuple[float, float]:
    """(sent, received) by a worker per step (Li et al., OSDI 2014): it pushes the
    gradients with a 16-byte header (step, version) to each server and pulls the
    parameters with an 8-byte version from each."""
    return nbytes + 16 * servers, nbytes + 8 * servers


def tensor_parallel_bytes(B: int, T: int, C: int, itemsize: int, t: int) -> float:
    """Bytes one rank sends per transformer block per step with the block sliced over ``t``
    ranks (Shoeybi et al. 2019): two allreduces of ``(B, T, C)`` forward and two
    backward, ``8 (t-1)/t x B T C s``; sequence parallelism (Korthikanti et al. 2022)
    turns each into a reduce-scatter and an allgather, the same bytes."""
    return 4 * collective_bytes("allreduce", B * T * C * itemsize, t)


def reader_bytes(b: int, K: int, sample: int, prefetch: int) -> int:
    """Bytes a rank's shard reader (:class:`mpitrain.data.ShardReader`) holds once its
    queue is full: the read buffers of one round (``b`` lanes x ``K`` steps of a
    ``sample``, its bytes as stored with its label), and ``prefetch + 2`` rounds of
    batches (queued, in use, and the one the reader thread has ready), each sample as
    stored with its 8-byte index."""
    return b * K * sample + (prefetch + 2) * b * K * (sample + 8)


# ----------------------------------------------------------------------- pipelines
def pipeline_idle(name: str, p: int, m: int, v: int = 1, F: float = 1.0, B: float = 1.0, W: float = 1.0) -> float:
    """Idle time per rank in one step of ``m`` micro-batches on ``p`` stages, in units of
    one stage's forward ``F``, input-gradient ``B`` and weight-gradient ``W`` passes:
    GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021) ``(p-1)(F+B+W)``,
    interleaved with ``v`` chunks (Narayanan et al., SC21) ``(p-1)(F+B+W)/v``, ZB-H1
    (Qi et al., ICLR 2024) ``(p-1)(F+B-W)`` for ``m >= p``; with fewer micro-batches only
    ``m - 1`` weight passes fill the warm-up: ``(p-1)(F+B) - (m-1)W`` (``W <= F + B``).
    The simulator in :mod:`mpitrain.schedules` is the authority for a given list; it
    equals these."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) * (F + B + W)
    if name == "interleaved":
        return (p - 1) * (F + B + W) / v
    return (p - 1) * (F + B) - (minimum(m, p) - 1) * W


def bubble_fraction(name: str, p: int, m: int, v: int = 1, F: float = 1.0, B: float = 1.0, W: float = 1.0) -> float:
    """The idle share of a step: idle / (work + idle); GPipe and 1F1B ``(p-1)/(m+p-1)``."""
    idle = pipeline_idle(name, p, m, v, F, B, W)
    return idle / (m * (F + B + W) + idle)


def micro_batches_held(name: str, p: int, m: int, rank: int, v: int = 1) -> float:
    """Micro-batches whose activations stage ``rank`` keeps at its peak (a chunk counts
    ``1/v``): GPipe ``m``; 1F1B ``min(m, p - r)``; interleaved ``(2(p-r-1) + (v-1)p + 1)/v``
    above the warm-up; ZB-H1 at most ``min(m, p)``, 1F1B's stage 0."""
    if name == "gpipe":
        return m
    if name == "1f1b" or (name == "interleaved" and v == 1):
        return minimum(m, p - rank)
    if name == "interleaved":
        return minimum(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1) / v
    return minimum(m, p)


# --------------------------------------------------------------------- activations
def gpt_block_activation_bytes(B: int, T: int, C: int, H: int, itemsize: int, checkpointed: bool = False,
                               t: int = 1, sequence: bool = False) -> int:
    """Bytes one of mpitrain's transformer blocks keeps from forward for backward, fused or
    op by op alike: per sublayer the layer norm's normalised input and output and inverse
    deviations (``2NC + N``), attention's q, k, v (``3NC``), probabilities (``B H T^2``)
    and output (``NC``), the MLP's GELU output and derivative (``8NC``):
    ``(16NC + BHT^2 + 2N) s`` with ``N = B T``; checkpointed, its input only, ``N C s``.
    One of ``t`` tensor-parallel ranks keeps the layer norms' whole and its heads' and
    hidden units' ``1/t`` of the rest: ``4NC + 2N + (12NC + BHT^2) / t``; with sequence
    parallelism the norms keep their ``1/t`` of the sequence, and the gathered inputs of
    the two sublayers' first products, whole (``2NC``), stand for their outputs
    (:class:`~mpitrain.parallel.tensor_parallel.ColumnParallelLinear`):
    ``2NC + (2NC + 2N + 12NC + BHT^2) / t``. Checkpointed, the input: ``N C / t`` with
    sequence parallelism."""
    N = B * T
    if checkpointed:
        return N * C * itemsize // (t if sequence else 1)
    sliced = (12 * N * C + B * H * T * T) // t
    if sequence:
        return (2 * N * C + (2 * N * C + 2 * N) // t + sliced) * itemsize
    return (4 * N * C + 2 * N + sliced) * itemsize


def gpt_ends_activation_bytes(B: int, T: int, C: int, V: int, itemsize: int) -> int:
    """Bytes mpitrain's GPT keeps outside its blocks: the final norm's (``2NC + N``) and the
    cross-entropy's probabilities (``N V``)."""
    N = B * T
    return (2 * N * C + N + N * V) * itemsize


def transformer_block_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence: bool = False,
                                       recompute: bool = False, itemsize: int = 2, ffn: int = 0, kv: int = 0,
                                       gated: bool = False, selective: bool = False) -> float:
    """Activation bytes of one transformer block in 16-bit training (Korthikanti et al.
    2022, "Reducing Activation Recomputation"): ``s b h (34 + 5 a s/h)`` for sequence
    ``s``, micro-batch ``b``, width ``h``, ``a`` heads; sliced over ``t`` ranks ``s b h (10
    + 24/t + 5 a s/(h t))``, and with sequence parallelism all of it over ``t``; with full
    recomputation the block's input alone, ``sbh`` 16-bit numbers (over ``t`` with
    sequence parallelism). Numbers of ``itemsize`` bytes scale it by ``itemsize / 2``.
    Their terms, for other shapes: the ``10 sbh`` every slice keeps whole (the norms'
    inputs 4, the inputs of the two sublayers' first products 4, two dropout masks 2); the
    sliced ``24 sbh``, of which attention's queries and projection input ``4 sbh`` and its
    keys and values ``4 sb kv`` (``kv``, their width: 0 is ``h``; narrower with
    grouped-query attention), the MLP's activation input and second product's input ``4
    sb f`` (``ffn``, its width ``f``: 0 is ``4h``; ``6 sb f`` ``gated``, SwiGLU's two
    first products and their product); and the ``5 a s^2 b`` of the scores, softmax and
    its dropout mask, which ``selective`` recomputation drops (it runs them again in
    backward: ``34 sbh / t`` with sequence parallelism, as the paper says)."""
    if recompute:
        count = 2 * s * b * h / (t if sequence else 1)
    else:
        f, k = ffn or 4 * h, kv or h
        sliced = 4 * s * b * h + 4 * s * b * k + (6 if gated else 4) * s * b * f + 5 * a * s * s * b * (not selective)
        count = (10 * s * b * h + sliced) / t if sequence else 10 * s * b * h + sliced / t
    return count * itemsize / 2


def logits_activation_bytes(s: int, b: int, v: int, t: int = 1, itemsize: int = 2) -> float:
    """Bytes of the cross-entropy's probabilities a model's last stage keeps for backward:
    ``s b v`` numbers, each of ``t`` vocabulary-parallel ranks its ``1/t``."""
    return s * b * v / t * itemsize


def sliced_activation_ratios(t: int, a: int, s: int, h: int) -> tuple[float, float]:
    """Activation bytes per block of one of ``t`` tensor-parallel ranks, and with sequence
    parallelism, relative to one rank's: Korthikanti et al.'s count (2022, section 4) for
    mpitrain's float32 blocks, ``s b h (72 + 12 a s/h)`` unsliced. Their half-precision
    terms doubled, and each dropout mask 4 bytes an element (mpitrain's are float arrays,
    theirs bytes): the layer norms' inputs 8 sbh, the inputs of the first matrices of the
    two sublayers 4 + 4 sbh, the two dropout masks on the residual branches 4 + 4 sbh
    (together 24 sbh, whole on every rank under tensor slicing); q and k 8, v 4, the
    projection's input 4, GELU's input and output 16 + 16 (48 sbh, sliced); the attention
    scores, their dropout mask and its output 4 + 4 + 4 a s^2 b (sliced). Sliced:
    ``s b h (24 + 48/t + 12 a s/(h t))``. Sequence parallelism slices the 24 too, except
    that the gathered inputs of the two first matrices are kept whole (for their weight
    gradients; Megatron gathers them again in backward instead):
    ``s b h (72/t + 8 (1 - 1/t) + 12 a s/(h t))``."""
    whole = 72 + 12 * a * s / h
    sliced = 24 + 48 / t + 12 * a * s / (h * t)
    sequence = 72 / t + 8 * (1 - 1 / t) + 12 * a * s / (h * t)
    return sliced / whole, sequence / whole


# --------------------------------------------------------------------------- FLOPs
def matmul_flops(rows: int, inner: int, cols: int) -> int:
    """A ``(rows, inner) @ (inner, cols)`` product: a multiply-add is 2 FLOPs."""
    return 2 * rows * inner * cols


def conv2d_flops(B: int, Ho: int, Wo: int, kh: int, kw: int, cin: int, cout: int) -> int:
    """A convolution: one ``kh kw cin``-long dot product per output number."""
    return matmul_flops(B * Ho * Wo, kh * kw * cin, cout)


def attention_flops(B: int, T: int, C: int) -> int:
    """Attention's two batched products over all heads, ``q k^T`` and ``P v``: ``4 B T^2 C``
    (causal masking not subtracted, as Megatron counts it)."""
    return 2 * matmul_flops(B * T, C, T)


def decode_attention_flops(B: int, n: int, C: int) -> int:
    """Attention of one new token a sequence against ``n`` cached keys and values, over all
    heads: ``q k^T`` and ``P v``, ``4 B n C``."""
    return 2 * matmul_flops(B, C, n)


def kv_cache_bytes(layers: int, batch: int, context: int, width: int, itemsize: int) -> int:
    """A key-value cache (Pope et al. 2022): a key and a value of ``width`` numbers (a
    rank's heads' share of ``n_embd``, or fewer with grouped-query attention) for each of
    ``layers`` blocks, ``batch`` sequences and ``context`` positions,
    ``2 x layers x batch x context x width x itemsize``."""
    return 2 * layers * batch * context * width * itemsize


def backward_flops(forward: int, operands_needing_gradient: int) -> int:
    """The backward of a product costs one product of its size per operand that needs a
    gradient: twice the forward, or once when one operand is data."""
    return forward * operands_needing_gradient


def gpt_block_flops(B: int, T: int, C: int, ffn: int = 0, kv: int = 0, gated: bool = False) -> int:
    """FLOPs of one GPT block's products in forward: QKV, attention, the projection and the
    MLP, ``24 B T C^2 + 4 B T^2 C`` for a ``4C``-wide MLP and a key and a value per query
    head. ``ffn``: the MLP's width (0: ``4C``); ``kv``: the width of the keys and of the
    values (0: ``C``; fewer heads than the queries': grouped-query attention, Ainslie et
    al. 2023); ``gated``: a gated MLP's third product (SwiGLU, Shazeer 2020)."""
    f, k = ffn or 4 * C, kv or C
    return (matmul_flops(B * T, C, C + 2 * k) + attention_flops(B, T, C) + matmul_flops(B * T, C, C)
            + (3 if gated else 2) * matmul_flops(B * T, C, f))


def gpt_step_flops(B: int, T: int, C: int, L: int, V: int) -> int:
    """Model FLOPs of a GPT training step without recomputation (Narayanan et al., SC21):
    ``72 B T L C^2 (1 + T/6C + V/12LC)``, the products of forward (each block's,
    :func:`gpt_block_flops`, and the logits) three times over."""
    return 3 * (L * gpt_block_flops(B, T, C) + matmul_flops(B * T, C, V))


def recomputed_step_flops(B: int, T: int, C: int, L: int, V: int) -> int:
    """FLOPs of a GPT training step with each block's forward again in backward, as
    Narayanan et al. (SC21, equation 3) count a run's achieved teraFLOP/s:
    ``96 B T L C^2 (1 + T/6C + V/16LC)``, :func:`gpt_step_flops` and the blocks' forward."""
    return gpt_step_flops(B, T, C, L, V) + L * gpt_block_flops(B, T, C)


def training_flops(multiply_adds: float) -> float:
    """A sample's training FLOPs from its forward's multiply-adds: 2 FLOPs a multiply-add,
    and backward twice forward, ``2 x 3 x`` them."""
    return 2 * 3 * multiply_adds


def dense_training_flops(parameters: int, tokens: int) -> float:
    """The usual estimate of a dense model's training compute (Kaplan et al. 2020):
    ``6 N D``, two FLOPs per parameter and token forward, four backward."""
    return 6.0 * parameters * tokens


def pflops_days(flops: float) -> float:
    """Compute in PFLOP/s-days: FLOPs over ``10^15 x 86,400``."""
    return flops / PFLOP_S_DAY


def machine_seconds(flops: float, devices: int, peak_flops: float, utilization: float) -> float:
    """Wall time of ``flops`` on ``devices`` of ``peak_flops`` each at ``utilization``."""
    return flops / (devices * peak_flops * utilization)


# ------------------------------------------------------------------------- storage
def storage_bandwidth(bytes_per_sample: float, samples_per_second: float) -> float:
    """Bytes per second a reader must deliver (Ibrahim et al., PMBS 2021)."""
    return bytes_per_sample * samples_per_second


def accelerator_storage_bandwidth(bytes_per_sample: float, flops_per_sample: float, flops_per_second: float) -> float:
    """Bytes per second that keep a device busy: ``bytes/sample / FLOPs/sample x FLOP/s``."""
    return storage_bandwidth(bytes_per_sample, flops_per_second / flops_per_sample)
