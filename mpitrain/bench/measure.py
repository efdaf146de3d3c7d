"""What the benches share: the GPT they train, calls timed on one process or on every
rank, and variants timed round by round, each once per round, so that all see the same
machine (their ratios are taken side by side: ``mpitrain/bench/README.md``)."""

from __future__ import annotations

import time

import numpy as np

from mpitrain import nn, optim, rng
from mpitrain.precision import MixedPrecision

NANOGPT = dict(n_layer=4, n_head=4, n_embd=128, block_size=64)  # nanoGPT's small CPU setting
VOCAB = 65  # its characters of Shakespeare


def gpt(spec: dict = NANOGPT, precision: str = "fp32", **config):
    """A GPT of ``spec``'s shape (and ``config``'s other settings), seeded, and its AdamW; in
    mixed precision (``bf16``, ``fp16``) the model's weights half and the optimizer over
    float32 masters."""
    rng.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=VOCAB, **{k: spec[k] for k in NANOGPT}, **config))
    opt = optim.AdamW(optim.decay_groups(model.named_parameters(), 0.1), lr=1e-3, betas=(0.9, 0.99))
    return model, opt if precision == "fp32" else MixedPrecision(opt, precision)


def seconds(fn, calls: int = 1) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls, on this process."""
    tick = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - tick) / calls


def slowest(comm, fn, calls: int = 1, ranks: int | None = None) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls from a barrier, the slowest rank's;
    with ``ranks``, only the first ``ranks`` ranks call it, the others sleeping meanwhile."""
    comm.barrier()
    mine = seconds(fn, calls) if ranks is None or comm.rank < ranks else 0.0
    if ranks is not None:
        comm.sleeping_barrier()
    return max(comm.allgather(mine))


def interleaved(variants: dict, rounds: int, timed) -> dict:
    """{name: [seconds, ...]}: ``timed(variant)`` (seconds, or a list of them) of every
    variant in each of ``rounds`` rounds."""
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, variant in variants.items():
            t = timed(variant)
            times[k] += t if isinstance(t, list) else [t]
    return times


def medians(times: dict) -> dict:
    return {k: float(np.median(v)) for k, v in times.items()}
