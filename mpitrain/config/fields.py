"""The fields of a run's configuration: one frozen dataclass per section of a config file
(``[model]``, ``[data]``, ``[optim]``, ``[train]``, ``[parallel]``, ``[run]``), and the
tables of which choice reads which field. The ``#:`` comment at each field says what it
means; :func:`mpitrain.config.reference` turns those into ``jobs/CONFIG.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MODELS = ("lenet", "convnet", "resnet", "gpt")
# LoRA's default targets: each block's attention (q, k, v together; the output projection) and MLP matrices
LORA_TARGETS = ("blocks.*.attn.c_attn", "blocks.*.attn.c_proj", "blocks.*.mlp.c_fc", "blocks.*.mlp.c_proj")
EMBEDDED = {"mnist5k": "image", "shakespeare": "text"}  # name -> kind


class ConfigError(ValueError):
    """An invalid configuration; ``str()`` names the field."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = "lenet"  #: the model: "lenet", "convnet", "resnet" (CNNs, on images) or "gpt" (on text)
    channels: tuple[int, ...] = (16, 32)  #: convolution widths: lenet's two 5x5 layers, convnet's 3x3 layers
    hidden: int = 128  #: units of the hidden linear layer
    widths: tuple[int, ...] = (16, 32, 64)  #: the width of each stage (stride 2 between stages)
    blocks: int = 1  #: basic blocks per stage (1: ResNet-8, 3: ResNet-20)
    dropout: float = 0.0  #: dropout probability (lenet: before the classifier; gpt: attention and residuals)
    n_layer: int = 4  #: transformer blocks
    n_head: int = 4  #: attention heads per block; n_embd, and with tensor slices parallel.tp, divide by it
    n_embd: int = 128  #: the width of the residual stream
    block_size: int = 64  #: the context: tokens per training window
    bias: bool = False  #: biases in the linear layers and layer norms
    checkpoint_activations: bool = False  #: recompute each block's activations in backward instead of keeping them
    gelu: str = "tanh"  #: the MLP's GELU: "tanh" (GPT-2's approximation) or "erf" (exact, as nanoGPT today)
    vocab_size: int = 0  #: the vocabulary (0: the data's); another is planned only, as the fields below are
    ffn_hidden: int = 0  #: the MLP's width (0: 4 x n_embd)
    gated_mlp: bool = False  #: a gated MLP (SwiGLU, as Llama's: three matrices)
    n_kv_head: int = 0  #: key and value heads (0: n_head; fewer: grouped-query attention, dividing n_head)
    tie_embeddings: bool = True  #: the head's weight is the embedding's (false: a head of its own)
    position_embedding: bool = True  #: learned positions (false: none to learn, as rotary or ALiBi models have)
    selective_recompute: bool = False  #: recompute attention's scores and softmax in backward (Korthikanti et al.)
    flash_attention: bool = False  #: attention as one fused kernel that keeps no scores (FlashAttention, Dao 2022)
    lora_rank: int = 0  #: LoRA adapters of this rank on lora_targets (Hu et al. 2021); 0: none. On: only they train
    lora_alpha: float = 0.0  #: the adapters' scale is lora_alpha / lora_rank; 0: lora_rank (a scale of 1)
    lora_targets: tuple[str, ...] = LORA_TARGETS  #: Linear layers adapted (globs): attention's qkv and out, MLP's two


