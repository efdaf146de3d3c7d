"""Drawing text from a trained GPT, on one process or over MPI ranks, and what it costs.

**The loop** (:func:`generate`): the prompts' first pass (prefill) gives each its first
new token; then one token a step for every sequence. With the key-value cache
(:mod:`mpitrain.nn.kv_cache`, the default) a step is one token through the model; without
(``cache=False``, recomputation, the plain version) it is the whole window again. Both
give the same tokens (a test).

**Draws.** Sequence ``i`` of a request draws from its own stream, keyed by ``(seed, i)``:
its text is the same alone or in a batch, on any rank, whatever else is drawn.

**Ranks** (:func:`serve`): ``tp`` ranks hold one model sliced as tensor-parallel training
slices it (:func:`mpitrain.parallel.tensor_parallel.slice_gpt`: heads and MLP columns,
each rank caching its heads' keys and values), every rank drawing the same tokens from
the same logits; ``dp`` such groups each take a consecutive share of the prompts. A
pipeline of stages is not offered: a token's pass through one stage after another
leaves all but one stage idle, unless many requests are in flight at once, which a
batch of prompts here is not.

**What it costs**, measured (:class:`Generation`): the time to the first token (the
prefill and its draw), each later token's step, tokens a second, the cache's bytes.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from mpitrain.nn import kv_cache
from mpitrain.tensor import no_grad

SAMPLING = 7  # the streams' tag, apart from the others (mpitrain.data.loader's and the reader's 1 and 4-6, dropout's 6)


def streams(seed: int, indices) -> list:
    """A generator for each sequence ``indices`` of a request seeded ``seed``."""
    return [np.random.default_rng((seed, SAMPLING, int(i))) for i in indices]


def draw(logits: np.ndarray, temperature: float, top_k: int | None, gens: list) -> np.ndarray:
    """A token for each row of ``logits`` (B, V): softmax of ``logits / temperature`` over
    the ``top_k`` likeliest (None: all), sampled with one uniform from each row's generator."""
    z = logits.astype(np.float64) / max(temperature, 1e-8)
    if top_k is not None:
        kth = np.sort(z, axis=-1)[:, -min(top_k, z.shape[-1])][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    u = np.array([[g.random()] for g in gens])
    return np.minimum((p.cumsum(axis=-1) < u).sum(axis=-1), p.shape[-1] - 1).astype(np.int64)


def recomputed(model, sequences: list, block_size: int, gather=None) -> np.ndarray:
    """The logits (B, V) after each sequence, each window (its last ``block_size`` tokens)
    through the whole model again: decoding without a cache."""
    ids, lengths = kv_cache.windows(sequences, block_size)
    with no_grad():
        logits, _ = model(ids)
    logits = logits if gather is None else gather(logits)
    return logits.data[np.arange(len(ids)), lengths - 1]


@dataclass
class Generation:
    """What :func:`generate` drew and how long it took: each sequence's ids (prompt and new
    tokens), its prompt's length, seconds to the first token and of each later step, the
    cache's bytes (0 without), whether a stop signal ended it early."""

    sequences: list
    prompt_lengths: list
    ttft: float = 0.0
    steps: list = field(default_factory=list)
    cache_bytes: int = 0
    capacity: int = 0
    stopped: bool = False

    @property
    def new_tokens(self) -> int:
        """Tokens drawn per sequence."""
        return len(self.sequences[0]) - self.prompt_lengths[0] if self.sequences else 0

    @property
    def seconds(self) -> float:
        return self.ttft + sum(self.steps)


def generate(model, prompts: list, tokens: int, *, block_size: int, temperature: float = 0.8,
             top_k: int | None = None, seed: int = 1337, first: int = 0, cache: bool = True, gather=None,
             stop=None, progress=None) -> Generation:
    """``tokens`` new tokens after each of ``prompts`` (arrays of ids), sequence ``i``
    drawing from stream ``first + i``. ``gather`` joins a sliced head's logits; ``stop()``
    true after a step ends it there (every rank of a group must agree); ``progress(done,
    tokens)`` after each step."""
    out = Generation([list(map(int, p)) for p in prompts], [len(p) for p in prompts])
    gens = streams(seed, range(first, first + len(prompts)))
    capacity = min(block_size, max(out.prompt_lengths) + tokens)
    start = time.perf_counter()
    if cache:
        kv = kv_cache.KVCache.for_model(model, len(prompts), capacity)
        out.cache_bytes, out.capacity = kv.nbytes, capacity
        logits = kv_cache.prefill(model, *kv_cache.windows(out.sequences, capacity), kv, gather)
    else:
        logits = recomputed(model, out.sequences, block_size, gather)
    for s, t in zip(out.sequences, draw(logits, temperature, top_k, gens)):
        s.append(int(t))
    out.ttft = time.perf_counter() - start
    for done in range(1, tokens):
        if stop is not None and stop():
            out.stopped = True
            break
        began = time.perf_counter()
        logits = (kv_cache.next_logits(model, out.sequences, kv, block_size, gather) if cache
                  else recomputed(model, out.sequences, block_size, gather))
        for s, t in zip(out.sequences, draw(logits, temperature, top_k, gens)):
            s.append(int(t))
        out.steps.append(time.perf_counter() - began)
        if progress is not None:
            progress(done + 1, tokens)
    return out


def percentile(values, q: float) -> float:
    """The ``q``-th percentile of ``values`` (NumPy's linear rule); NaN if empty."""
    return float(np.percentile(values, q)) if len(values) else math.nan


def figures(gens: list, batch: int, tp: int, dp: int, peak: int | None = None) -> dict:
    """The request's figures from each data-parallel group's :class:`Generation` (their
    ``batch`` sequences in all): time to first token (the slowest group's), time per
    output token (every step of every group), tokens a second in all and per sequence
    (over the slowest group's time), the cache's bytes per rank, the peak."""
    steps = [s for g in gens for s in g.steps]
    seconds = max(g.seconds for g in gens)
    new = gens[0].new_tokens
    return {"batch": batch, "tp": tp, "dp": dp, "new_tokens": new,
            "prompt_tokens": [n for g in gens for n in g.prompt_lengths],
            "ttft_s": max(g.ttft for g in gens),
            "tpot_s": {"mean": float(np.mean(steps)) if steps else math.nan, "p50": percentile(steps, 50),
                       "p90": percentile(steps, 90), "p99": percentile(steps, 99), "steps": len(steps)},
            "tokens_per_s": batch * new / seconds if seconds else math.nan,
            "tokens_per_s_per_sequence": new / seconds if seconds else math.nan,
            "seconds": seconds, "kv_cache_bytes": max(g.cache_bytes for g in gens),
            "context": max(g.capacity for g in gens), "peak_bytes": peak,
            "stopped": any(g.stopped for g in gens)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 10 else f"{seconds:.3g} s"


def report(fig: dict) -> list[str]:
    """The lines ``mpitrain sample`` prints after the text."""
    t = fig["tpot_s"]
    ranks = f"{fig['tp'] * fig['dp']} rank(s): tp {fig['tp']} x dp {fig['dp']}"
    lines = [f"time to first token: {_ms(fig['ttft_s'])} (the prefill of {fig['batch']} prompt(s) of "
             f"{min(fig['prompt_tokens'])}-{max(fig['prompt_tokens'])} tokens; {ranks})"]
    if t["steps"]:
        groups = f"{t['steps'] // fig['dp']} in each of {fig['dp']} group(s)" if fig["dp"] > 1 else t["steps"]
        lines.append(f"time per output token: mean {_ms(t['mean'])}, p50 {_ms(t['p50'])}, p90 {_ms(t['p90'])}, "
                     f"p99 {_ms(t['p99'])} (over {groups} step(s) of {fig['batch']} sequence(s))")
    lines.append(f"tokens/s: {fig['tokens_per_s']:.4g} in all, {fig['tokens_per_s_per_sequence']:.4g} per sequence "
                 f"({fig['new_tokens']} new token(s) each in {_ms(fig['seconds'])})")
    memory = f"KV cache: {fig['kv_cache_bytes']:,} B per rank ({fig['context']} positions)"
    if fig.get("peak_bytes") is not None:
        memory += f"; peak memory {fig['peak_bytes']:,} B per rank (the weights, the cache and the work arrays)"
    lines.append(memory if fig["kv_cache_bytes"] else "no KV cache (recomputation)")
    if fig["stopped"]:
        lines.append("stopped early (a stop signal): the text and figures so far")
    return lines


class Progress:
    """A progress line on stderr for a long request: on a terminal, redrawn in place; else a
    line every ``every`` seconds."""

    def __init__(self, stream=None, every: float = 10.0):
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.every, self.start, self.last = (0.5 if self.tty else every), time.monotonic(), 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every and done < total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        left = (total - done) / rate if rate else math.inf
        line = f"{done:,}/{total:,} tokens, {rate:.3g} tokens/s a sequence, {_eta(left)} left"
        self.stream.write(f"\r{line}\033[K" if self.tty else line + "\n")
        self.stream.flush()

    def end(self) -> None:
        """After the last step (or a stop): a terminal's line ended."""
        if self.tty and self.last:
            self.stream.write("\n")
            self.stream.flush()


def _eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.2g} s"