# which fields a choice of model, dataset or optimizer reads: setting another is an error
MODEL_FIELDS = {
    "lenet": {"name", "channels", "hidden", "dropout"},
    "convnet": {"name", "channels"},
    "resnet": {"name", "widths", "blocks"},
    "gpt": {"name", "n_layer", "n_head", "n_embd", "block_size", "bias", "dropout",
            "checkpoint_activations", "gelu", "vocab_size", "ffn_hidden", "gated_mlp", "n_kv_head",
            "tie_embeddings", "position_embedding", "selective_recompute", "flash_attention",
            "lora_rank", "lora_alpha", "lora_targets"},
}
_OPTIM_COMMON = {"name", "lr", "min_lr", "schedule", "warmup_steps", "weight_decay", "grad_clip"}
OPTIM_FIELDS = {
    "sgd": _OPTIM_COMMON | {"momentum", "nesterov"},
    "adam": _OPTIM_COMMON | {"betas", "eps"},
    "adamw": _OPTIM_COMMON | {"betas", "eps"},
}
TEXT_ONLY_TRAIN_FIELDS = {"eval_batches", "sample_tokens"}
IMAGE_ONLY_TRAIN_FIELDS = {"eval_flip"}
_PARALLEL_COMMON = {"dp", "pp", "tp", "sync", "thread_level", "schedule", "chunks", "sequence_parallel"}
PARALLEL_FIELDS = {  # by parallel.sync
    "ddp": _PARALLEL_COMMON | {"allreduce", "bucket_mb", "progress", "wire"},
    "zero1": _PARALLEL_COMMON | {"allreduce"},
    "zero2": _PARALLEL_COMMON | {"allreduce", "bucket_mb", "accumulate"},
    "zero3": _PARALLEL_COMMON | {"allreduce", "gather"},
    "local": _PARALLEL_COMMON,
    "ps": _PARALLEL_COMMON | {"servers", "staleness", "slow_worker", "slow_factor"},
}
# the field that makes a section's choice, and the fields each value reads
CHOICES = {"model": ("name", MODEL_FIELDS), "optim": ("name", OPTIM_FIELDS), "parallel": ("sync", PARALLEL_FIELDS)}
RENAMED = {"parallel.strategy": "parallel.sync"}  # old spelling -> new: still read, with a note
GRID = ("dp", "pp", "tp")
WHOLE_REPLICA_SYNCS = ("ps",)  # the syncs that train whole replicas only: no pipeline stages, no tensor slices


@dataclass(frozen=True)
class DataConfig:
    name: str = "mnist5k"  #: an embedded dataset, built into shards on first use: "mnist5k" or "shakespeare"
    path: str = ""  #: or a shard directory made by `mpitrain data build` or `data download` (then no name)
    shift: int = 0  #: images: random translation by up to this many pixels (augmentation)
    flip: bool = False  #: images: mirror each image left to right with probability 1/2 (augmentation)
    sampling: str = "stride"  #: text: training windows every block_size tokens ("stride") or anywhere ("random")
    verify: bool = True  #: re-hash every shard's content before step 0, the shards split over the ranks
    buffer_mb: float = 32  #: reader: megabytes of samples per read round, over all ranks
    prefetch: int = 2  #: reader: rounds read ahead by the background thread


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  #: the optimizer: "sgd", "adam" or "adamw" (decoupled weight decay)
    lr: float = 1e-3  #: the peak learning rate
    min_lr: float = 0.0  #: the floor the cosine schedule decays to
    schedule: str = "cosine"  #: after warmup: "cosine" (decay to min_lr at the last step) or "constant"
    warmup_steps: int = 0  #: steps of linear warmup up to lr
    weight_decay: float = 0.0  #: weight decay of the matrices and embeddings (biases and norm scales: none)
    betas: tuple[float, float] = (0.9, 0.999)  #: the decay rates of the two moments
    eps: float = 1e-8  #: added to the square root of the second moment
    momentum: float = 0.9  #: momentum (0: none)
    nesterov: bool = False  #: Nesterov's momentum
    grad_clip: float = 0.0  #: clip the gradients to this global L2 norm; 0: no clipping


@dataclass(frozen=True)
class TrainConfig:
    global_batch_size: int = 64  #: samples per step over all ranks, the same at any rank count
    steps: int = 0  #: optimizer steps to train for (text models); or
    epochs: int = 0  #: passes over the training split (image models); exactly one of the two
    seed: int = 1337  #: seeds the initial weights, the data order and dropout
    dtype: str = "float32"  #: "float32", or "float64" (for exact comparisons in tests)
    precision: str = "fp32"  #: "fp32", or mixed precision: "bf16" or "fp16" weights and gradients, float32 masters
    log_interval: int = 50  #: steps between progress lines and metrics records
    eval_interval: int = 0  #: steps between evaluations; 0: after every epoch (images) or at the end (text)
    eval_flip: bool = False  #: images: score each image and its mirror, averaging their probabilities (two views)
    eval_batches: int = 0  #: text: at most this many global batches of validation windows per evaluation; 0: all
    sample_tokens: int = 300  #: text: characters the model generates at the end of the run
    threads: int = 0  #: BLAS threads per rank; 0: the cores available divided by the ranks on the node
    micro_batches: int = 1  #: each rank's part of the global batch goes through the model in this many pieces
    fast_paths: bool = True  #: the fast ops (fused transformer halves, tiled convolution, ...); false: the plain ones
    accumulation: str = "fused"  #: GPU plans: gradients summed by the products ("fused") or a pass ("float32", "16-bit")
    label_smoothing: float = 0.0  #: train against (1 - this) x one-hot + this / classes; evaluation: one-hot
    trainable: tuple[str, ...] = ()  #: globs on parameter names that train ("head.*"); []: all, or LoRA's adapters


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = -1  #: data-parallel replicas; -1: the ranks that pp and tp leave (with sync = ps: the workers)
    pp: int = 1  #: pipeline stages (-1: the ranks dp and tp leave)
    tp: int = 1  #: tensor slices of the GPT's layers (-1: the ranks dp and pp leave)
    schedule: str = "1f1b"  #: pp > 1: the pipeline schedule: "gpipe", "1f1b", "interleaved" or "zb-h1"
    chunks: int = 1  #: pp > 1, schedule "interleaved": model chunks per rank (virtual stages)
    sequence_parallel: bool = False  #: tp > 1: layer norms, residual adds and dropout on slices of the sequence
    sync: str = "ddp"  #: the gradient sync: "ddp", "zero1", "zero2", "zero3", "local" (dp = 1) or "ps" (servers)
    allreduce: str = "mpi"  #: "mpi" (MPI's collectives), "ring" (mpitrain's) or "hierarchical" (node-aware; ddp)
    bucket_mb: float = 4.0  #: gradient bucket size: an allreduce (zero2: a reduce-scatter) starts per full bucket
    accumulate: str = "sharded"  #: with micro-batches: reduce-scatter each ("sharded") or their sum once ("full")
    gather: str = "layer"  #: zero3: free a layer's gathered weights after each use ("layer") or after the step ("step")
    wire: str = "fp32"  #: allreduce "ring": the gradients' format on the wire, "fp32", "bf16" or "fp16" (added in fp32)
    progress: str = "test"  #: how buckets advance during backward: "test", "thread" or "none"; "off": started after it
    thread_level: str = "auto"  #: MPI thread level: "auto" (multiple), "single", "funneled", "serialized" or "multiple"
    servers: int = 1  #: the first this many ranks are parameter servers, the others workers
    staleness: int = 0  #: 0: synchronous; k > 0: a worker runs at most k steps ahead of the slowest; -1: unbounded
    slow_worker: int = -1  #: make this worker a straggler (for experiments); -1: none
    slow_factor: float = 1.0  #: ... this many times slower than its compute


@dataclass(frozen=True)
class RunConfig:
    dir: str = ""  #: run directory (checkpoints, metrics.jsonl); "" writes nothing; the CLI: `runs/<config name>`
    checkpoint_interval: int = 0  #: steps between checkpoints; 0: only at the end and when stopped by a signal
    keep: int = 3  #: the newest checkpoints kept
    on_nan: str = "stop"  #: a non-finite loss: "stop" (exit 1, naming the last good checkpoint) or "skip" the update
    timeline: bool = False  #: write timeline.json, a Chrome trace of every rank's compute, communication and I/O
    stall_warn_s: float = 60.0  #: a collective waiting this long: print which ranks are not there (0: never)
    stall_abort_s: float = 600.0  #: ... and this long: abort every rank (0: never)
    progress: str = "auto"  #: "bar": a progress bar under the lines; "lines": no bar; "auto": a bar on a terminal
    trace_memory: bool = False  #: trace the heap over the build and the first 3 steps, print it at the end (slower)
    tensorboard: bool = False  #: also write TensorBoard scalars to RUN_DIR/tensorboard (the tensorboard extra)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    given: frozenset = field(default=frozenset(), compare=False, repr=False)
    notes: tuple = field(default=(), compare=False, repr=False)  # renamed fields read, for the trainer to print

    def to_dict(self) -> dict:
        return {s.name: dataclasses.asdict(getattr(self, s.name)) for s in sections()}


def sections() -> list:
    """The sections of a config (the dataclass fields of :class:`Config` that are tables)."""
    return [f for f in dataclasses.fields(Config) if f.name not in ("given", "notes")]
